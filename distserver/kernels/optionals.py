"""Optionals: a variant tensor holding a list of tensors or nothing.

What control flow v2's `tf.cond` gradient builds: the forward `If` outputs each
branch's intermediates wrapped in `OptionalFromValue`, and an `OptionalNone` from
the branch that does not compute them; the gradient's branch unwraps them with
`OptionalGetValue`. A value is a 0-d object array holding an `OptionalValue`; it
lives on the task that made it (it has no wire form).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from distserver import errors
from distserver.kernels.registry import KernelContext, OpKernel, register_kernel


@dataclass(frozen=True)
class OptionalValue:
    """The tensors an optional holds, or None when it is empty."""

    components: tuple[Any, ...] | None


def _wrap(value: OptionalValue) -> np.ndarray:
    out = np.empty((), dtype=object)
    out[()] = value
    return out


def _unwrap(tensor: Any) -> OptionalValue:
    value = np.asarray(tensor, dtype=object)
    item = value[()] if value.shape == () else None
    if not isinstance(item, OptionalValue):
        raise errors.InvalidArgumentError(
            "Input tensor must be a scalar DT_VARIANT tensor holding an optional"
        )
    return item


@register_kernel("OptionalFromValue")
class OptionalFromValueKernel(OpKernel):
    """`components... -> optional` holding them."""

    runs_on_loop = True  # keeps references: no work

    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        return [_wrap(OptionalValue(tuple(inputs)))]


@register_kernel("OptionalNone")
class OptionalNoneKernel(OpKernel):
    """`-> optional` holding nothing."""

    runs_on_loop = True

    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        return [_wrap(OptionalValue(None))]


@register_kernel("OptionalHasValue")
class OptionalHasValueKernel(OpKernel):
    """`optional -> bool`."""

    runs_on_loop = True

    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        return [np.bool_(_unwrap(inputs[0]).components is not None)]


@register_kernel("OptionalGetValue")
class OptionalGetValueKernel(OpKernel):
    """`optional -> components...`; an empty optional is an InvalidArgumentError, as in TensorFlow."""

    runs_on_loop = True

    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        components = _unwrap(inputs[0]).components
        if components is None:
            raise errors.InvalidArgumentError("The optional does not have a value.")
        expected = len(self.node.attr["output_types"].list.type)
        if len(components) != expected:
            raise errors.InvalidArgumentError(
                f"The optional holds {len(components)} tensors; output_types lists {expected}"
            )
        return list(components)
