"""Optionals: a variant tensor holding a list of tensors or nothing.

What control flow v2's `tf.cond` gradient builds: the forward `If` outputs each
branch's intermediates wrapped in `OptionalFromValue`, and an `OptionalNone` from
the branch that does not compute them; the gradient's branch unwraps them with
`OptionalGetValue`. A value is a 0-d object array holding an `OptionalValue`; across
tasks it travels as a `VariantTensorDataProto` ("tensorflow::data::OptionalVariant",
the components as its tensors).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from distserver import errors
from distserver.kernels.registry import KernelContext, OpKernel, register_kernel
from distserver.protos.tensor_pb2 import VariantTensorDataProto
from distserver.tensors import from_tensor_proto, to_tensor_proto


@dataclass(frozen=True)
class OptionalValue:
    """The tensors an optional holds, or None when it is empty."""

    components: tuple[Any, ...] | None

    TYPE_NAME = "tensorflow::data::OptionalVariant"

    def to_variant_proto(self) -> VariantTensorDataProto:
        proto = VariantTensorDataProto(type_name=self.TYPE_NAME)
        proto.tensors.extend(to_tensor_proto(item) for item in self.components or ())
        return proto


def optional_tensor(value: OptionalValue) -> np.ndarray:
    """The 0-d DT_VARIANT value holding `value`."""
    out = np.empty((), dtype=object)
    out[()] = value
    return out


def _unwrap(tensor: Any) -> OptionalValue:
    value = np.asarray(tensor, dtype=object)
    item = value[()] if value.shape == () else None
    if isinstance(item, VariantTensorDataProto) and item.type_name == OptionalValue.TYPE_NAME:
        # From another task; an optional of no components reads as empty, as in TensorFlow.
        item = OptionalValue(tuple(from_tensor_proto(t) for t in item.tensors) or None)
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
        return [optional_tensor(OptionalValue(tuple(inputs)))]


@register_kernel("OptionalNone")
class OptionalNoneKernel(OpKernel):
    """`-> optional` holding nothing."""

    runs_on_loop = True

    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        return [optional_tensor(OptionalValue(None))]


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
