"""Functional ops: the arguments and results of a graph function, and `While` loops.

`tf.while_loop` under control flow v2 builds a `While` node whose `cond` and `body`
attrs name functions of the graph's library. The kernel calls them through
`KernelContext.call_function` (the runtime runs each call's body with a nested
executor in the same step), feeding the loop variables to `cond`, then to `body`,
until `cond` says stop. There is no iteration limit: a loop runs as long as
TensorFlow's would, and stops with the step (cancellation, timeout, a closed
session). `parallel_iterations` is accepted and not used: iterations run one after
another. `If` never reaches a kernel: the master lowers it (runtime/functions.py).
"""

from __future__ import annotations

import asyncio
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


@register_kernel("StatelessWhile")
class WhileKernel(OpKernel):
    """`(loop variables...) -> (loop variables...)`: `body` while `cond` holds."""

    is_async = True

    def __init__(self, node: NodeDef) -> None:
        super().__init__(node)
        for attr in ("cond", "body"):
            if not self.has_attr(attr) or not node.attr[attr].func.name:
                raise errors.InvalidArgumentError(
                    f"Node '{node.name}' ({node.op}) has no '{attr}' function", node_name=node.name
                )
        self.cond = node.attr["cond"].func
        self.body = node.attr["body"].func

    async def compute_async(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        values = list(inputs)
        while True:
            (keep_going,) = await ctx.call_function(self.cond, values)
            if not to_bool(keep_going):
                return values
            results = await ctx.call_function(self.body, values)
            if len(results) != len(values):
                raise errors.InvalidArgumentError(
                    f"While body '{self.body.name}' returned {len(results)} values "
                    f"for {len(values)} loop variables"
                )
            values = results
            # A body of synchronous kernels never waits: let the loop breathe (and cancel).
            await asyncio.sleep(0)


@register_kernel("While")
class StatefulWhileKernel(WhileKernel):
    """`While`: a loop whose body may have side effects."""

    is_stateful = True
