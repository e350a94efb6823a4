"""Variable updates grouped when a worker registers a graph (`runtime.fusion.group_variable_updates`):
one node for the independent updates of a device, the same values, errors naming the part,
and no group that would wait for itself; and malformed grouped nodes (updates and reads)
refused."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import distserver as ds
from distserver import errors
from distserver.kernels import create_kernel
from distserver.kernels.math import FUSED_NODES_ATTR
from distserver.kernels.state import ARENA_MAX_VARIABLE_BYTES, GROUPED_READS_OP, GROUPED_UPDATES_OP
from distserver.protos.attr_value_pb2 import AttrValue
from distserver.protos.node_def_pb2 import NodeDef
from distserver.protos.types_pb2 import DT_FLOAT
from distserver.runtime.fusion import group_variable_updates
from distserver.testing import LocalCluster

F32 = np.float32


def _descent(variable: ds.Variable, grad: Any, name: str) -> Any:
    """A `ResourceApplyGradientDescent` of `variable` (learning rate 0.5)."""
    return ds.get_default_graph().create_op(
        "ResourceApplyGradientDescent",
        [variable.handle, ds.constant(F32(0.5)), grad],
        name=name,
        attrs={"T": AttrValue(type=DT_FLOAT), "use_locking": AttrValue(b=False)},
    )


def _grouped(graph_def: Any) -> list[NodeDef]:
    return [node for node in graph_def.node if node.op == GROUPED_UPDATES_OP]


def _parts(node: NodeDef) -> list[str]:
    return [NodeDef.FromString(data).name for data in node.attr[FUSED_NODES_ATTR].list.s]


def _trained(server: ds.Server, graph: ds.Graph, init: Any, train: Any, variables: list[Any]) -> list[Any]:
    """The variables' values after three steps of `train`."""
    with ds.Session(server.target, graph=graph) as sess:
        sess.run(init)
        for _ in range(3):
            sess.run(train)
        return sess.run(variables)


def test_momentum_updates_of_many_variables_run_as_one_node_with_the_same_values(server):
    rng = np.random.default_rng(11)
    starts = [rng.standard_normal((3, 4)).astype(F32) for _ in range(6)]
    scales = [rng.standard_normal((3, 4)).astype(F32) for _ in range(6)]
    with ds.Graph().as_default() as graph:
        variables = [ds.Variable(start, name=f"v{i}") for i, start in enumerate(starts)]
        loss = ds.add_n([ds.reduce_sum(v * ds.constant(s)) for v, s in zip(variables, scales, strict=True)])
        train = ds.train.MomentumOptimizer(0.1, 0.9).minimize(loss)
        init = ds.global_variables_initializer()
    (group,) = _grouped(group_variable_updates(graph.as_graph_def()))
    assert len(_parts(group)) == 6
    got = _trained(server, graph, init, train, variables)
    for start, scale, value in zip(starts, scales, got, strict=True):
        var, accum = start.copy(), np.zeros_like(start)
        for _ in range(3):  # d loss / d v = scale
            accum = accum * F32(0.9) + scale
            var = var - F32(0.1) * accum
        np.testing.assert_array_equal(value.view(np.uint32), var.view(np.uint32))


