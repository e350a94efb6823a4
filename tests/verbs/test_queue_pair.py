"""Queue pairs and completion queues: setup, one-sided operations, messages, failures.

In-process tests use two protection domains and real sockets, memfds and eventfds;
cross-process tests run `verbs_peer.py` in a separate OS process.
"""

from __future__ import annotations

import asyncio
import gc
import hashlib
import json
import os
import socket

import numpy as np
import pytest

from distserver import errors
from distserver.transports import verbs
from distserver.transports.verbs import _qp
from distserver.transports.verbs._memory import SharedCopy


async def _exposed(owner: verbs.QueuePair, other: verbs.QueuePair, nbytes: int, probes) -> verbs.MemoryRegion:
    """A region of `owner`'s domain that `other` has mapped."""
    region = owner.pd.register(nbytes)
    await owner.expose(region)
    await probes.poll_until(lambda: other.statistics().remote_regions >= 1, what="REG_MR")
    return region


async def test_messages_arrive_in_order(qp_pair):
    qa, qb = qp_pair
    for i in range(100):
        await qa.send(f"m{i}".encode())
    assert [await qb.recv() for _ in range(100)] == [f"m{i}".encode() for i in range(100)]
    big = os.urandom(verbs.MAX_SEND_BYTES)
    await qb.send(big)
    assert await qa.recv() == big
    with pytest.raises(ValueError, match="at most"):
        await qa.send(bytes(verbs.MAX_SEND_BYTES + 1))
    assert qa.peer_pid == qb.peer_pid == os.getpid()
    assert qa.peer_identity == verbs.host_identity()


async def test_write_copies_into_the_peer_and_posts_a_completion(qp_pair, probes):
    qa, qb = qp_pair
    region = await _exposed(qa, qb, 1 << 20, probes)
    local = await qb.write(region.id, region.key, 64, b"hello", wr_id=11, imm_data=0x1234)
    assert local == verbs.WorkCompletion(11, verbs.Opcode.RDMA_WRITE, verbs.WcStatus.SUCCESS, 5, 0x1234)
    remote = await qa.cq.poll()
    assert remote == verbs.WorkCompletion(
        11, verbs.Opcode.RECV_RDMA_WITH_IMM, verbs.WcStatus.SUCCESS, 5, 0x1234
    )
    assert remote.ok
    assert bytes(region.view(64, 5)) == b"hello"
    # A strided numpy array is copied element by element into C order: still one copy.
    source = np.arange(64, dtype=np.int64).reshape(8, 8).T
    await qb.write(region.id, region.key, 4096, source)
    assert np.array_equal(region.array(np.int64, (8, 8), offset=4096), source)
    # Large writes run in the executor.
    payload = np.random.default_rng(1).integers(0, 255, size=(1 << 20) - 4096, dtype=np.uint8)
    await qb.write(region.id, region.key, 4096, payload, wr_id=3)
    assert np.array_equal(region.array(np.uint8, (payload.size,), offset=4096), payload)
    assert [wc.wr_id for wc in [await qa.cq.poll(), await qa.cq.poll()]] == [0, 3]
    stats = qb.statistics()
    assert (stats.writes, stats.bytes_written, stats.completions_posted) == (3, 5 + 512 + payload.size, 3)


async def test_read_copies_out_of_the_peer(qp_pair, probes):
    qa, qb = qp_pair
    region = await _exposed(qa, qb, 2 << 20, probes)
    data = os.urandom(2 << 20)
    region.view()[:] = data
    into = bytearray(100)
    wc = await qb.read(region.id, region.key, 1000, 100, into, wr_id=5)
    assert (wc.opcode, wc.byte_len, wc.wr_id) == (verbs.Opcode.RDMA_READ, 100, 5)
    assert bytes(into) == data[1000:1100]
    big = np.empty(2 << 20, np.uint8)
    await qb.read(region.id, region.key, 0, 2 << 20, big)
    assert big.tobytes() == data
    assert qa.cq.poll_nowait() == []  # reads are one-sided: no completion at the owner
    with pytest.raises(errors.InvalidArgumentError, match="LOC_LEN_ERR"):
        await qb.read(region.id, region.key, 0, 101, into)
    with pytest.raises(TypeError, match="writable"):
        await qb.read(region.id, region.key, 0, 1, b"x")


