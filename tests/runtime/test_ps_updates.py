"""A ps's optimizer updates are written into its variables' own arrays once the values
it sent to a worker have been taken: a step lets go of what another task received."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest
from google.protobuf.empty_pb2 import Empty

import distserver as ds
from distserver.protos.services import STATUS_SERVICE
from distserver.testing import LocalCluster
from distserver.transports import get_transport

STEPS = 3
SIZE = 64


def _updates(protocol: str, target: str) -> dict[str, int]:
    async def ask() -> dict[str, int]:
        channel = get_transport(protocol).connect(target.partition("://")[2])
        try:
            answer = await channel.call(STATUS_SERVICE, "GetStatistics", Empty(), timeout=30)
        finally:
            await channel.close()
        return dict(json.loads(answer.value)["optimizer_updates"])

    return asyncio.run(ask())


def _model(fetch_reads: bool) -> tuple[ds.Graph, ds.Operation, list[ds.Tensor], ds.Operation]:
    """Two variables on the ps; the worker reads them, computes a loss and its gradients;
    the ps applies momentum. With `fetch_reads`, the ps also reads both variables
    before the update, for the client: the step holds those values until it ends."""
    graph = ds.Graph()
    with graph.as_default():
        with ds.device("/job:ps/task:0"):
            a = ds.Variable(np.linspace(-1, 1, SIZE, dtype=np.float32), name="a")
            b = ds.Variable(np.full(SIZE, 0.5, np.float32), name="b")
            reads = [a.read_value(), b.read_value()] if fetch_reads else []
        with ds.device("/job:worker/task:0"):
            loss = ds.reduce_sum(ds.square(a * b - 1.0))
        with ds.device("/job:ps/task:0"), ds.control_dependencies(reads):
            train = ds.train.MomentumOptimizer(0.01, 0.9).minimize(loss)
        init = ds.global_variables_initializer()
    return graph, init, reads, train


def _expected_steps() -> list[tuple[np.ndarray, np.ndarray]]:
    """The variables before each step and after the last, computed with numpy."""
    a = np.linspace(-1, 1, SIZE, dtype=np.float32)
    b = np.full(SIZE, 0.5, np.float32)
    accum_a, accum_b = np.zeros_like(a), np.zeros_like(b)
    states = [(a.copy(), b.copy())]
    for _ in range(STEPS):
        error = a * b - np.float32(1.0)
        grad_a, grad_b = np.float32(2.0) * error * b, np.float32(2.0) * error * a
        accum_a = accum_a * np.float32(0.9) + grad_a
        accum_b = accum_b * np.float32(0.9) + grad_b
        a, b = a - np.float32(0.01) * accum_a, b - np.float32(0.01) * accum_b
        states.append((a.copy(), b.copy()))
    return states


def _train(
    protocol: str, fetch_reads: bool
) -> tuple[dict[str, int], list[list[np.ndarray]], list[np.ndarray]]:
    """STEPS steps of `_model` on a ps and a worker (one OS process each): the ps's
    optimizer updates meanwhile, by how they were written; the ps's reads each step
    fetched (with `fetch_reads`); the variables after the last step."""
    with LocalCluster({"ps": 1, "worker": 1}, protocol=protocol) as cluster:
        graph, init, reads, train = _model(fetch_reads)
        with ds.Session(cluster.target("worker"), graph=graph) as session:
            session.run(init)
            before = _updates(protocol, cluster.target("ps"))
            fetched = [session.run([reads, train])[0] if reads else session.run(train) for _ in range(STEPS)]
            after = _updates(protocol, cluster.target("ps"))
            final = session.run([graph.get_tensor_by_name(f"{name}/Read/ReadVariableOp:0") for name in "ab"])
    return {how: after[how] - before[how] for how in after}, fetched, final


@pytest.mark.parametrize("protocol", ["grpc", "grpc+verbs"])
def test_a_ps_updates_in_place_the_variables_a_worker_has_read(protocol):
    expected = _expected_steps()
    updates, _, final = _train(protocol, fetch_reads=False)
    assert updates == {"in_place": 2 * STEPS, "copied": 0}
    np.testing.assert_allclose(final[0], expected[-1][0], rtol=1e-6)
    np.testing.assert_allclose(final[1], expected[-1][1], rtol=1e-6)


def test_values_the_step_still_holds_for_its_client_are_never_written():
    # The ps's own reads, fetched: its RunGraph response is written after the update, so
    # the update must build new arrays and the client must get the values from before it.
    expected = _expected_steps()
    updates, fetched, _ = _train("grpc", fetch_reads=True)
    assert updates == {"in_place": 0, "copied": 2 * STEPS}
    for step, got in enumerate(fetched):
        np.testing.assert_allclose(got[0], expected[step][0], rtol=1e-6)
        np.testing.assert_allclose(got[1], expected[step][1], rtol=1e-6)
