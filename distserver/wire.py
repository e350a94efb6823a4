"""Tensor bytes on the wire without protobuf in the way.

Python protobuf copies a `bytes` field on every access and cannot take a
memoryview, so a large tensor sent as a `RecvTensorResponse` message would be copied
several times on each side. These functions produce and read the very same bytes
(a valid `RecvTensorResponse`, so any TensorFlow peer parses them) by hand:

    RecvTensorResponse:  field 1 (tensor: TensorProto) | field 2 (is_dead) | ...
    RunStepRequest:      field 2 (feed: NamedTensorProto: name (1), tensor (2)), ... | others
    RunCallableRequest:  field 3 (feed: TensorProto), ... | others
    RunGraphRequest:     field 3 (send: NamedTensorProto), ... | others
    RunStepResponse:     field 1 (NamedTensorProto), ... | field 2 (metadata)
    RunGraphResponse:    field 1 (NamedTensorProto), ... | field 2 (step_stats) | 5, 6 (status)
    RunCallableResponse: field 1 (TensorProto), ...
    TensorProto:         dtype (1), tensor_shape (2) ... then tensor_content (4)

The content is written after a small header built with protobuf (joining the parts
copies it once; requests and answers carrying tensors are sent as an `EncodedMessage`,
encoded off the event loop when large: `encode_off_loop`), and read back as numpy
views over the received buffer (no copy): RecvTensor answers always, the other six
messages' tensors of 16 KiB or more in answers from 4 KiB and requests from 128 KiB
(`decode_tensor_message`; the transports' `parse_handler_request` gives handlers such
requests as a `TensorRequest`). A view keeps the whole received message alive as long
as it lives. Smaller tensors are copies. A step sends the same names, dtypes and shapes
every time, so each item's head (all but the content) is cached on both sides: the
writer joins the cached head and the array's memory, and the reader, once protobuf
has read an item whose bytes are those the writer makes, reads the next ones of that
name and head without it (60 tensors of 128 B to 4 KiB: written in ~35 us instead of
~130, read in ~110 us instead of ~150-220). Tensors that are not plain memory
(strings, resources, variants) go through protobuf.

The chunked form (`chunk_tensor` / `TensorAssembler`) carries one tensor as a stream
of messages: the first holds a length-prefixed header and the start of the content,
the rest hold content only. It has no size limit, unlike one protobuf message (2 GiB).
"""

from __future__ import annotations

import asyncio
import math
import struct
from collections.abc import Iterator, Sequence
from typing import Any, Generic, NamedTuple, TypeVar

import numpy as np
from google.protobuf.message import Message

from distserver import errors
from distserver.protos.named_tensor_pb2 import NamedTensorProto
from distserver.protos.tensor_pb2 import TensorProto
from distserver.protos.worker_pb2 import RecvTensorResponse
from distserver.tensors import (
    MAX_RANK,
    DecodeBudget,
    as_numpy_dtype,
    from_tensor_proto,
    holdable,
    shape_from_proto,
    shape_to_proto,
    tensor_nbytes,
    to_tensor_proto,
    write_tensor_proto,
)

MessageT = TypeVar("MessageT", bound=Message)