def test_an_update_that_depends_on_another_stays_out_and_waits_for_the_group(server):
    with ds.Graph().as_default() as graph:
        a, b, c = (ds.Variable(np.full(2, 10.0, F32), name=n) for n in "abc")
        first = _descent(a, ds.constant(np.ones(2, F32)), "first")
        second = _descent(b, ds.constant(np.ones(2, F32)), "second")
        with ds.control_dependencies([first]):
            # Reads a after its update: grouping it with `first` would wait for itself.
            third = _descent(c, ds.identity(a.read_value()), "third")
        done = ds.group(first, second, third, name="done")
        init = ds.global_variables_initializer()
    grouped = group_variable_updates(graph.as_graph_def())
    (group,) = _grouped(grouped)
    assert _parts(group) == ["first", "second"]
    waited = [node.name for node in graph.as_graph_def().node if "^first" in node.input]
    assert "done" in waited
    assert len(waited) > 1  # (and what reads `a` for `third`)
    nodes = {node.name: node for node in grouped.node}
    for name in waited:
        assert f"^{group.name}" in nodes[name].input
        assert "^first" not in nodes[name].input
    assert [text for text in nodes["done"].input if text.startswith("^")] == [f"^{group.name}", "^third"]
    with ds.Session(server.target, graph=graph) as sess:
        sess.run(init)
        sess.run(done)
        # `third` ran after `first` (its gradient is a's new value)
        np.testing.assert_array_equal(sess.run([a, b, c]), [[9.5, 9.5], [9.5, 9.5], [10 - 0.5 * 9.5] * 2])


def test_updates_on_different_devices_form_a_group_each():
    with ds.Graph().as_default() as graph:
        updates = []
        for task in (0, 0, 1, 1, 2):
            with ds.device(f"/job:ps/task:{task}"):
                v = ds.Variable(np.zeros(2, F32))
                updates.append(_descent(v, ds.constant(np.ones(2, F32)), f"update_{len(updates)}"))
    groups = _grouped(group_variable_updates(graph.as_graph_def()))
    assert sorted(_parts(group) for group in groups) == [["update_0", "update_1"], ["update_2", "update_3"]]
    for group in groups:
        assert group.device == NodeDef.FromString(group.attr[FUSED_NODES_ATTR].list.s[0]).device


def test_an_update_of_a_received_value_of_a_large_variable_runs_as_it_arrives_not_in_the_group():
    # A parameter server's update of a gradient from a worker: grouped, it would wait
    # for the last gradient instead of overlapping with the worker's remaining work.
    # Small variables' updates are grouped all the same (one update over their arena
    # costs less); a variable whose size its VarHandleOp does not tell counts as large.
    with ds.Graph().as_default() as graph:
        shapes = [(2,), (2,), (2,), (2,), (128, 129), (2,)]  # (128 x 129 float32: 66,048 bytes)
        for i, shape in enumerate(shapes):
            _descent(ds.Variable(np.zeros(shape, F32)), ds.constant(np.ones(shape, F32)), f"update_{i}")
    graph_def = graph.as_graph_def()
    nodes = {node.name: node for node in graph_def.node}
    assert 128 * 129 * 4 > ARENA_MAX_VARIABLE_BYTES >= 2 * 4
    for i in (3, 4, 5):
        receive = graph_def.node.add(name=f"grad_from_worker_{i}", op="_Recv")
        receive.attr["tensor_type"].type = DT_FLOAT
        nodes[f"update_{i}"].input[2] = receive.name
    # update_5's handle through an Identity: its size is not known here
    handle = nodes["update_5"].input[0]
    graph_def.node.add(name="handle_copy", op="Identity", input=[handle])
    nodes["update_5"].input[0] = "handle_copy"
    (group,) = _grouped(group_variable_updates(graph_def))
    assert _parts(group) == ["update_0", "update_1", "update_2", "update_3"]
    # A value sent to the client after an update changes nothing ...
    fetch = graph_def.node.add(name="fetch_after_update", op="_Send", input=["^update_0"])
    fetch.attr["client_terminated"].b = True
    (group,) = _grouped(group_variable_updates(graph_def))
    assert _parts(group) == ["update_0", "update_1", "update_2", "update_3"]
    # ... but one sent to another task might come back as a value a received update
    # takes: those run apart then, as their values arrive.
    graph_def.node.add(name="to_worker_after_update", op="_Send", input=["^update_1"])
    (group,) = _grouped(group_variable_updates(graph_def))
    assert _parts(group) == ["update_0", "update_1", "update_2"]


