"""Byte layouts of everything the verbs library sends: sans-I/O encode/decode only.

Two layers share one `SOCK_SEQPACKET` socket per queue pair (one packet = one frame):

Queue-pair frames (first byte = `FrameType`):

    HELLO     magic "DSVB", version, pid, cq depth, identity   fds: cq ring memfd, cq eventfd
    REG_MR    region id, size, 16-byte key                    fds: region memfd
    UNREG_MR  region id
    SEND      opaque payload (the `send`/`recv` control channel)
    CREDIT    n: the peer consumed n completion-ring entries
    BYE       reason (a graceful close; EOF follows)

Tensor-path messages travel as SEND payloads (first byte = `TensorMessage`):

    REQUEST     req id, destination (region, key, offset, capacity), the description
                the receiver expects (or none), request header
    RE_REQUEST  req id, destination        (after NEEDS_SPACE: a larger destination)
    CANCEL      req id                      (the receiver gave up)
    CALL        call id, method path, serialized request   (a control call, `_calls`)
    CALL_CANCEL call id                     (the caller gave up)
    CALL_RESULT call id, more?, status code, a piece of the serialized response (or
                the error message); responses larger than a packet come in pieces
    RESPONSE    req id, kind, then per kind:
                  INLINE       tensor description + the tensor bytes
                  WRITING      tensor description (the write follows; its completion ends it;
                               not sent when the REQUEST's expected description holds)
                  NEEDS_SPACE  tensor description (destination missing or too small)
                  ERROR        status code + message

A tensor description is (nbytes, dtype, shape, meta). Every decoder checks lengths
and raises `ProtocolError` on anything malformed.

The completion of a tensor write carries `imm_data`: `IMM_WRITING_SENT` (a WRITING
message describes it) or `IMM_AS_EXPECTED` (the description the receiver sent with
its REQUEST, or got in NEEDS_SPACE, holds: TF verbs' metadata cache, so a steady-state
transfer is one REQUEST and one write).
"""

from __future__ import annotations

import enum
import functools
import math
import struct
from dataclasses import dataclass
from typing import Any

import ml_dtypes  # noqa: F401 - registers bfloat16 & co. by name with numpy
import numpy as np

from distserver import errors

MAGIC = b"DSVB"
VERSION = 3
KEY_BYTES = 16
MAX_RANK = 254  # TensorFlow's limit
MAX_PACKET_BYTES = 256 << 10
MAX_SEND_BYTES = 200 << 10
"""Largest `QueuePair.send` payload (a packet is one SEQPACKET message)."""


class ProtocolError(errors.InternalError):
    """A peer sent a malformed or unexpected frame."""


class FrameType(enum.IntEnum):
    HELLO = 1
    REG_MR = 2
    UNREG_MR = 3
    SEND = 4
    CREDIT = 5
    BYE = 6


_HELLO = struct.Struct("<B4sHIIQ16s")  # type, magic, version, pid, cq depth, cq ring bytes, ticket
TICKET_BYTES = 16
_REG_MR = struct.Struct("<BQQ16s")
_UNREG_MR = struct.Struct("<BQ")
_CREDIT = struct.Struct("<BI")


@dataclass(frozen=True)
class Hello:
    version: int
    pid: int
    cq_depth: int
    cq_ring_bytes: int
    identity: bytes
    ticket: bytes = bytes(TICKET_BYTES)  # the listener's ticket, from the connecting side


@dataclass(frozen=True)
class RegMr:
    region_id: int
    nbytes: int
    key: bytes


def encode_hello(hello: Hello) -> bytes:
    head = _HELLO.pack(
        FrameType.HELLO, MAGIC, hello.version, hello.pid, hello.cq_depth, hello.cq_ring_bytes, hello.ticket
    )
    return head + hello.identity


def decode_hello(data: bytes) -> Hello:
    _need(data, _HELLO.size, "HELLO")
    _, magic, version, pid, depth, ring_bytes, ticket = _HELLO.unpack_from(data)
    if magic != MAGIC:
        raise ProtocolError(f"the peer is not a distserver verbs endpoint (magic {magic!r})")
    return Hello(version, pid, depth, ring_bytes, bytes(data[_HELLO.size :]), ticket)


def encode_reg_mr(region_id: int, nbytes: int, key: bytes) -> bytes:
    return _REG_MR.pack(FrameType.REG_MR, region_id, nbytes, key)


def decode_reg_mr(data: bytes) -> RegMr:
    _need(data, _REG_MR.size, "REG_MR")
    _, region_id, nbytes, key = _REG_MR.unpack_from(data)
    return RegMr(region_id, nbytes, key)