# Tensors below this size, whose items `encode_tensor_message` has no head for or
# `decode_tensor_message` does not know yet, are encoded and decoded by protobuf's C code
# (faster for them, and their one copy is cheap); from this size by hand, as views (no
# copy).
HAND_ENCODED_BYTES = 16 << 10
# Answers with tensors from this size are read by hand (`decode_tensor_message`):
# protobuf copies a tensor's content once as it parses and again each time the field is
# read (~100 us for a 784 KiB feed here, against ~25 us by hand), and a message of many
# small tensors whose heads are known takes ~2/3 of protobuf's time (60 tensors of 128 B
# to 4 KiB: 144 against 191 us). Below it, with a tensor or two, protobuf is as fast or
# faster.
HAND_DECODED_MESSAGE_BYTES = 4 << 10
# Requests from this size (the transports' `parse_handler_request`): they carry a few
# feeds, or none but many other fields (a RecvTensors call's keys), which the hand
# reader would walk before protobuf parses them again.
HAND_DECODED_REQUEST_BYTES = 128 << 10

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
    if pos + 1 < len(data):  # (one or two bytes: most tags and lengths)
        first = data[pos]
        if first < 0x80:
            return first, pos + 1
        second = data[pos + 1]
        if second < 0x80:
            return (first & 0x7F) | (second << 7), pos + 2
    result = shift = 0
    while True:
        if pos >= len(data):
            raise errors.DataLossError("Truncated varint in a tensor message")
        if shift > 63:  # a varint has at most 10 bytes
            raise errors.DataLossError("A varint of more than 10 bytes in a tensor message")
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


# Serialized TensorProto headers (dtype and shape) by (dtype, shape), and the reverse:
# a step sends and receives the same few shapes over and over. Bounded: cleared when full.
_HEADER_CACHE_SIZE = 4096
_headers: dict[tuple[np.dtype[Any], tuple[int, ...]], bytes] = {}
_header_meanings: dict[bytes, tuple[np.dtype[Any], tuple[int, ...]] | None] = {}


def _header(value: np.ndarray) -> bytes:
    key = (value.dtype, value.shape)
    found = _headers.get(key)
    if found is None:
        header = TensorProto()
        header.dtype = to_tensor_proto(np.zeros((), value.dtype)).dtype
        header.tensor_shape.CopyFrom(shape_to_proto(value.shape))
        found = header.SerializeToString()
        if len(_headers) >= _HEADER_CACHE_SIZE:
            _headers.clear()
        _headers[key] = found
    return found


def _header_meaning(header: bytes) -> tuple[np.dtype[Any], tuple[int, ...]] | None:
    """(dtype, shape) of a serialized TensorProto header; None when it is not plain."""
    if header in _header_meanings:
        return _header_meanings[header]
    proto = TensorProto.FromString(header)
    dtype = as_numpy_dtype(proto.dtype)
    static_shape = shape_from_proto(proto.tensor_shape)
    meaning = None
    if (
        dtype.kind != "O"
        and static_shape is not None
        and len(static_shape) <= MAX_RANK  # (else `from_tensor_proto` refuses it)
        and all(d is not None for d in static_shape)
    ):
        shape = tuple(int(d or 0) for d in static_shape)
        if holdable(shape, dtype.itemsize):  # (else `from_tensor_proto` refuses it)
            meaning = dtype, shape
    if len(_header_meanings) >= _HEADER_CACHE_SIZE:
        _header_meanings.clear()
    _header_meanings[header] = meaning
    return meaning


def encode_recv_tensor_response(value: Any, is_dead: bool = False) -> bytes:
    """The serialized `RecvTensorResponse` carrying `value` (one copy of the content)."""
    return b"".join(recv_tensor_response_parts(value, is_dead))


def recv_tensor_response_parts(value: Any, is_dead: bool = False) -> list[Part]:
    """`encode_recv_tensor_response` in parts to join or write one after another: a
    numeric array's content is a view of the array."""
    parts = length_delimited(1, tensor_proto_parts(value))
    if is_dead:
        parts.append(_RESPONSE_IS_DEAD)
    return parts


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


# The repeated tensor field of each message `encode_tensor_message` and
# `decode_tensor_message` handle: NamedTensorProtos, or RunCallable's bare TensorProtos.
_TENSOR_FIELDS = {
    "RunStepRequest": "feed",
    "RunCallableRequest": "feed",
    "RunGraphRequest": "send",
    "RunStepResponse": "tensor",
    "RunCallableResponse": "fetch",
    "RunGraphResponse": "recv",
}


class TensorField(NamedTuple):
    """A message's repeated tensor field: its name and number, and whether its items are
    `NamedTensorProto`s (else bare `TensorProto`s)."""

    name: str
    number: int
    named: bool


