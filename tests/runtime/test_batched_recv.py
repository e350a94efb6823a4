"""Batched receives between distserver tasks (`runtime/batched_recv.py`), one OS process per task.

A step that reads many small ps variables on a worker and sends as many updates back
makes a few RecvTensors calls per peer instead of one RecvTensor per value; values
stay equal; large values still go by RecvTensor; a peer that dies mid-batch fails
the step with an error instead of a hang.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import signal
import threading

import numpy as np
import pytest
from google.protobuf.empty_pb2 import Empty

import distserver as ds
from distserver import errors
from distserver.devices import parse_rendezvous_key, rendezvous_key
from distserver.protos.services import STATUS_SERVICE
from distserver.runtime import batched_recv
from distserver.runtime.rendezvous import StepRendezvous
from distserver.testing import LocalCluster
from distserver.transports import get_transport

COUNT = 30
PS_TASK = "/job:ps/replica:0/task:0"
WORKER_TASK = "/job:worker/replica:0/task:0"


def _statistics(protocol, target):
    async def ask():
        address = target.partition("://")[2]
        channel = get_transport(protocol).connect(address)
        try:
            answer = await channel.call(STATUS_SERVICE, "GetStatistics", Empty(), timeout=30)
        finally:
            await channel.close()
        return json.loads(answer.value)

    return asyncio.run(ask())


def _peer(stats, task):
    return stats["peers"][task]


def _key(name: str):
    """The rendezvous key of a value the ps sends the worker."""
    return parse_rendezvous_key(
        rendezvous_key(f"{PS_TASK}/device:CPU:0", 1, f"{WORKER_TASK}/device:CPU:0", name)
    )


async def _nothing_fetched_by_itself(step_id: int, key) -> tuple:
    raise AssertionError("nothing is fetched by itself")


def _run_into(outcome, session, fetch, feed):
    outcome["total"] = session.run(fetch, feed)


def _graph(count, size):
    """`count` variables on the ps read by the worker, each updated by a value the worker computes."""
    graph = ds.Graph()
    with graph.as_default():
        variables = []
        with ds.device("/job:ps/task:0"):
            for i in range(count):
                variables.append(ds.Variable(np.full(size, float(i), np.float32), name=f"v{i}"))
        with ds.device("/job:worker/task:0"):
            doubled = [v.read_value() * 2.0 for v in variables]
            total = ds.add_n([ds.reduce_sum(d) for d in doubled])
        with ds.device("/job:ps/task:0"):
            updates = [v.assign_add(d) for v, d in zip(variables, doubled, strict=True)]
        init = ds.global_variables_initializer()
    return graph, init, total, updates


async def test_an_answer_to_a_request_that_comes_after_values_were_sent_leaves_at_once():
    """Values sent before the request came (a ps's variable reads, a worker's ids) are
    answered without waiting a loop turn (one lets a large copy or the task's own
    receives go first), those still to come in a later answer; a request that waits
    gets what was sent in the same pass as the first value."""
    loop = asyncio.get_running_loop()
    rendezvous = StepRendezvous(1, PS_TASK, None)

    sent, late = [_key("v0"), _key("v1")], _key("late")
    for i, each in enumerate(sent):
        rendezvous.send(each, np.full(4, float(i), np.float32))
    turned: list[bool] = []
    loop.call_soon(turned.append, True)
    values = await batched_recv.answer(rendezvous, [*sent, late])
    assert not turned
    assert {text: float(value[0]) for text, value in values.items()} == {sent[0].text: 0.0, sent[1].text: 1.0}

    later = [_key("w0"), _key("w1")]

    def one_pass() -> None:
        for each in later:
            rendezvous.send(each, np.zeros(4, np.float32))

    loop.call_soon(one_pass)
    assert set(await batched_recv.answer(rendezvous, [late, *later])) == {each.text for each in later}


async def test_answers_waiting_on_many_keys_wake_on_any_of_them_or_on_the_steps_failure():
    """Answers wait on one future for all their keys (`StepRendezvous.wait_for_any`):
    two waiting on overlapping keys both wake when one of theirs is sent; one given
    up (its call cancelled) leaves the keys to later answers; a failing step wakes a
    waiting answer with its error."""
    rendezvous = StepRendezvous(1, PS_TASK, None)

    a, b, c, d = (_key(name) for name in "abcd")
    first = asyncio.ensure_future(batched_recv.answer(rendezvous, [a, b]))
    second = asyncio.ensure_future(batched_recv.answer(rendezvous, [b, c]))
    given_up = asyncio.ensure_future(batched_recv.answer(rendezvous, [d]))
    await asyncio.sleep(0)
    given_up.cancel()
    await asyncio.sleep(0)
    assert not first.done()
    assert not second.done()
    rendezvous.send(b, np.ones(1, np.float32))
    got_first, got_second = await asyncio.wait_for(asyncio.gather(first, second), 5)
    assert set(got_first) == set(got_second) == {b.text}
    rendezvous.send(d, np.zeros(1, np.float32))
    assert set(await asyncio.wait_for(batched_recv.answer(rendezvous, [c, d]), 5)) == {d.text}
    waiting = asyncio.ensure_future(batched_recv.answer(rendezvous, [a, c]))
    await asyncio.sleep(0)
    rendezvous.abort(errors.AbortedError("the step failed"))
    with pytest.raises(errors.AbortedError, match="the step failed"):
        await asyncio.wait_for(waiting, 5)


async def test_an_answer_for_every_key_waits_for_the_last_one():
    """RecvAllTensors (`every`): values sent early wait in the answer until the last key
    asked for is sent, then all leave together; a failing step ends the wait."""
    rendezvous = StepRendezvous(1, PS_TASK, None)

    early, late, later = _key("early"), _key("late"), _key("later")
    rendezvous.send(early, np.zeros(2, np.float32))
    answering = asyncio.ensure_future(batched_recv.answer(rendezvous, [early, late, later], every=True))
    for _ in range(5):
        await asyncio.sleep(0)
    assert not answering.done()
    rendezvous.send(late, np.ones(2, np.float32))
    for _ in range(5):
        await asyncio.sleep(0)
    assert not answering.done()
    rendezvous.send(later, np.full(2, 2.0, np.float32))
    values = await asyncio.wait_for(answering, 5)
    assert {text: float(value[0]) for text, value in values.items()} == {
        early.text: 0.0,
        late.text: 1.0,
        later.text: 2.0,
    }
    failing = StepRendezvous(2, PS_TASK, None)
    failing.send(early, np.zeros(2, np.float32))
    waiting = asyncio.ensure_future(batched_recv.answer(failing, [early, late], every=True))
    await asyncio.sleep(0)
    failing.abort(errors.AbortedError("the step failed"))
    with pytest.raises(errors.AbortedError, match="the step failed"):
        await asyncio.wait_for(waiting, 5)


async def test_a_batch_asks_for_every_value_only_when_all_its_receives_come_together():
    """A batch of receives made `together` (a partition that waits for all of them) is a
    RecvAllTensors call; one receive not made so makes its batch a RecvTensors call."""
    asked: list[tuple[int, bool]] = []

    async def batch_call(step_id: int, keys: list[str], every: bool) -> dict:
        asked.append((step_id, every))
        return {text: np.zeros(1) for text in keys}

    fetch_one = _nothing_fetched_by_itself

    receiver = batched_recv.BatchedReceiver(lambda task: batch_call, fetch_one)

    await asyncio.gather(
        receiver.fetch_soon(1, _key("a"), together=True), receiver.fetch_soon(1, _key("b"), together=True)
    )
    await asyncio.gather(receiver.fetch_soon(2, _key("a"), together=True), receiver.fetch_soon(2, _key("b")))
    assert asked == [(1, True), (2, False)]


async def test_a_bug_in_a_batchs_call_fails_its_receives_instead_of_leaving_them_waiting():
    async def batch_call(step_id: int, keys: list[str], every: bool) -> dict:
        raise TypeError("a bug")

    fetch_one = _nothing_fetched_by_itself

    receiver = batched_recv.BatchedReceiver(lambda task: batch_call, fetch_one)
    key = parse_rendezvous_key(
        rendezvous_key(f"{PS_TASK}/device:CPU:0", 1, f"{WORKER_TASK}/device:CPU:0", "a")
    )
    with pytest.raises(TypeError, match="a bug"):
        await asyncio.wait_for(receiver.fetch_soon(1, key), 5)


async def test_a_turns_batch_is_asked_for_before_its_values_fetched_one_by_one():
    """A request sent first is served first: the batch of small values (what the peer's
    first nodes wait for) goes before the large values the turn fetches one by one."""
    asked: list[str] = []

    async def batch_call(step_id: int, keys: list[str], every: bool) -> dict:
        asked.append("batch")
        return {text: batched_recv.FETCH_SEPARATELY if "large" in text else np.zeros(1) for text in keys}

    async def fetch_one(step_id: int, key) -> tuple:
        asked.append("one")
        return np.zeros(8), False

    receiver = batched_recv.BatchedReceiver(lambda task: batch_call, fetch_one)

    await asyncio.gather(receiver.fetch_soon(1, _key("large")), receiver.fetch_soon(1, _key("small")))
    assert asked == ["batch", "one"]  # step 1: "large" learnt to be fetched by itself
    asked.clear()
    await asyncio.gather(receiver.fetch_soon(2, _key("large")), receiver.fetch_soon(2, _key("small")))
    assert asked == ["batch", "one"]


async def test_a_batch_stops_asking_once_the_receives_still_waiting_are_given_up():
    """A batch delivers what its first answer brings and asks again for the rest; once
    every receive still waiting is cancelled (its step is over), it stops asking: the
    call in flight is cancelled, whatever the receives already delivered."""
    asking_again = asyncio.Event()
    stopped: list[bool] = []

    async def batch_call(step_id: int, keys: list[str], every: bool) -> dict:
        if len(keys) == 2:
            return {keys[0]: np.ones(2, np.float32)}
        asking_again.set()
        try:
            await asyncio.Event().wait()  # (the sender never sends it)
        except asyncio.CancelledError:
            stopped.append(True)
            raise
        return {}

    fetch_one = _nothing_fetched_by_itself

    receiver = batched_recv.BatchedReceiver(lambda task: batch_call, fetch_one)

    delivered, waiting = receiver.fetch_soon(1, _key("a")), receiver.fetch_soon(1, _key("b"))
    value, is_dead = await asyncio.wait_for(delivered, 5)
    np.testing.assert_array_equal(value, [1.0, 1.0])
    assert not is_dead
    await asyncio.wait_for(asking_again.wait(), 5)
    waiting.cancel()
    for _ in range(10):
        if stopped:
            break
        await asyncio.sleep(0)
    assert stopped == [True]


@pytest.mark.parametrize("protocol", ["grpc", "grpc+verbs"])
def test_many_small_values_cross_in_few_calls_and_stay_equal(protocol):
    with LocalCluster({"ps": 1, "worker": 1}, protocol=protocol) as cluster:
        graph, init, total, updates = _graph(COUNT, 4)
        with ds.Session(cluster.target("worker"), graph=graph) as session:
            session.run(init)
            session.run([total, updates])  # warm: graphs registered, peers met
            worker_before = _peer(_statistics(protocol, cluster.target("worker")), PS_TASK)
            ps_before = _peer(_statistics(protocol, cluster.target("ps")), WORKER_TASK)
            steps = 3
            for step in range(steps):
                got_total, got_updates = session.run([total, updates])
                # Before this step each v_i held i * 3**(step + 1): it reads that, doubles it, adds it.
                held = np.arange(COUNT, dtype=np.float32) * 3.0 ** (step + 1)
                assert got_total == pytest.approx(float((held * 2.0).sum() * 4))
                for i, value in enumerate(got_updates):
                    np.testing.assert_array_equal(value, np.full(4, held[i] * 3.0, np.float32))
            worker_after = _peer(_statistics(protocol, cluster.target("worker")), PS_TASK)
            ps_after = _peer(_statistics(protocol, cluster.target("ps")), WORKER_TASK)
    # One RecvTensor per value would be COUNT per step on each side, plus the RunGraph.
    worker_calls = (worker_after["calls_started"] - worker_before["calls_started"]) / steps
    ps_calls = (ps_after["calls_started"] - ps_before["calls_started"]) / steps
    worker_tensors = (worker_after["tensors_received"] - worker_before["tensors_received"]) / steps
    ps_tensors = (ps_after["tensors_received"] - ps_before["tensors_received"]) / steps
    print(f"per step: worker->ps {worker_calls} calls, ps->worker {ps_calls} calls")
    assert worker_tensors == 0  # no plain RecvTensor for small values
    assert ps_tensors == 0
    assert worker_calls < COUNT / 2, worker_after
    assert ps_calls < COUNT / 2, ps_after


@pytest.mark.parametrize("protocol", ["grpc", "grpc+verbs"])
def test_a_worker_waiting_for_all_its_receives_gets_a_late_value_with_the_early_ones(protocol):
    """The worker's partition uses no received value before all are in (the planner
    marks it), so it asks the ps with RecvAllTensors: the ps answers once every value
    is sent. Here one is late: the ps computes it from the worker's fed value after a
    queue's dequeue, which another session's enqueue releases 0.3 s into the step. The
    early variable read waits for it: one call a step besides the RunGraph, where an
    answer with what is ready takes two."""
    with LocalCluster({"ps": 1, "worker": 1}, protocol=protocol) as cluster:
        graph = ds.Graph()
        with graph.as_default():
            with ds.device("/job:ps/task:0"):
                v = ds.Variable(np.full(4, 3.0, np.float32), name="v")
                queue = ds.FIFOQueue(4, [ds.float32], shapes=[[4]], name="released")
            with ds.device("/job:worker/task:0"):
                x = ds.placeholder(ds.float32, shape=[4], name="x")
                doubled = x * 2.0
            with ds.device("/job:ps/task:0"):
                early = v.read_value() + 1.0
                late = queue.dequeue() * doubled
            with ds.device("/job:worker/task:0"):
                total = early * late
            release = queue.enqueue(ds.constant(np.full(4, 5.0, np.float32)))
            init = ds.global_variables_initializer()
        feed = {x: np.arange(4, dtype=np.float32)}
        expected = 4.0 * 5.0 * np.arange(4, dtype=np.float32) * 2.0
        with (
            ds.Session(cluster.target("worker"), graph=graph) as session,
            ds.Session(cluster.target("ps"), graph=graph) as releaser,
        ):
            session.run(init)
            releaser.run(release)
            np.testing.assert_array_equal(session.run(total, feed), expected)  # warm: graphs registered
            for _ in range(2):
                before = _peer(_statistics(protocol, cluster.target("worker")), PS_TASK)
                outcome: dict = {}
                step = threading.Thread(target=functools.partial(_run_into, outcome, session, total, feed))
                step.start()
                step.join(0.3)
                assert step.is_alive()  # the ps waits on the queue
                releaser.run(release)
                step.join(30)
                np.testing.assert_array_equal(outcome["total"], expected)
                after = _peer(_statistics(protocol, cluster.target("worker")), PS_TASK)
                # RunGraph and one RecvAllTensors (answering with what is ready: a second).
                assert after["calls_started"] - before["calls_started"] == 2, (before, after)


def test_large_values_still_go_by_recv_tensor():
    size = (2 << 20) // 4  # 2 MiB float32: above the batch's value limit
    with LocalCluster({"ps": 1, "worker": 1}) as cluster:
        graph, init, total, updates = _graph(2, size)
        with ds.Session(cluster.target("worker"), graph=graph) as session:
            session.run(init)
            got_total, got_updates = session.run([total, updates])
            assert got_total == pytest.approx(2.0 * size)
            np.testing.assert_array_equal(got_updates[1], np.full(size, 3.0, np.float32))
            stats = _statistics("grpc", cluster.target("worker"))
    assert _peer(stats, PS_TASK)["tensors_received"] == 2  # both reads, by RecvTensor


def test_a_peer_dying_mid_batch_fails_the_step():
    """The ps waits in a RecvTensors call for values the worker is still computing
    (blocked in a FIFOQueue dequeue); the worker dies: the ps's step fails, no hang."""
    with LocalCluster({"ps": 1, "worker": 1}) as cluster:
        graph = ds.Graph()
        with graph.as_default():
            with ds.device("/job:ps/task:0"):
                # The worker's partition receives this (a constant would be copied
                # there): its values are fetched, not pushed.
                one = ds.identity(ds.constant(1.0), name="one")
            with ds.device("/job:worker/task:0"):
                queue = ds.FIFOQueue(1, [ds.float32], shapes=[[]], name="gate")
                gated = queue.dequeue() + one
                parts = [gated * float(i) for i in range(5)]
            with ds.device("/job:ps/task:0"):
                total = ds.add_n(parts)
            enqueue = queue.enqueue(ds.constant(2.0))
        with ds.Session(cluster.target("ps"), graph=graph) as session:
            session.run(enqueue)
            assert session.run(total) == 30.0  # warm: graphs registered
            before = _peer(_statistics("grpc", cluster.target("ps")), WORKER_TASK)
            outcome = {}

            def run():
                try:
                    outcome["value"] = session.run(total)  # no step timeout
                except errors.OpError as exc:
                    outcome["error"] = exc

            thread = threading.Thread(target=run)
            thread.start()
            thread.join(3.0)  # the step now waits on the worker's queue
            assert thread.is_alive()
            during = _peer(_statistics("grpc", cluster.target("ps")), WORKER_TASK)
            # RunGraph and one RecvTensors for the 5 parts (plain: 5 RecvTensors more).
            assert during["calls_started"] - before["calls_started"] == 2, (before, during)
            os.kill(cluster.process("worker").pid, signal.SIGKILL)
            thread.join(60.0)
            assert not thread.is_alive(), "the step still hangs after its peer died"
    assert "error" in outcome, outcome
    assert isinstance(outcome["error"], (errors.UnavailableError, errors.AbortedError)), outcome["error"]