def test_the_updates_of_received_values_of_a_vector_and_a_scalar_variable_are_grouped():
    # A logistic layer's weights and bias on a ps (an embedding model's `w` and `b`):
    # both small, the scalar included (its shape, (), is known: one element).
    with ds.Graph().as_default() as graph:
        for name, shape in (("w", (32, 1)), ("b", ())):
            _descent(
                ds.Variable(np.zeros(shape, F32), name=name),
                ds.constant(np.ones(shape, F32)),
                f"update_{name}",
            )
    graph_def = graph.as_graph_def()
    nodes = {node.name: node for node in graph_def.node}
    for name in ("w", "b"):
        receive = graph_def.node.add(name=f"grad_of_{name}", op="_Recv")
        receive.attr["tensor_type"].type = DT_FLOAT
        nodes[f"update_{name}"].input[2] = receive.name
    (group,) = _grouped(group_variable_updates(graph_def))
    assert _parts(group) == ["update_w", "update_b"]


def test_a_group_with_a_scalar_variable_updates_it_by_adagrads_formula(server):
    rng = np.random.default_rng(5)
    w, scale = rng.standard_normal((4, 1)).astype(F32), rng.standard_normal((4, 1)).astype(F32)
    with ds.Graph().as_default() as graph:
        weights, bias = ds.Variable(w, name="w"), ds.Variable(F32(0.25), name="b")
        loss = ds.reduce_sum(weights * ds.constant(scale)) + bias * F32(3.0)
        train = ds.train.AdagradOptimizer(0.5).minimize(loss)
        init = ds.global_variables_initializer()
    (group,) = _grouped(group_variable_updates(graph.as_graph_def()))
    assert len(_parts(group)) == 2
    got_w, got_b = _trained(server, graph, init, train, [weights, bias])
    expected = []
    for var, grad in ((w.copy(), scale), (np.asarray(F32(0.25)), np.asarray(F32(3.0)))):
        accum = np.full_like(var, F32(0.1))  # Adagrad's initial accumulator
        for _ in range(3):
            accum = accum + grad * grad
            var = var - F32(0.5) * grad * (F32(1.0) / np.sqrt(accum))
        expected.append(var)
    np.testing.assert_allclose(got_w, expected[0], rtol=1e-6)
    assert np.shape(got_b) == ()
    np.testing.assert_allclose(got_b, expected[1], rtol=1e-6)


@pytest.mark.slow
def test_a_group_never_waits_for_itself_across_tasks():
    # ps: a and b updated from the worker's gradients; the worker computes b's gradient
    # from a's value read after a's update. Grouped, the two updates would wait for
    # b's gradient, which waits for a's update: the step must finish instead.
    with ds.Graph().as_default() as graph:
        with ds.device("/job:ps/task:0"):
            a = ds.Variable(np.full(2, 1.0, F32), name="a")
            b = ds.Variable(np.full(2, 1.0, F32), name="b")
        with ds.device("/job:worker/task:0"):
            grad_a = ds.constant(np.ones(2, F32)) * 2.0
        with ds.device("/job:ps/task:0"):
            update_a = _descent(a, grad_a, "update_a")
            with ds.control_dependencies([update_a]):
                a_after = ds.identity(a.read_value())
        with ds.device("/job:worker/task:0"):
            grad_b = a_after * 3.0
        with ds.device("/job:ps/task:0"):
            update_b = _descent(b, grad_b, "update_b")
        init = ds.global_variables_initializer()
    with (
        LocalCluster({"ps": 1, "worker": 1}) as cluster,
        ds.Session(cluster.target("worker"), graph=graph) as sess,
    ):
        sess.run(init)
        sess.run([update_a, update_b], options=ds.RunOptions(timeout_in_ms=20_000))
        got_a, got_b = sess.run([a.read_value(), b.read_value()])
    np.testing.assert_array_equal(got_a, [0.0, 0.0])  # 1 - 0.5 * 2
    np.testing.assert_array_equal(got_b, [1.0, 1.0])  # 1 - 0.5 * (0 * 3)