def tensor_field(message_class: type[Message]) -> TensorField | None:
    """The repeated tensor field of a RunStep, RunCallable or RunGraph request or
    response; None for other messages."""
    try:  # (asked two or three times a call: a step's request and response)
        return _tensor_field_of[message_class]
    except KeyError:
        pass
    descriptor = message_class.DESCRIPTOR
    name = _TENSOR_FIELDS.get(descriptor.name)
    found = None
    if name is not None:
        field = descriptor.fields_by_name[name]
        found = TensorField(name, field.number, field.message_type is NamedTensorProto.DESCRIPTOR)
    _tensor_field_of[message_class] = found
    return found


_tensor_field_of: dict[type[Message], TensorField | None] = {}


def encode_tensor_message(message: Message, values: Sequence[Any]) -> bytes:
    """`message` (its tensor field empty: `tensor_field`) serialized with `values` added
    to that field: (name, value) pairs for `NamedTensorProto`s (a value None: the name
    alone, as RecvTensors marks a value to fetch separately), bare values for
    RunCallable's `TensorProto`s. Plain numeric C-contiguous arrays are written by hand:
    the item's head (`_item_head`, cached), then the array's bytes, copied once (by the
    join); other values by protobuf's C code, in runs, or by hand when large."""
    field = tensor_field(type(message))
    if field is None:
        raise TypeError(f"{type(message).__name__} has no tensor field to encode")
    named = field.named
    parts: list[Part] = [message.SerializeToString()]
    small = type(message)()  # small values in a row, serialized together
    for item in values:
        name, value = item if named else ("", item)
        head = _item_head(field, name, value) if type(value) is np.ndarray else None
        if (
            head is None
            and value is not None
            and not (isinstance(value, np.ndarray) and value.nbytes >= HAND_ENCODED_BYTES)
        ):
            items: Any = getattr(small, field.name)
            write_tensor_proto(items.add(name=name).tensor if named else items.add(), value)
            continue
        if small.ByteSize():
            parts.append(small.SerializeToString())
            small.Clear()
        if head is not None:
            parts += (head, value)
            continue
        tensor = [] if value is None else tensor_proto_parts(value)
        if named:
            tensor = length_delimited(1, [name.encode()]) + (length_delimited(2, tensor) if tensor else [])
        parts += length_delimited(field.number, tensor)
    if small.ByteSize():
        parts.append(small.SerializeToString())
    return b"".join(parts)


# The serialized head of a tensor-field item (all of it but the content at its end) by
# (field number, name, dtype, shape): a step sends the same names and shapes over and
# over, and a cached head spares ~2 us of protobuf a small tensor. Bounded: cleared when
# full, and only names of up to `_CACHED_NAME_BYTES` (rendezvous keys and tensor names
# are ~10-300 bytes; a name a peer or client makes up may be megabytes).
_item_heads: dict[tuple[int, str, np.dtype[Any], tuple[int, ...]], bytes] = {}
_CACHED_NAME_BYTES = 1024


def _item_head(field: TensorField, name: str, value: np.ndarray) -> bytes | None:
    """The bytes of the item of `field` holding `value` (named `name` if the field's
    items are named) that come before its content, for a plain numeric array in
    C order, little-endian, with content; else None."""
    if not value.flags.c_contiguous:
        return None
    key = (field.number, name, value.dtype, value.shape)
    head = _item_heads.get(key)
    if head is None:
        if not _has_plain_content(value):
            return None
        named, rest = _item_parts(field, name, value)
        head = _field_head(field.number, len(named) + len(rest) + value.nbytes) + named + rest
        if len(named) <= _CACHED_NAME_BYTES:
            if len(_item_heads) >= _HEADER_CACHE_SIZE:
                _item_heads.clear()
            _item_heads[key] = head
    return head


