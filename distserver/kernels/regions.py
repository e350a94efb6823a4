"""A connected group of light nodes run as one (`FUSED_REGION_OP`).

An embedding lookup splits its ids by shard with eleven light nodes, and a logistic
loss and most of its gradient take twenty-three more; each costs the executor ~0.5
us around its kernel (taking its inputs, weighing it for the pool, storing its
output). The executor (`runtime.executor._fuse_regions`) makes each
such group of `OpKernel.fusable` nodes one node of this op, which runs its parts'
kernels one after the other: the same kernels on the same values, so the same bits
and the same errors, naming the part that failed. Two kinds of region run otherwise,
with the same bits: an embedding's id split, as one compiled loop (`id_split`), and,
once its parts have run on inputs of some dtypes and shapes, a region of small float
values, as compiled passes over its element-wise parts for such inputs
(`region_plans`).

The node carries its parts' NodeDefs (`FUSED_NODES_ATTR`, in an order where each
part comes after the parts it reads) and how they are wired: attr `wiring`, for each
part's data inputs in turn, k >= 0 for the node's input k, or -1 - q for the output
of part q (an earlier one); attr `outputs`, the parts whose values are the node's
`M` outputs, in order; `N`, its inputs. A graph may name this op itself (a task
registers what its peers send): every part must be a fusable op (not a region) and
every reference in range, or the node is refused.
"""

from __future__ import annotations

from typing import Any

from distserver import errors
from distserver.kernels import _compiled, id_split, region_plans
from distserver.kernels.math import fused_parts
from distserver.kernels.registry import (
    KernelContext,
    OpKernel,
    compute_without_dereference,
    create_kernel,
    fusable_op,
    register_kernel,
)
from distserver.protos.node_def_pb2 import NodeDef

FUSED_REGION_OP = "_DistserverFusedRegion"
# How many times a region plans for new inputs (`region_plans`): inputs whose shapes
# change every step would otherwise pay for a plan each time.
_MAX_PLANS = 8