def test_graphs_with_v1_control_flow_or_a_single_update_are_left_alone():
    with ds.Graph().as_default() as graph:
        v = ds.Variable(np.zeros(2, F32))
        _descent(v, ds.constant(np.ones(2, F32)), "only")
    assert group_variable_updates(graph.as_graph_def()).node == graph.as_graph_def().node
    graph_def = graph.as_graph_def()
    with ds.Graph().as_default() as graph:
        u, v = ds.Variable(np.zeros(2, F32)), ds.Variable(np.zeros(2, F32))
        _descent(u, ds.constant(np.ones(2, F32)), "one")
        _descent(v, ds.constant(np.ones(2, F32)), "two")
    graph_def = graph.as_graph_def()
    assert len(_grouped(group_variable_updates(graph_def))) == 1
    switch = graph_def.node.add(name="switch", op="Switch")
    switch.input.extend(["one", "two"])  # (never run: only its op matters)
    assert not _grouped(group_variable_updates(graph_def))


def test_a_failing_part_is_named_in_the_error(server):
    with ds.Graph().as_default() as graph:
        u, v = ds.Variable(np.zeros(2, F32), name="u"), ds.Variable(np.zeros(2, F32), name="v")
        ok = _descent(u, ds.constant(np.ones(2, F32)), "fine_update")
        bad = _descent(v, ds.constant(np.ones(3, F32)), "misshapen_update")
        init = ds.global_variables_initializer()
    assert len(_grouped(group_variable_updates(graph.as_graph_def()))) == 1
    with ds.Session(server.target, graph=graph) as sess:
        sess.run(init)
        with pytest.raises(errors.InvalidArgumentError, match="misshapen_update") as caught:
            sess.run([ok, bad])
    assert "var and delta do not have the same shape" in caught.value.message


# A grouped node's op, one well-formed part of it (op, data inputs, type attr), and what
# an N one too large and a part of another op are refused with.
GROUPED_NODES = [
    (
        GROUPED_UPDATES_OP,
        ("ResourceApplyGradientDescent", ["v", "lr", "g"], "T"),
        "N = 4 inputs, but its parts take 3",
        "expected dense updates of resource variables",
    ),
    (
        GROUPED_READS_OP,
        ("ReadVariableOp", ["v"], "dtype"),
        "N = 2 inputs, but 1 parts",
        "expected ReadVariableOps",
    ),
]


@pytest.mark.parametrize(
    ("op", "part_of", "wrong_count", "wrong_op"), GROUPED_NODES, ids=["updates", "reads"]
)
def test_a_grouped_node_of_other_ops_or_a_wrong_count_is_refused(op, part_of, wrong_count, wrong_op):
    part_op, inputs, type_attr = part_of
    part = NodeDef(name="p", op=part_op, input=inputs)
    part.attr[type_attr].type = DT_FLOAT
    node = NodeDef(name="g", op=op, input=inputs)
    node.attr["N"].i = len(inputs)
    node.attr[FUSED_NODES_ATTR].list.s.append(part.SerializeToString())
    create_kernel(node)  # well formed
    node.attr["N"].i = len(inputs) + 1
    with pytest.raises(errors.InvalidArgumentError, match=wrong_count):
        create_kernel(node)
    node.attr["N"].i = len(inputs)
    node.attr[FUSED_NODES_ATTR].list.s[0] = NodeDef(name="p", op="AssignVariableOp").SerializeToString()
    with pytest.raises(errors.InvalidArgumentError, match=wrong_op):
        create_kernel(node)
    node.attr[FUSED_NODES_ATTR].list.s[0] = b"\xff\xff"
    with pytest.raises(errors.InvalidArgumentError, match="not a NodeDef"):
        create_kernel(node)
