"""Hand-built RecvTensorResponse bytes: identical meaning to protobuf's, no copies."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from distserver import errors
from distserver.protos.config_pb2 import RunMetadata
from distserver.protos.debug_pb2 import StepStats
from distserver.protos.master_pb2 import RunCallableResponse, RunStepResponse
from distserver.protos.worker_pb2 import RecvTensorResponse, RunGraphResponse
from distserver.tensors import ResourceHandle, from_tensor_proto, to_tensor_proto
from distserver.wire import (
    HAND_ENCODED_BYTES,
    TensorAssembler,
    chunk_tensor,
    content_start,
    decode_plain_recv_tensor_response,
    decode_recv_tensor_response,
    decode_tensor_message,
    encode_recv_tensor_response,
    encode_tensor_message,
)

DTYPES = [
    np.float16, np.float32, np.float64, np.int8, np.int16, np.int32, np.int64,
    np.uint8, np.uint16, np.uint32, np.uint64, np.bool_, np.complex64, np.complex128, ml_dtypes.bfloat16,
]  # fmt: skip


def assert_view_where_aligned(got: np.ndarray, data: bytes | bytearray, value: np.ndarray) -> None:
    """`got`, `value` read by hand from `data`: a view of `data` where `value`'s content
    lies aligned for its dtype, else an aligned copy below 1 MiB (a view above)."""
    buffer = np.frombuffer(data, np.uint8)
    start = bytes(data).find(value.tobytes())
    assert start >= 0
    aligned_there = (buffer.ctypes.data + start) % value.dtype.alignment == 0
    assert np.shares_memory(got, buffer) == (aligned_there or value.nbytes >= 1 << 20)
    assert got.flags.aligned if value.nbytes < 1 << 20 else got.flags.aligned == aligned_there


def values():
    yield np.float32(1.5)
    yield np.array(7, np.int64)
    yield np.zeros((0, 3), np.float32)
    yield np.arange(12, dtype=np.int32).reshape(3, 4).T  # not contiguous
    yield np.arange(5, dtype=">f8")  # big-endian
    yield np.array([b"a", b"", b"xyz"], dtype=object)
    yield np.array(ResourceHandle("/job:ps/replica:0/task:0/device:CPU:0", "c", "v"), dtype=object)
    for dtype in DTYPES:
        yield (np.arange(10) % 3).astype(dtype).reshape(2, 5)


@pytest.mark.parametrize("value", list(values()), ids=lambda v: f"{v.dtype}{v.shape}")
@pytest.mark.parametrize("is_dead", [False, True])
def test_round_trip_and_protobuf_agree(value, is_dead):
    data = encode_recv_tensor_response(value, is_dead)
    decoded, dead = decode_recv_tensor_response(data)
    parsed = RecvTensorResponse.FromString(data)
    assert dead is is_dead
    assert parsed.is_dead is is_dead
    for got in (decoded, from_tensor_proto(parsed.tensor)):
        assert got.shape == value.shape
        assert got.dtype.newbyteorder("=") == value.dtype.newbyteorder("=")
        np.testing.assert_array_equal(got, value)


@pytest.mark.parametrize("value", list(values()), ids=lambda v: f"{v.dtype}{v.shape}")
@pytest.mark.parametrize("chunk", [1, 7, 64, 1 << 20])
def test_chunked_round_trip(value, chunk):
    assembler = TensorAssembler()
    messages = list(chunk_tensor(value, False, chunk))
    for message in messages:
        assembler.add(message)
    got, dead = assembler.result()
    assert not dead
    assert got.shape == value.shape
    np.testing.assert_array_equal(got, value)
    if value.dtype.kind != "O" and value.nbytes > chunk:
        assert len(messages) == -(-value.nbytes // chunk)


def test_fetch_responses_built_by_hand_are_what_protobuf_reads():
    # RunStep and RunCallable answers (every value of `values()`, strings and resources
    # included), read back by protobuf as a TensorFlow client reads them.
    fetched = [(f"t{i}:0", value) for i, value in enumerate(values())]
    metadata = RunMetadata()
    metadata.step_stats.dev_stats.add(device="/job:worker/replica:0/task:0/device:CPU:0")
    for message in (RunStepResponse(), RunStepResponse(metadata=metadata)):
        step = RunStepResponse.FromString(encode_tensor_message(message, fetched))
        assert [named.name for named in step.tensor] == [name for name, _ in fetched]
        assert step.metadata == message.metadata
        for named, (_, value) in zip(step.tensor, fetched, strict=True):
            assert_same(from_tensor_proto(named.tensor), value)
    called = RunCallableResponse.FromString(
        encode_tensor_message(RunCallableResponse(), [v for _, v in fetched])
    )
    for proto, (_, value) in zip(called.fetch, fetched, strict=True):
        assert_same(from_tensor_proto(proto), value)
    assert RunStepResponse.FromString(encode_tensor_message(RunStepResponse(), [])) == RunStepResponse()


def test_named_tensor_responses_read_back_as_views_with_the_other_fields_parsed():
    plain = [(f"t{i}:0", v) for i, v in enumerate(values()) if np.asarray(v).dtype != object]
    stats = StepStats()
    stats.dev_stats.add(device="/job:ps/replica:0/task:0/device:CPU:0")
    metadata = RunMetadata(step_stats=stats)
    for message, field2, tensors in (
        (RunGraphResponse(step_stats=stats), stats, "recv"),
        (RunStepResponse(metadata=metadata), metadata, "tensor"),
    ):
        message_class = type(message)
        data = encode_tensor_message(message, plain)
        # Status fields after the tensors, as a protobuf writer might put them.
        extra = message_class(status_code=3, status_error_message="bad").SerializeToString()
        named, rest = decode_tensor_message(data + extra, message_class)
        assert [name for name, _ in named] == [name for name, _ in plain]
        for (_, got), (_, value) in zip(named, plain, strict=True):
            assert_same(got, value)
        assert (rest.status_code, rest.status_error_message) == (3, "bad")
        assert rest.ListFields()[0][1] == field2
        assert not getattr(rest, tensors)
    big = np.arange(1 << 16, dtype=np.float32)
    received = bytearray(encode_tensor_message(RunStepResponse(), [("big:0", big)]))
    ((_, got),), _ = decode_tensor_message(received, RunStepResponse)
    assert_view_where_aligned(got, received, big)
    np.testing.assert_array_equal(got, big)


def test_named_tensor_responses_protobuf_must_read_are_left_to_it():
    # A large tensor that is not plain memory: the whole answer goes to protobuf.
    big_strings = [("s:0", np.array([b"x" * 20_000], dtype=object))]
    assert (
        decode_tensor_message(encode_tensor_message(RunStepResponse(), big_strings), RunStepResponse) is None
    )
    # Small items are read by protobuf in place, whatever their form: strings, typed fields.
    small_strings = [("s:0", np.array([b"a", b""], dtype=object))]
    ((_, got),), _ = decode_tensor_message(
        encode_tensor_message(RunStepResponse(), small_strings), RunStepResponse
    )
    assert list(got) == [b"a", b""]
    typed = RunStepResponse()
    typed.tensor.add(name="x:0").tensor.CopyFrom(to_tensor_proto(np.zeros(3, np.float32)))
    typed.tensor[0].tensor.ClearField("tensor_content")
    typed.tensor[0].tensor.float_val.append(2.0)
    ((_, got),), _ = decode_tensor_message(typed.SerializeToString(), RunStepResponse)
    np.testing.assert_array_equal(got, [2.0, 2.0, 2.0])
    data = encode_tensor_message(RunStepResponse(), [("x:0", np.arange(10_000, dtype=np.float32))])
    for cut in (3, len(data) // 2, len(data) - 1):
        with pytest.raises(errors.DataLossError):
            decode_tensor_message(data[:cut], RunStepResponse)


def test_a_large_tensor_of_more_dimensions_than_an_array_holds_is_left_to_protobuf_to_refuse():
    value = np.zeros((1,) * 63 + (8192,), np.float32)  # 32 KiB: read by hand
    data = encode_tensor_message(RunStepResponse(), [("x:0", value)])
    ((_, got),), _ = decode_tensor_message(data, RunStepResponse)
    assert got.shape == value.shape
    # One more dimension of 1 (as a peer may write it): not plain, so protobuf's
    # decode, which refuses it by name, rather than numpy's ValueError.
    message = RunStepResponse.FromString(data)
    message.tensor[0].tensor.tensor_shape.dim.add(size=1)
    data = message.SerializeToString()
    assert decode_tensor_message(data, RunStepResponse) is None
    with pytest.raises(errors.InvalidArgumentError, match="has 65 dimensions"):
        from_tensor_proto(RunStepResponse.FromString(data).tensor[0].tensor)


def test_a_large_answer_with_an_empty_tensor_no_array_can_hold_is_refused_by_name():
    message = RunStepResponse.FromString(
        encode_tensor_message(RunStepResponse(), [("x:0", np.zeros(8192, np.float32))])  # read by hand
    )
    empty = message.tensor.add(name="y:0").tensor
    empty.dtype = message.tensor[0].tensor.dtype
    for size in (0, 1 << 45, 1 << 45):  # (numpy: "array is too big")
        empty.tensor_shape.dim.add(size=size)
    with pytest.raises(errors.InvalidArgumentError, match="more elements than an array can hold"):
        decode_tensor_message(message.SerializeToString(), RunStepResponse)


def assert_same(got, value):
    value = np.asarray(value)
    assert got.shape == value.shape
    assert got.dtype.newbyteorder("=") == value.dtype.newbyteorder("=")
    if value.dtype == object and value.shape == ():
        assert got[()] == value[()]
    else:
        np.testing.assert_array_equal(got, value)


def test_decoded_numeric_value_is_a_view_over_the_received_bytes():
    value = np.arange(1 << 16, dtype=np.float32)
    data = encode_recv_tensor_response(value)
    decoded, _ = decode_recv_tensor_response(data)
    assert_view_where_aligned(decoded, data, value)


def test_protobuf_encoded_responses_decode_too():
    # What a TensorFlow peer (or protobuf) writes: typed fields, broadcast, tensor_content.
    response = RecvTensorResponse()
    response.tensor.dtype = 1  # DT_FLOAT
    response.tensor.tensor_shape.dim.add(size=3)
    response.tensor.float_val.append(2.5)
    value, dead = decode_recv_tensor_response(response.SerializeToString())
    np.testing.assert_array_equal(value, [2.5, 2.5, 2.5])
    assert not dead
    response = RecvTensorResponse(is_dead=True)
    response.tensor.CopyFrom(to_tensor_proto(np.arange(4, dtype=np.int16)))
    response.send_start_micros = 123
    value, dead = decode_recv_tensor_response(response.SerializeToString())
    np.testing.assert_array_equal(value, np.arange(4))
    assert dead


def test_only_a_plain_response_decodes_without_protobuf():
    # The receiver decodes a plain response on the event loop whatever its size (a view),
    # so anything with more fields or a long header than a plain tensor has is left to
    # protobuf (which the receiver runs in a thread when the response is large).
    value = np.arange(6, dtype=np.float32).reshape(2, 3)
    plain = encode_recv_tensor_response(value)
    decoded = decode_plain_recv_tensor_response(plain)
    assert decoded is not None
    np.testing.assert_array_equal(decoded[0], value)
    typed = RecvTensorResponse()
    typed.tensor.dtype = 1
    typed.tensor.float_val.extend([1.0, 2.0])
    typed.tensor.tensor_shape.dim.add(size=2)
    data = typed.SerializeToString()
    assert decode_plain_recv_tensor_response(data) is None
    np.testing.assert_array_equal(decode_recv_tensor_response(data)[0], [1.0, 2.0])
    long_shape = RecvTensorResponse()
    long_shape.tensor.dtype = 1
    for _ in range(2000):  # a 6 KB header (more dimensions than numpy has)
        long_shape.tensor.tensor_shape.dim.add(size=1)
    long_shape.tensor.tensor_content = b"\0\0\0\0"
    assert decode_plain_recv_tensor_response(long_shape.SerializeToString()) is None
    padded = bytes(plain) + bytes([(3 << 3) | 0, 1]) * 20  # 20 send_start_micros fields
    assert decode_plain_recv_tensor_response(padded) is None
    np.testing.assert_array_equal(decode_recv_tensor_response(padded)[0], value)


def test_truncated_streams_and_mismatched_content_are_data_loss():
    value = np.arange(100, dtype=np.float64)
    messages = list(chunk_tensor(value, False, 64))
    assembler = TensorAssembler()
    for message in messages[:-1]:
        assembler.add(message)
    with pytest.raises(errors.DataLossError, match="ended after"):
        assembler.result()
    data = bytearray(encode_recv_tensor_response(np.arange(4, dtype=np.int32)))
    with pytest.raises(errors.DataLossError):
        decode_recv_tensor_response(bytes(data[:-3]))


@settings(max_examples=60, deadline=None)
@given(
    hnp.arrays(
        dtype=st.sampled_from([np.float32, np.int64, np.uint8, np.complex64, np.bool_]),
        shape=hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=6),
    ),
    st.integers(1, 50),
)
def test_property_round_trips(value, chunk):
    decoded, _ = decode_recv_tensor_response(encode_recv_tensor_response(value))
    np.testing.assert_array_equal(decoded, value)
    assembler = TensorAssembler()
    for message in chunk_tensor(value, False, chunk):
        assembler.add(message)
    np.testing.assert_array_equal(assembler.result()[0], value)


def test_run_callable_responses_read_back_as_views():
    values = [np.arange(6000, dtype=np.float32).reshape(2, 3000), np.int64(7), np.zeros((0,), np.float64)]
    metadata = RunMetadata()
    metadata.step_stats.dev_stats.add(device="/job:worker/replica:0/task:0/device:CPU:0")
    data = (
        bytearray(encode_tensor_message(RunCallableResponse(), values))
        + RunCallableResponse(metadata=metadata).SerializeToString()
    )
    fetched, rest = decode_tensor_message(data, RunCallableResponse)
    assert [name for name, _ in fetched] == ["", "", ""]
    for (_, got), value in zip(fetched, values, strict=True):
        assert_same(got, value)
    assert_view_where_aligned(fetched[0][1], data, values[0])
    assert rest.metadata == metadata
    assert not rest.fetch
    strings = encode_tensor_message(RunCallableResponse(), [np.array([b"x" * 20_000], dtype=object)])
    assert decode_tensor_message(strings, RunCallableResponse) is None


def test_a_name_without_a_tensor_is_a_value_to_fetch_separately_only_where_allowed():
    # RecvTensors answers mark a value the receiver fetches on its own with the name alone.
    data = encode_tensor_message(RunGraphResponse(), [("a", np.arange(3, dtype=np.int32)), ("b", None)])
    parsed = RunGraphResponse.FromString(data)
    assert [n.name for n in parsed.recv] == ["a", "b"]
    assert not parsed.recv[1].HasField("tensor")
    named, _ = decode_tensor_message(data, RunGraphResponse, missing_ok=True)
    assert named[1] == ("b", None)
    np.testing.assert_array_equal(named[0][1], [0, 1, 2])
    assert decode_tensor_message(data, RunGraphResponse) is None  # elsewhere protobuf decides


def test_requests_with_tensors_built_by_hand_are_what_protobuf_reads_and_read_back_as_views():
    # RunStep, RunCallable and RunGraph requests: a TensorFlow master or worker parses
    # them with protobuf; a distserver one reads their large tensors as views.
    from distserver.protos.master_pb2 import RunCallableRequest, RunStepRequest
    from distserver.protos.worker_pb2 import RunGraphRequest

    big = np.arange(1 << 18, dtype=np.float32).reshape(512, 512)
    small = [v for v in values() if np.asarray(v).dtype != object]
    step = RunStepRequest(session_handle="s", fetch=["y:0"], target=["train"])
    step.options.timeout_in_ms = 5
    graph = RunGraphRequest(graph_handle="g", step_id=7, recv_key=["k"])
    graph.exec_opts.record_timeline = True
    for message, items in (
        (step, [("big:0", big)] + [(f"x{i}:0", v) for i, v in enumerate(small)]),
        (graph, [(f"x{i}", v) for i, v in enumerate(small)] + [("big", big)]),
        (RunCallableRequest(session_handle="s", handle=3), [*small, big]),
    ):
        data = bytearray(encode_tensor_message(message, items))
        parsed = type(message).FromString(data)
        field = {"RunGraphRequest": "send"}.get(type(message).__name__, "feed")
        by_protobuf = getattr(parsed, field)
        parsed.ClearField(field)
        assert parsed == message
        decoded, rest = decode_tensor_message(data, type(message))
        assert rest == message
        expected = items if isinstance(items[0], tuple) else [("", v) for v in items]
        assert len(decoded) == len(by_protobuf) == len(expected)
        for (name, got), (want_name, value), proto in zip(decoded, expected, by_protobuf, strict=True):
            assert name == want_name
            assert_same(got, value)
            assert_same(from_tensor_proto(getattr(proto, "tensor", proto)), value)
        (got_big,) = [v for _, v in decoded if v.nbytes == big.nbytes]
        assert_view_where_aligned(got_big, data, big)


def test_a_large_request_reaches_its_handler_as_views_and_bad_ones_are_invalid_arguments():
    from distserver.protos.master_pb2 import RunStepRequest
    from distserver.protos.worker_pb2 import RecvTensorRequest
    from distserver.transports.base import parse_handler_request
    from distserver.wire import HAND_DECODED_REQUEST_BYTES, TensorRequest

    # From this size requests are read by hand (an mlp's 784 KiB feed is).
    big = np.ones(HAND_DECODED_REQUEST_BYTES // 4, np.float32)
    request = RunStepRequest(session_handle="s", fetch=["y:0"])
    data = encode_tensor_message(request, [("x:0", big)])
    parsed = parse_handler_request(RunStepRequest, data)
    assert isinstance(parsed, TensorRequest)
    assert parsed.message == request
    ((name, value),) = parsed.tensors
    assert name == "x:0"
    assert_view_where_aligned(value, data, big)
    assert not value.flags.writeable  # a view of the received bytes, or a read-only copy
    # Smaller requests and messages without tensors: protobuf, as before.
    small = parse_handler_request(RunStepRequest, encode_tensor_message(request, [("x:0", big[:4])]))
    assert isinstance(small, RunStepRequest)
    below = parse_handler_request(RunStepRequest, encode_tensor_message(request, [("x:0", big[:-64])]))
    assert isinstance(below, RunStepRequest)
    assert small.feed[0].name == "x:0"
    other = RecvTensorRequest(rendezvous_key="k" * (2 << 20)).SerializeToString()
    assert parse_handler_request(RecvTensorRequest, other).rendezvous_key == "k" * (2 << 20)
    # A request cut short, or with a varint longer than 10 bytes: INVALID_ARGUMENT, at once.
    for bad in (data[: len(data) // 2], b"\x12" + b"\xff" * (2 << 20)):
        with pytest.raises(errors.InvalidArgumentError, match="Could not parse the RunStepRequest"):
            parse_handler_request(RunStepRequest, bad)


def test_hand_read_content_at_an_unaligned_offset_is_copied_aligned_below_1_mib():
    from distserver.protos.master_pb2 import RunStepRequest

    for size, copies in ((256 << 10, True), (2 << 20, False)):
        value = np.arange(size // 4, dtype=np.float32)
        unaligned_seen = False
        for handle_length in range(4):  # moves the content a byte at a time
            data = encode_tensor_message(RunStepRequest(session_handle="s" * handle_length), [("x:0", value)])
            ((_, got),), _ = decode_tensor_message(data, RunStepRequest)
            assert_same(got, value)
            assert not got.flags.writeable
            if copies:
                assert_view_where_aligned(got, data, value)
                unaligned_seen |= not np.shares_memory(got, np.frombuffer(data, np.uint8))
            else:  # large: a view wherever it lies
                assert np.shares_memory(got, np.frombuffer(data, np.uint8))
                unaligned_seen |= not got.flags.aligned
        assert unaligned_seen


def test_content_start_finds_the_first_large_tensors_content_from_the_messages_first_bytes():
    from distserver.protos.master_pb2 import RunCallableRequest, RunStepRequest
    from distserver.protos.worker_pb2 import RunGraphRequest

    small = np.arange(8, dtype=np.float32)
    large = np.arange(HAND_ENCODED_BYTES // 4, dtype=np.float32)
    for message in (
        RunStepRequest(session_handle="s" * 7, fetch=["loss:0"]),
        RunGraphRequest(graph_handle="g", step_id=12345),
        RunCallableRequest(session_handle="abc", handle=3),
    ):
        for items in ([("x:0", large)], [("small:0", small), ("feed_with_a_longer_name:0", large)]):
            values = [value for _, value in items] if isinstance(message, RunCallableRequest) else items
            data = encode_tensor_message(message, values)
            where = data.find(large.tobytes())
            assert content_start(data, type(message)) == where > 0
            # From the first bytes on: what a receiver has read of the message when it places it.
            assert content_start(memoryview(data)[: where + 1], type(message)) == where
            assert content_start(memoryview(data)[: where - 1], type(message)) is None
        # Written by protobuf itself: the same answer.
        built = type(message)()
        built.CopyFrom(message)
        if isinstance(built, RunCallableRequest):
            built.feed.add().CopyFrom(to_tensor_proto(large))
        else:
            items_field = built.send if isinstance(built, RunGraphRequest) else built.feed
            items_field.add(name="x:0").tensor.CopyFrom(to_tensor_proto(large))
        data = built.SerializeToString()
        assert content_start(data, type(message)) == data.find(large.tobytes()) > 0
        # No tensor large enough, or a message without tensors: nothing to align.
        data = encode_tensor_message(message, _items_or_values(message, small))
        assert content_start(data, type(message)) is None
    assert content_start(RunStepResponse().SerializeToString(), RecvTensorResponse) is None
    assert content_start(b"\xff" * 64, RunStepRequest) is None  # not a message: no answer, no error


def _items_or_values(message, value):
    from distserver.protos.master_pb2 import RunCallableRequest

    return [value] if isinstance(message, RunCallableRequest) else [("x:0", value)]


def _protobuf_message(message, items):
    """`message` with `items` added to its tensor field by protobuf itself."""
    built = type(message)()
    built.CopyFrom(message)
    for name, value in items:
        if isinstance(built, RunCallableResponse):
            built.fetch.add().CopyFrom(to_tensor_proto(value))
        else:
            field = built.recv if isinstance(built, RunGraphResponse) else built.tensor
            field.add(name=name).tensor.CopyFrom(to_tensor_proto(value))
    return built.SerializeToString()


def test_items_written_from_cached_heads_are_the_bytes_protobuf_writes():
    # Small plain tensors go out as a cached head and their own bytes: the same message
    # protobuf writes, the first time and every time after, whatever the name's length
    # (a varint of one or two bytes) or the dtype. A value the head does not fit (not in
    # C order, big-endian) still goes out right under the same name and shape.
    long_name = "/job:ps/replica:0/task:0/device:CPU:0;" + "k" * 120 + ";0:0"
    plain = [v for v in values() if np.asarray(v).dtype != object and np.asarray(v).size]
    for message in (RunGraphResponse(), RunStepResponse(), RunCallableResponse()):
        items = [(f"{long_name if i % 2 else 'x'}{i}", np.asarray(v)) for i, v in enumerate(plain)]
        want = _protobuf_message(message, items)
        unnamed = isinstance(message, RunCallableResponse)
        for _ in range(2):
            assert encode_tensor_message(message, [v for _, v in items] if unnamed else items) == want
    again = [("t:0", np.arange(12, dtype=np.int32).reshape(3, 4))]
    encode_tensor_message(RunGraphResponse(), again)  # its head cached
    for other in (np.arange(12, dtype=np.int32).reshape(4, 3).T, np.arange(12, dtype=">i4").reshape(3, 4)):
        data = encode_tensor_message(RunGraphResponse(), [("t:0", other)])
        assert data == _protobuf_message(RunGraphResponse(), [("t:0", other)])


def test_known_items_read_back_as_protobuf_reads_them_and_nothing_else(monkeypatch):
    # A message of many small tensors, read twice: the long way (protobuf, which teaches
    # the reader each item's head), then from the known heads alone. Both give
    # protobuf's values, as read-only aligned copies that do not keep the message alive,
    # wherever the content lies (a message field before the tensors moves it a byte at
    # a time).
    from distserver import wire

    long_name = "/job:worker/replica:0/task:0/device:CPU:0;" + "g" * 120 + ";0:0"
    shapes = [(4 * (i % 3 + 1), 4) for i in range(12)]
    items = [
        (f"{long_name}{i}", np.arange(np.prod(shape), dtype=np.float32).reshape(shape) + i)
        for i, shape in enumerate(shapes)
    ]
    items.append(("labels:0", np.arange(7, dtype=np.int64)))
    long_way = wire._decode_small_item

    def refused(*args):
        raise AssertionError("a known item read the long way")

    for shift in range(4):
        message = RunStepResponse(status_error_message="e" * shift)
        data = encode_tensor_message(message, items)
        buffer = np.frombuffer(data, np.uint8)
        for reader in (long_way, refused):
            monkeypatch.setattr(wire, "_decode_small_item", reader)
            decoded, rest = decode_tensor_message(data, RunStepResponse)
            assert rest == message
            assert [name for name, _ in decoded] == [name for name, _ in items]
            for (_, got), (_, value) in zip(decoded, items, strict=True):
                assert_same(got, value)
                assert got.flags.aligned
                assert not got.flags.writeable
                assert not np.shares_memory(got, buffer)
        monkeypatch.setattr(wire, "_decode_small_item", long_way)
    # The same name and item length with another dtype or shape: read as what the item
    # says, never as the known item.
    name, value = items[1]
    for other in (value.view(np.int32), value.reshape(-1), value.reshape(4, 8).view(np.uint32)):
        data = encode_tensor_message(RunStepResponse(), [(name, other)])
        ((got_name, got),), _ = decode_tensor_message(data, RunStepResponse)
        assert got_name == name
        assert_same(got, other)
    # Cut short inside a known item's content: data loss, as before.
    data = encode_tensor_message(RunStepResponse(), items[:2])
    with pytest.raises(errors.DataLossError):
        decode_tensor_message(data[:-5], RunStepResponse)


def test_names_longer_than_a_kibibyte_are_written_and_read_right_but_never_cached():
    # A name a peer or a client makes up may be megabytes: the heads of such items are
    # not kept, on either side, and the items still cross as protobuf writes and reads.
    from distserver import wire

    value = np.arange(6, dtype=np.float32).reshape(2, 3)
    for _ in range(2):
        names = [f"{i}:" + "n" * 2048 for i in range(20)]
        heads, known = len(wire._item_heads), len(wire._known_items)
        data = encode_tensor_message(RunStepResponse(), [(name, value) for name in names])
        assert data == _protobuf_message(RunStepResponse(), [(name, value) for name in names])
        decoded, _ = decode_tensor_message(data, RunStepResponse)
        assert [name for name, _ in decoded] == names
        for _, got in decoded:
            assert_same(got, value)
        assert (len(wire._item_heads), len(wire._known_items)) == (heads, known)


def test_small_tensors_in_a_hand_read_request_are_charged_to_its_budget():
    # A small item claiming a huge shape (a typed field TensorFlow pads): refused before
    # anything is allocated, as protobuf-parsed requests are.
    from distserver.protos.master_pb2 import RunStepRequest
    from distserver.transports.base import parse_handler_request

    request = RunStepRequest()
    padded = request.feed.add(name="pad:0").tensor
    padded.dtype = 1  # DT_FLOAT
    padded.tensor_shape.dim.add(size=1 << 40)
    padded.float_val.append(1.0)
    data = encode_tensor_message(request, [("big:0", np.ones(1 << 18, np.float32))])
    with pytest.raises(errors.ResourceExhaustedError):
        parse_handler_request(RunStepRequest, data)
