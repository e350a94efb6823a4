"""Connected groups of light nodes run as one node (`executor._fuse_regions`,
`kernels.regions.FusedRegionKernel`): the same bits as the nodes one by one, errors
naming the part, values let go after their last reader, the pool for large values,
and no group that would wait for itself, in the graph or across partitions."""

from __future__ import annotations

import collections
import importlib.util
import itertools
import tracemalloc
import types
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import distserver as ds
from distserver import errors
from distserver.kernels import _compiled, create_kernel, region_plans
from distserver.kernels import regions as regions_module
from distserver.kernels.math import FUSED_NODES_ATTR
from distserver.kernels.regions import FUSED_REGION_OP, FusedRegionKernel
from distserver.kernels.sendrecv import RECEIVES_FIRST_ATTR
from distserver.protos.graph_pb2 import GraphDef
from distserver.protos.node_def_pb2 import NodeDef
from distserver.protos.types_pb2 import DT_DOUBLE, DT_FLOAT, DT_INT32, DT_INT64
from distserver.runtime import executor as executor_module
from distserver.runtime.executor import Executor
from tests.runtime.conftest import assert_same_training

F32 = np.float32
HERE = "/job:localhost/replica:0/task:0"
PS = "/job:ps/replica:0/task:0"


def _regions(executor: Executor) -> list[list[str]]:
    """Each fused region's parts, by name, in order."""
    return [
        [NodeDef.FromString(data).name for data in node.kernel.node.attr[FUSED_NODES_ATTR].list.s]
        for node in executor._nodes
        if not node.left_out and node.kernel.op == FUSED_REGION_OP
    ]


def _embedding_model() -> tuple[ds.Graph, Any, Any, Any, Any, Any]:
    """An embedding lookup over two shards and a logistic loss, trained with Adagrad: its
    ids split by shard and its loss are groups of element-wise nodes. (graph, init,
    train, loss, ids, labels)"""
    rng = np.random.default_rng(3)
    with ds.Graph().as_default() as graph:
        ids = ds.placeholder(ds.int64, [16, 3], name="ids")
        labels = ds.placeholder(ds.float32, [16], name="labels")
        shards = [ds.Variable(rng.standard_normal((51, 4)).astype(F32), name=f"table_{i}") for i in range(2)]
        rows = ds.embedding_lookup(shards, ids)
        logit = ds.squeeze(ds.matmul(ds.reduce_mean(rows, axis=1), ds.Variable(np.ones((4, 1), F32))), 1)
        loss = ds.reduce_mean(ds.sigmoid_cross_entropy_with_logits(labels=labels, logits=logit), name="loss")
        train = ds.train.AdagradOptimizer(0.5).minimize(loss)
        init = ds.global_variables_initializer()
    return graph, init, train, loss, ids, labels


def _train(server: ds.Server, model: tuple[Any, ...], feeds: list[tuple[Any, Any]]) -> Any:
    graph, init, train, loss, ids, labels = model
    config = ds.ConfigProto(isolate_session_state=True)  # (each session its own variables)
    with ds.Session(server.target, graph=graph, config=config) as session:
        session.run(init)
        losses = [session.run([train, loss], {ids: i, labels: y})[1] for i, y in feeds]
        with graph.as_default():
            return losses, session.run(ds.global_variables())


def test_groups_of_element_wise_nodes_run_as_one_node_with_the_same_bits(server, monkeypatch, executors):
    rng = np.random.default_rng(4)
    feeds = [(rng.integers(0, 102, (16, 3)), rng.integers(0, 2, 16).astype(F32)) for _ in range(4)]
    model = _embedding_model()
    fused = _train(server, model, feeds)
    step = max(executors, key=lambda e: len(_regions(e)))
    regions = _regions(step)
    by_last = {parts[-1]: parts for parts in regions}
    # The ids' split by shard ("div": a floor division, a remainder, a comparison, a
    # select, ...) and the loss with most of its gradient.
    split = next(parts for parts in regions if any("FloorMod" in name for name in parts))
    assert len(split) >= 8
    assert all(name.startswith("embedding_lookup/") for name in split)
    assert any("logistic_loss" in name for parts in by_last.values() for name in parts)
    assert all(len(parts) >= executor_module.REGION_MIN_NODES for parts in regions)
    # The same steps with every node on its own: the same bits.
    monkeypatch.setattr(executor_module, "_fuse_regions", lambda nodes, control_sources: None)
    assert_same_training(fused, _train(server, model, feeds), len(feeds))


def test_a_part_that_fails_is_named_by_its_part(server, executors):
    with ds.Graph().as_default() as graph:
        x = ds.placeholder(ds.int64, [4], name="x")
        y = ds.placeholder(ds.int64, [], name="y")
        quotient = ds.floordiv(x + 1, y, name="quotient")
        out = ds.maximum(quotient - 1, ds.negative(x), name="out")
    with ds.Session(server.target, graph=graph) as session:
        value = session.run(out, {x: np.arange(4), y: np.int64(2)})
        np.testing.assert_array_equal(value, [0, 0, 0, 1])
        with pytest.raises(errors.InvalidArgumentError, match="Integer division by zero") as raised:
            session.run(out, {x: np.arange(4), y: np.int64(0)})
    assert raised.value.node_name == "quotient"
    assert any("quotient" in parts and "out" in parts for e in executors for parts in _regions(e))