async def test_access_errors(qp_pair, probes):
    qa, qb = qp_pair
    region = await _exposed(qa, qb, 4096, probes)
    with pytest.raises(errors.PermissionDeniedError, match="wrong key"):
        await qb.write(region.id, bytes(16), 0, b"x")
    with pytest.raises(errors.PermissionDeniedError, match="wrong key"):
        await qb.read(region.id, region.key[::-1], 0, 1, bytearray(1))
    with pytest.raises(errors.OutOfRangeError, match="outside the region"):
        await qb.write(region.id, region.key, 4095, b"xy")
    with pytest.raises(errors.OutOfRangeError):
        await qb.read(region.id, region.key, -1, 1, bytearray(1))
    with pytest.raises(errors.NotFoundError, match="has not exposed"):
        await qb.write(region.id + 100, region.key, 0, b"x")
    unexposed = qa.pd.register(4096)
    with pytest.raises(errors.NotFoundError):
        await qb.write(unexposed.id, unexposed.key, 0, b"x")
    with pytest.raises(TypeError, match="Python objects"):
        await qb.write(region.id, region.key, 0, np.array([object()]))
    assert qa.cq.poll_nowait() == []  # failed writes post nothing
    assert bytes(region.view(4095, 1)) == b"\0"


async def test_closing_a_region_withdraws_it(qp_pair, probes):
    qa, qb = qp_pair
    region = await _exposed(qa, qb, 4096, probes)
    await qb.write(region.id, region.key, 0, b"ok")
    region.close()
    await probes.poll_until(lambda: qb.statistics().remote_regions == 0, what="UNREG_MR")
    with pytest.raises(errors.NotFoundError):
        await qb.write(region.id, region.key, 0, b"late")


async def test_expose_checks_the_domain(qp_pair):
    qa, qb = qp_pair
    foreign = qb.pd.register(4096)
    with pytest.raises(ValueError, match="another protection domain"):
        await qa.expose(foreign)


async def test_completion_queue_backpressure_keeps_every_completion(probes):
    """A 4-slot ring and 500 writes: credits must hold the writer back, nothing is lost."""
    async with verbs.ProtectionDomain() as pd_a, verbs.ProtectionDomain() as pd_b:
        async with await verbs.listen(pd_a, cq_depth=4) as listener:
            connecting = asyncio.ensure_future(verbs.connect(pd_b, listener.address, cq_depth=4))
            qa = await listener.accept()
            qb = await connecting
        region = await _exposed(qa, qb, 4096, probes)
        writer = asyncio.ensure_future(
            asyncio.gather(
                *(qb.write(region.id, region.key, 0, b"z", wr_id=i, imm_data=i) for i in range(500))
            )
        )
        received = [await qa.cq.poll() for _ in range(500)]
        await writer
        assert [wc.wr_id for wc in received] == list(range(500))
        assert [wc.imm_data for wc in received] == list(range(500))
        assert qa.cq.statistics().largest_batch <= 4


async def test_poll_waits_without_blocking_the_loop(qp_pair, probes):
    qa, qb = qp_pair
    region = await _exposed(qa, qb, 4096, probes)
    polling = asyncio.ensure_future(qa.cq.poll())
    ticks = 0
    for _ in range(50):  # the loop keeps running while poll() waits
        await asyncio.sleep(0)
        ticks += 1
    assert ticks == 50
    assert not polling.done()
    await qb.write(region.id, region.key, 0, b"!", wr_id=99)
    assert (await asyncio.wait_for(polling, 10)).wr_id == 99


async def test_large_copies_leave_the_loop_running(qp_pair, probes):
    qa, qb = qp_pair
    region = await _exposed(qa, qb, 64 << 20, probes)
    payload = np.ones(64 << 20, np.uint8)
    writing = asyncio.ensure_future(qb.write(region.id, region.key, 0, payload))
    ticks = 0
    while not writing.done():
        await asyncio.sleep(0)
        ticks += 1
    await writing
    # A copy on the loop would finish within the task's first step (ticks == 1); in the
    # executor the loop keeps turning while it runs.
    assert ticks >= 3
    assert region.array(np.uint8, (64 << 20,)).all()


