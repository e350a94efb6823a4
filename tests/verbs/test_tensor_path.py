"""The tensor path: receiver-allocated one-copy transfers, flow control, errors, failures."""

from __future__ import annotations

import asyncio
import gc
import json
from collections.abc import AsyncIterator

import ml_dtypes
import numpy as np
import pytest

from distserver import errors
from distserver.transports import verbs
from distserver.transports.verbs import _wire as wire

MiB = 1 << 20

EVERY_DTYPE = [
    "|b1", "|i1", "|u1", "<i2", "<u2", "<i4", "<u4", "<i8", "<u8",
    "<f2", "<f4", "<f8", np.dtype(np.longdouble).str, "<c8", "<c16", np.dtype(np.clongdouble).str,
    "|S5", "<U3", "|V3", "<M8[ns]", "<m8[us]", ">f8", ">i4",
    "name:bfloat16", "name:float8_e4m3fn", "name:float8_e5m2", "name:int4", "name:uint4",
]  # fmt: skip


class Source:
    """A tensor source for in-process tests: header = key into `tensors`, or an instruction."""

    def __init__(self) -> None:
        self.tensors: dict[bytes, object] = {}
        self.release = asyncio.Event()
        self.started = 0
        self.cancellations = 0

    async def __call__(self, header: bytes):
        self.started += 1
        if header == b"hang":
            await asyncio.Event().wait()
        if header == b"gate":
            await self.release.wait()
            return np.ones(MiB, np.uint8)
        if header == b"stubborn":  # ignores cancellation until released
            while not self.release.is_set():
                try:
                    await self.release.wait()
                except asyncio.CancelledError:
                    self.cancellations += 1
            return np.ones(MiB, np.uint8)
        value = self.tensors[header]
        if isinstance(value, BaseException):
            raise value
        return value


@pytest.fixture
async def link() -> AsyncIterator[tuple[verbs.TensorEndpoint, Source, verbs.RegionPool, verbs.TensorServer]]:
    """A receiver endpoint connected to a TensorServer in this process."""
    async with verbs.ProtectionDomain() as pd:
        source = Source()
        server = await verbs.TensorServer.start(pd, source)
        endpoint = await verbs.TensorEndpoint.connect(pd, server.address, max_bytes_in_flight=4 * MiB)
        pool = verbs.RegionPool(pd, region_bytes=8 * MiB)
        yield endpoint, source, pool, server
        await endpoint.close()
        await server.close()


async def test_a_call_ready_with_a_large_write_is_answered_before_its_copy():
    """A large write's copy holds the event loop (~0.1 ms a MiB): a call that became
    ready in the same turn (a batch of small values to answer) goes first."""
    gate = asyncio.Event()
    waiting = asyncio.Semaphore(0)
    large = np.ones(2 * MiB, np.uint8)

    async def source(header: bytes):
        if header == b"gated":
            waiting.release()
            await gate.wait()
        return large

    async def written_when_called(path: str, payload: bytes) -> bytes:
        waiting.release()
        await gate.wait()  # woken after the source: a write that does not yield copies first
        (serving,) = server.endpoints
        return str(serving.statistics().served).encode()

    async with verbs.ProtectionDomain() as pd:
        server = await verbs.TensorServer.start(pd, source, call_handler=written_when_called)
        endpoint = await verbs.TensorEndpoint.connect(pd, server.address)
        pool = verbs.RegionPool(pd, region_bytes=8 * MiB)
        try:
            # One transfer first: the destination's region is mapped and the description
            # cached, so that the gated write neither waits nor sends a WRITING message.
            await endpoint.recv_tensor_into(pool, b"warm", size_hint=large.nbytes, cache_key="t")
            receive = asyncio.ensure_future(
                endpoint.recv_tensor_into(pool, b"gated", size_hint=large.nbytes, cache_key="t")
            )
            await waiting.acquire()
            call = asyncio.ensure_future(endpoint.calls.call("/probe", b"", timeout=10, name="Probe"))
            await waiting.acquire()
            gate.set()
            assert await call == b"1"  # the warm-up only: the gated write had not copied yet
            got = await receive
            assert np.array_equal(got.value, large)
        finally:
            await endpoint.close()
            await server.close()


