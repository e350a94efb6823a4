"""String ops users feed features with: StringLength, StringToNumber, StringSplitV2,
StringToHashBucketFast.

DT_STRING values are object arrays of `bytes` (see `registry`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from distserver.kernels._common import INT32, INT64, OBJECT, kernel_error, shape_str
from distserver.kernels._farmhash import fingerprint64
from distserver.kernels.registry import KernelContext, OpKernel, register_kernel

if TYPE_CHECKING:
    from distserver.protos.node_def_pb2 import NodeDef


def _strings(kernel: OpKernel, value: Any) -> np.ndarray:
    array = np.asarray(value)
    if array.dtype != OBJECT:
        raise kernel_error(kernel, f"{kernel.op} takes a string tensor, got {array.dtype.name}")
    return array


@register_kernel("StringLength")
class StringLengthKernel(OpKernel):
    """The length of each string in bytes (`unit` BYTE) or in UTF-8 characters (UTF8_CHAR)."""

    def __init__(self, node: NodeDef) -> None:
        super().__init__(node)
        self.unit = self.attr_str("unit", "BYTE")
        if self.unit not in ("BYTE", "UTF8_CHAR"):
            raise kernel_error(self, f"unit must be BYTE or UTF8_CHAR, got {self.unit}")

    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        values = _strings(self, inputs[0])
        if self.unit == "BYTE":
            lengths = [len(v) for v in values.reshape(-1).tolist()]
        else:  # every byte that does not continue a UTF-8 sequence starts a character
            lengths = [sum(1 for b in v if b & 0xC0 != 0x80) for v in values.reshape(-1).tolist()]
        return [np.array(lengths, dtype=INT32).reshape(values.shape)]


@register_kernel("StringToNumber")
class StringToNumberKernel(OpKernel):
    """Each string parsed as `out_type` (float32 by default); anything else is an error."""

    def __init__(self, node: NodeDef) -> None:
        super().__init__(node)
        self.dtype = self.attr_type("out_type", np.dtype(np.float32))
        if self.dtype.kind not in "fi":
            raise kernel_error(self, f"out_type must be a float or int type, got {self.dtype.name}")

    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        values = _strings(self, inputs[0])
        parse = float if self.dtype.kind == "f" else int
        limits = np.iinfo(self.dtype) if self.dtype.kind == "i" else None
        out = np.empty(values.shape, dtype=self.dtype)
        flat = out.reshape(-1)
        for i, text in enumerate(values.reshape(-1).tolist()):
            try:
                number = parse(text.decode().strip())
                if limits is not None and not limits.min <= number <= limits.max:
                    raise ValueError(text)
                flat[i] = number
            except (ValueError, UnicodeDecodeError):
                shown = text.decode(errors="replace")
                raise kernel_error(
                    self, f"StringToNumberOp could not correctly convert string: {shown}"
                ) from None
        return [out]


@register_kernel("StringSplitV2")
class StringSplitV2Kernel(OpKernel):
    """`(input [n], sep)` -> the pieces as a sparse tensor (indices, values, dense shape).

    An empty `sep` splits on runs of whitespace and drops empty pieces; otherwise on
    every occurrence of `sep`, keeping empty pieces. At most `maxsplit` splits (-1: all).
    """

    def __init__(self, node: NodeDef) -> None:
        super().__init__(node)
        self.maxsplit = self.attr_int("maxsplit", -1)

    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        values, sep_value = _strings(self, inputs[0]), _strings(self, inputs[1])
        if values.ndim != 1:
            raise kernel_error(self, f"input must be a vector, got shape: {shape_str(values.shape)}")
        if sep_value.shape != ():
            raise kernel_error(self, f"sep must be a scalar, got shape: {shape_str(sep_value.shape)}")
        sep = sep_value[()] or None
        indices: list[tuple[int, int]] = []
        pieces: list[bytes] = []
        widest = 0
        for row, text in enumerate(values.tolist()):
            parts = text.split(sep, self.maxsplit)
            indices.extend((row, column) for column in range(len(parts)))
            pieces.extend(parts)
            widest = max(widest, len(parts))
        out_values = np.empty(len(pieces), dtype=OBJECT)
        out_values[:] = pieces
        return [
            np.array(indices, dtype=INT64).reshape(-1, 2),
            out_values,
            np.array([values.shape[0], widest], dtype=INT64),
        ]


@register_kernel("StringToHashBucketFast")
class StringToHashBucketFastKernel(OpKernel):
    """Each string's bucket: its farmhash Fingerprint64 modulo `num_buckets` (TensorFlow's exactly)."""

    def __init__(self, node: NodeDef) -> None:
        super().__init__(node)
        self.num_buckets = self.attr_int("num_buckets")
        if self.num_buckets < 1:
            raise kernel_error(self, f"num_buckets must be at least 1, got {self.num_buckets}")

    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        values = _strings(self, inputs[0])
        buckets = [fingerprint64(text) % self.num_buckets for text in values.reshape(-1).tolist()]
        return [np.array(buckets, dtype=INT64).reshape(values.shape)]