async def test_copies_up_to_the_shared_size_stay_on_the_loop(qp_pair, probes, monkeypatch):
    """At and below `SHARED_COPY_BYTES` the loop copies alone (no thread's GIL hand-off);
    above it threads share the copy. Either way every byte lands and one completion
    per write reaches the peer."""
    qa, qb = qp_pair
    limit = _qp.SHARED_COPY_BYTES
    region = await _exposed(qa, qb, 2 * limit + 4096, probes)
    shared = []
    monkeypatch.setattr(_qp, "SharedCopy", lambda *a, **k: shared.append(a[2]) or SharedCopy(*a, **k))
    rng = np.random.default_rng(7)
    for wr_id, nbytes in enumerate((limit, limit + 1)):
        payload = rng.integers(0, 255, size=nbytes, dtype=np.uint8)
        await qb.write(region.id, region.key, 4096, payload, wr_id=wr_id)
        assert np.array_equal(region.array(np.uint8, (nbytes,), offset=4096), payload)
        completion = await qa.cq.poll()
        assert (completion.wr_id, completion.byte_len) == (wr_id, nbytes)
    assert shared == [limit + 1]
    assert qa.cq.poll_nowait() == []


async def test_async_for_and_poll_nowait(qp_pair, probes):
    qa, qb = qp_pair
    region = await _exposed(qa, qb, 4096, probes)
    for i in range(5):
        await qb.write(region.id, region.key, 0, b"a", wr_id=i)
    await probes.poll_until(lambda: qa.cq.statistics().pending == 5, what="completions")
    assert [wc.wr_id for wc in qa.cq.poll_nowait(2)] == [0, 1]
    seen = []
    async for wc in qa.cq:
        seen.append(wc.wr_id)
        if len(seen) == 3:
            break
    assert seen == [2, 3, 4]


async def test_handlers_take_completions_and_messages_as_they_arrive(qp_pair, probes):
    qa, qb = qp_pair
    region = await _exposed(qa, qb, 4096, probes)
    await qb.write(region.id, region.key, 0, b"a", wr_id=1)  # before the handler: handed over then
    await qb.send(b"early")
    await probes.poll_until(lambda: qa.cq.statistics().pending == 1, what="the first completion")
    completions, messages = [], []
    qa.cq.deliver_to(completions.append)
    qa.deliver_to(messages.append)
    for i in range(2, 5):
        await qb.write(region.id, region.key, 0, b"a", wr_id=i)
        await qb.send(f"m{i}".encode())
    await probes.poll_until(lambda: len(completions) == 4 and len(messages) == 4, what="everything")
    assert [wc.wr_id for wc in completions] == [1, 2, 3, 4]
    assert messages == [b"early", b"m2", b"m3", b"m4"]
    assert qa.cq.poll_nowait() == []
    receiving = asyncio.ensure_future(qa.recv())  # now only a failure ends it
    await qb.close()
    with pytest.raises(errors.UnavailableError):
        await asyncio.wait_for(receiving, 10)


async def test_a_message_sent_in_parts_arrives_whole_and_delivered_messages_stay_as_sent(qp_pair, probes):
    # Parts leave as one packet, unjoined (a call's answer: a head and a view of its
    # piece); a handler gets a view of each message, which later packets never touch.
    qa, qb = qp_pair
    delivered: list[bytes | memoryview] = []
    qa.deliver_to(delivered.append)
    body = os.urandom(verbs.MAX_SEND_BYTES)
    sent = []
    for i in range(20):
        head = f"m{i}:".encode()
        piece = memoryview(body)[i : verbs.MAX_SEND_BYTES - len(head) - i]
        qb.send_nowait(head, piece)
        sent.append(head + bytes(piece))
    await probes.poll_until(lambda: len(delivered) == 20, what="every message")
    assert [bytes(message) for message in delivered] == sent
    with pytest.raises(ValueError, match="at most"):
        qb.send_nowait(b"x", bytes(verbs.MAX_SEND_BYTES))  # the parts together are checked


