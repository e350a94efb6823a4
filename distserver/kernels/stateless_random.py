"""TensorFlow's stateless random ops, with TensorFlow's numbers.

`tf.random.stateless_uniform` / `stateless_normal` (what Keras 3's initializers run,
on the device of the variable they initialize: a parameter server) are
`StatelessRandomGetKeyCounter(seed)` followed by `StatelessRandomUniformV2` or
`StatelessRandomNormalV2(shape, key, counter, alg)`. These kernels compute the same
values as TensorFlow's CPU kernels:

* the generator is Philox4x32-10 (TensorFlow's `PhiloxRandom`): a 128-bit counter and
  a 64-bit key, each call giving four 32-bit numbers; output group `g` (four values,
  or two for float64) comes from the call at counter + g;
* `StatelessRandomGetKeyCounter` scrambles the seed pair as TensorFlow's
  `GenerateKey` does (one Philox call on the seed with a fixed key);
* uniform float32: the low 23 bits of a number as the mantissa of a float in
  [1, 2), minus 1; float64 takes 20 + 32 bits of two numbers; normal: Box-Muller on
  pairs of such uniforms (float32 math, as TensorFlow's `BoxMullerFloat`).

The algorithms accepted are Philox (1) and auto-select (3, Philox on CPU).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from distserver.kernels._common import INDEX_TYPES, attr_type_in, int_list, kernel_error
from distserver.kernels.registry import KernelContext, OpKernel, product_of, register_kernel

if TYPE_CHECKING:
    from distserver.protos.node_def_pb2 import NodeDef

_M0, _M1 = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)
_W0, _W1 = 0x9E3779B9, 0xBB67AE85
_MASK32 = np.uint64(0xFFFFFFFF)
_PHILOX, _AUTO_SELECT = 1, 3
# The key GenerateKey scrambles a seed with.
_SEED_KEY = (0x3EC8F720, 0x02461E29)


def philox(counters: np.ndarray, key: tuple[int, int]) -> np.ndarray:
    """Philox4x32-10 of each row of `counters` (n x 4 uint32 words, low word first)."""
    c = [counters[:, i].astype(np.uint64) for i in range(4)]
    k0, k1 = key
    for round_ in range(10):
        if round_:
            k0, k1 = (k0 + _W0) & 0xFFFFFFFF, (k1 + _W1) & 0xFFFFFFFF
        product0 = _M0 * c[0]
        product1 = _M1 * c[2]
        c = [
            (product1 >> np.uint64(32)) ^ c[1] ^ np.uint64(k0),
            product1 & _MASK32,
            (product0 >> np.uint64(32)) ^ c[3] ^ np.uint64(k1),
            product0 & _MASK32,
        ]
    return np.stack(c, axis=1).astype(np.uint32)


def _counters(start: tuple[int, int, int, int], count: int) -> np.ndarray:
    """`count` consecutive 128-bit counters from `start`, as n x 4 uint32 words."""
    low = start[0] | start[1] << 32
    high = start[2] | start[3] << 32
    steps = np.arange(count, dtype=np.uint64)
    new_low = np.uint64(low) + steps  # wraps modulo 2**64
    carry = (new_low < np.uint64(low)).astype(np.uint64)
    new_high = np.uint64(high) + carry
    words = np.empty((count, 4), np.uint32)
    words[:, 0] = new_low & _MASK32
    words[:, 1] = new_low >> np.uint64(32)
    words[:, 2] = new_high & _MASK32
    words[:, 3] = new_high >> np.uint64(32)
    return words


def random_bits(key: int, counter: tuple[int, int], calls: int) -> np.ndarray:
    """The 32-bit numbers of `calls` Philox calls (calls x 4) for uint64 key and counter."""
    words = (counter[0] & 0xFFFFFFFF, counter[0] >> 32, counter[1] & 0xFFFFFFFF, counter[1] >> 32)
    return philox(_counters(words, calls), (key & 0xFFFFFFFF, key >> 32))


def key_and_counter(seed: tuple[int, int]) -> tuple[int, tuple[int, int]]:
    """TensorFlow's GenerateKey: (uint64 key, (uint64, uint64) counter) of a seed pair."""
    seed0, seed1 = (s & 0xFFFFFFFFFFFFFFFF for s in seed)
    start = np.array([[seed0 & 0xFFFFFFFF, seed0 >> 32, seed1 & 0xFFFFFFFF, seed1 >> 32]], np.uint32)
    mix = [int(v) for v in philox(start, _SEED_KEY)[0]]
    return mix[0] | mix[1] << 32, (0, mix[2] | mix[3] << 32)


def uniform_floats(bits: np.ndarray) -> np.ndarray:
    """TensorFlow's Uint32ToFloat: [0, 1) float32 from the low 23 bits."""
    return ((bits & np.uint32(0x7FFFFF)) | np.uint32(0x3F800000)).view(np.float32) - np.float32(1)


def uniform_doubles(high: np.ndarray, low: np.ndarray) -> np.ndarray:
    """TensorFlow's Uint64ToDouble: [0, 1) float64 from 20 bits of `high` and 32 of `low`."""
    mantissa = (high.astype(np.uint64) & np.uint64(0xFFFFF)) << np.uint64(32) | low.astype(np.uint64)
    return (mantissa | np.uint64(1023 << 52)).view(np.float64) - 1.0


