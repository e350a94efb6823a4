"""The cluster coordinator: scheduling over workers, failed and hung workers, per-worker data.

Every cluster here is real: one `distserver serve` process per task (LocalCluster).
"""

from __future__ import annotations

import asyncio
import os
import queue
import signal
import threading
import time

import numpy as np
import pytest

import distserver as ds
from distserver import errors
from distserver.testing import LocalCluster, free_ports

WORKERS = 3


def counter_graph():
    """A counter on ps 0 and a value on ps 1; a step adds its feed on the running worker."""
    graph = ds.Graph()
    with graph.as_default():
        with ds.device("/job:ps/task:0"):
            total = ds.Variable(np.float64(0), name="total")
        with ds.device("/job:ps/task:1"):
            scale = ds.Variable(np.float64(2), name="scale")
        with ds.device("/job:worker"):
            x = ds.placeholder(ds.float64, shape=[], name="x")
            doubled = ds.multiply(x, scale, name="doubled")
            add = total.assign_add(x)
        init = ds.global_variables_initializer()
    return graph, total, x, doubled, add, init


def poll(condition, timeout=60.0, what="condition"):
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not happen within {timeout} s")
        time.sleep(0.05)


@pytest.fixture(scope="module")
def cluster():
    with LocalCluster({"ps": 2, "worker": WORKERS}) as local:
        yield local


# -- without a cluster -----------------------------------------------------------------


def test_join_with_nothing_scheduled_returns_at_once():
    # Nothing is contacted until a step is scheduled, so the addresses need not serve.
    with ds.ClusterCoordinator({"ps": ["localhost:1"], "worker": ["localhost:2"]}, ds.Graph()) as coordinator:
        assert coordinator.done()
        coordinator.join()
        assert coordinator.done()
        assert coordinator.available_workers() == [0]


async def test_async_join_with_nothing_scheduled_returns_at_once():
    async with ds.AsyncClusterCoordinator({"worker": ["localhost:2"]}, ds.Graph()) as coordinator:
        await coordinator.join()
        assert coordinator.done()


def test_bad_arguments_are_refused_with_a_reason():
    with pytest.raises(ValueError, match="no 'worker' job"):
        ds.ClusterCoordinator({"ps": ["localhost:1"]})
    with pytest.raises(ValueError, match=r"worker tasks 0..n-1; this cluster's are \[1\]"):
        ds.ClusterCoordinator({"worker": {1: "localhost:1"}})
    with pytest.raises(ValueError, match="device_filters"):
        ds.ClusterCoordinator({"worker": ["localhost:1"]}, config=ds.ConfigProto(device_filters=["/job:ps"]))
    with pytest.raises(ValueError, match="max_in_flight_per_worker"):
        ds.ClusterCoordinator({"worker": ["localhost:1"]}, max_in_flight_per_worker=0)
    with pytest.raises(errors.NotFoundError, match="nope"):
        ds.ClusterCoordinator({"worker": ["localhost:1"]}, protocol="nope")


def test_schedule_after_close_is_refused():
    coordinator = ds.ClusterCoordinator({"worker": ["localhost:2"]}, ds.Graph())
    coordinator.close()
    with pytest.raises(RuntimeError, match="closed"):
        coordinator.schedule("x:0")


async def test_fetch_on_the_event_loop_is_refused():
    graph = ds.Graph()
    with graph.as_default():
        ds.constant(1.0, name="one")
    # A worker that does not exist: the step fails, but fetch() refuses before waiting.
    async with ds.AsyncClusterCoordinator({"worker": ["localhost:1"]}, graph, step_timeout=1) as coordinator:
        value = coordinator.schedule("one:0")
        with pytest.raises(RuntimeError, match="await value"):
            value.fetch()