async def test_cancelled_poll_does_not_lose_a_completion(qp_pair, probes):
    qa, qb = qp_pair
    region = await _exposed(qa, qb, 4096, probes)
    first = asyncio.ensure_future(qa.cq.poll())
    second = asyncio.ensure_future(qa.cq.poll())
    await asyncio.sleep(0)
    first.cancel()
    await qb.write(region.id, region.key, 0, b"a", wr_id=1)
    assert (await asyncio.wait_for(second, 10)).wr_id == 1
    with pytest.raises(asyncio.CancelledError):
        await first


async def test_close_fails_everything_pending_on_both_sides(qp_pair, probes):
    qa, qb = qp_pair
    region = await _exposed(qa, qb, 4096, probes)
    receiving = asyncio.ensure_future(qa.recv())
    polling = asyncio.ensure_future(qa.cq.poll())
    peer_receiving = asyncio.ensure_future(qb.recv())
    await asyncio.sleep(0)
    await qb.close()
    with pytest.raises(errors.UnavailableError, match="closed the queue pair"):
        await asyncio.wait_for(receiving, 10)
    with pytest.raises(errors.UnavailableError):
        await asyncio.wait_for(polling, 10)
    with pytest.raises(errors.UnavailableError, match="closed"):
        await asyncio.wait_for(peer_receiving, 10)
    assert qa.closed
    assert qb.closed
    assert qa.peer_gone
    for op in (qb.send(b"x"), qb.recv(), qb.write(region.id, region.key, 0, b"x"), qa.send(b"x")):
        with pytest.raises(errors.UnavailableError):
            await op
    await qb.close()  # idempotent
    await qa.close()


async def test_setup_and_close_leave_no_fds_or_mappings(probes):
    before = probes.fd_table()
    async with verbs.ProtectionDomain() as pd_a, verbs.ProtectionDomain() as pd_b:
        listener = await verbs.listen(pd_a)
        connecting = asyncio.ensure_future(verbs.connect(pd_b, listener.address))
        qa = await listener.accept()
        qb = await connecting
        big = await pd_a.register_async(4 << 20)
        small = pd_a.register(4096)
        for region in (big, small):
            await qa.expose(region)
        await probes.poll_until(lambda: qb.statistics().remote_regions == 2, what="REG_MR")
        await qb.write(big.id, big.key, 0, bytes(2 << 20))
        assert probes.new_fds(before)
        await qa.close()
        await probes.poll_until(lambda: qb.closed, what="EOF")
    gc.collect()
    assert probes.new_fds(before) == {}
    assert probes.verbs_mappings() == []


def test_peer_uid_check():
    left, right = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with left, right:
        pid, uid = _qp.check_peer_uid(left, os.getuid())
        assert (pid, uid) == (os.getpid(), os.getuid())
        with pytest.raises(errors.PermissionDeniedError, match="runs as uid"):
            _qp.check_peer_uid(left, os.getuid() + 1)


async def test_listener_refuses_a_bad_handshake_and_keeps_serving(pd, probes):
    async with await verbs.listen(pd, handshake_timeout=5) as listener:
        rogue = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        with rogue:
            rogue.connect("\0" + listener.socket_address[1:])
            rogue.send(b"\x04not a hello")
            await probes.poll_until(lambda: listener.statistics().rejected == 1, what="rejection")
        async with verbs.ProtectionDomain() as other:
            connecting = asyncio.ensure_future(verbs.connect(other, listener.address))
            qp = await listener.accept()
            await (await connecting).send(b"fine")
            assert await qp.recv() == b"fine"
            assert listener.statistics() == verbs.ListenerStatistics(accepted=1, rejected=1)


async def test_a_peer_without_the_listener_ticket_is_refused(pd, probes):
    """The socket's name can be listed by any local process; the ticket comes only with the address."""
    async with await verbs.listen(pd, handshake_timeout=5) as listener:
        assert listener.address.startswith(listener.socket_address + "#")
        wrong_ticket = listener.socket_address + "#" + "00" * 16
        async with verbs.ProtectionDomain() as other:
            for address in (listener.socket_address, wrong_ticket):
                with pytest.raises(errors.OpError):
                    await verbs.connect(other, address, timeout=5)
            await probes.poll_until(lambda: listener.statistics().rejected == 2, what="rejections")
            connecting = asyncio.ensure_future(verbs.connect(other, listener.address))
            qp = await listener.accept()
            await (await connecting).send(b"fine")
            assert await qp.recv() == b"fine"