def _has_plain_content(value: np.ndarray) -> bool:
    """Whether `value`'s memory, as it is, is its `tensor_content`."""
    return (
        bool(value.nbytes) and is_plain(value) and value.flags.c_contiguous and value.dtype.byteorder != ">"
    )


def _item_parts(field: TensorField, name: str, value: np.ndarray) -> tuple[bytes, bytes]:
    """A tensor-field item holding `value` (`_has_plain_content`), less its field's tag
    and length and its content: the name's field (empty for a bare TensorProto) and the
    bytes between it and the content."""
    tensor = _header(value) + _TENSOR_CONTENT_TAG + encode_varint(value.nbytes)
    if not field.named:
        return b"", tensor
    encoded = name.encode()
    return _field_head(1, len(encoded)) + encoded, _field_head(2, len(tensor) + value.nbytes) + tensor


def _field_head(number: int, size: int) -> bytes:
    """The tag and length of length-delimited field `number` holding `size` bytes."""
    return encode_varint((number << 3) | _LEN) + encode_varint(size)


# A message with more top-level fields than this is left to protobuf (the loop below
# is Python: a peer must not make it spin).
_TENSOR_MESSAGE_FIELDS = 10_000


def decode_tensor_message(
    data: bytes | memoryview, message_class: type[MessageT], *, missing_ok: bool = False, what: str = ""
) -> tuple[list[tuple[str, np.ndarray | None]], MessageT] | None:
    """The reverse of `encode_tensor_message`, for any message `tensor_field` knows: its
    tensors as (name, value) pairs (the name "" for RunCallable's bare `TensorProto`s),
    plain numeric ones of `HAND_ENCODED_BYTES` or more as numpy views over `data`
    (read-only when `data` is), smaller ones decoded by protobuf (charged to one
    `DecodeBudget` named `what`) or, when an item of the same name, length and head
    was read before (`_known_item`), as read-only copies of their content; every
    other field parsed by protobuf as `message_class` (handles, options, status,
    metadata: small). None when a large tensor is not plain numeric content, or the
    message has too many fields: protobuf must parse it all. With `missing_ok`, a
    `NamedTensorProto` without a tensor gives (name, None) (RecvTensors: fetch it
    separately).

    Raises:
        DataLossError: a field or a tensor's content is cut short, or the content does
            not match its dtype and shape.
    """
    field = tensor_field(message_class)
    if field is None:
        raise TypeError(f"{message_class.__name__} has no tensor field to decode")
    named_items = field.named
    budget = DecodeBudget(what=what or f"a {message_class.__name__}")
    view = memoryview(data)
    named: list[tuple[str, np.ndarray | None]] = []
    rest: list[memoryview] = []
    try:
        for number, wire_type, field_start, start, end in _fields(view, 0, len(view), _TENSOR_MESSAGE_FIELDS):
            if number == field.number and wire_type == _LEN:
                item: tuple[str, Any] | None = _known_item(data, view, start, end, named_items)
                if item is None:
                    item = (
                        _decode_small_item(view[start:end], named_items, missing_ok, budget)
                        if end - start < HAND_ENCODED_BYTES
                        else _decode_named_tensor(data, view, start, end, missing_ok)
                        if named_items
                        else _unnamed(_decode_tensor(data, view, start, end))
                    )
                    if item is None:
                        return None
                    _learn_item(field, view, start, end, item)
                named.append(item)
            else:
                rest.append(view[field_start:end])
    except _NotPlain:
        return None
    return named, message_class.FromString(b"".join(rest))


# Items `_known_item` reads without protobuf: (name, item length) -> (the item's bytes
# between its name and its content, the name, dtype, shape, element count), learnt from
# items read the long way (`_learn_item`) whose bytes are what `encode_tensor_message`
# writes: a peer sends the same names and shapes every step. Bounded: cleared when full.
_known_items: dict[tuple[bytes, int], tuple[bytes, str, np.dtype[Any], tuple[int, ...], int]] = {}