def _node(name: str, op: str, *inputs: str, dtype: int = DT_FLOAT) -> NodeDef:
    node = NodeDef(name=name, op=op, input=list(inputs))
    node.attr["T"].type = dtype
    return node


def _const(name: str, value: np.ndarray) -> NodeDef:
    from distserver.tensors import to_tensor_proto

    node = NodeDef(name=name, op="Const")
    node.attr["dtype"].type = DT_FLOAT
    node.attr["value"].tensor.CopyFrom(to_tensor_proto(value))
    return node


def _placeholder(name: str) -> NodeDef:
    node = NodeDef(name=name, op="Placeholder")
    node.attr["dtype"].type = DT_FLOAT
    return node


def _x_to_c() -> list[NodeDef]:
    """A placeholder x and a chain of three light nodes from it: a, b, c."""
    return [_placeholder("x"), _node("a", "Neg", "x"), _node("b", "Exp", "a"), _node("c", "Square", "b")]


def test_a_group_never_waits_for_a_value_made_from_its_own():
    # a -> b -> c is a group, but d reads c through a product that is not fusable, and d
    # reads a: with the group, d would wait for it while it waited for d.
    graph_def = GraphDef()
    graph_def.node.extend(
        [
            *_x_to_c(),
            _node("product", "MatMul", "c", "c"),
            _node("d", "AddV2", "a", "product"),
            _node("e", "Neg", "d"),
            _node("f", "Abs", "e"),
        ]
    )
    executor = Executor(graph_def)
    assert _regions(executor) == [["a", "b", "c"], ["d", "e", "f"]]


def _transfer(name: str, op: str, source: str | None, task: str) -> NodeDef:
    """A `_Send` of `source` to `task`, or a `_Recv` from it (marked as the master's
    planner marks the receives of a step without a Switch: never dead)."""
    node = NodeDef(name=name, op=op, input=[source] if source else [])
    if op == "_Recv":
        node.attr[RECEIVES_FIRST_ATTR].b = True
    node.attr["T" if op == "_Send" else "tensor_type"].type = DT_FLOAT
    local, remote = f"{HERE}/device:CPU:0".encode(), f"{task}/device:CPU:0".encode()
    node.attr["send_device"].s = local if op == "_Send" else remote
    node.attr["recv_device"].s = remote if op == "_Send" else local
    node.attr["send_device_incarnation"].i = 1
    node.attr["tensor_name"].s = name.encode()
    return node


def test_a_group_holds_no_send_back_for_a_receive_it_did_not_wait_for():
    # a, b, c (and h) feed the ps; d, e, f need its answer, which may need a value that
    # a, b, c or h send. In one group, the sends would wait for the answer.
    graph_def = GraphDef()
    graph_def.node.extend(
        [
            *_x_to_c(),
            _transfer("to_ps", "_Send", "c", PS),
            _transfer("from_ps", "_Recv", None, PS),
            _node("d", "Mul", "from_ps", "c"),
            _node("e", "Neg", "d"),
            _node("f", "Abs", "e"),
            _node("h", "Exp", "c"),
            _transfer("h_to_ps", "_Send", "h", PS),
            _transfer("fetch", "_Send", "f", PS),
        ]
    )
    assert sorted(_regions(Executor(graph_def))) == [["a", "b", "c", "h"], ["d", "e", "f"]]
    # A group may feed a send that already waited for every receive it waits for: d, e,
    # f and g (sent, after the answer) are one group.
    graph_def.node.extend([_node("g", "Neg", "d"), _transfer("g_to_ps", "_Send", "g", PS)])
    assert sorted(_regions(Executor(graph_def))) == [["a", "b", "c", "h"], ["d", "e", "g", "f"]]


def test_values_from_constants_alone_are_left_to_constant_folding():
    graph_def = GraphDef()
    graph_def.node.extend(
        [
            _const("k", np.arange(4, dtype=F32)),
            _node("k2", "Mul", "k", "k"),
            _node("k3", "Neg", "k2"),
            _placeholder("x"),
            _node("a", "AddV2", "x", "k3"),
            _node("b", "Exp", "a"),
            _node("c", "Square", "b"),
        ]
    )
    executor = Executor(graph_def)
    assert _regions(executor) == [["a", "b", "c"]]
    assert {executor._nodes[i].kernel.name for i in executor._folded} == {"k2", "k3"}


