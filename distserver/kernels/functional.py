"""Functional ops: the arguments and results of a graph function, and `ToBool`.

`If`, `Case` and `While` never reach a kernel: the master lowers them to
`Switch`/`Merge` and to control flow v1 loops (runtime/functions.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from distserver import errors
from distserver.kernels.registry import FunctionFrame, KernelContext, OpKernel, register_kernel

if TYPE_CHECKING:
    from distserver.protos.node_def_pb2 import NodeDef


def _frame(kernel: OpKernel, ctx: KernelContext) -> FunctionFrame:
    frame = ctx.frame
    if frame is None:
        raise errors.InvalidArgumentError(
            f"Node '{kernel.name}' ({kernel.op}) runs only inside a function call", node_name=kernel.name
        )
    return frame


@register_kernel("_Arg")
class ArgKernel(OpKernel):
    """Argument `index` of the function call."""

    runs_on_loop = True

    def __init__(self, node: NodeDef) -> None:
        super().__init__(node)
        self.index = self.attr_int("index")

    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        args = _frame(self, ctx).args
        if not 0 <= self.index < len(args):
            raise errors.InvalidArgumentError(
                f"The call has {len(args)} arguments; this is argument {self.index}"
            )
        return [args[self.index]]


@register_kernel("_Retval")
class RetvalKernel(OpKernel):
    """Result `index` of the function call."""

    runs_on_loop = True

    def __init__(self, node: NodeDef) -> None:
        super().__init__(node)
        self.index = self.attr_int("index")

    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        retvals = _frame(self, ctx).retvals
        if not 0 <= self.index < len(retvals):
            raise errors.InvalidArgumentError(
                f"The function has {len(retvals)} results; this is result {self.index}"
            )
        retvals[self.index] = inputs[0]
        return []


def to_bool(value: Any) -> bool:
    """TensorFlow's truth of a tensor (`ToBool`): a scalar's value, else whether it has elements."""
    array = np.asarray(value)
    if array.shape == ():
        return bool(array.item())
    return array.size > 0


@register_kernel("ToBool")
class ToBoolKernel(OpKernel):
    """`(input) -> bool scalar`: `to_bool`; a lowered `While` puts it after a `cond`
    that does not return a bool."""

    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        return [np.bool_(to_bool(inputs[0]))]