def _known_item(
    data: bytes | memoryview, view: memoryview, start: int, end: int, named: bool
) -> tuple[str, np.ndarray] | None:
    """The tensor-field item view[start:end] as (name, value), when `_known_items` holds
    its name, length and head; else None. The value is a numpy view over `data` where
    `_decode_tensor` makes one."""
    at = start
    name = b""
    if named:
        if end - start < 2 or view[start] != 0x0A:  # (field 1, the name, first)
            return None
        size, at = _read_varint(view, start + 1)
        name = bytes(view[at : at + size])
        at += size
    known = _known_items.get((name, end - start))
    if known is None:
        return None
    head, text, dtype, shape, count = known
    offset = at + len(head)
    if offset + count * dtype.itemsize != end or view[at:offset] != head:
        return None
    if end - offset < HAND_ENCODED_BYTES:
        # A copy, read-only and aligned (a bytes object's content is): a small tensor
        # does not keep the whole message alive (protobuf copies it too).
        return text, np.ndarray(shape, dtype, bytes(view[offset:end]))
    return text, _aligned(np.ndarray(shape, dtype, data, offset))


def _learn_item(field: TensorField, view: memoryview, start: int, end: int, item: tuple[str, Any]) -> None:
    """Remember the item view[start:end], read the long way as `item`, for
    `_known_item`: when its bytes are those `encode_tensor_message` writes."""
    name, value = item
    if type(value) is not np.ndarray or not _has_plain_content(value):
        return
    named, rest = _item_parts(field, name, value)
    content = end - value.nbytes
    if len(named) > _CACHED_NAME_BYTES:
        return
    if content - start != len(named) + len(rest) or view[start:content] != named + rest:
        return
    if len(_known_items) >= _HEADER_CACHE_SIZE:
        _known_items.clear()
    key = (name.encode() if field.named else b"", end - start)
    _known_items[key] = (rest, name, value.dtype.newbyteorder("<"), value.shape, value.size)


class _NotPlain(Exception):
    """A message has a field the hand decoders leave to protobuf (or too many fields)."""


def _fields(view: memoryview, start: int, end: int, limit: int) -> Iterator[tuple[int, int, int, int, int]]:
    """(field number, wire type, where the field starts, where its value starts, where it
    ends) of each field of view[start:end]: a length-delimited value is its bytes, a
    varint its encoding. Raises `_NotPlain` for other wire types or more than `limit`
    fields (the decoders run on the event loop), DataLossError for a field cut short."""
    pos = start
    for _ in range(limit):
        if pos >= end:
            return
        field_start = pos
        key, pos = _read_varint(view, pos)
        wire_type = key & 7
        if wire_type == _LEN:
            length, pos = _read_varint(view, pos)
            if pos + length > end:
                raise errors.DataLossError("A tensor message is cut short")
            yield key >> 3, wire_type, field_start, pos, pos + length
            pos += length
        elif wire_type == _VARINT:
            _, value_end = _read_varint(view, pos)
            yield key >> 3, wire_type, field_start, pos, value_end
            pos = value_end
        else:
            raise _NotPlain
    if pos < end:
        raise _NotPlain


def content_start(head: bytes | memoryview, message_class: type[Message]) -> int | None:
    """Where, in a serialized `message_class` (a message `tensor_field` knows) of which
    `head` is the first bytes, the content of its first tensor item of
    `HAND_ENCODED_BYTES` or more starts: a receiver that places the message so that
    this offset is aligned lets `decode_tensor_message` read that tensor as a view, not
    an aligned copy. None when `head` ends before it, or the message is not as
    `encode_tensor_message` writes it."""
    field = tensor_field(message_class)
    if field is None:
        return None
    view = memoryview(head)
    try:
        for number, start, length in _field_heads(view, 0, _TENSOR_MESSAGE_FIELDS):
            if number == field.number and length >= HAND_ENCODED_BYTES:
                tensor = _value_start(view, start, 2) if field.named else start  # (NamedTensorProto.tensor)
                return _value_start(view, tensor, 4)  # TensorProto.tensor_content
    except (_NotPlain, errors.DataLossError):  # (cut short by the end of `head`)
        return None
    return None