def test_queued_steps_fail_unavailable_when_no_worker_answers_for_the_wait_timeout():
    graph = ds.Graph()
    with graph.as_default():
        ds.constant(1.0, name="one")
    (port,) = free_ports(1)  # nothing listens there
    with ds.ClusterCoordinator(
        {"worker": [f"localhost:{port}"]}, graph, probe_timeout=0.5, probe_interval=0.1, worker_wait_timeout=1
    ) as coordinator:
        values = [coordinator.schedule("one:0") for _ in range(3)]
        with pytest.raises(errors.UnavailableError, match="No worker has been available for 1 s"):
            coordinator.join()
        for value in values:
            with pytest.raises(errors.UnavailableError):
                value.fetch()
        assert coordinator.available_workers() == []


# -- on a running cluster --------------------------------------------------------------


@pytest.mark.slow
def test_steps_spread_over_workers_with_correct_results(cluster):
    graph, total, x, doubled, add, init = counter_graph()
    with ds.ClusterCoordinator(cluster.cluster, graph) as coordinator:
        coordinator.schedule(init).fetch()
        # The feed function runs at dispatch: each step adds (its worker's index + 1).
        values = [coordinator.schedule(add, feed_dict=lambda i: {x: i + 1.0}) for _ in range(60)]
        coordinator.join()
        assert coordinator.done()
        workers = [v.worker for v in values]
        assert set(workers) == set(range(WORKERS)), workers
        assert all(v.attempts == 1 for v in values)
        expected = sum(w + 1.0 for w in workers)
        # assign_add's results are the running totals: distinct, the last one the sum.
        results = sorted(float(v.fetch()) for v in values)
        assert len(set(results)) == len(results)
        assert results[-1] == expected
        assert coordinator.schedule(total).fetch() == expected
        # A fixed feed: the value computed with the ps's variable.
        assert coordinator.schedule({"d": doubled}, feed_dict={x: 4.0}).fetch() == {"d": 8.0}


@pytest.mark.slow
def test_step_errors_reach_the_remote_value_and_are_not_retried(cluster):
    graph, _, x, doubled, _, init = counter_graph()
    with ds.ClusterCoordinator(cluster.cluster, graph) as coordinator:
        coordinator.schedule(init).fetch()
        unfed = coordinator.schedule(doubled)  # the placeholder is not fed: the step's own error
        wrong_shape = coordinator.schedule(doubled, feed_dict={x: [1.0, 2.0]})  # refused on the client
        feed_error = coordinator.schedule(doubled, feed_dict=lambda i: 1 / 0)

        def bad_feed(index):
            raise KeyError("no input for this worker")

        bad = coordinator.schedule(doubled, feed_dict=bad_feed)
        good = coordinator.schedule(doubled, feed_dict={x: 1.5})
        with pytest.raises(errors.InvalidArgumentError, match="must feed a value for placeholder"):
            unfed.fetch()
        with pytest.raises(ValueError, match="shape"):
            wrong_shape.fetch()
        with pytest.raises(ZeroDivisionError):
            feed_error.fetch()
        with pytest.raises(KeyError):
            bad.fetch()
        assert good.fetch() == 3.0
        for value in (unfed, wrong_shape, feed_error, bad):
            assert value.attempts == 1
            assert value.worker is None
        # join() reports the first error (whichever step failed first) once, then is clean.
        with pytest.raises((errors.InvalidArgumentError, ValueError, ZeroDivisionError, KeyError)):
            coordinator.join()
        coordinator.join()
        assert coordinator.available_workers() == list(range(WORKERS))


