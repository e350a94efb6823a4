"""An optimizer's sparse update of rows named more than once made one node when a
worker registers a graph (`runtime.fusion.fuse_deduplicated_sparse_updates`): the
same training bit for bit, in one task and on a parameter server, and no fusion
where another node could see the inner values."""

from __future__ import annotations

from typing import Any

import numpy as np

import distserver as ds
from distserver.kernels.sparse import DEDUPLICATED_SPARSE_UPDATE_OP
from distserver.protos.graph_pb2 import GraphDef
from distserver.protos.node_def_pb2 import NodeDef
from distserver.runtime import worker as worker_module
from distserver.runtime.executor import Executor
from distserver.runtime.fusion import fuse_deduplicated_sparse_updates
from distserver.testing import LocalCluster
from tests.runtime.conftest import assert_same_training

F32 = np.float32


def _model(device: Any = None) -> tuple[ds.Graph, Any, Any, Any, Any]:
    """An embedding over two shards, trained with Adagrad: (graph, init, train, loss, ids)."""
    rng = np.random.default_rng(3)
    with ds.Graph().as_default() as graph, ds.device(device):
        ids = ds.placeholder(ds.int64, [16, 3], name="ids")
        shards = [ds.Variable(rng.standard_normal((51, 4)).astype(F32), name=f"table_{i}") for i in range(2)]
        rows = ds.embedding_lookup(shards, ids)
        loss = ds.reduce_sum(ds.square(ds.reduce_mean(rows, axis=1) - 1.0), name="loss")
        train = ds.train.AdagradOptimizer(0.5).minimize(loss)
        init = ds.global_variables_initializer()
    return graph, init, train, loss, ids


def _fused_updates(executor: Executor) -> list[str]:
    return [node.kernel.name for node in executor._nodes if node.kernel.op == DEDUPLICATED_SPARSE_UPDATE_OP]


def _train(target: str, model: tuple[Any, ...], feeds: list[Any]) -> Any:
    graph, init, train, loss, ids = model
    config = ds.ConfigProto(isolate_session_state=True)
    with ds.Session(target, graph=graph, config=config) as session:
        session.run(init)
        losses = [session.run([train, loss], {ids: i})[1] for i in feeds]
        with graph.as_default():
            return losses, session.run(ds.global_variables())


def _feeds() -> list[Any]:
    rng = np.random.default_rng(4)
    # (ids repeat within a step: each shard's update sums rows of the same id)
    return [rng.integers(0, 40, (16, 3)) for _ in range(4)]


def test_an_embeddings_sparse_updates_run_as_one_node_a_shard_with_the_same_bits(
    server, monkeypatch, executors
):
    fused = _train(server.target, _model(), _feeds())
    step = max(executors, key=lambda e: len(_fused_updates(e)))
    assert sorted(_fused_updates(step)) == [
        "Adagrad/update_table_0/ResourceSparseApplyAdagrad",
        "Adagrad/update_table_1/ResourceSparseApplyAdagrad",
    ]
    monkeypatch.setattr(worker_module, "fuse_deduplicated_sparse_updates", lambda graph_def: graph_def)
    executors.clear()
    unfused = _train(server.target, _model(), _feeds())
    assert not any(_fused_updates(e) for e in executors)
    assert_same_training(fused, unfused, 4)


def test_a_parameter_servers_updates_are_fused_with_the_same_bits(server, monkeypatch):
    # The variables and their updates on the ps (a task of its own), the lookup and the
    # gradient on the worker: the ps's partition has both chains, fed by receives.
    device = ds.replica_device_setter(ps_tasks=1, worker_device="/job:worker/task:0")
    placed = _model(device)
    fused = [
        node.device
        for node in fuse_deduplicated_sparse_updates(placed[0].as_graph_def()).node
        if node.op == DEDUPLICATED_SPARSE_UPDATE_OP
    ]
    assert fused == ["/job:ps/task:0"] * 2
    with LocalCluster({"ps": 1, "worker": 1}) as cluster:
        on_ps = _train(cluster.target("worker"), placed, _feeds())
    monkeypatch.setattr(worker_module, "fuse_deduplicated_sparse_updates", lambda graph_def: graph_def)
    unfused = _train(server.target, _model(), _feeds())
    assert_same_training(on_ps, unfused, 4)


def _graph_def() -> GraphDef:
    return _model()[0].as_graph_def()


def _fused_names(graph_def: GraphDef) -> list[str]:
    return sorted(
        node.name
        for node in fuse_deduplicated_sparse_updates(graph_def).node
        if node.op == DEDUPLICATED_SPARSE_UPDATE_OP
    )


def test_the_fused_node_takes_the_updates_name_inputs_and_waits():
    graph_def = _graph_def()
    nodes = {node.name: node for node in graph_def.node}
    update = nodes["Adagrad/update_table_0/ResourceSparseApplyAdagrad"]
    update.input.append("^loss")  # (a control input of a part: the node waits for it)
    fused = {node.name: node for node in fuse_deduplicated_sparse_updates(graph_def).node}
    node = fused[update.name]
    assert node.op == DEDUPLICATED_SPARSE_UPDATE_OP
    scope = "Adagrad/update_table_0/"
    for inner in ("Unique", "Shape", "strided_slice", "UnsortedSegmentSum"):
        assert scope + inner in nodes
        assert scope + inner not in fused
    assert list(node.input[2:5]) == list(update.input[:3])
    assert "^loss" in node.input
    assert [NodeDef.FromString(data).op for data in node.attr["_fused_nodes"].list.s] == [
        "Unique",
        "Shape",
        "StridedSlice",
        "UnsortedSegmentSum",
        "ResourceSparseApplyAdagrad",
    ]


def test_no_fusion_where_another_node_sees_an_inner_value():
    assert len(_fused_names(_graph_def())) == 2
    for change in ("reader", "control", "device", "switch"):
        graph_def = _graph_def()
        nodes = {node.name: node for node in graph_def.node}
        unique = nodes["Adagrad/update_table_0/Unique"]
        if change == "reader":  # the distinct ids read elsewhere
            graph_def.node.add(name="peek", op="Identity", input=[unique.name]).attr["T"].CopyFrom(
                unique.attr["T"]
            )
        elif change == "control":  # something waits for the sum
            graph_def.node.add(name="after", op="NoOp", input=["^Adagrad/update_table_0/UnsortedSegmentSum"])
        elif change == "device":
            unique.device = "/job:localhost/replica:0/task:0/device:CPU:1"
        else:  # TF 1.x control flow anywhere in the graph
            graph_def.node.add(name="switch", op="Switch", input=["loss", "loss"])
        expected = [] if change == "switch" else ["Adagrad/update_table_1/ResourceSparseApplyAdagrad"]
        assert _fused_names(graph_def) == expected, change