def _value_start(view: memoryview, pos: int, wanted: int) -> int:
    """Where the value of the length-delimited field `wanted` starts, in the fields from
    `pos` on (`_field_heads`; `_NotPlain` if not among the first `_PLAIN_FIELDS`)."""
    for number, start, _ in _field_heads(view, pos, _PLAIN_FIELDS):
        if number == wanted:
            return start
    raise _NotPlain


def _field_heads(view: memoryview, pos: int, limit: int) -> Iterator[tuple[int, int, int]]:
    """(field number, where its value starts, its length) of each length-delimited field
    from `pos` on, up to `limit` fields, varints passed over; a value may run past the
    end of `view` (a message's first bytes). Raises `_NotPlain` for other wire types,
    DataLossError where `view` ends inside a field's head."""
    for _ in range(limit):
        key, pos = _read_varint(view, pos)
        if key & 7 == _VARINT:
            _, pos = _read_varint(view, pos)
            continue
        if key & 7 != _LEN:
            raise _NotPlain
        length, pos = _read_varint(view, pos)
        yield key >> 3, pos, length
        pos += length


def _decode_small_item(
    item: memoryview, named: bool, missing_ok: bool, budget: DecodeBudget
) -> tuple[str, Any] | None:
    """A small tensor-field item by protobuf's C code (a NamedTensorProto, or a bare TensorProto)."""
    if not named:
        return "", from_tensor_proto(TensorProto.FromString(bytes(item)), budget=budget)
    parsed = NamedTensorProto.FromString(bytes(item))
    if not parsed.HasField("tensor"):
        return (parsed.name, None) if missing_ok else None
    return parsed.name, from_tensor_proto(parsed.tensor, budget=budget)


def _unnamed(value: np.ndarray | None) -> tuple[str, np.ndarray | None] | None:
    return None if value is None else ("", value)


def _decode_named_tensor(
    data: bytes | memoryview, view: memoryview, start: int, end: int, missing_ok: bool
) -> tuple[str, np.ndarray | None] | None:
    """A `NamedTensorProto` at view[start:end] with plain numeric content, else None."""
    name = b""
    tensor: tuple[int, int] | None = None
    try:
        for field, wire_type, _, value_start, value_end in _fields(view, start, end, _PLAIN_FIELDS):
            if wire_type != _LEN:
                return None
            if field == 1:
                name = bytes(view[value_start:value_end])
            elif field == 2:
                tensor = (value_start, value_end)
    except _NotPlain:
        return None
    value = _tensor_at(data, view, tensor)
    if value is None and not (missing_ok and tensor is None):
        return None
    try:
        return name.decode(), value
    except UnicodeDecodeError:
        return None


class EncodedMessage:
    """A message already serialized (by the encoders above: each tensor's bytes copied
    once), which the transports send as it is (`SerializeToString`)."""

    __slots__ = ("data", "message_class")

    def __init__(self, data: bytes, message_class: type[Message]) -> None:
        self.data = data
        self.message_class = message_class

    def SerializeToString(self) -> bytes:  # protobuf's name: the transports call it
        return self.data

    def parse(self) -> Message:
        return self.message_class.FromString(self.data)


ENCODE_IN_THREAD_BYTES = 1 << 20


async def encode_off_loop(message: Message, values: Sequence[Any]) -> EncodedMessage:
    """`encode_tensor_message(message, values)` as an `EncodedMessage`, in a thread when
    the tensors it copies come to `ENCODE_IN_THREAD_BYTES` or more (nobody may change
    `message` or `values` meanwhile)."""
    field = tensor_field(type(message))
    named = field is not None and field.named
    tensors = (value for _, value in values) if named else iter(values)
    nbytes = sum(tensor_nbytes(value) for value in tensors if value is not None)
    if nbytes < ENCODE_IN_THREAD_BYTES:
        return EncodedMessage(encode_tensor_message(message, values), type(message))
    return EncodedMessage(await asyncio.to_thread(encode_tensor_message, message, values), type(message))


