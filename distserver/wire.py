"""Tensor bytes on the wire without protobuf in the way.

Python protobuf copies a `bytes` field on every access and cannot take a
memoryview, so a large tensor sent as a `RecvTensorResponse` message would be copied
several times on each side. These functions produce and read the very same bytes
(a valid `RecvTensorResponse`, so any TensorFlow peer parses them) by hand:

    RecvTensorResponse:  field 1 (tensor: TensorProto) | field 2 (is_dead) | ...
    RunStepResponse:     field 1 (NamedTensorProto: name (1), tensor (2)), ... | field 2 (metadata)
    RunCallableResponse: field 1 (TensorProto), ...
    TensorProto:         dtype (1), tensor_shape (2) ... then tensor_content (4)

The content is written after a small header built with protobuf (joining the parts
copies it once; a master's fetch answers are served as an `EncodedMessage`), and a
RecvTensor answer is read back as a numpy view over the received buffer (no copy).
Tensors that are not plain memory (strings, resources, variants) go through protobuf.

The chunked form (`chunk_tensor` / `TensorAssembler`) carries one tensor as a stream
of messages: the first holds a length-prefixed header and the start of the content,
the rest hold content only. It has no size limit, unlike one protobuf message (2 GiB).
"""

from __future__ import annotations

import math
import struct
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
from google.protobuf.message import Message

from distserver import errors
from distserver.protos.tensor_pb2 import TensorProto
from distserver.protos.worker_pb2 import RecvTensorResponse
from distserver.tensors import (
    as_numpy_dtype,
    from_tensor_proto,
    shape_from_proto,
    shape_to_proto,
    to_tensor_proto,
)

_LEN = 2  # protobuf wire type of length-delimited fields
_VARINT = 0
# A plain tensor response has a few fields and a short header (dtype, shape): one with
# more is left to protobuf, off the event loop when large (a peer's data is hostile).
_PLAIN_FIELDS = 16
_PLAIN_HEADER_BYTES = 4096
_TENSOR_CONTENT_TAG = bytes([(4 << 3) | _LEN])
_RESPONSE_IS_DEAD = bytes([(2 << 3) | _VARINT, 1])