def _seed_pair(kernel: OpKernel, value: np.ndarray) -> tuple[int, int]:
    flat = np.asarray(value).reshape(-1)
    if flat.shape != (2,):
        raise kernel_error(kernel, f"seed must have shape [2], not {list(np.shape(value))}")
    return int(flat[0]), int(flat[1])


@register_kernel("StatelessRandomGetKeyCounter")
class StatelessRandomGetKeyCounterKernel(OpKernel):
    """(key uint64[1], counter uint64[2]) of a seed pair, as TensorFlow scrambles it."""

    def __init__(self, node: NodeDef) -> None:
        super().__init__(node)
        attr_type_in(self, "Tseed", (np.dtype(np.int32), np.dtype(np.int64)), default=np.dtype(np.int64))

    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        key, counter = key_and_counter(_seed_pair(self, inputs[0]))
        return [np.array([key], np.uint64), np.array(counter, np.uint64)]


@register_kernel("StatelessRandomGetAlg")
class StatelessRandomGetAlgKernel(OpKernel):
    """The algorithm auto-select picks on this device: Philox."""

    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        return [np.array(_PHILOX, np.int32)]


class _StatelessV2Kernel(OpKernel):
    """Inputs (shape, key uint64[1], counter uint64[2], alg int32); output `dtype`."""

    def __init__(self, node: NodeDef) -> None:
        super().__init__(node)
        self.dtype = attr_type_in(
            self, "dtype", (np.dtype(np.float32), np.dtype(np.float64)), default=np.dtype(np.float32)
        )
        attr_type_in(self, "Tshape", INDEX_TYPES, default=np.dtype(np.int32))

    def output_nbytes(self, inputs: list[Any]) -> int:
        return product_of(inputs[0]) * self.dtype.itemsize

    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        shape_value, key_value, counter_value, alg_value = inputs
        shape = int_list(self, shape_value, "shape")
        if any(size < 0 for size in shape):
            raise kernel_error(self, f"Shape {shape} has a negative dimension")
        key = np.asarray(key_value).reshape(-1)
        counter = np.asarray(counter_value).reshape(-1)
        if key.shape != (1,) or counter.shape[0] < 2:
            raise kernel_error(
                self,
                f"key must have shape [1] and counter at least [2]; got {list(key.shape)}, "
                f"{list(counter.shape)}",
            )
        alg = int(np.asarray(alg_value))
        if alg not in (_PHILOX, _AUTO_SELECT):
            raise kernel_error(self, f"Unsupported algorithm id: {alg}")
        count = int(np.prod(shape, dtype=np.int64))
        values = self.draw(int(key[0]), (int(counter[0]), int(counter[1])), count)
        return [values.reshape(shape)]

    def draw(self, key: int, counter: tuple[int, int], count: int) -> np.ndarray:
        raise NotImplementedError


@register_kernel("StatelessRandomUniformV2")
class StatelessRandomUniformV2Kernel(_StatelessV2Kernel):
    """Uniform [0, 1): four float32 (two float64) per Philox call."""

    def draw(self, key: int, counter: tuple[int, int], count: int) -> np.ndarray:
        per_call = 4 if self.dtype == np.float32 else 2
        bits = random_bits(key, counter, -(-count // per_call))
        if self.dtype == np.float32:
            return uniform_floats(bits.reshape(-1))[:count]
        return uniform_doubles(bits[:, 0::2].reshape(-1), bits[:, 1::2].reshape(-1))[:count]


@register_kernel("StatelessRandomNormalV2")
class StatelessRandomNormalV2Kernel(_StatelessV2Kernel):
    """N(0, 1) by Box-Muller: four float32 (two float64) per Philox call."""

    def draw(self, key: int, counter: tuple[int, int], count: int) -> np.ndarray:
        if self.dtype == np.float32:
            bits = random_bits(key, counter, -(-count // 4)).reshape(-1, 2)
            u1 = np.maximum(uniform_floats(bits[:, 0]), np.float32(1e-7))
            v1 = np.float32(2 * np.pi) * uniform_floats(bits[:, 1])
            # Each function correctly rounded to float32 (via float64), as TensorFlow's
            # float math nearly always is; the products in float32, as there.
            log_u1 = np.log(u1.astype(np.float64)).astype(np.float32)
            radius = np.sqrt(np.float32(-2) * log_u1)
            sin = np.sin(v1.astype(np.float64)).astype(np.float32)
            cos = np.cos(v1.astype(np.float64)).astype(np.float32)
            out = np.stack([sin * radius, cos * radius], axis=1)
            return out.reshape(-1)[:count]
        # float64: one call gives two doubles, from words (0, 1) and (2, 3).
        bits = random_bits(key, counter, -(-count // 2))
        u = np.maximum(uniform_doubles(bits[:, 0], bits[:, 1]), 1e-7)
        angle = 2 * np.pi * uniform_doubles(bits[:, 2], bits[:, 3])
        length = np.sqrt(-2 * np.log(u))
        return np.stack([np.sin(angle) * length, np.cos(angle) * length], axis=1).reshape(-1)[:count]