class TensorRequest(Generic[MessageT]):
    """A request whose tensors `decode_tensor_message` read (large ones as views over
    the received bytes): `message` without them, and `tensors` as (name, value) pairs.
    The transports' `parse_request` gives handlers large RunStep, RunCallable and
    RunGraph requests this way."""

    __slots__ = ("message", "tensors")

    def __init__(self, message: MessageT, tensors: list[tuple[str, Any]]) -> None:
        self.message = message
        self.tensors = tensors


def decode_recv_tensor_response(data: bytes) -> tuple[np.ndarray, bool]:
    """The (value, is_dead) of a serialized `RecvTensorResponse`.

    Numeric content becomes a read-only numpy view over `data` (no copy); anything
    unusual falls back to protobuf parsing.
    """
    decoded = decode_plain_recv_tensor_response(data)
    return _decode_with_protobuf(data) if decoded is None else decoded


def decode_plain_recv_tensor_response(data: bytes | memoryview) -> tuple[np.ndarray, bool] | None:
    """`decode_recv_tensor_response` of numeric content, a view over `data` whatever its
    size (cheap enough for the event loop); None when protobuf must parse it."""
    view = memoryview(data)
    tensor: tuple[int, int] | None = None
    is_dead = False
    try:
        for field, wire_type, _, start, end in _fields(view, 0, len(view), _PLAIN_FIELDS):
            if field == 1 and wire_type == _LEN:
                tensor = (start, end)
            elif field == 2 and wire_type == _VARINT:
                is_dead = bool(_read_varint(view, start)[0])
    except _NotPlain:
        return None
    value = _tensor_at(data, view, tensor)
    return None if value is None else (value, is_dead)


def _tensor_at(data: bytes | memoryview, view: memoryview, span: tuple[int, int] | None) -> np.ndarray | None:
    return None if span is None else _decode_tensor(data, view, *span)


def _decode_tensor(data: bytes | memoryview, view: memoryview, start: int, end: int) -> np.ndarray | None:
    """The `TensorProto` at view[start:end] as a numpy view over `data` when its content is
    plain (`tensor_content`), else None."""
    header = bytearray()
    content: tuple[int, int] | None = None
    try:
        for field, wire_type, field_start, value_start, value_end in _fields(view, start, end, _PLAIN_FIELDS):
            if wire_type == _VARINT or (field == 2 and value_end - value_start <= _PLAIN_HEADER_BYTES):
                header += view[field_start:value_end]
            elif field == 4:
                content = (value_start, value_end - value_start)
            else:
                return None  # typed *_val fields, strings, ...: let protobuf read them
    except _NotPlain:
        return None
    if len(header) > _PLAIN_HEADER_BYTES:
        return None
    meaning = _header_meaning(bytes(header))
    if meaning is None:
        return None
    dtype, shape = meaning
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
    value = np.frombuffer(data, dtype=dtype.newbyteorder("<"), count=count, offset=offset)
    return _aligned(value.reshape(shape))


def _aligned(value: np.ndarray) -> np.ndarray:
    """`value`, a view of a message's content, or its aligned copy."""
    if not value.flags.aligned and value.nbytes < ENCODE_IN_THREAD_BYTES:
        # Content at an offset its dtype does not divide (most of TensorFlow's clients'
        # feeds, many of ours): every kernel that read it would first copy it in pieces
        # (a 784 KiB matrix product +0.1-0.2 ms, a sum 1.7-2.2x). One aligned copy
        # instead (read-only, as a view of the message is); a larger value stays a view
        # (its copy would stall the event loop).
        value = value.copy()
        value.flags.writeable = False
    return value


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