def encode_varint(value: int) -> bytes:
    """`value` (non-negative) as a protobuf base-128 varint."""
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _read_varint(data: memoryview, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(data):
            raise errors.DataLossError("Truncated varint in a tensor response")
        byte = data[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7


def is_plain(value: Any) -> bool:
    """True for numpy arrays whose bytes are the tensor (not strings or resources)."""
    # bfloat16 (ml_dtypes) has kind "V" but no fields; structured dtypes are not tensors.
    return isinstance(value, np.ndarray) and value.dtype.kind not in "OUS" and value.dtype.fields is None


def _contiguous_le(value: np.ndarray) -> np.ndarray:
    if value.dtype.byteorder == ">":
        value = value.astype(value.dtype.newbyteorder("<"))
    # Not np.ascontiguousarray: it turns 0-d arrays into 1-d ones.
    return value if value.flags.c_contiguous else value.copy(order="C")


def _bytes_view(array: np.ndarray) -> memoryview:
    """The bytes of a C-contiguous array, without copying."""
    view: memoryview = array.reshape(-1).view(np.uint8).data
    return view


def _header(value: np.ndarray) -> bytes:
    header = TensorProto()
    header.dtype = to_tensor_proto(np.zeros((), value.dtype)).dtype
    header.tensor_shape.CopyFrom(shape_to_proto(value.shape))
    return header.SerializeToString()


def encode_recv_tensor_response(value: Any, is_dead: bool = False) -> bytes:
    """The serialized `RecvTensorResponse` carrying `value` (one copy of the content)."""
    parts = length_delimited(1, tensor_proto_parts(value))
    if is_dead:
        parts.append(_RESPONSE_IS_DEAD)
    return b"".join(parts)


Part = bytes | memoryview


def tensor_proto_parts(value: Any) -> list[Part]:
    """`to_tensor_proto(value)` serialized, in parts to join: a numeric array's content is
    a view of the array, so joining the parts copies it once."""
    if isinstance(value, np.generic):
        value = np.asarray(value)
    if not is_plain(value):
        return [to_tensor_proto(value).SerializeToString()]
    array = _contiguous_le(value)
    parts: list[Part] = [_header(array)]
    if array.nbytes:
        parts += [_TENSOR_CONTENT_TAG, encode_varint(array.nbytes), _bytes_view(array)]
    return parts


def length_delimited(field: int, parts: list[Part]) -> list[Part]:
    """Field `field` (a message or bytes) holding the concatenation of `parts`."""
    size = sum(part.nbytes if isinstance(part, memoryview) else len(part) for part in parts)
    return [encode_varint((field << 3) | _LEN), encode_varint(size), *parts]


def encode_run_step_response(fetched: Sequence[tuple[str, Any]], metadata: bytes = b"") -> bytes:
    """A serialized `RunStepResponse`: each (name, value) as a `NamedTensorProto` (field 1),
    then `metadata` (a serialized `RunMetadata`, field 2) when not empty."""
    parts: list[Part] = []
    for name, value in fetched:
        named = [*length_delimited(1, [name.encode()]), *length_delimited(2, tensor_proto_parts(value))]
        parts += length_delimited(1, named)
    if metadata:
        parts += length_delimited(2, [metadata])
    return b"".join(parts)


def encode_run_callable_response(values: Sequence[Any]) -> bytes:
    """A serialized `RunCallableResponse`: each value a `TensorProto` (field 1)."""
    parts: list[Part] = []
    for value in values:
        parts += length_delimited(1, tensor_proto_parts(value))
    return b"".join(parts)


class EncodedMessage:
    """A response message already serialized (by the encoders above: each tensor's bytes
    copied once), which the transports send as it is (`SerializeToString`)."""

    __slots__ = ("data", "message_class")

    def __init__(self, data: bytes, message_class: type[Message]) -> None:
        self.data = data
        self.message_class = message_class

    def SerializeToString(self) -> bytes:  # protobuf's name: the transports call it
        return self.data

    def parse(self) -> Message:
        return self.message_class.FromString(self.data)


def decode_recv_tensor_response(data: bytes) -> tuple[np.ndarray, bool]:
    """The (value, is_dead) of a serialized `RecvTensorResponse`.

    Numeric content becomes a read-only numpy view over `data` (no copy); anything
    unusual falls back to protobuf parsing.
    """
    decoded = decode_plain_recv_tensor_response(data)
    return _decode_with_protobuf(data) if decoded is None else decoded


def decode_plain_recv_tensor_response(data: bytes) -> tuple[np.ndarray, bool] | None:
    """`decode_recv_tensor_response` of numeric content, a view over `data` whatever its
    size (cheap enough for the event loop); None when protobuf must parse it."""
    view = memoryview(data)
    pos = 0
    tensor: tuple[int, int] | None = None
    is_dead = False
    for _ in range(_PLAIN_FIELDS):
        if pos >= len(view):
            break
        key, pos = _read_varint(view, pos)
        field, wire_type = key >> 3, key & 7
        if wire_type == _LEN:
            length, pos = _read_varint(view, pos)
            if pos + length > len(view):
                raise errors.DataLossError("Truncated tensor response")
            if field == 1:
                tensor = (pos, pos + length)
            pos += length
        elif wire_type == _VARINT:
            number, pos = _read_varint(view, pos)
            if field == 2:
                is_dead = bool(number)
        else:
            return None
    else:
        return None  # more fields than a plain response has
    if tensor is None:
        return None
    value = _decode_tensor(data, view, *tensor)
    if value is None:
        return None
    return value, is_dead


def _decode_tensor(data: bytes, view: memoryview, start: int, end: int) -> np.ndarray | None:
    pos = start
    header = bytearray()
    content: tuple[int, int] | None = None
    for _ in range(_PLAIN_FIELDS):
        if pos >= end:
            break
        field_start = pos
        key, pos = _read_varint(view, pos)
        field, wire_type = key >> 3, key & 7
        if wire_type == _LEN:
            length, pos = _read_varint(view, pos)
            if field == 4:
                content = (pos, length)
            elif field == 2 and length <= _PLAIN_HEADER_BYTES:
                header += view[field_start : pos + length]
            else:
                return None  # typed *_val fields, strings, ...: let protobuf read them
            pos += length
        elif wire_type == _VARINT:
            _, pos = _read_varint(view, pos)
            header += view[field_start:pos]
        else:
            return None
    else:
        return None
    if len(header) > _PLAIN_HEADER_BYTES:
        return None
    proto = TensorProto.FromString(bytes(header))
    dtype = as_numpy_dtype(proto.dtype)
    if dtype.kind == "O":
        return None
    static_shape = shape_from_proto(proto.tensor_shape)
    if static_shape is None or any(d is None for d in static_shape):
        return None
    shape = tuple(int(d or 0) for d in static_shape)
    count = math.prod(shape)
    if content is None:
        return np.zeros(shape, dtype) if count == 0 else None
    offset, length = content
    if offset + length > len(data):
        raise errors.DataLossError(f"Tensor content is cut short: {len(data) - offset} of {length} bytes")
    if length != count * dtype.itemsize:
        raise errors.DataLossError(
            f"Tensor content has {length} bytes; dtype {dtype} and shape {shape} "
            f"need {count * dtype.itemsize}"
        )
    return np.frombuffer(data, dtype=dtype.newbyteorder("<"), count=count, offset=offset).reshape(shape)


def _decode_with_protobuf(data: bytes) -> tuple[np.ndarray, bool]:
    response = RecvTensorResponse.FromString(data)
    return from_tensor_proto(response.tensor), response.is_dead


# -- chunked form ----------------------------------------------------------------------

_HEADER_PREFIX = struct.Struct("<I")  # length of the header that follows


def chunk_tensor(value: Any, is_dead: bool, chunk_bytes: int) -> Iterator[bytes]:
    """Messages that carry `value` as a stream (see the module docstring).

    The first message is `<u32 header length> <RecvTensorResponse without content>`
    followed by up to `chunk_bytes` of content; later messages are content only.
    """
    if isinstance(value, np.generic):
        value = np.asarray(value)
    if not is_plain(value):
        # Strings and resources: the whole protobuf response, in one message.
        encoded = encode_recv_tensor_response(value, is_dead)
        yield _HEADER_PREFIX.pack(0) + encoded
        return
    array = _contiguous_le(value)
    header = RecvTensorResponse(is_dead=is_dead)
    header.tensor.ParseFromString(_header(array))
    head = header.SerializeToString()
    content = _bytes_view(array) if array.nbytes else memoryview(b"")
    yield _HEADER_PREFIX.pack(len(head)) + head + content[:chunk_bytes]
    for start in range(chunk_bytes, array.nbytes, chunk_bytes):
        yield bytes(content[start : start + chunk_bytes])


class TensorAssembler:
    """Rebuilds a tensor from `chunk_tensor` messages, copying each chunk into place once."""

    def __init__(self) -> None:
        self._buffer: np.ndarray | None = None
        self._filled = 0
        self._value: np.ndarray | None = None
        self.is_dead = False

    def add(self, message: bytes) -> None:
        if self._value is None and self._buffer is None:
            (head_len,) = _HEADER_PREFIX.unpack_from(message)
            if head_len == 0:
                self._value, self.is_dead = decode_recv_tensor_response(message[_HEADER_PREFIX.size :])
                return
            start = _HEADER_PREFIX.size
            head = RecvTensorResponse.FromString(message[start : start + head_len])
            self.is_dead = head.is_dead
            dtype = as_numpy_dtype(head.tensor.dtype)
            shape = shape_from_proto(head.tensor.tensor_shape)
            assert shape is not None
            self._buffer = np.empty(tuple(int(d or 0) for d in shape), dtype)
            self._write(memoryview(message)[start + head_len :])
            return
        self._write(memoryview(message))

    def _write(self, chunk: memoryview) -> None:
        assert self._buffer is not None
        flat = self._buffer.reshape(-1).view(np.uint8)
        end = self._filled + len(chunk)
        if end > flat.size:
            raise errors.DataLossError(f"Tensor stream sent {end} bytes for a {flat.size}-byte tensor")
        flat[self._filled : end] = np.frombuffer(chunk, np.uint8)
        self._filled = end

    def result(self) -> tuple[np.ndarray, bool]:
        """The tensor, once every chunk has arrived."""
        if self._value is not None:
            return self._value, self.is_dead
        if self._buffer is None or self._filled != self._buffer.nbytes:
            size = 0 if self._buffer is None else self._buffer.nbytes
            raise errors.DataLossError(f"Tensor stream ended after {self._filled} of {size} bytes")
        return self._buffer, self.is_dead
