"""Stacks of one step: StackV2, StackPushV2, StackPopV2, StackCloseV2.

What the gradient of a control flow v1 `tf.while_loop` builds: the forward loop pushes
each iteration's intermediate values, the gradient loop pops them in reverse. A stack
lives as long as the step's values that hold it: the handle `StackV2` outputs holds
the stack itself (TensorFlow keeps it in the step's resource container), so it never
outlives its step and cannot cross tasks (TensorFlow colocates a stack's ops with it).
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Any

import numpy as np

from distserver import errors
from distserver.kernels._common import kernel_error
from distserver.kernels.registry import KernelContext, OpKernel, register_kernel

if TYPE_CHECKING:
    from distserver.protos.node_def_pb2 import NodeDef

_stack_ids = itertools.count()


class Stack:
    """One stack of one step (the value of a StackV2 handle)."""

    def __init__(self, name: str, elem_type: np.dtype[Any], max_size: int) -> None:
        self.name = name
        self.elem_type = elem_type
        self.max_size = max_size  # < 0: no limit
        self.items: list[Any] = []
        self.closed = False

    def check_open(self) -> None:
        if self.closed:
            raise errors.InvalidArgumentError(f"Stack[{self.name}] has already been closed.")


def _stack_of(kernel: OpKernel, value: Any) -> Stack:
    stack = value[()] if isinstance(value, np.ndarray) and value.ndim == 0 else value
    if not isinstance(stack, Stack):
        raise kernel_error(
            kernel, f"{kernel.op} expects a stack handle as input 0, got {type(stack).__name__}"
        )
    return stack


class _StackKernel(OpKernel):
    runs_on_loop = True  # moves references: no work to offload, and one thread touches a stack
    loop_bound = True
    is_stateful = True


@register_kernel("StackV2")
class StackV2Kernel(_StackKernel):
    """`(max_size: int32) -> handle`: a new, empty stack of `elem_type` values."""

    def __init__(self, node: NodeDef) -> None:
        super().__init__(node)
        self.elem_type = self.attr_type("elem_type")
        self.stack_name = self.attr_str("stack_name", "") or self.name

    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        max_size = np.asarray(inputs[0])
        if max_size.shape != () or max_size.dtype.kind not in "iu":
            raise kernel_error(self, f"max_size must be an int32 scalar, got shape {list(max_size.shape)}")
        handle = np.empty((), dtype=object)
        handle[()] = Stack(f"{self.stack_name}_{next(_stack_ids)}", self.elem_type, int(max_size))
        return [handle]


@register_kernel("StackPushV2")
class StackPushV2Kernel(_StackKernel):
    """`(handle, elem) -> elem`: pushes `elem` onto the stack and passes it on."""

    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        stack = _stack_of(self, inputs[0])
        stack.check_open()
        elem = np.asarray(inputs[1])
        if elem.dtype != stack.elem_type:
            raise errors.InvalidArgumentError(
                f"Stack[{stack.name}] holds {stack.elem_type.name} values, but the pushed value is "
                f"{elem.dtype.name}"
            )
        if 0 <= stack.max_size <= len(stack.items):
            raise errors.InvalidArgumentError(
                f"Stack[{stack.name}] overflowed its max_size ({stack.max_size})"
            )
        stack.items.append(inputs[1])
        return [inputs[1]]


@register_kernel("StackPopV2")
class StackPopV2Kernel(_StackKernel):
    """`(handle) -> elem`: the value pushed last, taken off the stack."""

    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        stack = _stack_of(self, inputs[0])
        stack.check_open()
        if not stack.items:
            raise errors.InvalidArgumentError(f"Stack[{stack.name}] is empty.")
        return [stack.items.pop()]


@register_kernel("StackCloseV2")
class StackCloseV2Kernel(_StackKernel):
    """`(handle) -> ()`: drops the stack's values; later pushes and pops fail."""

    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        stack = _stack_of(self, inputs[0])
        stack.items.clear()
        stack.closed = True
        return []
