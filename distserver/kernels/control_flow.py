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