async def test_small_tensors_ride_inline_and_large_ones_are_written(link):
    endpoint, source, pool, _ = link
    small = np.arange(10, dtype=np.float32)
    large = np.arange(MiB // 8, dtype=np.float64)
    source.tensors.update({b"s": small, b"l": large})
    got = await endpoint.recv_tensor_into(pool, b"s")
    assert not got.zero_copy
    assert np.array_equal(got.value, small)
    assert got.value.flags.writeable
    got = await endpoint.recv_tensor_into(pool, b"l", size_hint=large.nbytes)
    assert got.zero_copy
    assert np.array_equal(got.value, large)
    assert got.value.flags.writeable
    assert got.value.base is not None  # a view of pool memory
    stats = endpoint.statistics()
    assert (stats.inline, stats.written, stats.re_requests) == (1, 1, 0)
    assert stats.bytes_received == small.nbytes + large.nbytes


async def test_a_cached_description_spares_the_writing_message(link):
    endpoint, source, pool, server = link
    (serving,) = server.endpoints
    source.tensors[b"t"] = np.arange(MiB // 4, dtype=np.float32)
    for _ in range(3):
        sends = serving.qp.statistics().sends
        got = await endpoint.recv_tensor_into(pool, b"t", cache_key="t")
        assert np.array_equal(got.value, source.tensors[b"t"])
    assert serving.qp.statistics().sends == sends  # the last transfer: a write, no message
    assert endpoint.statistics().described_in_advance == 3  # the first one by NEEDS_SPACE
    source.tensors[b"t"] = np.ones((2, MiB // 8), np.float32)  # as many bytes, another shape
    got = await endpoint.recv_tensor_into(pool, b"t", cache_key="t")
    assert got.value.shape == (2, MiB // 8)
    assert float(got.value.sum()) == MiB // 4
    assert serving.qp.statistics().sends == sends + 1  # WRITING told the new shape
    assert endpoint.statistics().described_in_advance == 3


async def test_without_a_size_hint_the_receiver_asks_again(link):
    endpoint, source, pool, _ = link
    tensor = np.ones((300, 300), np.int32)
    source.tensors[b"t"] = tensor
    got = await endpoint.recv_tensor_into(pool, b"t", cache_key="t")
    assert np.array_equal(got.value, tensor)
    assert endpoint.statistics().re_requests == 1
    got = await endpoint.recv_tensor_into(pool, b"t", cache_key="t")  # the cached size is right now
    assert endpoint.statistics().re_requests == 1
    too_small = await endpoint.recv_tensor_into(pool, b"t", size_hint=100 * 1024)
    assert np.array_equal(too_small.value, tensor)
    assert endpoint.statistics().re_requests == 2


async def test_zero_copy_views_hold_their_slice_until_collected(link):
    endpoint, source, pool, _ = link
    source.tensors[b"t"] = np.full(MiB, 7, np.uint8)
    got = await endpoint.recv_tensor_into(pool, b"t", size_hint=MiB)
    assert pool.statistics().live_slices == 1
    view = got.value[::2]
    del got
    gc.collect()
    assert pool.statistics().live_slices == 1
    assert int(view[0]) == 7
    del view
    gc.collect()
    assert pool.statistics().live_slices == 0


async def test_copy_true_returns_an_owned_array_and_frees_the_slice(link):
    endpoint, source, pool, _ = link
    tensor = np.random.default_rng(0).standard_normal((512, 1024)).astype(np.float32)
    source.tensors[b"t"] = tensor
    got = await endpoint.recv_tensor_into(pool, b"t", size_hint=tensor.nbytes, copy=True)
    assert not got.zero_copy
    assert got.value.flags.owndata
    assert np.array_equal(got.value, tensor)
    gc.collect()
    assert pool.statistics().live_slices == 0


async def test_meta_reaches_the_receiver(link):
    endpoint, source, pool, _ = link
    source.tensors[b"dead"] = verbs.TensorReply(np.zeros((), np.float32), meta=b"\x01")
    source.tensors[b"big"] = verbs.TensorReply(np.zeros(MiB, np.uint8), meta=b"meta")
    assert (await endpoint.recv_tensor_into(pool, b"dead")).meta == b"\x01"
    assert (await endpoint.recv_tensor_into(pool, b"big", size_hint=MiB)).meta == b"meta"


@pytest.mark.parametrize(
    "error",
    [
        errors.InvalidArgumentError("bad shape [[{{node x}}]]"),
        errors.NotFoundError("no such key"),
        errors.AbortedError("restarted"),
        errors.ResourceExhaustedError("out of memory"),
        errors.FailedPreconditionError("uninitialized"),
        errors.DeadlineExceededError("the sender's own deadline"),
    ],
    ids=lambda e: type(e).__name__,
)
async def test_sender_errors_arrive_as_the_same_class(link, error):
    endpoint, source, pool, _ = link
    source.tensors[b"e"] = error
    with pytest.raises(type(error)) as raised:
        await endpoint.recv_tensor_into(pool, b"e", size_hint=MiB)
    assert raised.value.message == error.message
    assert pool.statistics().live_slices == 0
    assert endpoint.statistics().bytes_in_flight == 0


async def test_other_sender_failures(link):
    endpoint, source, pool, _ = link
    source.tensors[b"value-error"] = ValueError("boom")
    with pytest.raises(errors.UnknownError, match="ValueError: boom"):
        await endpoint.recv_tensor_into(pool, b"value-error")
    source.tensors[b"object"] = np.array([b"a", b"b"], dtype=object)
    with pytest.raises(errors.UnimplementedError, match="not plain bytes"):
        await endpoint.recv_tensor_into(pool, b"object")
    source.tensors[b"list"] = [1, 2, 3]
    with pytest.raises(errors.InternalError, match="not an array"):
        await endpoint.recv_tensor_into(pool, b"list")
    with pytest.raises(ValueError, match="request headers"):
        await endpoint.recv_tensor_into(pool, bytes(64 << 10))


async def test_an_endpoint_without_a_source_refuses_requests(link):
    _endpoint, _, pool, server = link
    (serving,) = server.endpoints
    with pytest.raises(errors.UnimplementedError, match="serves no tensors"):
        await serving.recv_tensor_into(pool, b"anything")


async def test_timeout_cancels_and_frees_the_destination(link, probes):
    endpoint, _source, pool, _ = link
    with pytest.raises(errors.DeadlineExceededError):
        await endpoint.recv_tensor_into(pool, b"hang", size_hint=2 * MiB, timeout=0.2)
    # The slice is kept until the sender confirms it will not write (CANCEL -> answer).
    await probes.poll_until(lambda: pool.statistics().live_slices == 0, what="the slice back in the pool")
    stats = endpoint.statistics()
    assert stats.bytes_in_flight == 0
    assert stats.quarantined_bytes == 0
    assert stats.failed == 1


async def test_cancelling_the_receiver_frees_the_destination(link, probes):
    endpoint, source, pool, _ = link
    receiving = asyncio.ensure_future(endpoint.recv_tensor_into(pool, b"hang", size_hint=MiB))
    await probes.poll_until(lambda: source.started == 1, what="the request")
    receiving.cancel()
    with pytest.raises(asyncio.CancelledError):
        await receiving
    await probes.poll_until(lambda: pool.statistics().live_slices == 0, what="the slice back in the pool")


async def test_flow_control_bounds_bytes_in_flight(link):
    endpoint, source, pool, _ = link
    source.tensors.update({f"t{i}".encode(): np.full(MiB, i, np.uint8) for i in range(32)})
    results = await asyncio.gather(
        *(endpoint.recv_tensor_into(pool, f"t{i}".encode(), size_hint=MiB) for i in range(32))
    )
    for i, got in enumerate(results):
        assert got.value.shape == (MiB,)
        assert int(got.value[0]) == i == int(got.value[-1])
    stats = endpoint.statistics()
    assert stats.max_bytes_in_flight == 4 * MiB
    assert stats.peak_bytes_in_flight == 4 * MiB  # reached, never exceeded
    assert stats.bytes_in_flight == 0


async def test_a_tensor_larger_than_the_budget_is_admitted_alone(link, probes):
    endpoint, source, pool, _ = link
    source.tensors[b"huge"] = np.ones(6 * MiB, np.uint8)
    source.tensors[b"small"] = np.ones(MiB, np.uint8)
    gated = asyncio.ensure_future(endpoint.recv_tensor_into(pool, b"gate", size_hint=MiB))
    await probes.poll_until(lambda: source.started == 1, what="the gated request")
    huge = asyncio.ensure_future(endpoint.recv_tensor_into(pool, b"huge", size_hint=6 * MiB))
    small = asyncio.ensure_future(endpoint.recv_tensor_into(pool, b"small", size_hint=MiB))
    await probes.poll_until(lambda: endpoint._budget.waiting == 2, what="both requests queued")
    # FIFO: the huge request waits for the gated one to finish, the small one waits behind it.
    assert source.started == 1
    assert endpoint.statistics().bytes_in_flight == MiB
    source.release.set()
    await asyncio.gather(gated, huge, small)
    assert endpoint.statistics().peak_bytes_in_flight == 6 * MiB
    assert (await huge).value.sum() == 6 * MiB


async def test_closing_the_endpoint_fails_pending_requests(link, probes):
    endpoint, source, pool, _ = link
    receiving = asyncio.ensure_future(endpoint.recv_tensor_into(pool, b"hang", size_hint=MiB))
    await probes.poll_until(lambda: source.started == 1, what="the request")
    await endpoint.close()
    with pytest.raises(errors.UnavailableError, match="closed"):
        await receiving
    assert pool.statistics().live_slices == 0  # the sender answered the CANCEL in time
    assert endpoint.statistics().quarantined_bytes == 0
    with pytest.raises(errors.UnavailableError):
        await endpoint.recv_tensor_into(pool, b"x")


async def test_a_destination_the_sender_may_still_write_is_never_reused(probes):
    async with verbs.ProtectionDomain() as pd:
        source = Source()
        server = await verbs.TensorServer.start(pd, source)
        endpoint = await verbs.TensorEndpoint.connect(pd, server.address, close_timeout=0.2)
        pool = verbs.RegionPool(pd, region_bytes=8 * MiB)
        receiving = asyncio.ensure_future(endpoint.recv_tensor_into(pool, b"stubborn", size_hint=MiB))
        await probes.poll_until(lambda: source.started == 1, what="the request")
        await endpoint.close()  # the sender does not answer the CANCEL within 0.2 s
        with pytest.raises(errors.UnavailableError):
            await receiving
        assert source.cancellations == 1
        assert endpoint.statistics().quarantined_bytes == MiB
        assert endpoint.statistics().bytes_in_flight == 0
        assert pool.statistics().live_slices == 1  # kept out of the pool for good
        assert pool.try_allocate(MiB) is not None  # the rest of the region is usable
        source.release.set()
        await server.close()


@pytest.fixture
async def hand_driven_sender(
    pd,
) -> AsyncIterator[tuple[verbs.TensorEndpoint, verbs.QueuePair, verbs.RegionPool]]:
    """A receiver endpoint whose sender is a raw queue pair the test drives message by message."""
    listener = await verbs.listen(pd)
    accepting = asyncio.ensure_future(listener.accept())
    endpoint = await verbs.TensorEndpoint.connect(pd, listener.address)
    sender = await accepting
    pool = verbs.RegionPool(pd, region_bytes=8 * MiB)
    yield endpoint, sender, pool
    await endpoint.close()
    await sender.close()
    await listener.close()


async def next_request(sender: verbs.QueuePair) -> wire.Request:
    message = wire.decode_tensor_message(await sender.recv())
    assert isinstance(message, wire.Request)
    return message


async def test_an_error_after_writing_fails_the_receive_and_frees_the_slice(hand_driven_sender):
    endpoint, sender, pool = hand_driven_sender
    receiving = asyncio.ensure_future(endpoint.recv_tensor_into(pool, b"x", size_hint=MiB))
    request = await next_request(sender)
    description = wire.describe(np.zeros(MiB, np.uint8), b"")
    await sender.send(wire.encode_response(request.req_id, wire.ResponseKind.WRITING, description))
    await sender.send(wire.encode_error(request.req_id, errors.DATA_LOSS, "the copy failed"))
    with pytest.raises(errors.DataLossError, match="the copy failed"):
        await receiving
    assert pool.statistics().live_slices == 0  # an ERROR is the sender's final answer
    assert endpoint.statistics().quarantined_bytes == 0


async def test_a_receiver_that_gives_up_during_a_write_frees_the_slice_at_its_completion(
    hand_driven_sender, probes
):
    endpoint, sender, pool = hand_driven_sender
    receiving = asyncio.ensure_future(endpoint.recv_tensor_into(pool, b"x", size_hint=MiB, timeout=0.3))
    request = await next_request(sender)
    value = np.full(MiB, 7, np.uint8)
    writing = wire.encode_response(request.req_id, wire.ResponseKind.WRITING, wire.describe(value, b""))
    await sender.send(writing)
    with pytest.raises(errors.DeadlineExceededError):
        await receiving
    cancel = wire.decode_tensor_message(await sender.recv())
    assert isinstance(cancel, wire.Cancel)
    assert cancel.req_id == request.req_id
    assert pool.statistics().live_slices == 1  # the sender said it writes: the slice waits
    where = request.destination
    await sender.write(where.region_id, where.key, where.offset, value, wr_id=request.req_id)
    await probes.poll_until(lambda: pool.statistics().live_slices == 0, what="the slice back in the pool")
    assert endpoint.statistics().quarantined_bytes == 0


async def test_a_write_that_fails_after_writing_is_answered_with_an_error_and_no_completion(pd):
    source = Source()
    source.tensors[b"t"] = np.ones(MiB, np.uint8)
    server = await verbs.TensorServer.start(pd, source)
    receiver = await verbs.connect(pd, server.address)
    region = pd.register(MiB)
    try:
        await receiver.expose(region)
        wrong_key = wire.Destination(region.id, bytes(wire.KEY_BYTES), 0, MiB)
        await receiver.send(wire.encode_request(1, wrong_key, b"t"))
        answers = [wire.decode_tensor_message(await receiver.recv()) for _ in range(2)]
        assert [a.kind for a in answers] == [wire.ResponseKind.WRITING, wire.ResponseKind.ERROR]
        assert answers[1].code == errors.PERMISSION_DENIED
        # The ERROR is the sender's final answer, sent after its write failed: no completion
        # can follow it on the same socket.
        assert receiver.cq.poll_nowait() == []  # nothing was written
    finally:
        await receiver.close()
        region.close()
        await server.close()


async def test_one_pool_serves_several_peers(pd):
    sources = [Source(), Source()]
    for i, source in enumerate(sources):
        source.tensors[b"t"] = np.full(MiB, i + 1, np.uint16)
    servers = [await verbs.TensorServer.start(pd, s) for s in sources]
    endpoints = [await verbs.TensorEndpoint.connect(pd, s.address) for s in servers]
    pool = verbs.RegionPool(pd, region_bytes=16 * MiB)
    for _ in range(3):
        results = await asyncio.gather(
            *(e.recv_tensor_into(pool, b"t", size_hint=2 * MiB) for e in endpoints)
        )
        assert [int(r.value[0]) for r in results] == [1, 2]
        assert all(r.value.sum() == (i + 1) * MiB for i, r in enumerate(results))
        del results
    assert pool.statistics().regions_registered == 1
    for closable in (*endpoints, *servers):
        await closable.close()


async def test_closing_the_server_fails_the_receiver(link, probes):
    endpoint, source, pool, server = link
    receiving = asyncio.ensure_future(endpoint.recv_tensor_into(pool, b"hang", size_hint=MiB))
    await probes.poll_until(lambda: source.started == 1, what="the request")
    await server.close()
    with pytest.raises(errors.UnavailableError, match="closed the queue pair"):
        await asyncio.wait_for(receiving, 10)
    gc.collect()
    assert pool.statistics().live_slices == 0


async def test_uvloop_runs_the_tensor_path():
    uvloop = pytest.importorskip("uvloop")

    async def scenario() -> None:
        async with verbs.ProtectionDomain() as pd:
            source = Source()
            source.tensors[b"t"] = np.arange(MiB, dtype=np.int32)
            server = await verbs.TensorServer.start(pd, source)
            async with server, await verbs.TensorEndpoint.connect(pd, server.address) as endpoint:
                pool = verbs.RegionPool(pd)
                got = await endpoint.recv_tensor_into(pool, b"t", copy=True)
                assert np.array_equal(got.value, source.tensors[b"t"])

    def run() -> None:
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            runner.run(scenario())

    # In a thread of its own: this test's own loop is the default asyncio one.
    await asyncio.to_thread(run)


# -- across processes -----------------------------------------------------------------


@pytest.fixture
async def remote(spawn_peer) -> AsyncIterator[tuple[verbs.TensorEndpoint, verbs.RegionPool, object]]:
    """A receiver endpoint in this process, connected to a tensor-server peer process."""
    async with verbs.ProtectionDomain() as pd:
        peer = spawn_peer("tensor-server")
        ready = await peer.read_json()
        endpoint = await verbs.TensorEndpoint.connect(pd, ready["address"], max_bytes_in_flight=64 * MiB)
        pool = verbs.RegionPool(pd, region_bytes=16 * MiB)
        yield endpoint, pool, peer
        await endpoint.close()


def _header(**spec) -> bytes:
    return json.dumps(spec).encode()


@pytest.mark.slow
async def test_every_dtype_across_processes(remote, make_array):
    endpoint, pool, _ = remote
    for token in EVERY_DTYPE:
        for shape, order in [
            ((), "C"),
            ((0, 3), "C"),
            ((7,), "C"),
            ((300, 257), "F"),
            ((64, 1030), "strided"),
        ]:
            spec = {"dtype": token, "shape": list(shape), "seed": 3, "order": order}
            expected = make_array(spec)
            got = await endpoint.recv_tensor_into(pool, _header(**spec), cache_key=(token, shape))
            assert got.value.dtype == expected.dtype, (token, shape)
            assert got.value.shape == expected.shape, (token, shape)
            assert got.value.tobytes() == np.ascontiguousarray(expected).tobytes(), (token, shape)
            assert got.value.flags.c_contiguous
    assert endpoint.statistics().written > 0
    assert endpoint.statistics().inline > 0
    assert np.dtype(ml_dtypes.bfloat16) in {np.dtype(verbs._wire.dtype_from_token(t)) for t in EVERY_DTYPE}


@pytest.mark.slow
async def test_256_mib_tensor_arrives_intact(remote, make_array):
    endpoint, pool, _ = remote
    spec = {"dtype": "<u8", "shape": [32 * MiB], "pattern": "arange"}
    got = await endpoint.recv_tensor_into(pool, _header(**spec), size_hint=256 * MiB)
    assert got.zero_copy
    assert got.value.nbytes == 256 * MiB
    assert np.array_equal(got.value, np.arange(32 * MiB, dtype=np.uint64))
    del got
    gc.collect()
    assert pool.statistics().live_slices == 0


@pytest.mark.slow
async def test_concurrent_transfers_across_processes(remote, make_array):
    endpoint, pool, _ = remote
    specs = [{"dtype": "<f4", "shape": [256 + i, 1024], "seed": i} for i in range(24)]
    specs += [{"dtype": "<i2", "shape": [i + 1], "seed": i} for i in range(24)]  # inline ones in between
    results = await asyncio.gather(
        *(
            endpoint.recv_tensor_into(pool, _header(**s), size_hint=4 * (256 + i) * 1024)
            for i, s in enumerate(specs)
        )
    )
    for spec, got in zip(specs, results, strict=True):
        assert got.value.tobytes() == make_array(spec).tobytes()
    stats = endpoint.statistics()
    assert 0 < stats.peak_bytes_in_flight <= 64 * MiB
    assert stats.bytes_in_flight == 0


@pytest.mark.slow
async def test_sender_errors_across_processes(remote):
    endpoint, pool, _ = remote
    with pytest.raises(errors.NotFoundError, match="no tensor here"):
        await endpoint.recv_tensor_into(
            pool, _header(error=[errors.NOT_FOUND, "no tensor here"]), size_hint=MiB
        )
    with pytest.raises(errors.UnknownError, match="ValueError: nope"):
        await endpoint.recv_tensor_into(pool, _header(error=[0, "nope"]))
    with pytest.raises(errors.UnimplementedError):
        await endpoint.recv_tensor_into(pool, _header(object=True))
    got = await endpoint.recv_tensor_into(pool, _header(dtype="<f4", shape=[3], meta="is_dead"))
    assert got.meta == b"is_dead"


@pytest.mark.slow
async def test_kill_9_of_the_sender_fails_the_pending_receive(spawn_peer, probes):
    shm_before = probes.shm_entries()
    fds_before = probes.fd_table()
    pd = verbs.ProtectionDomain()
    peer = spawn_peer("tensor-server")
    ready = await peer.read_json()
    endpoint = await verbs.TensorEndpoint.connect(pd, ready["address"])
    pool = verbs.RegionPool(pd, region_bytes=16 * MiB)
    warm = await endpoint.recv_tensor_into(pool, _header(dtype="<u1", shape=[8 * MiB]), size_hint=8 * MiB)
    assert probes.verbs_mappings(peer.pid)  # we map the peer's completion ring
    receiving = asyncio.ensure_future(endpoint.recv_tensor_into(pool, _header(hang=True), size_hint=8 * MiB))
    await probes.poll_until(lambda: endpoint.statistics().bytes_in_flight == 8 * MiB, what="the request")
    peer.kill()
    async with asyncio.timeout(10):  # the bound: the socket's EOF arrives as the process dies
        with pytest.raises(errors.UnavailableError, match="went away"):
            await receiving
    # The peer is gone, so its destination went straight back to the pool.
    stats = endpoint.statistics()
    assert stats.bytes_in_flight == 0
    assert stats.quarantined_bytes == 0
    assert pool.statistics().live_slices == 1  # only `warm`
    with pytest.raises(errors.UnavailableError):
        await endpoint.recv_tensor_into(pool, _header(dtype="<u1", shape=[1]))
    assert probes.verbs_mappings(peer.pid) == []  # released on EOF
    await endpoint.close()
    del warm
    await pd.close()
    gc.collect()
    assert probes.verbs_mappings() == []
    assert probes.new_fds(fds_before) == {}
    assert probes.shm_entries() == shm_before