def _region_node(parts: list[NodeDef], wiring: list[int], outputs: list[int], inputs: int) -> NodeDef:
    node = NodeDef(name="region", op=FUSED_REGION_OP)
    node.attr["N"].i = inputs
    node.attr["M"].i = len(outputs)
    node.attr["wiring"].list.i.extend(wiring)
    node.attr["outputs"].list.i.extend(outputs)
    node.attr[FUSED_NODES_ATTR].list.s.extend(part.SerializeToString() for part in parts)
    return node


def test_a_region_node_a_graph_names_itself_is_checked():
    neg, square = _node("neg", "Neg", "x"), _node("square", "Square", "neg")
    kernel = create_kernel(_region_node([neg, square], [0, -1], [1], 1))
    np.testing.assert_array_equal(kernel.compute(None, [np.array([2.0], F32)])[0], [4.0])
    bad = {
        "a part that is not light": _region_node([_node("product", "MatMul", "x", "x")], [0, 0], [0], 1),
        "a part reading a later one": _region_node([neg, square], [-2, -1], [1], 1),
        "a part reading itself": _region_node([neg, square], [0, -2], [1], 1),
        "an input out of range": _region_node([neg, square], [3, -1], [1], 1),
        "an output out of range": _region_node([neg, square], [0, -1], [2], 1),
        "fewer wires than inputs": _region_node([neg, square], [0], [1], 1),
        "no parts": _region_node([], [], [], 0),
        "a region in a region": _region_node([_region_node([neg, square], [0, -1], [1], 1)], [0], [0], 1),
    }
    for what, node in bad.items():
        node.attr["M"].i = len(node.attr["outputs"].list.i)
        with pytest.raises(errors.InvalidArgumentError, match="region") as raised:
            create_kernel(node)
        assert raised.value.node_name == "region", what
    wrong_count = _region_node([neg, square], [0, -1], [1], 1)
    wrong_count.attr["M"].i = 2
    with pytest.raises(errors.InvalidArgumentError, match="M = 2"):
        create_kernel(wrong_count)


def test_values_are_let_go_after_their_last_reader():
    # Four parts of 8 MB values: one by one, at most two of them (an input and an output)
    # and the node's own input live at once.
    parts = [_node("a", "Neg", "x"), _node("b", "Exp", "a"), _node("c", "Square", "b")]
    parts.append(_node("d", "Abs", "c"))
    kernel = create_kernel(_region_node(parts, [0, -1, -2, -3], [3], 1))
    x = np.ones(2 << 20, F32)
    tracemalloc.start()
    try:
        (out,) = kernel.compute(None, [x])
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert out.nbytes == x.nbytes
    assert peak < 2.5 * x.nbytes  # (all four kept would be 4 x)


def test_a_region_whose_values_grow_goes_to_the_pool():
    # A broadcast inside the region: its inputs are small, its values are not.
    column, row = np.ones((1024, 1), F32), np.ones((1, 1024), F32)
    parts = [_node("outer", "Mul", "column", "row"), _node("b", "Exp", "outer"), _node("c", "Neg", "b")]
    kernel = create_kernel(_region_node(parts, [0, 1, -1, -2], [2], 2))
    kernel.compute(None, [column, row])
    assert executor_module._large(kernel, [column, row])
    small = create_kernel(_region_node(parts, [0, 1, -1, -2], [2], 2))
    small.compute(None, [column[:8], row[:, :8]])
    assert not executor_module._large(small, [column[:8], row[:, :8]])


def test_a_graph_that_may_see_dead_values_has_no_regions():
    graph_def = GraphDef()
    switch = NodeDef(name="switch", op="Switch", input=["x", "flag"])
    switch.attr["T"].type = DT_FLOAT
    flag = NodeDef(name="flag", op="Placeholder")
    flag.attr["dtype"].type = 10  # DT_BOOL
    graph_def.node.extend(
        [
            _placeholder("x"),
            flag,
            switch,
            _node("a", "Neg", "switch:1"),
            _node("b", "Exp", "a"),
            _node("c", "Square", "b"),
        ]
    )
    assert _regions(Executor(graph_def)) == []
    # A receive from another partition that the planner did not mark may bring a dead
    # value (a Switch there): one part dead would make the group dead.
    graph_def = GraphDef()
    receive = _transfer("from_ps", "_Recv", None, PS)
    graph_def.node.extend(
        [receive, _node("a", "Neg", "from_ps"), _node("b", "Exp", "a"), _node("c", "Abs", "b")]
    )
    assert _regions(Executor(graph_def)) == [["a", "b", "c"]]
    del graph_def.node[0].attr[RECEIVES_FIRST_ATTR]
    assert _regions(Executor(graph_def)) == []


def _int64_parts(rows: list[tuple[str, ...]]) -> list[NodeDef]:
    """Int64 nodes from (name, op, inputs...) rows."""
    return [_node(name, op, *inputs, dtype=DT_INT64) for name, op, *inputs in rows]