@pytest.mark.slow
def test_per_worker_dataset_batches_come_from_each_workers_own_shard(cluster):
    graph = ds.Graph()
    rows = np.arange(60, dtype=np.float32).reshape(30, 2)
    labels = np.arange(30, dtype=np.int64)
    with ds.ClusterCoordinator(cluster.cluster, graph) as coordinator:
        dataset = coordinator.create_per_worker_dataset((rows, labels), 4, shuffle_seed=None)
        assert dataset.shard_sizes == [10, 10, 10]
        values = [coordinator.schedule(dataset.batch) for _ in range(30)]
        coordinator.join()
        seen = {i: [] for i in range(WORKERS)}
        for value in values:
            batch_rows, batch_labels = value.fetch()
            assert batch_rows.shape == (4, 2)
            np.testing.assert_array_equal(batch_rows, rows[batch_labels])
            # Worker i's shard is rows 10*i .. 10*i+9, read in order with wrap-around.
            assert all(10 * value.worker <= label < 10 * value.worker + 10 for label in batch_labels)
            seen[value.worker].extend(batch_labels.tolist())
        for worker, labels_seen in seen.items():
            if labels_seen:
                assert set(labels_seen) == set(range(10 * worker, 10 * worker + 10)) or len(labels_seen) < 10
        # One batch from every worker at once: each from its own shard.
        per_worker = coordinator.run_on_every_worker(dataset.batch)
        assert len(per_worker) == WORKERS
        for worker, (_, batch_labels) in enumerate(per_worker):
            assert all(10 * worker <= label < 10 * worker + 10 for label in batch_labels)


def _stall_worker_until(index, released):
    """A feed function that holds the first step dispatched to worker `index` until `released`."""
    arrived = threading.Event()

    def feed(worker):
        if worker == index and not released.is_set():
            arrived.set()
            released.wait(60)
        return {}

    return feed, arrived


@pytest.mark.slow
def test_a_killed_worker_has_its_steps_rescheduled_and_is_readmitted_after_restart():
    with LocalCluster({"ps": 2, "worker": WORKERS}) as local:
        graph = ds.Graph()
        with graph.as_default():
            with ds.device("/job:ps/task:0"):
                total = ds.Variable(np.float64(0), name="total")
            with ds.device("/job:worker"):
                add = total.assign_add(np.float64(1))
            init = ds.global_variables_initializer()
        released = threading.Event()
        feed, arrived = _stall_worker_until(1, released)
        with ds.ClusterCoordinator(local.cluster, graph, step_timeout=10) as coordinator:
            dataset = coordinator.create_per_worker_dataset(
                np.arange(9, dtype=np.int64), 1, shuffle_seed=None
            )
            coordinator.schedule(init).fetch()
            values = [coordinator.schedule(add, feed_dict=feed) for _ in range(40)]
            assert arrived.wait(60)
            local.kill("worker", 1)  # kill -9, with a step of its own about to run
            released.set()
            coordinator.join()
            assert all(v.done() for v in values)
            moved = [v for v in values if v.attempts > 1]
            assert moved, "no step was rescheduled"
            assert all(v.worker != 1 for v in moved)
            assert {v.worker for v in values} >= {0, 2}
            assert 1 not in coordinator.available_workers()
            # At least once: every step ran; one cut off mid-step may have added too.
            count = coordinator.schedule(total).fetch()
            assert 40 <= count <= 40 + sum(v.attempts - 1 for v in values)

            local.restart("worker", 1)
            poll(lambda: 1 in coordinator.available_workers(), what="worker 1's re-admission")
            # It got its shard again (rows 3..5) and a new session: it runs steps.
            batches = [coordinator.schedule(dataset.batch) for _ in range(30)]
            coordinator.join()
            on_1 = [int(b.fetch()[0][0]) for b in batches if b.worker == 1]
            assert on_1, [b.worker for b in batches]
            assert set(on_1) <= {3, 4, 5}