def encode_unreg_mr(region_id: int) -> bytes:
    return _UNREG_MR.pack(FrameType.UNREG_MR, region_id)


def decode_unreg_mr(data: bytes) -> int:
    _need(data, _UNREG_MR.size, "UNREG_MR")
    return int(_UNREG_MR.unpack_from(data)[1])


def encode_credit(n: int) -> bytes:
    return _CREDIT.pack(FrameType.CREDIT, n)


def decode_credit(data: bytes) -> int:
    _need(data, _CREDIT.size, "CREDIT")
    return int(_CREDIT.unpack_from(data)[1])


SEND_FRAME = bytes((FrameType.SEND,))
"""The head of a SEND frame; its payload follows (`QueuePair.send` sends the parts)."""


def encode_bye(reason: str) -> bytes:
    return bytes((FrameType.BYE,)) + reason.encode("utf-8", "replace")[:1024]


# -- tensor path --------------------------------------------------------------------


class TensorMessage(enum.IntEnum):
    REQUEST = 1
    RE_REQUEST = 2
    CANCEL = 3
    RESPONSE = 4
    CALL = 5
    CALL_CANCEL = 6
    CALL_RESULT = 7


class ResponseKind(enum.IntEnum):
    INLINE = 1
    WRITING = 2
    NEEDS_SPACE = 3
    ERROR = 4


@dataclass(frozen=True)
class Destination:
    """Where the sender may write: a slice of a region the receiver exposed."""

    region_id: int
    key: bytes
    offset: int
    capacity: int


NO_DESTINATION = Destination(0, bytes(KEY_BYTES), 0, 0)

IMM_WRITING_SENT = 0
IMM_AS_EXPECTED = 1

_REQ_HEAD = struct.Struct("<BQ")  # message type, request id
_DEST = struct.Struct("<QQQ16s")  # region id, offset, capacity, key
_RESP_HEAD = struct.Struct("<BQB")  # message type, request id, kind
_DESC = struct.Struct("<QHH")  # nbytes, rank, dtype length
_META_LEN = struct.Struct("<I")
_EXPECTED_LEN = struct.Struct("<I")
_CALL_HEAD = struct.Struct("<BQH")  # message type, call id, path length
_RESULT_HEAD = struct.Struct("<BQBI")  # message type, call id, more pieces follow, status code
MAX_CALL_BYTES = MAX_SEND_BYTES - _CALL_HEAD.size - 1024
"""The largest method path + request a CALL carries (larger calls go over gRPC)."""
_RESULT_PIECE_BYTES = MAX_SEND_BYTES - _RESULT_HEAD.size
_STATUS = struct.Struct("<I")


@dataclass(frozen=True)
class Request:
    req_id: int
    destination: Destination
    header: bytes
    expected: TensorDescription | None = None


@dataclass(frozen=True)
class ReRequest:
    req_id: int
    destination: Destination


@dataclass(frozen=True)
class Cancel:
    req_id: int


@dataclass(frozen=True)
class TensorDescription:
    nbytes: int
    dtype: np.dtype[Any]
    shape: tuple[int, ...]
    meta: bytes


@dataclass(frozen=True)
class Response:
    req_id: int
    kind: ResponseKind
    description: TensorDescription | None = None
    payload: bytes | bytearray = b""  # INLINE: the tensor bytes
    code: int = 0  # ERROR
    message: str = ""  # ERROR


@dataclass(frozen=True)
class Call:
    call_id: int
    path: str
    payload: bytes


@dataclass(frozen=True)
class CallCancel:
    call_id: int


@dataclass(frozen=True)
class CallResult:
    call_id: int
    more: bool
    code: int
    body: bytes | memoryview  # (a view of the message it came in, when that was one)


TensorPathMessage = Request | ReRequest | Cancel | Response | Call | CallCancel | CallResult


def _pack_destination(dest: Destination) -> bytes:
    return _DEST.pack(dest.region_id, dest.offset, dest.capacity, dest.key)


def encode_request(
    req_id: int, destination: Destination, header: bytes, expected: TensorDescription | None = None
) -> bytes:
    described = b"" if expected is None else _pack_description(expected)
    return b"".join(
        (
            _REQ_HEAD.pack(TensorMessage.REQUEST, req_id),
            _pack_destination(destination),
            _EXPECTED_LEN.pack(len(described)),
            described,
            header,
        )
    )


def encode_re_request(req_id: int, destination: Destination) -> bytes:
    return _REQ_HEAD.pack(TensorMessage.RE_REQUEST, req_id) + _pack_destination(destination)


def encode_cancel(req_id: int) -> bytes:
    return _REQ_HEAD.pack(TensorMessage.CANCEL, req_id)


