"""The byte layouts (sans-I/O): round trips, and refusal of malformed frames."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from distserver import errors
from distserver.transports.verbs import _wire as wire

ALL_DTYPES = [
    np.bool_, np.int8, np.uint8, np.int16, np.uint16, np.int32, np.uint32, np.int64, np.uint64,
    np.float16, np.float32, np.float64, np.longdouble, np.complex64, np.complex128, np.clongdouble,
    "S7", "U3", "V5", "M8[ns]", "m8[s]", ">f4", ">i8",
    ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2, ml_dtypes.int4, ml_dtypes.uint4,
]  # fmt: skip


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_dtype_tokens_round_trip(dtype):
    dt = np.dtype(dtype)
    assert wire.dtype_from_token(wire.dtype_token(dt)) == dt


@pytest.mark.parametrize("dtype", [object, [("a", "i4"), ("b", "f8")], ("i4", (2,))], ids=str)
def test_non_plain_dtypes_cannot_travel(dtype):
    with pytest.raises(errors.UnimplementedError):
        wire.dtype_token(np.dtype(dtype))


def test_object_dtype_from_a_peer_is_refused():
    with pytest.raises(wire.ProtocolError):
        wire.dtype_from_token("|O")
    with pytest.raises(wire.ProtocolError):
        wire.dtype_from_token("no-such-dtype")


def test_request_round_trip():
    dest = wire.Destination(7, b"k" * 16, 4096, 1 << 20)
    message = wire.decode_tensor_message(wire.encode_request(42, dest, b"header"))
    assert message == wire.Request(42, dest, b"header")
    assert wire.decode_tensor_message(wire.encode_re_request(43, dest)) == wire.ReRequest(43, dest)
    assert wire.decode_tensor_message(wire.encode_cancel(44)) == wire.Cancel(44)


@pytest.mark.parametrize("shape", [(), (0,), (2, 3), (1,) * 40])
def test_response_round_trip(shape):
    array = np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape)
    description = wire.describe(array, b"meta")
    for kind in (wire.ResponseKind.WRITING, wire.ResponseKind.NEEDS_SPACE):
        decoded = wire.decode_tensor_message(wire.encode_response(5, kind, description))
        assert decoded == wire.Response(5, kind, description, b"")
    inline = wire.decode_tensor_message(
        wire.encode_response(6, wire.ResponseKind.INLINE, description, array.tobytes())
    )
    assert isinstance(inline, wire.Response)
    assert inline.payload == array.tobytes()
    assert isinstance(inline.payload, bytearray)


def test_error_round_trip():
    decoded = wire.decode_tensor_message(wire.encode_error(9, errors.NOT_FOUND, "no such tensor ✓"))
    assert decoded == wire.Response(
        9, wire.ResponseKind.ERROR, code=errors.NOT_FOUND, message="no such tensor ✓"
    )


def test_malformed_messages_are_protocol_errors():
    description = wire.describe(np.zeros((2, 2), np.int32), b"")
    good = wire.encode_response(1, wire.ResponseKind.INLINE, description, bytes(16))
    for bad in [
        b"",
        b"\x63",
        good[:10],
        good[:-1],
        good + b"x",
        wire.encode_request(1, wire.NO_DESTINATION, b"")[:9],
    ]:
        with pytest.raises(wire.ProtocolError):
            wire.decode_tensor_message(bad)
    # A description whose size does not match dtype x shape.
    lying = wire.TensorDescription(15, np.dtype(np.int32), (2, 2), b"")
    with pytest.raises(wire.ProtocolError, match="inconsistent"):
        wire.decode_tensor_message(wire.encode_response(1, wire.ResponseKind.WRITING, lying))
    assert issubclass(wire.ProtocolError, errors.InternalError)


def test_queue_pair_frames_round_trip():
    hello = wire.Hello(wire.VERSION, 123, 1024, 32768, b"{}", b"t" * wire.TICKET_BYTES)
    assert wire.decode_hello(wire.encode_hello(hello)) == hello
    with pytest.raises(wire.ProtocolError, match="not a distserver"):
        wire.decode_hello(b"\x01XXXX" + bytes(36))
    reg = wire.decode_reg_mr(wire.encode_reg_mr(3, 4096, b"q" * 16))
    assert (reg.region_id, reg.nbytes, reg.key) == (3, 4096, b"q" * 16)
    assert wire.decode_unreg_mr(wire.encode_unreg_mr(3)) == 3
    assert wire.decode_credit(wire.encode_credit(77)) == 77
    with pytest.raises(wire.ProtocolError):
        wire.decode_credit(b"\x05")