@pytest.mark.parametrize("method", ["RecvTensors", "RecvAllTensors"])
def test_hostile_recv_tensors_requests_get_clear_errors(method):
    from distserver.protos import worker_pb2 as w
    from distserver.protos.services import TENSOR_SERVICE
    from distserver.runtime.batched_recv import MAX_BATCH_KEYS
    from distserver.wire import HAND_DECODED_REQUEST_BYTES

    async def ask(address, keys):
        channel = get_transport("grpc").connect(address)
        try:
            request = w.RunGraphRequest(step_id=1, recv_key=keys)
            with pytest.raises(errors.InvalidArgumentError) as info:
                await channel.call(TENSOR_SERVICE, method, request, timeout=30)
        finally:
            await channel.close()
        return info.value.message

    with LocalCluster({"worker": 1}) as cluster:
        address = cluster.target("worker").partition("://")[2]
        too_many = asyncio.run(ask(address, ["k"] * (MAX_BATCH_KEYS + 1)))
        assert f"{method} asks for {MAX_BATCH_KEYS + 1} keys; ask for 1 to {MAX_BATCH_KEYS}" in too_many
        assert "ask for 1 to" in asyncio.run(ask(address, []))
        assert "Invalid rendezvous key" in asyncio.run(ask(address, ["not a key"]))
        other = f"{PS_TASK}/device:CPU:0;1;{WORKER_TASK}/device:CPU:0;x:0;0:0"
        assert "Invalid rendezvous key (src)" in asyncio.run(ask(address, [other]))
        # A request of 128 KiB or more (a thousand long keys) is read by hand as requests
        # with tensors are: its keys are checked the same.
        long = f"{PS_TASK}/device:CPU:0;1;{WORKER_TASK}/device:CPU:0;{'x' * 200}:0;0:0"
        assert len(long) * MAX_BATCH_KEYS > HAND_DECODED_REQUEST_BYTES
        assert "Invalid rendezvous key (src)" in asyncio.run(ask(address, [long] * MAX_BATCH_KEYS))
