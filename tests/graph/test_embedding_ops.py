"""Tests of the ops the training benchmark's own client needed: `random_uniform`,
`log1p`, `sigmoid_cross_entropy_with_logits`, `dynamic_partition`, `dynamic_stitch`
and `embedding_lookup` over sharded tables (TensorFlow 2's "div" partitioning).

Values are checked on a local server against numpy; graphs against what TensorFlow
2.21's `tf.compat.v1` builds (node types, seeds, placement).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import numpy as np
import pytest

import distserver as ds


@pytest.fixture(scope="module")
def server() -> Iterator[ds.Server]:
    with ds.Server.create_local_server() as server:
        yield server


def _run(server: ds.Server, graph: ds.Graph, fetches, feeds=None):
    with graph.as_default():
        init = ds.global_variables_initializer()
    with ds.Session(server.target, graph=graph) as session:
        session.run(init)
        return session.run(fetches, feeds)


def test_random_uniform_with_a_seed_has_tensorflows_seeds_and_repeats(server):
    graph = ds.Graph()
    with graph.as_default():
        seeded = ds.random_uniform([50, 4], -0.05, 0.05, seed=5)
        again = ds.random_uniform([50, 4], -0.05, 0.05, seed=5)
        fresh = ds.random_uniform([50, 4])
    drawn = graph.get_operation_by_name("random_uniform/RandomUniform")
    assert (drawn.get_attr("seed"), drawn.get_attr("seed2")) == (87654321, 5)
    assert [op.type for op in drawn.outputs[0].consumers()] == ["Mul"]
    assert (seeded.op.type, seeded.op.name) == ("AddV2", "random_uniform")
    assert (seeded.shape, seeded.dtype) == ((50, 4), np.float32)
    unseeded = graph.get_operation_by_name("random_uniform_2/RandomUniform")
    assert (unseeded.get_attr("seed"), unseeded.get_attr("seed2")) == (0, 0)
    a, b, c = _run(server, graph, [seeded, again, fresh])
    np.testing.assert_array_equal(a, b)  # same seeds, same numbers
    assert -0.05 <= a.min() < a.max() < 0.05
    assert a.std() > 0.01
    assert 0.0 <= c.min() < c.max() < 1.0


def test_random_uniform_refuses_integer_dtypes():
    with ds.Graph().as_default(), pytest.raises(TypeError, match="draws floats"):
        ds.random_uniform([3], 0, 10, dtype=ds.int32)


def test_log1p_and_sigmoid_cross_entropy_match_numpy(server):
    logits = np.array([-80.0, -2.5, -1e-3, 0.0, 0.7, 3.0, 90.0], np.float32)
    labels = np.array([0.0, 1.0, 0.5, 1.0, 0.0, 1.0, 0.0], np.float32)
    graph = ds.Graph()
    with graph.as_default():
        x = ds.placeholder(ds.float32, [7])
        z = ds.placeholder(ds.float32, [7])
        loss = ds.sigmoid_cross_entropy_with_logits(labels=z, logits=x)
        grad_x, grad_z = ds.gradients(ds.reduce_sum(loss), [x, z])
        small = ds.log1p(ds.constant([1e-10, 1.0], ds.float64))
    values, gx, gz, tiny = _run(server, graph, [loss, grad_x, grad_z, small], {x: logits, z: labels})
    x64, z64 = logits.astype(np.float64), labels.astype(np.float64)
    expected = np.maximum(x64, 0) - x64 * z64 + np.log1p(np.exp(-np.abs(x64)))
    np.testing.assert_allclose(values, expected, rtol=1e-6, atol=1e-7)  # finite at +-80: no overflow
    np.testing.assert_allclose(gx, 1 / (1 + np.exp(-x64)) - z64, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(gz, -x64, rtol=1e-6)
    np.testing.assert_allclose(tiny, np.log1p([1e-10, 1.0]), rtol=1e-15)  # not log(1 + 1e-10)
    assert (loss.op.name, loss.op.type) == ("logistic_loss", "AddV2")


def test_sigmoid_cross_entropy_refuses_different_shapes():
    with ds.Graph().as_default(), pytest.raises(ValueError, match="logistic_loss"):
        ds.sigmoid_cross_entropy_with_logits(labels=np.zeros(3, np.float32), logits=np.zeros(4, np.float32))


def test_dynamic_partition_and_stitch_are_inverses(server):
    data = np.arange(12, dtype=np.float32).reshape(6, 2)
    parts = np.array([1, 0, 2, 1, 1, 0], np.int32)
    graph = ds.Graph()
    with graph.as_default():
        pieces = ds.dynamic_partition(data, parts, 3)
        positions = ds.dynamic_partition(np.arange(6, dtype=np.int32), parts, 3)
        back = ds.dynamic_stitch(positions, pieces)
    assert [p.shape for p in pieces] == [(None, 2)] * 3
    assert (back.op.type, back.shape) == ("DynamicStitch", (None, 2))
    got = _run(server, graph, [*pieces, back])
    for i in range(3):
        np.testing.assert_array_equal(got[i], data[parts == i])
    np.testing.assert_array_equal(got[3], data)


def test_partition_and_stitch_check_their_arguments():
    with ds.Graph().as_default():
        with pytest.raises(ValueError, match="num_partitions"):
            ds.dynamic_partition([1.0], [0], 0)
        with pytest.raises(ValueError, match="as many data tensors"):
            ds.dynamic_stitch([[0]], [])


@pytest.mark.parametrize("rows", [[4, 3, 3], [5, 5], [7]])
def test_embedding_lookup_of_shards_is_a_lookup_of_the_whole_table(server, rows):
    # "div": shard i holds the next block of rows, the first shards one more when uneven.
    total = sum(rows)
    table = np.arange(total * 3, dtype=np.float32).reshape(total, 3)
    ids = np.array([[0, total - 1, 4], [3, 3, 6]], np.int64)
    graph = ds.Graph()
    with graph.as_default():
        with ds.device("/job:localhost/replica:0/task:0"):
            starts = np.cumsum([0, *rows])
            shards = [
                ds.Variable(table[a:b], name=f"part_{i}")
                for i, (a, b) in enumerate(itertools.pairwise(starts))
            ]
        looked_up = ds.embedding_lookup(shards, ids)
        grads = ds.gradients(ds.reduce_sum(looked_up * 2.0), shards)
    assert looked_up.shape == (2, 3, 3)
    gathers = [op for op in graph.get_operations() if op.type == "ResourceGather"]
    assert len(gathers) == len(rows)
    assert all(op.device == shard.device for op, shard in zip(gathers, shards, strict=True))
    got, *grad_values = _run(server, graph, [looked_up, *[(g.values, g.indices) for g in grads]])
    np.testing.assert_array_equal(got, table[ids])
    # Sparse gradients: each shard gets 2.0 for each of its rows looked up (local row numbers).
    for shard_rows, start, (values, indices) in zip(rows, starts[:-1], grad_values, strict=True):
        dense = np.zeros((shard_rows, 3), np.float32)
        np.add.at(dense, indices, values)
        wanted = np.zeros((shard_rows, 3), np.float32)
        for i in ids.ravel():
            if start <= i < start + shard_rows:
                wanted[i - start] += 2.0
        np.testing.assert_array_equal(dense, wanted)


def test_embedding_lookup_places_each_gather_on_its_shard_and_the_rest_on_the_worker():
    graph = ds.Graph()
    with (
        graph.as_default(),
        ds.device(ds.replica_device_setter(ps_tasks=2, worker_device="/job:worker/task:0")),
    ):
        shards = [ds.Variable(np.zeros((10, 4), np.float32), name=f"part_{i}") for i in range(2)]
        ids = ds.placeholder(ds.int64, [None], name="ids")
        rows = ds.embedding_lookup(shards, ids)
    assert rows.shape == (None, 4)
    devices = {op.type: op.device for op in graph.get_operations() if op.name.startswith("embedding_lookup")}
    assert [op.device for op in graph.get_operations() if op.type == "ResourceGather"] == [
        "/job:ps/task:0",
        "/job:ps/task:1",
    ]
    assert devices["DynamicPartition"] == devices["ParallelDynamicStitch"] == "/job:worker/task:0"


def test_embedding_lookup_checks_its_shards():
    with ds.Graph().as_default():
        with pytest.raises(ValueError, match="at least one shard"):
            ds.embedding_lookup([], [0])
        with pytest.raises(ValueError, match="static shapes"):
            ds.embedding_lookup([ds.placeholder(ds.float32, [None, 2]), ds.zeros([3, 2])], [0])
        with pytest.raises(ValueError, match="differ in shape or dtype"):
            ds.embedding_lookup([ds.zeros([3, 2]), ds.zeros([3, 5])], [0])
        with pytest.raises(ValueError, match="only 1 rows"):
            ds.embedding_lookup([ds.zeros([1, 2]), ds.zeros([0, 2])], [0])