def encode_call(call_id: int, path: str, payload: bytes) -> tuple[bytes, bytes]:
    """A CALL message: its head with the path, then the request, sent as they are."""
    raw = path.encode()
    if len(raw) + len(payload) > MAX_CALL_BYTES:
        raise ValueError(f"a CALL carries at most {MAX_CALL_BYTES} bytes of path and request")
    return _CALL_HEAD.pack(TensorMessage.CALL, call_id, len(raw)) + raw, payload


def encode_call_cancel(call_id: int) -> bytes:
    return _REQ_HEAD.pack(TensorMessage.CALL_CANCEL, call_id)


def encode_call_result(call_id: int, code: int, body: bytes) -> list[tuple[bytes, memoryview]]:
    """CALL_RESULT messages for one answer (the response, or an error message): each
    a head and a view of its piece of `body`, sent as they are (no copy here)."""
    view = memoryview(body)
    starts = range(0, max(len(view), 1), _RESULT_PIECE_BYTES)
    return [
        (
            _RESULT_HEAD.pack(TensorMessage.CALL_RESULT, call_id, start != starts[-1], code),
            view[start : start + _RESULT_PIECE_BYTES],
        )
        for start in starts
    ]


@functools.lru_cache(maxsize=256)  # (~4 us a dtype, twice a tensor sent)
def dtype_token(dtype: np.dtype[Any]) -> str:
    """How a dtype travels: its `str` ('<f4', '|b1', '<U3'), or 'name:bfloat16' for ml_dtypes.

    Raises:
        UnimplementedError: object or structured dtypes (not plain bytes).
    """
    if dtype.hasobject or dtype.fields is not None or dtype.subdtype is not None:
        raise errors.UnimplementedError(
            f"tensors of dtype {dtype} are not plain bytes and cannot use the verbs data path"
        )
    for token, spelling in ((dtype.str, dtype.str), ("name:" + dtype.name, dtype.name)):
        # Extension dtypes (ml_dtypes) have a `str` numpy cannot parse back ('<V2',
        # '<f1'); their name is exact.
        try:
            if np.dtype(spelling) == dtype:
                return token
        except TypeError:
            continue
    raise errors.UnimplementedError(f"dtype {dtype!r} cannot be named portably for the verbs data path")


def dtype_from_token(token: str) -> np.dtype[Any]:
    try:
        dtype = np.dtype(token[5:] if token.startswith("name:") else token)
    except TypeError as exc:
        raise ProtocolError(f"unknown dtype {token!r} from the peer") from exc
    if dtype.hasobject or dtype.fields is not None:
        # Never build object arrays over raw shared bytes: they would be pointers.
        raise ProtocolError(f"the peer described a tensor of non-plain dtype {dtype}")
    return dtype


def describe(array: np.ndarray[Any, Any], meta: bytes) -> TensorDescription:
    if array.ndim > MAX_RANK:
        raise errors.InvalidArgumentError(f"tensor rank {array.ndim} exceeds {MAX_RANK}")
    dtype_token(array.dtype)  # raises for dtypes that cannot travel
    return TensorDescription(int(array.nbytes), array.dtype, tuple(int(d) for d in array.shape), bytes(meta))


def _pack_description(desc: TensorDescription) -> bytes:
    token = dtype_token(desc.dtype).encode("ascii")
    return b"".join(
        (
            _DESC.pack(desc.nbytes, len(desc.shape), len(token)),
            token,
            struct.pack(f"<{len(desc.shape)}q", *desc.shape),
            _META_LEN.pack(len(desc.meta)),
            desc.meta,
        )
    )


def encode_response(
    req_id: int,
    kind: ResponseKind,
    description: TensorDescription | None = None,
    payload: bytes | memoryview = b"",
) -> bytes:
    head = _RESP_HEAD.pack(TensorMessage.RESPONSE, req_id, kind)
    assert description is not None
    return head + _pack_description(description) + bytes(payload)


def encode_error(req_id: int, code: int, message: str) -> bytes:
    head = _RESP_HEAD.pack(TensorMessage.RESPONSE, req_id, ResponseKind.ERROR)
    return head + _STATUS.pack(code) + message.encode("utf-8", "replace")


