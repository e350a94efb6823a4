"""Conditionals with dead tensors: Switch, Merge and their reference forms, ControlTrigger.

What `tf.cond` builds without control flow v2 (and `tf.case`, `piecewise_constant`,
StopAtStepHook's global-step read): a `Switch` per value a branch uses, whose port
for the branch not taken carries `DEAD`; the executor skips every node downstream of
a dead value; a `Merge` per branch output picks the one live input. See
`registry.DEAD` and `OpKernel.dead_inputs`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from distserver import errors
from distserver.kernels.registry import DEAD, SEES_DEAD_DATA, KernelContext, OpKernel, register_kernel

if TYPE_CHECKING:
    from distserver.protos.node_def_pb2 import NodeDef


@register_kernel("Switch", "RefSwitch")
class SwitchKernel(OpKernel):
    """`(data, pred) -> (output_false, output_true)`: `data` on the port `pred` names, DEAD on the other."""

    runs_on_loop = True  # passes a reference on: no work to offload
    may_output_dead = True

    def __init__(self, node: NodeDef) -> None:
        super().__init__(node)
        if self.op == "RefSwitch":
            self.ref_inputs = frozenset({0})  # the variable itself goes through

    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        data, pred = inputs
        pred = np.asarray(pred)
        if pred.shape != ():
            raise errors.InvalidArgumentError(
                f"The second input must be a scalar, but it has shape {list(pred.shape)}"
            )
        return [DEAD, data] if bool(pred) else [data, DEAD]


@register_kernel("Merge", "RefMerge")
class MergeKernel(OpKernel):
    """`(inputs...) -> (output, value_index)`: the live input (the first, should there be more).

    Dead when every input is dead. The executor runs it once all its inputs are there,
    live or dead (enough for conditionals; loops need more, and have no kernels yet).
    """

    runs_on_loop = True
    dead_inputs = SEES_DEAD_DATA

    def __init__(self, node: NodeDef) -> None:
        super().__init__(node)
        if self.op == "RefMerge":
            self.ref_inputs = frozenset(range(self.attr_int("N", 0)))

    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        for index, value in enumerate(inputs):
            if value is not DEAD:
                return [value, np.int32(index)]
        return [DEAD, DEAD]


@register_kernel("ControlTrigger")
class ControlTriggerKernel(OpKernel):
    """Runs once its inputs are there, dead or alive (a control join that never dies)."""

    runs_on_loop = True
    dead_inputs = SEES_DEAD_DATA

    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        return []


@register_kernel("Enter", "RefEnter", "Exit", "RefExit", "NextIteration", "RefNextIteration")
class LoopTransferKernel(OpKernel):
    """Control flow v1 loops: passes its input on; the executor moves it between frames.

    `Enter` takes a value into the loop frame `frame_name` (iteration 0, or every
    iteration when `is_constant`), `NextIteration` into the next iteration of its frame,
    `Exit` out to the parent frame (see `runtime/executor.py`, frames).
    """

    runs_on_loop = True

    def __init__(self, node: NodeDef) -> None:
        super().__init__(node)
        if self.op.startswith("Ref"):
            self.ref_inputs = frozenset({0})
        if self.op.endswith("Enter"):
            self.frame_name = self.attr_str("frame_name")
            if not self.frame_name:
                raise errors.InvalidArgumentError(f"{self.op} node '{self.name}' has an empty frame_name")
            self.is_constant = self.attr_bool("is_constant", False)
            self.parallel_iterations = self.attr_int("parallel_iterations", 10)
            if self.parallel_iterations < 1:
                raise errors.InvalidArgumentError(
                    f"{self.op} node '{self.name}': parallel_iterations must be at least 1, "
                    f"got {self.parallel_iterations}"
                )

    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        return [inputs[0]]


@register_kernel("LoopCond")
class LoopCondKernel(OpKernel):
    """`(input: bool scalar) -> output`: the loop's predicate, passed on to its Switches."""

    runs_on_loop = True

    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        pred = np.asarray(inputs[0])
        if pred.shape != () or pred.dtype != np.bool_:
            raise errors.InvalidArgumentError(
                f"LoopCond's input must be a bool scalar, got {pred.dtype} of shape {list(pred.shape)}"
            )
        return [pred]