def test_integer_parts_keep_their_dtype():
    parts = _int64_parts([("a", "FloorDiv", "x", "y"), ("b", "FloorMod", "a", "y"), ("c", "Sub", "b", "a")])
    kernel = create_kernel(_region_node(parts, [0, 1, -1, 1, -2, -1], [2], 2))
    x, y = np.array([-7, 7, 100], np.int64), np.array(3, np.int64)
    (out,) = kernel.compute(None, [x, y])
    assert out.dtype == np.int64
    np.testing.assert_array_equal(out, np.floor_divide(x, y) % y - np.floor_divide(x, y))


# --------------------------------------------------------------------------- id splits


def _recording_split(executors: list[Executor]) -> tuple[Any, list[list[Any]]]:
    """The region that is an id split (`kernels.id_split`) among the nodes of the
    executors built so far, and the inputs it is given from now on (each call's)."""
    (kernel,) = [
        node.kernel
        for executor in executors
        for node in executor._nodes
        if node.kernel.op == FUSED_REGION_OP and node.kernel._id_split is not None
    ]
    calls: list[list[Any]] = []
    run = kernel._id_split.run

    def recording(inputs: list[Any]) -> Any:
        calls.append(list(inputs))
        return run(inputs)

    kernel._id_split.run = recording
    return kernel, calls


def _counted_loops(monkeypatch: pytest.MonkeyPatch) -> collections.Counter[str]:
    """The compiled loops, each call counted by name."""
    assert _compiled.wait(300), "no compiled loops: numba missing? (pip install -e '.[dev]')"
    real, calls = _compiled.loops(), collections.Counter[str]()

    def counted(name: str) -> Any:
        def call(*args: Any) -> Any:
            calls[name] += 1
            return getattr(real, name)(*args)

        return call

    monkeypatch.setattr(
        _compiled,
        "_loops",
        types.SimpleNamespace(**{n: counted(n) for n in dir(real) if not n.startswith("_")}),
    )
    return calls