def decode_tensor_message(data: bytes | memoryview) -> TensorPathMessage:
    """Decode one tensor-path message (a SEND payload)."""
    _need(data, 1, "tensor message")
    kind = data[0]
    if kind in (TensorMessage.REQUEST, TensorMessage.RE_REQUEST):
        _need(data, _REQ_HEAD.size + _DEST.size, "REQUEST")
        req_id = _REQ_HEAD.unpack_from(data)[1]
        region_id, offset, capacity, key = _DEST.unpack_from(data, _REQ_HEAD.size)
        dest = Destination(region_id, key, offset, capacity)
        if kind == TensorMessage.RE_REQUEST:
            return ReRequest(req_id, dest)
        pos = _REQ_HEAD.size + _DEST.size
        _need(data, pos + _EXPECTED_LEN.size, "REQUEST")
        (described,) = _EXPECTED_LEN.unpack_from(data, pos)
        pos += _EXPECTED_LEN.size
        expected = None
        if described:
            _need(data, pos + described, "REQUEST")
            expected, end = _unpack_description(data, pos)
            if end != pos + described:
                raise ProtocolError("the REQUEST's expected description has the wrong length")
            pos = end
        return Request(req_id, dest, bytes(data[pos:]), expected)
    if kind == TensorMessage.CANCEL:
        _need(data, _REQ_HEAD.size, "CANCEL")
        return Cancel(_REQ_HEAD.unpack_from(data)[1])
    if kind == TensorMessage.RESPONSE:
        return _decode_response(data)
    if kind == TensorMessage.CALL:
        _need(data, _CALL_HEAD.size, "CALL")
        _, call_id, path_len = _CALL_HEAD.unpack_from(data)
        _need(data, _CALL_HEAD.size + path_len, "CALL")
        end = _CALL_HEAD.size + path_len
        return Call(call_id, bytes(data[_CALL_HEAD.size : end]).decode("utf-8", "replace"), bytes(data[end:]))
    if kind == TensorMessage.CALL_CANCEL:
        _need(data, _REQ_HEAD.size, "CALL_CANCEL")
        return CallCancel(_REQ_HEAD.unpack_from(data)[1])
    if kind == TensorMessage.CALL_RESULT:
        _need(data, _RESULT_HEAD.size, "CALL_RESULT")
        _, call_id, more, code = _RESULT_HEAD.unpack_from(data)
        return CallResult(call_id, bool(more), code, data[_RESULT_HEAD.size :])
    raise ProtocolError(f"unknown tensor message type {kind}")


def _decode_response(data: bytes | memoryview) -> Response:
    _need(data, _RESP_HEAD.size, "RESPONSE")
    _, req_id, raw_kind = _RESP_HEAD.unpack_from(data)
    try:
        kind = ResponseKind(raw_kind)
    except ValueError as exc:
        raise ProtocolError(f"unknown response kind {raw_kind}") from exc
    pos = _RESP_HEAD.size
    if kind == ResponseKind.ERROR:
        _need(data, pos + _STATUS.size, "ERROR")
        (code,) = _STATUS.unpack_from(data, pos)
        return Response(
            req_id, kind, code=code, message=bytes(data[pos + _STATUS.size :]).decode("utf-8", "replace")
        )
    description, pos = _unpack_description(data, pos)
    payload = bytearray(memoryview(data)[pos:]) if kind == ResponseKind.INLINE else b""
    if kind == ResponseKind.INLINE and len(payload) != description.nbytes:
        raise ProtocolError(
            f"inline tensor carries {len(payload)} bytes, its description says {description.nbytes}"
        )
    return Response(req_id, kind, description, payload)


def _unpack_description(data: bytes | memoryview, pos: int) -> tuple[TensorDescription, int]:
    """The description at `pos`, and where it ends."""
    _need(data, pos + _DESC.size, "tensor description")
    nbytes, rank, token_len = _DESC.unpack_from(data, pos)
    pos += _DESC.size
    if rank > MAX_RANK:
        raise ProtocolError(f"tensor rank {rank} exceeds {MAX_RANK}")
    _need(data, pos + token_len + 8 * rank + _META_LEN.size, "tensor description")
    dtype = dtype_from_token(bytes(data[pos : pos + token_len]).decode("ascii", "replace"))
    pos += token_len
    shape = struct.unpack_from(f"<{rank}q", data, pos)
    pos += 8 * rank
    (meta_len,) = _META_LEN.unpack_from(data, pos)
    pos += _META_LEN.size
    _need(data, pos + meta_len, "tensor meta")
    meta = bytes(data[pos : pos + meta_len])
    pos += meta_len
    if any(d < 0 for d in shape) or math.prod(shape) * dtype.itemsize != nbytes:
        raise ProtocolError(f"inconsistent tensor description: {dtype} {shape} in {nbytes} bytes")
    return TensorDescription(nbytes, dtype, tuple(shape), meta), pos


def _need(data: bytes | memoryview, size: int, what: str) -> None:
    if len(data) < size:
        raise ProtocolError(f"truncated {what} frame ({len(data)} bytes, need {size})")