@pytest.mark.slow
def test_a_hung_worker_is_detected_bypassed_and_readmitted_when_it_answers():
    with LocalCluster({"ps": 1, "worker": WORKERS}) as local:
        graph = ds.Graph()
        with graph.as_default():
            with ds.device("/job:ps/task:0"):
                total = ds.Variable(np.float64(0), name="total")
            with ds.device("/job:worker"):
                add = total.assign_add(np.float64(1))
            init = ds.global_variables_initializer()
        released = threading.Event()
        feed, arrived = _stall_worker_until(2, released)
        pid = local.process("worker", 2).pid
        try:
            with ds.ClusterCoordinator(
                local.cluster, graph, step_timeout=2, probe_timeout=1, probe_interval=0.5
            ) as coordinator:
                coordinator.schedule(init).fetch()
                values = [coordinator.schedule(add, feed_dict=feed) for _ in range(30)]
                assert arrived.wait(60)
                os.kill(pid, signal.SIGSTOP)  # alive, port open, silent
                released.set()
                coordinator.join()
                moved = [v for v in values if v.attempts > 1]
                assert moved, "no step was rescheduled"
                assert all(v.worker in (0, 1) for v in moved)
                assert 2 not in coordinator.available_workers()
                os.kill(pid, signal.SIGCONT)
                poll(lambda: 2 in coordinator.available_workers(), what="worker 2's re-admission")
                more = [coordinator.schedule(add) for _ in range(30)]
                coordinator.join()
                assert 2 in {v.worker for v in more}
        finally:
            os.kill(pid, signal.SIGCONT)


@pytest.mark.slow
def test_a_ps_failure_is_reported_as_unavailable_and_not_retried():
    with LocalCluster({"ps": 1, "worker": 2}) as local:
        graph, x, add, init = counter_graph_one_ps()
        with ds.ClusterCoordinator(local.cluster, graph, step_timeout=10) as coordinator:
            coordinator.schedule(init).fetch()
            assert coordinator.schedule(add, feed_dict={x: 1.0}).fetch() == 1.0
            local.kill("ps")
            value = coordinator.schedule(add, feed_dict={x: 1.0})
            with pytest.raises(errors.UnavailableError):
                value.fetch()
            assert value.attempts == 1
            # The workers answer: they stay in service.
            assert coordinator.available_workers() == [0, 1]
            with pytest.raises(errors.UnavailableError):
                coordinator.join()


def counter_graph_one_ps():
    graph = ds.Graph()
    with graph.as_default():
        with ds.device("/job:ps/task:0"):
            total = ds.Variable(np.float64(0), name="total")
        with ds.device("/job:worker"):
            x = ds.placeholder(ds.float64, shape=[], name="x")
            add = total.assign_add(x)
        init = ds.global_variables_initializer()
    return graph, x, add, init


@pytest.mark.slow
def test_the_async_and_blocking_faces_give_the_same_results(cluster):
    graph = ds.Graph()
    data = np.arange(24, dtype=np.float32).reshape(12, 2)
    weights = np.array([[1.0], [-2.0]], np.float32)
    with graph.as_default():
        with ds.device("/job:ps/task:1"):
            w = ds.Variable(weights, name="w")
        with ds.device("/job:worker"):
            x = ds.placeholder(ds.float32, shape=[None, 2], name="x")
            y = ds.matmul(x, w)
        init = ds.global_variables_initializer()
    feeds = [np.full((1, 2), k, np.float32) for k in range(12)]

    def per_worker_product(dataset):
        with graph.as_default(), ds.device("/job:worker"):
            return [dataset.batch[0], ds.matmul(dataset.batch[0], w)]

    with ds.ClusterCoordinator(cluster.cluster, graph) as coordinator:
        coordinator.schedule(init).fetch()
        blocking = [coordinator.schedule(y, feed_dict={x: f}).fetch() for f in feeds]
        dataset = coordinator.create_per_worker_dataset(data, 2, shuffle_seed=None, name="blocking")
        fetches = per_worker_product(dataset)
        blocking_batches = [v.fetch() for v in [coordinator.schedule(fetches) for _ in range(9)]]

    async def run_async():
        async with ds.AsyncClusterCoordinator(cluster.cluster, graph) as c:
            results = [await c.schedule(y, feed_dict={x: f}) for f in feeds]
            dataset = await c.create_per_worker_dataset(data, 2, shuffle_seed=None, name="async")
            fetches = per_worker_product(dataset)
            values = [c.schedule(fetches) for _ in range(9)]
            await c.join()
            return results, [await v for v in values]

    async_results, async_batches = asyncio.run(run_async())
    assert [r.tolist() for r in async_results] == [r.tolist() for r in blocking]
    assert [r.tolist() for r in blocking] == [(f @ weights).tolist() for f in feeds]
    # Batches: 2 rows of one worker's shard (rows 4i..4i+3), and their product with w.
    shard_batches = {tuple(data[s : s + 2].ravel()) for s in range(0, 12, 2)}
    for rows, product in blocking_batches + async_batches:
        assert tuple(rows.ravel()) in shard_batches
        np.testing.assert_array_equal(product, rows @ weights)