@register_kernel(FUSED_REGION_OP)
class FusedRegionKernel(OpKernel):
    """Runs its parts (see the module docstring) on its inputs; outputs the values of
    the parts attr `outputs` names. Each intermediate value is let go after its last
    reader, as the executor would."""

    def __init__(self, node: NodeDef, kernels: list[OpKernel] | None = None) -> None:
        """`kernels`: the parts' kernels, when the caller has them (the executor that
        fuses the parts built them already); else built here."""
        super().__init__(node)
        parts = fused_parts(self)
        # (checked before any part's kernel is built: a part may not be a region itself)
        not_fusable = [part.op for part in parts if not fusable_op(part.op)]
        if not parts or not_fusable:
            raise self._refused(f"groups ops that may not run in one node: {not_fusable or 'none'}")
        if kernels is None or len(kernels) != len(parts):
            kernels = [create_kernel(part) for part in parts]
        wiring = list(self._attr("wiring").list.i)
        outputs = list(self._attr("outputs").list.i)
        arities = [sum(1 for text in part.input if not text.startswith("^")) for part in parts]
        if sum(arities) != len(wiring):
            raise self._refused(f"wires {len(wiring)} inputs, but its parts take {sum(arities)}")
        if not all(0 <= q < len(parts) for q in outputs) or len(outputs) != self.attr_int("M"):
            raise self._refused(f"outputs parts {outputs} of {len(parts)}, M = {self.attr_int('M')}")
        count = self.attr_int("N")  # its inputs
        # Values by place: the node's inputs, then each part's output in turn.
        steps: list[tuple[Any, tuple[int, ...]]] = []
        last_read: dict[int, int] = {}  # value place -> the last part reading it
        start = 0
        for p, (kernel, arity) in enumerate(zip(kernels, arities, strict=True)):
            sources = []
            for code in wiring[start : start + arity]:
                if not (-1 - p < code < count):  # (a part reads its inputs or an earlier part)
                    raise self._refused(f"part {p} ({parts[p].name}) reads {code}, not an earlier value")
                place = code if code >= 0 else count + (-1 - code)
                sources.append(place)
                last_read[place] = p
            start += arity
            steps.append((compute_without_dereference(kernel), tuple(sources)))
        kept = {count + q for q in outputs}
        drops: list[list[int]] = [[] for _ in parts]
        for place, p in last_read.items():
            if place not in kept:
                drops[p].append(place)
        self._steps = [
            (compute, sources, tuple(drop)) for (compute, sources), drop in zip(steps, drops, strict=True)
        ]
        self._outputs = [count + q for q in outputs]
        self.parts = kernels
        # An embedding lookup's split of its ids by shard runs as one compiled loop.
        self._id_split = id_split.match(parts, [sources for _, sources in steps], self._outputs, count)
        if self._id_split is not None:
            _compiled.prepare()
        # Element-wise parts as compiled passes (`region_plans`), planned from the values
        # the parts made for inputs of a new signature, at most `_MAX_PLANS` times.
        self._parts_nodes = parts
        self._may_plan = self._id_split is None and region_plans.may_plan(parts)
        if self._may_plan:
            _compiled.prepare()
        self._plan: region_plans.ElementwisePlan | None = None
        self._planned_for: region_plans.Signature | None = None  # (with or without a plan)
        self._plans_tried = 0
        # The bytes of the largest value its last call made: parts may make values larger
        # than the node's inputs (a broadcast), which the executor weighs for its pool.
        self._largest = 0

    def _refused(self, what: str) -> errors.InvalidArgumentError:
        return errors.InvalidArgumentError(
            f"Node '{self.name}' ({FUSED_REGION_OP}) {what}", node_name=self.name
        )

    def output_nbytes(self, inputs: list[Any]) -> int:
        return self._largest  # (its last call's: a step's values are alike the next's)

    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        if self._id_split is not None:
            split = self._id_split.run(inputs)
            if split is not None:
                self._largest = max(split[0].nbytes, split[1].nbytes)
                return split
        made: list[region_plans.Made] | None = None  # (each value's dtype and shape, to plan)
        if self._may_plan:
            made_for = region_plans.signature(inputs)
            plan = self._plan
            if plan is not None and plan.made_for == made_for:
                outputs = plan.run(ctx, inputs)
                if outputs is not None:
                    self._largest = plan.largest
                    return outputs
                self._plan = self._planned_for = None  # (a part's value changed shape: plan again)
            elif made_for != self._planned_for and self._plans_tried < _MAX_PLANS and _compiled.loops():
                made = list(map(region_plans.made, inputs))
        values = list(inputs)
        largest = 0
        for compute, sources, drops in self._steps:
            # (one or two inputs taken without a comprehension: most parts have them)
            if len(sources) == 1:
                args = [values[sources[0]]]
            elif len(sources) == 2:
                args = [values[sources[0]], values[sources[1]]]
            else:
                args = [values[place] for place in sources]
            (value,) = compute(ctx, args)
            values.append(value)
            nbytes = getattr(value, "nbytes", 0)
            if nbytes > largest:
                largest = nbytes
            for place in drops:
                values[place] = None
            if made is not None:
                made.append(region_plans.made(value))
        self._largest = largest
        if made is not None:
            self._plan_for(made_for, made)
        return [values[place] for place in self._outputs]

    def _plan_for(self, made_for: region_plans.Signature, made: list[region_plans.Made]) -> None:
        """Plan for inputs of `made_for`, from what the parts made of such inputs."""
        self._plans_tried += 1
        self._plan = region_plans.ElementwisePlan.build(
            made_for,
            self._parts_nodes,
            [
                (kernel, compute, sources)
                for kernel, (compute, sources, _) in zip(self.parts, self._steps, strict=True)
            ],
            self._outputs,
            made,
        )
        self._planned_for = made_for


__all__ = ["FUSED_REGION_OP", "FusedRegionKernel"]