async def test_path_address(pd, tmp_path):
    directory = tmp_path / "private"
    directory.mkdir(mode=0o700)
    address = str(directory / "qp.sock")
    listener = await verbs.listen(pd, address)
    assert listener.socket_address == address
    async with verbs.ProtectionDomain() as other:
        connecting = asyncio.ensure_future(verbs.connect(other, listener.address))
        qp = await listener.accept()
        await (await connecting).send(b"via a path")
        assert await qp.recv() == b"via a path"
    await listener.close()
    assert "qp.sock" not in os.listdir(directory)
    with pytest.raises(errors.UnavailableError):
        await listener.accept()


async def test_connect_to_nothing_is_unavailable(pd):
    with pytest.raises(errors.UnavailableError, match="cannot reach"):
        await verbs.connect(pd, "@distserver-verbs-nobody-listens-here")


async def test_closing_the_listener_wakes_accept(pd):
    listener = await verbs.listen(pd)
    accepting = asyncio.ensure_future(listener.accept())
    await asyncio.sleep(0)
    await listener.close()
    with pytest.raises(errors.UnavailableError, match="closed"):
        await asyncio.wait_for(accepting, 10)
    assert [qp async for qp in listener] == []


# -- across processes -----------------------------------------------------------------


async def _rdma_peer(pd, spawn_peer, nbytes=1 << 20, fill=0xAB):
    listener = await verbs.listen(pd)
    peer = spawn_peer("rdma-client", address=listener.address, nbytes=nbytes, fill=fill)
    qp = await asyncio.wait_for(listener.accept(), 60)
    await listener.close()
    announced = json.loads(await asyncio.wait_for(qp.recv(), 60))
    await peer.read_json()  # the peer is ready
    return peer, qp, announced


async def _ask(qp, **command):
    await qp.send(json.dumps(command).encode())
    return json.loads(await asyncio.wait_for(qp.recv(), 60))


@pytest.mark.slow
async def test_one_sided_operations_across_processes(pd, spawn_peer, probes):
    peer, qp, theirs = await _rdma_peer(pd, spawn_peer, nbytes=4 << 20)
    assert qp.peer_pid == peer.pid
    # We read the peer's memory: it holds its fill byte.
    into = np.empty(theirs["nbytes"], np.uint8)
    await qp.read(theirs["region"], bytes.fromhex(theirs["key"]), 0, theirs["nbytes"], into)
    assert (into == 0xAB).all()
    # We write into the peer's memory (a large write goes through the executor).
    data = np.random.default_rng(7).integers(0, 256, size=3 << 20, dtype=np.uint8)
    await qp.write(theirs["region"], bytes.fromhex(theirs["key"]), 4096, data, wr_id=21, imm_data=77)
    answer = await _ask(qp, op="digest", offset=4096, length=data.size)
    assert answer["sha256"] == hashlib.sha256(data.tobytes()).hexdigest()
    answer = await _ask(qp, op="poll", n=1)
    assert answer["wcs"] == [[21, verbs.Opcode.RECV_RDMA_WITH_IMM, 0, data.size, 77]]
    # The peer writes into and reads from our memory.
    ours = pd.register(1 << 20)
    await qp.expose(ours)
    answer = await _ask(
        qp, op="write", region=ours.id, key=ours.key.hex(), offset=100, nbytes=1000, fill=5, wr_id=8, imm=9
    )
    assert answer["wc"] == [8, verbs.Opcode.RDMA_WRITE, 0, 1000, 9]
    assert (await qp.cq.poll()) == verbs.WorkCompletion(
        8, verbs.Opcode.RECV_RDMA_WITH_IMM, verbs.WcStatus.SUCCESS, 1000, 9
    )
    assert bytes(ours.view(100, 1000)) == b"\x05" * 1000
    assert bytes(ours.view(99, 1)) == b"\0"
    answer = await _ask(qp, op="read", region=ours.id, key=ours.key.hex(), offset=100, length=1000)
    assert answer["sha256"] == hashlib.sha256(b"\x05" * 1000).hexdigest()
    # Their access errors come back as errors.
    answer = await _ask(
        qp, op="write", region=ours.id, key="00" * 16, offset=0, nbytes=1, fill=1, wr_id=0, imm=0
    )
    assert answer["error"][0] == "PermissionDeniedError"
    answer = await _ask(qp, op="read", region=ours.id, key=ours.key.hex(), offset=ours.nbytes, length=1)
    assert answer["error"][0] == "OutOfRangeError"
    await qp.close()