@pytest.mark.slow
@pytest.mark.parametrize("bound", [1, 2])
def test_no_worker_runs_more_steps_at_once_than_the_bound(cluster, bound):
    graph = ds.Graph()
    with graph.as_default(), ds.device("/job:worker"):
        one = ds.constant(1.0, name="one")
    release = threading.Event()
    dispatched = []
    lock = threading.Lock()

    def feed(worker):
        with lock:
            dispatched.append(worker)
        release.wait(60)
        return {}

    single = {"ps": cluster.cluster["ps"], "worker": cluster.cluster["worker"][:1]}
    with ds.ClusterCoordinator(single, graph, max_in_flight_per_worker=bound) as coordinator:
        values = [coordinator.schedule(one, feed_dict=feed) for _ in range(4)]
        poll(lambda: len(dispatched) >= bound, what=f"{bound} dispatches")
        time.sleep(0.2)  # room for a wrong extra dispatch to show (no timing is asserted)
        assert len(dispatched) == bound
        assert not coordinator.done()
        release.set()
        coordinator.join()
        assert [v.fetch() for v in values] == [1.0] * 4
        assert dispatched == [0] * 4


@pytest.mark.slow
def test_the_coordinator_connects_over_grpc_verbs():
    with LocalCluster({"ps": 1, "worker": 2}, protocol="grpc+verbs") as local:
        graph = ds.Graph()
        with graph.as_default():
            with ds.device("/job:ps/task:0"):
                big = ds.Variable(np.ones(100_000, np.float32), name="big")
            with ds.device("/job:worker"):
                total = ds.reduce_sum(big * 2.0)
            init = ds.global_variables_initializer()
        with ds.ClusterCoordinator(local.cluster, graph, protocol="grpc+verbs") as coordinator:
            coordinator.schedule(init).fetch()
            values = [coordinator.schedule(total) for _ in range(6)]
            coordinator.join()
            assert [float(v.fetch()) for v in values] == [200_000.0] * 6
            assert {v.worker for v in values} == {0, 1}


@pytest.mark.slow
def test_a_step_that_fails_worker_after_worker_is_not_rescheduled_forever():
    with LocalCluster({"worker": 1}) as local:
        graph = ds.Graph()
        with graph.as_default():
            ds.constant(1.0, name="one")
        killed = queue.Queue()

        def kill_my_worker(worker):
            local.kill("worker", worker)  # the worker dies as each attempt starts
            killed.put(worker)
            return {}

        with ds.ClusterCoordinator(local.cluster, graph, probe_interval=0.2) as coordinator:
            doomed = coordinator.schedule("one:0", feed_dict=kill_my_worker)
            for _ in range(2):  # 2 attempts per worker, 1 worker
                # Restarted from this thread: a task dies with the thread that started it.
                local.restart("worker", killed.get(timeout=60))
            with pytest.raises(errors.UnavailableError):
                doomed.fetch()
            assert doomed.attempts == 2
            poll(lambda: coordinator.available_workers() == [0], what="the worker's re-admission")
            assert coordinator.schedule("one:0").fetch() == 1.0
            assert killed.empty()
            with pytest.raises(errors.UnavailableError):
                coordinator.join()