def _extreme_ids(total: int, *divisors: int) -> list[np.ndarray]:
    """Arrays of ids: in and out of a table of `total` rows, with whole multiples of
    `divisors` of up to 2**50, where the loop's float quotient can fall short of the
    floor (the graph's divisors: rows per shard and one more); beyond 2**50, where the
    loop divides as the CPU does (a float quotient would be wrong for some); and where
    int64 wraps."""
    rng = np.random.default_rng(5)
    multiples = [d * rng.integers(-(2**50) // d, 2**50 // d, 300) for d in divisors]
    near = [
        0,
        1,
        total - 1,
        total,
        -1,
        -total,
        2**50 - 1,
        -(2**50) + 1,
        *rng.integers(-3 * total, 3 * total, 500),
    ]
    beyond = [2**50, 2**52 + 3, -(2**52) - 5, 2**55 + 1, -(2**57) - 3, 2**59 + 12345]
    wrapping = [2**62, -(2**63), 2**63 - 1, -(2**63) + 7]
    return [np.concatenate([*multiples, near]), np.array([*near, *beyond]), np.array([*beyond, *wrapping])]


def _both_ways(
    kernel: Any, inputs: list[Any], monkeypatch: pytest.MonkeyPatch
) -> tuple[list[Any], list[Any]]:
    """The region's outputs for `inputs` from its loop, then from its parts."""
    compiled = kernel.compute(None, inputs)
    with monkeypatch.context() as patch:
        patch.setattr(_compiled, "_loops", None)
        return compiled, kernel.compute(None, inputs)


def _assert_same_bits(got: list[Any], expected: list[Any]) -> None:
    for a, b in zip(got, expected, strict=True):
        assert (a.dtype, a.shape) == (b.dtype, b.shape)
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize(
    "rows", [[51, 51], [34, 34, 33], [5, 4, 4, 4]], ids=["even", "two-longer", "one-longer"]
)
def test_an_embedding_lookups_ids_split_by_shard_in_one_loop_with_the_parts_bits(
    server, executors, monkeypatch, rows
):
    calls = _counted_loops(monkeypatch)
    total = sum(rows)
    table = np.arange(total * 2, dtype=F32).reshape(total, 2)
    starts = np.cumsum([0, *rows])
    with ds.Graph().as_default() as graph:
        ids = ds.placeholder(ds.int64, [4, 6], name="ids")
        shards = [
            ds.Variable(table[a:b], name=f"shard_{i}") for i, (a, b) in enumerate(itertools.pairwise(starts))
        ]
        looked_up = ds.embedding_lookup(shards, ids)
        init = ds.global_variables_initializer()
    feed = np.random.default_rng(6).integers(0, total, (4, 6))
    with ds.Session(server.target, graph=graph) as session:
        session.run(init)
        np.testing.assert_array_equal(session.run(looked_up, {ids: feed}), table[feed])
        kernel, inputs = _recording_split(executors)
        np.testing.assert_array_equal(session.run(looked_up, {ids: feed[::-1]}), table[feed[::-1]])
    assert kernel._id_split.loop == "split_ids_by_blocks"
    assert calls["split_ids_by_blocks"] == 2
    # (the ids, the flat shape [-1], then the graph's constants)
    per_shard = total // len(rows)
    for extreme in [*_extreme_ids(total, per_shard, per_shard + 1), _extreme_ids(total)[0][::-1]]:
        args = [extreme, *inputs[0][1:]]
        compiled, parts = _both_ways(kernel, args, monkeypatch)
        _assert_same_bits(compiled, parts)
    assert calls["split_ids_by_blocks"] == 6


def _split_by_remainder(ids: Any, count: Any, count_again: Any = None) -> tuple[Any, Any]:
    """`tf.compat.v1.nn.embedding_lookup`'s "mod" split of `ids`, (shard, row): with
    `count_again`, the row's divisor another constant (the same number in its graphs)."""
    flat = ds.reshape(ids, [-1])
    return ds.cast(ds.floormod(flat, count), ds.int32), ds.floordiv(
        flat, count if count_again is None else count_again
    )


def test_ids_split_by_remainder_run_in_one_loop_with_the_parts_bits(server, executors, monkeypatch):
    calls = _counted_loops(monkeypatch)
    with ds.Graph().as_default() as graph:
        ids = ds.placeholder(ds.int64, [5, 3], name="ids")
        shard, row = _split_by_remainder(ids, 49, 47)
    feed = np.random.default_rng(7).integers(-400, 400, (5, 3))
    with ds.Session(server.target, graph=graph) as session:
        session.run([shard, row], {ids: -feed})
        kernel, inputs = _recording_split(executors)
        got = session.run([shard, row], {ids: feed})
    np.testing.assert_array_equal(got[0], (feed.reshape(-1) % 49).astype(np.int32))
    np.testing.assert_array_equal(got[1], feed.reshape(-1) // 47)
    assert kernel._id_split.loop == "split_ids_by_remainder"
    for extreme in _extreme_ids(7, 49, 47):
        compiled, parts = _both_ways(kernel, [extreme, *inputs[0][1:]], monkeypatch)
        _assert_same_bits(compiled, parts)
    assert calls["split_ids_by_remainder"] == 5
    # Constants handed over as arrays that may be written are read again at each call
    # (those of a graph are read-only, and the loop keeps what it read from them).
    ids_now, flat, *constants = inputs[0]
    writable = [np.array(c) for c in constants]
    first = kernel.compute(None, [ids_now, flat, *writable])
    writable[0][...] = 5
    second = kernel.compute(None, [ids_now, flat, *writable])
    shards_of = lambda outputs: next(v for v in outputs if v.dtype == np.int32)  # noqa: E731
    np.testing.assert_array_equal(shards_of(first), ids_now.reshape(-1) % 49)
    np.testing.assert_array_equal(shards_of(second), ids_now.reshape(-1) % 5)
    assert calls["split_ids_by_remainder"] == 7


def test_a_split_the_loop_is_not_for_runs_its_parts(server, executors, monkeypatch):
    calls = _counted_loops(monkeypatch)
    with ds.Graph().as_default() as graph:
        ids = ds.placeholder(ds.int64, [6], name="ids")
        count = ds.placeholder(ds.int64, None, name="count")
        shard, row = _split_by_remainder(ids, count)
        narrow = ds.placeholder(ds.int32, [6], name="narrow")
        narrow_split = _split_by_remainder(narrow, 4)
    feed = np.arange(-3, 3)
    with ds.Session(server.target, graph=graph) as session:
        # A divisor that is not a scalar, or not positive: the parts' values and errors.
        got = session.run([shard, row], {ids: feed, count: np.array([4])})
        _, inputs = _recording_split(executors)
        np.testing.assert_array_equal(got[0], feed % 4)
        np.testing.assert_array_equal(got[1], feed // 4)
        np.testing.assert_array_equal(session.run([shard, row], {ids: feed, count: -4})[0], feed % -4)
        with pytest.raises(errors.InvalidArgumentError, match="Integer division by zero"):
            session.run([shard, row], {ids: feed, count: 0})
        assert calls["split_ids_by_remainder"] == 0
        np.testing.assert_array_equal(session.run(narrow_split[0], {narrow: feed.astype(np.int32)}), feed % 4)
        # A divisor fed as an int64 scalar is taken, checked at each call.
        np.testing.assert_array_equal(session.run([shard, row], {ids: feed, count: 2})[1], feed // 2)
        assert calls["split_ids_by_remainder"] == 1
    assert [int(call[2]) for call in inputs] == [-4, 0, 2]


def test_tensorflow_1s_select_in_a_split_by_blocks_is_taken_too(monkeypatch):
    # The region as TensorFlow 1's `where` writes the split ("Select"): a table of 98
    # rows in two shards; inputs: ids, [-1], then the constants 50, 0, 50, 0, 49, 49, 0.
    calls = _counted_loops(monkeypatch)
    parts = _int64_parts(
        [
            ("flat", "Reshape", "ids", "shape"),
            ("floordiv", "FloorDiv", "flat", "y0"),
            ("sub", "Sub", "flat", "y1"),
            ("floormod", "FloorMod", "flat", "y2"),
            ("sub_1", "Sub", "flat", "y3"),
            ("floordiv_1", "FloorDiv", "sub", "y4"),
            ("floormod_1", "FloorMod", "sub_1", "y5"),
            ("maximum", "Maximum", "floordiv", "floordiv_1"),
            ("less", "Less", "maximum", "y6"),
            ("cast", "Cast", "maximum"),
            ("select", "Select", "less", "floormod", "floormod_1"),
        ]
    )
    parts[0].attr["Tshape"].type = DT_INT32
    del parts[9].attr["T"]
    parts[9].attr["SrcT"].type, parts[9].attr["DstT"].type = DT_INT64, DT_INT32
    wiring = [0, 1, -1, 2, -1, 3, -1, 4, -1, 5, -3, 6, -5, 7, -2, -6, -8, 8, -8, -9, -4, -7]
    kernel = create_kernel(_region_node(parts, wiring, [9, 10], 9))
    assert kernel._id_split.loop == "split_ids_by_blocks"
    constants = [np.array(c, np.int64) for c in (50, 0, 50, 0, 49, 49, 0)]
    for ids in _extreme_ids(98, 50, 49):
        compiled, parts_way = _both_ways(kernel, [ids, np.array([-1], np.int32), *constants], monkeypatch)
        _assert_same_bits(compiled, parts_way)
        np.testing.assert_array_equal(compiled[0], np.maximum(ids // 50, ids // 49).astype(np.int32))
    assert calls["split_ids_by_blocks"] == 3
    # The same region with a part of another dtype is not a split.
    parts[4].attr["T"].type = DT_INT32
    assert create_kernel(_region_node(parts, wiring, [9, 10], 9))._id_split is None


# --------------------------------------------------------------------------- element-wise plans


def _same_bits(got: list[Any], expected: list[Any]) -> None:
    """Equal dtypes, shapes and bits (NaN payloads and zeros' signs included)."""
    for a, b in zip(got, expected, strict=True):
        assert (a.dtype, a.shape) == (b.dtype, b.shape)
        assert a.tobytes() == b.tobytes()


def _planned_and_parts(kernel: Any, inputs: list[Any]) -> tuple[list[Any], list[Any]]:
    """The region's outputs for `inputs` from its plan, then from its parts."""
    assert kernel._plan is not None
    assert kernel._plan.made_for == region_plans.signature(inputs)
    planned = kernel._plan.run(None, inputs)
    assert planned is not None
    kernel._may_plan = False
    try:
        return planned, kernel.compute(None, inputs)
    finally:
        kernel._may_plan = True


def _awkward(shape: tuple[int, ...], dtype: Any, seed: int) -> np.ndarray:
    """Values of `dtype` in `shape` with NaNs, infinities, signed zeros, subnormals and
    the largest and smallest numbers among random ones of every size."""
    info = np.finfo(dtype)
    special = [
        np.nan,
        -np.nan,
        np.inf,
        -np.inf,
        0.0,
        -0.0,
        info.tiny / 4,
        -info.tiny,
        info.max,
        -info.max,
        1.0,
    ]
    rng = np.random.default_rng(seed)
    size = int(np.prod(shape))
    with np.errstate(over="ignore"):
        values = (rng.standard_normal(size) * 10.0 ** rng.integers(-8, 9, size)).astype(dtype)
    picked = [special[(seed + i) % len(special)] for i in range(min(size, len(special)))]
    values[rng.choice(size, len(picked), replace=False)] = picked
    return values.reshape(shape)


def _every_operation(dtype: int) -> Any:
    """A region of a part of each op a plan compiles, some ufuncs (run over its rows),
    then an `Equal` of shapes that do not broadcast, which makes one flag (run by its
    kernel): inputs x, y [64], s [] and t [1], x2 [64, 1], w [8, 8]; outputs every
    part's value."""
    rows = [
        ("a", "AddV2", "x", "y"),
        ("b", "Sub", "a", "s"),
        ("m", "Mul", "b", "t"),
        ("d", "RealDiv", "m", "y"),
        ("n", "Neg", "d"),
        ("q", "Square", "n"),
        ("r", "Sqrt", "q"),
        ("ab", "Abs", "b"),
        ("rs", "Rsqrt", "ab"),
        ("rc", "Reciprocal", "b"),
        ("sd", "SquaredDifference", "x", "s"),
        ("g", "Greater", "x", "y"),
        ("ge", "GreaterEqual", "x", "s"),
        ("l", "Less", "x", "y"),
        ("le", "LessEqual", "y", "s"),
        ("e", "Equal", "x", "y"),
        ("ne", "NotEqual", "x", "t"),
        ("sel", "SelectV2", "g", "rc", "rs"),
        ("sel1", "Select", "ge", "sd", "r"),
        ("z", "ZerosLike", "x"),
        ("o", "OnesLike", "y"),
        ("sq", "Squeeze", "x2"),
        ("add", "Add", "sq", "x"),
        ("sum", "AddN", "sel", "sel1", "z", "o", "add", "d"),
        ("ex", "Exp", "d"),
        ("lp", "Log1p", "ab"),
        ("th", "Tanh", "sum"),
        ("mx", "Maximum", "x", "s"),
        ("mn", "Minimum", "y", "t"),
        ("after", "Mul", "ex", "th"),
        ("unlike", "Equal", "x", "w"),
    ]
    parts = [_node(name, op, *inputs, dtype=dtype) for name, op, *inputs in rows]
    parts[-1].attr["incompatible_shape_error"].b = False
    names = ["x", "y", "s", "t", "x2", "w"]
    wiring = []
    for _, _, *inputs in rows:
        wiring += [names.index(i) if i in names[:6] else -1 - (names.index(i) - 6) for i in inputs]
        names.append(rows[len(names) - 6][0])
    return create_kernel(_region_node(parts, wiring, list(range(len(rows))), 6))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_every_operation_of_a_plan_gives_its_parts_bits(monkeypatch, dtype):
    calls = _counted_loops(monkeypatch)
    kernel = _every_operation(DT_FLOAT if dtype == np.float32 else DT_DOUBLE)
    for seed in range(4):
        inputs = [
            _awkward((64,), dtype, seed),
            _awkward((64,), dtype, seed + 10),
            _awkward((), dtype, seed + 20),
            _awkward((1,), dtype, seed + 30),
            _awkward((64, 1), dtype, seed + 40),
            _awkward((8, 8), dtype, seed + 50),
        ]
        inputs[5][0, 0] = inputs[0][0]  # (an element-wise Equal of x and w would say so)
        if seed == 3:  # (equal values where x and y meet, and x equal to the scalars)
            inputs[1][:32] = inputs[0][:32]
            inputs[2][()] = inputs[3][0] = inputs[0][40]
        first = kernel.compute(None, inputs)  # (the first call plans)
        planned, parts = _planned_and_parts(kernel, inputs)
        _same_bits(planned, parts)
        _same_bits(first, parts)
    # The parts in compiled passes, but the ufuncs, run over rows, and the unlike
    # shapes' Equal, run by its kernel.
    assert [step[0] for step in kernel._plan._steps] == ["pass", *["ufunc"] * 5, "pass", "part"]
    assert not parts[-1]
    assert calls["elementwise_program"] == 14  # (two passes: three calls by the plan, four by the test)
    assert kernel._plans_tried == 1


def test_a_logistic_loss_and_its_gradient_run_as_compiled_passes_with_the_parts_bits(
    server, executors, monkeypatch
):
    calls = _counted_loops(monkeypatch)
    taken: dict[Any, list[Any]] = {}  # a region -> the inputs of its last call
    compute = FusedRegionKernel.compute

    def recording(self: Any, ctx: Any, inputs: list[Any]) -> list[Any]:
        taken[self] = list(inputs)
        return compute(self, ctx, inputs)

    monkeypatch.setattr(FusedRegionKernel, "compute", recording)
    rng = np.random.default_rng(7)
    feeds = [(rng.integers(0, 102, (16, 3)), rng.integers(0, 2, 16).astype(F32)) for _ in range(3)]
    model = _embedding_model()
    planned = _train(server, model, feeds)
    (kernel,) = [
        node.kernel
        for executor in executors
        for node in executor._nodes
        if node.kernel.op == FUSED_REGION_OP
        and any("logistic_loss" in p.name for p in node.kernel._parts_nodes)
    ]
    assert kernel._plan is not None
    # Two compiled passes, the exponential and log1p between them (their ufuncs, over
    # rows), and the gradient's reshape (by a shape the region reads, its kernel) after.
    count = len(taken[kernel])
    parts = kernel._parts_nodes  # (a step of a part ends with the part's place)
    steps = [
        step[0] if step[0] == "pass" else f"{step[0]} {parts[step[-1] - count].op}"
        for step in kernel._plan._steps
    ]
    assert steps == ["pass", "ufunc Exp", "ufunc Log1p", "pass", "part Reshape"]
    assert calls["elementwise_program"] >= 2 * (len(feeds) - 1)
    # The inputs of its last call, with awkward values in their place: the same bits.
    inputs = taken[kernel]
    for seed in range(3):
        awkward = [
            _awkward(v.shape, v.dtype, seed + i) if v.dtype == F32 else v for i, v in enumerate(inputs)
        ]
        _same_bits(*_planned_and_parts(kernel, awkward))
    # The same steps with every node on its own: the same bits.
    monkeypatch.setattr(executor_module, "_fuse_regions", lambda nodes, control_sources: None)
    assert_same_training(planned, _train(server, model, feeds), len(feeds))


def _expected(x: np.ndarray, shape: Any) -> np.ndarray:
    """What `_reshaped` makes."""
    with np.errstate(all="ignore"):
        r = x.reshape(shape)
        b = (r + r) * (r + r)
        return np.abs(np.square(-b - r) / r)


def _reshaped() -> Any:
    """A region: r = Reshape(x, shape), then |(-((r + r) * (r + r)) - r)^2 / r| in six
    parts; inputs x, shape."""
    parts = [
        _node("r", "Reshape", "x", "shape"),
        _node("a", "AddV2", "r", "r"),
        _node("b", "Mul", "a", "a"),
        _node("c", "Neg", "b"),
        _node("d", "Sub", "c", "r"),
        _node("e", "Square", "d"),
        _node("f", "RealDiv", "e", "r"),
        _node("g", "Abs", "f"),
    ]
    parts[0].attr["Tshape"].type = DT_INT32
    wiring = [0, 1, -1, -1, -2, -2, -3, -4, -1, -5, -6, -1, -7]
    return create_kernel(_region_node(parts, wiring, [7], 2))


def test_a_plan_gives_way_to_the_parts_when_a_part_makes_another_shape(monkeypatch):
    calls = _counted_loops(monkeypatch)
    kernel = _reshaped()
    x = _awkward((64,), F32, 1)
    # Planned by the first call, run by the second; the third's reshape makes another
    # shape (the same signature: the shape's values changed): the parts run, and the
    # fourth plans again.
    for shape in ([8, 8], [8, 8], [4, 16], [4, 16], [4, 16]):
        (out,) = kernel.compute(None, [x, np.array(shape, np.int32)])
        _same_bits([out], [_expected(x, shape)])
    assert kernel._plans_tried == 2
    # A chain of values: each row is given back after its value's last reader, so three
    # rows hold the reshaped input (read to the end), the value made and the one read.
    assert kernel._plan._table == (3, 64)
    assert calls["elementwise_program"] == 2
    # Shapes that change at every call are planned for a few times, then run the parts.
    for i in range(3 * regions_module._MAX_PLANS):
        shape = [8, 8] if i % 2 else [4, 16]
        (out,) = kernel.compute(None, [x, np.array(shape, np.int32)])
        _same_bits([out], [_expected(x, shape)])
    assert kernel._plans_tried == regions_module._MAX_PLANS


def test_regions_of_large_values_or_without_compiled_loops_run_their_parts(monkeypatch):
    _counted_loops(monkeypatch)
    kernel = _reshaped()
    x = _awkward((region_plans.MAX_ELEMENTS + 2,), F32, 2)
    shape = np.array([2, -1], np.int32)
    for _ in range(2):
        (out,) = kernel.compute(None, [x, shape])
        _same_bits([out], [_expected(x, (2, -1))])
    assert kernel._plan is None
    kernel = _reshaped()
    monkeypatch.setattr(_compiled, "_loops", None)
    for _ in range(2):
        (out,) = kernel.compute(None, [x[:64], shape])
        _same_bits([out], [_expected(x[:64], (2, -1))])
    assert kernel._plans_tried == 0


def test_a_planned_regions_outputs_hold_none_of_its_rows(monkeypatch):
    # Six compiled parts, then a reshape of their value (a view of a row, from its
    # kernel): what leaves the region must not keep the plan's table of rows alive.
    _counted_loops(monkeypatch)
    parts = [
        _node("a", "Neg", "x"),
        _node("b", "AddV2", "a", "a"),
        _node("c", "Mul", "b", "b"),
        _node("d", "Sub", "c", "a"),
        _node("e", "Square", "d"),
        _node("f", "Abs", "e"),
        _node("g", "Reshape", "f", "shape"),
    ]
    parts[-1].attr["Tshape"].type = DT_INT32
    kernel = create_kernel(_region_node(parts, [0, -1, -1, -2, -2, -3, -1, -4, -5, -6, 1], [6, 5], 2))
    x, shape = _awkward((64,), F32, 3), np.array([8, 8], np.int32)
    for _ in range(2):
        reshaped, flat = kernel.compute(None, [x, shape])
    assert kernel._plan is not None
    with np.errstate(all="ignore"):
        b = -x + -x
        expected = np.abs(np.square(b * b - -x))
    _same_bits([reshaped, flat], [expected.reshape(8, 8), expected])
    for value in (reshaped, flat):
        assert value.base is None or value.base.nbytes == value.nbytes


def test_the_region_plans_benchmark_runs_a_step_both_ways():
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_region_plans.py"
    spec = importlib.util.spec_from_file_location("bench_region_plans", path)
    assert spec is not None
    assert spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    figures = bench.run("embedding", 1, 2)
    (region,) = figures["regions"]
    assert region["steps"] == ["pass", "ufunc", "ufunc", "pass"]  # (the loss and its gradient)
    assert region["plan_us"] > 0
    assert region["parts_us"] > 0
    assert figures["step"]["pairs"] == 1