@pytest.mark.slow
async def test_completions_from_another_process_are_batched_per_wakeup(pd, spawn_peer):
    peer, qp, _ = await _rdma_peer(pd, spawn_peer)
    ours = pd.register(4096)
    await qp.expose(ours)
    await qp.send(
        json.dumps({"op": "write_many", "region": ours.id, "key": ours.key.hex(), "count": 200}).encode()
    )
    # Stall our own loop until the peer has posted all 200: one wake-up must carry them all.
    assert peer.read_json_blocking() == {"done": 200}
    completions = [await asyncio.wait_for(qp.cq.poll(), 10) for _ in range(200)]
    assert [wc.wr_id for wc in completions] == list(range(200))
    assert qp.cq.statistics().largest_batch == 200
    assert json.loads(await qp.recv()) == {"written": 200}
    await qp.close()


@pytest.mark.slow
async def test_poll_across_processes_keeps_the_loop_running(pd, spawn_peer):
    _, qp, _ = await _rdma_peer(pd, spawn_peer)
    ours = pd.register(4096)
    await qp.expose(ours)
    polling = asyncio.ensure_future(qp.cq.poll())
    for _ in range(20):
        await asyncio.sleep(0)
    assert not polling.done()
    answer = await _ask(
        qp, op="write", region=ours.id, key=ours.key.hex(), offset=0, nbytes=8, fill=1, wr_id=4, imm=2
    )
    assert answer["wc"][0] == 4
    assert (await asyncio.wait_for(polling, 10)).wr_id == 4
    await qp.close()


@pytest.mark.slow
@pytest.mark.skipif(os.getuid() != 0, reason="needs root to start a process of another uid")
async def test_a_peer_of_another_uid_is_refused(pd, spawn_peer, probes):
    listener = await verbs.listen(pd)
    peer = spawn_peer("connect-as", address=listener.address, uid=65534)
    result = await peer.read_json()
    assert result["result"] == "PermissionDeniedError"
    await probes.poll_until(lambda: listener.statistics().rejected == 1, what="rejection")
    assert listener.statistics().accepted == 0
    await listener.close()


@pytest.mark.slow
async def test_kill_9_fails_pending_operations_and_leaves_nothing(pd, spawn_peer, probes):
    shm_before = probes.shm_entries()
    fds_before = probes.fd_table()
    peer, qp, theirs = await _rdma_peer(pd, spawn_peer, nbytes=8 << 20)
    await qp.write(theirs["region"], bytes.fromhex(theirs["key"]), 0, bytes(2 << 20))
    assert probes.verbs_mappings(peer.pid)  # we map the peer's region and completion ring
    receiving = asyncio.ensure_future(qp.recv())
    polling = asyncio.ensure_future(qp.cq.poll())
    await asyncio.sleep(0)
    peer.kill()
    async with asyncio.timeout(10):  # the bound: socket EOF arrives at once
        with pytest.raises(errors.UnavailableError, match="went away"):
            await receiving
        with pytest.raises(errors.UnavailableError):
            await polling
    with pytest.raises(errors.UnavailableError):
        await qp.write(theirs["region"], bytes.fromhex(theirs["key"]), 0, b"x")
    assert qp.peer_gone
    await qp.close()
    assert probes.verbs_mappings(peer.pid) == []
    await pd.close()
    gc.collect()
    assert probes.new_fds(fds_before) == {}
    assert probes.verbs_mappings() == []
    assert probes.shm_entries() == shm_before
