"""Numpy kernels for TensorFlow's stateful random ops (the variable initializers use them).

`RandomUniform` ([0, 1)), `RandomStandardNormal` (N(0, 1)), `TruncatedNormal` (N(0, 1)
redrawn outside two standard deviations) and `RandomUniformInt` ([minval, maxval)).

Seeds follow TensorFlow's op-level contract, not its numbers: when the node's
`seed` or `seed2` attr is non-zero, the kernel draws from a Philox generator keyed by
the pair, so the same graph yields the same sequence of values in every session
and on every task (each run of the node continues the sequence, as in TF). With
both seeds zero the values come from fresh OS entropy. The values differ from
TensorFlow's: programs that need identical initial values across frameworks should
initialise from constants.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

import ml_dtypes
import numpy as np

from distserver.kernels._common import (
    FLOATS,
    INDEX_TYPES,
    attr_type_in,
    check_input_dtype,
    int_list,
    kernel_error,
    shape_str,
)
from distserver.kernels.registry import KernelContext, OpKernel, product_of, register_kernel

if TYPE_CHECKING:
    from distserver.protos.node_def_pb2 import NodeDef

_UINT64 = (1 << 64) - 1
# The largest value below 1 of the dtypes drawn in float32 and rounded.
_BELOW_ONE = {
    np.dtype(np.float16): np.asarray(1 - 2**-11, np.float16),
    np.dtype(ml_dtypes.bfloat16): np.asarray(1 - 2**-8, ml_dtypes.bfloat16),
}
# TruncatedNormal keeps values within this many standard deviations.
_TRUNCATE_AT = 2.0


class _RandomKernel(OpKernel):
    """Reads `seed`/`seed2` and owns the node's generator (one per kernel instance)."""

    is_stateful = True
    dtype: np.dtype[Any]  # of the output, set by each kernel

    def __init__(self, node: NodeDef) -> None:
        super().__init__(node)
        seed = self.attr_int("seed", 0)
        seed2 = self.attr_int("seed2", 0)
        if seed or seed2:
            bit_generator = np.random.Philox(key=[seed & _UINT64, seed2 & _UINT64])
        else:
            bit_generator = np.random.Philox()
        self.generator = np.random.Generator(bit_generator)
        # Steps of one graph may run this node concurrently from worker threads.
        self.lock = threading.Lock()

    def output_nbytes(self, inputs: list[Any]) -> int:
        return product_of(inputs[0]) * self.dtype.itemsize

    def _shape(self, value: np.ndarray) -> list[int]:
        shape = int_list(self, value, "shape")
        for i, size in enumerate(shape):
            if size < 0:
                raise kernel_error(self, f"Dimension {size} must be >= 0 (shape[{i}])")
        return shape


class _RandomFloatKernel(_RandomKernel):
    def __init__(self, node: NodeDef) -> None:
        super().__init__(node)
        self.dtype = attr_type_in(self, "dtype", FLOATS)
        self.shape_type = attr_type_in(self, "T", INDEX_TYPES, default=np.dtype(np.int32))
        # Draw doubles for float64, float32 for everything narrower.
        self.draw_dtype = np.dtype(np.float64) if self.dtype == np.float64 else np.dtype(np.float32)

    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        (shape_value,) = inputs
        shape = self._shape(shape_value)
        with self.lock:
            values = self.draw(shape)
        return [values.astype(self.dtype, copy=False)]

    def draw(self, shape: list[int]) -> np.ndarray:
        raise NotImplementedError


@register_kernel("RandomUniform")
class RandomUniformKernel(_RandomFloatKernel):
    """Uniform values in [0, 1)."""

    def draw(self, shape: list[int]) -> np.ndarray:
        values: np.ndarray = self.generator.random(shape, dtype=self.draw_dtype)
        if self.dtype != self.draw_dtype:
            # Rounding to half precision can give 1.0; TF's range excludes it.
            values = np.minimum(values.astype(self.dtype), _BELOW_ONE[self.dtype])
        return values


@register_kernel("RandomStandardNormal")
class RandomStandardNormalKernel(_RandomFloatKernel):
    """Normally distributed values, mean 0 and standard deviation 1."""

    def draw(self, shape: list[int]) -> np.ndarray:
        values: np.ndarray = self.generator.standard_normal(shape, dtype=self.draw_dtype)
        return values


@register_kernel("TruncatedNormal")
class TruncatedNormalKernel(_RandomFloatKernel):
    """N(0, 1) values, each drawn again until it lies within two standard deviations."""

    def draw(self, shape: list[int]) -> np.ndarray:
        values: np.ndarray = self.generator.standard_normal(shape, dtype=self.draw_dtype)
        outside = np.abs(values) > _TRUNCATE_AT
        while np.any(outside):
            values[outside] = self.generator.standard_normal(int(outside.sum()), dtype=self.draw_dtype)
            outside = np.abs(values) > _TRUNCATE_AT
        return values


@register_kernel("RandomUniformInt")
class RandomUniformIntKernel(_RandomKernel):
    """Uniform integers in [minval, maxval)."""

    def __init__(self, node: NodeDef) -> None:
        super().__init__(node)
        self.dtype = attr_type_in(self, "Tout", INDEX_TYPES)
        self.shape_type = attr_type_in(self, "T", INDEX_TYPES, default=np.dtype(np.int32))

    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        shape_value, minval, maxval = inputs
        shape = self._shape(shape_value)
        for index, (what, value) in enumerate((("minval", minval), ("maxval", maxval)), start=1):
            check_input_dtype(self, index, value, self.dtype)
            if value.ndim != 0:
                raise kernel_error(self, f"{what} must be 0-D, got shape {shape_str(value.shape)}")
        low, high = int(minval), int(maxval)
        if low >= high and np.prod(shape) > 0:
            raise kernel_error(self, f"Need minval < maxval: {low} >= {high}")
        if np.prod(shape) == 0:
            return [np.zeros(shape, self.dtype)]
        with self.lock:
            values = self.generator.integers(low, high, size=shape, dtype=self.dtype)
        return [np.asarray(values)]


__all__ = [
    "RandomStandardNormalKernel",
    "RandomUniformIntKernel",
    "RandomUniformKernel",
    "TruncatedNormalKernel",
]


@register_kernel("RandomShuffle")
class RandomShuffleKernel(_RandomKernel):
    """`value` with its first dimension randomly permuted (scalars as they are)."""

    def __init__(self, node: NodeDef) -> None:
        super().__init__(node)
        self.dtype = self.attr_type("T")

    def output_nbytes(self, inputs: list[Any]) -> int:
        return 0  # as large as its input: the executor sees that already

    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        (value,) = inputs
        if value.ndim == 0 or value.shape[0] <= 1:
            return [value]
        with self.lock:
            order = self.generator.permutation(value.shape[0])
        return [value[order]]
