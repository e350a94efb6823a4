"""Variable reads grouped when a worker registers a graph (`runtime.fusion.group_variable_reads`):
one node for the reads of a device's small variables that wait for nothing but their
handles, the same values, errors naming the part, and variables found again when one
was destroyed."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import distserver as ds
from distserver import errors
from distserver.kernels.math import FUSED_NODES_ATTR
from distserver.kernels.state import ARENA_MAX_VARIABLE_BYTES, GROUPED_READS_OP
from distserver.protos.attr_value_pb2 import AttrValue
from distserver.protos.node_def_pb2 import NodeDef
from distserver.protos.types_pb2 import DT_FLOAT, DT_INT32
from distserver.runtime.fusion import group_variable_reads

F32 = np.float32


def _read(variable: ds.Variable, name: str, dtype: Any = F32) -> Any:
    """A ReadVariableOp of `variable`'s handle, as TensorFlow's clients make them."""
    op = ds.get_default_graph().create_op(
        "ReadVariableOp",
        [variable.handle],
        [dtype],
        name=name,
        attrs={"dtype": AttrValue(type=DT_INT32 if dtype == np.int32 else DT_FLOAT)},
    )
    return op.outputs[0]


def _groups(graph_def: Any) -> list[NodeDef]:
    return [node for node in graph_def.node if node.op == GROUPED_READS_OP]


def _parts(node: NodeDef) -> list[str]:
    return [NodeDef.FromString(data).name for data in node.attr[FUSED_NODES_ATTR].list.s]


def test_reads_of_small_variables_run_as_one_node_and_every_reader_gets_its_own_value(server):
    rng = np.random.default_rng(3)
    starts = [rng.standard_normal((3, 4)).astype(F32) for _ in range(5)]
    with ds.Graph().as_default() as graph:
        variables = [ds.Variable(start, name=f"v{i}") for i, start in enumerate(starts)]
        reads = [_read(v, f"read_{i}") for i, v in enumerate(variables)]
        doubled = [ds.identity(r * 2.0, name=f"doubled_{i}") for i, r in enumerate(reads)]
        with ds.control_dependencies([reads[4].op]):
            after = ds.constant(F32(1.0), name="after_read_4")
        init = ds.global_variables_initializer()
    graph_def = graph.as_graph_def()
    grouped = group_variable_reads(graph_def)
    groups = _groups(grouped)
    ours = [group for group in groups if "read_0" in _parts(group)]
    assert len(ours) == 1  # (each Variable's own read, on the same device, is grouped too)
    parts = _parts(ours[0])
    assert [name for name in parts if name.startswith("read_")] == [f"read_{i}" for i in range(5)]
    nodes = {node.name: node for node in grouped.node}
    assert not any(name in nodes for name in parts)
    for i in range(5):  # each reader takes its part's output
        assert nodes[f"doubled_{i}"].input[0] != f"read_{i}"
    assert f"^{ours[0].name}" in nodes["after_read_4"].input
    with ds.Session(server.target, graph=graph) as sess:
        sess.run(init)
        got = sess.run([*reads, *doubled, after])
    for i, start in enumerate(starts):
        np.testing.assert_array_equal(got[i], start)
        np.testing.assert_array_equal(got[5 + i], start * F32(2.0))


def test_reads_that_wait_for_something_else_or_of_large_variables_stay_apart():
    with ds.Graph().as_default() as graph:
        small = [ds.Variable(np.zeros(2, F32), name=f"s{i}") for i in range(3)]
        large = ds.Variable(np.zeros((128, 129), F32), name="large")  # 66,048 bytes
        first = _read(small[0], "first")
        _read(small[1], "second")
        with ds.control_dependencies([first.op]):
            _read(small[2], "after_first")  # a control input: ordered, so apart
        _read(large, "of_large")
        with ds.device("/job:localhost/replica:0/task:0/device:CPU:1"):
            _read(small[0], "elsewhere_0")
            _read(small[1], "elsewhere_1")  # (a device of its own: a group of its own)
        _read(small[2], "third")
    assert ARENA_MAX_VARIABLE_BYTES < 128 * 129 * 4
    graph_def = graph.as_graph_def()
    # A read through an Identity of the handle: its size is not known here.
    nodes = {node.name: node for node in graph_def.node}
    graph_def.node.add(name="handle_copy", op="Identity", input=[nodes["second"].input[0]])
    nodes["second"].input[0] = "handle_copy"
    grouped = {name for group in _groups(group_variable_reads(graph_def)) for name in _parts(group)}
    assert {"first", "third"} <= grouped
    assert not grouped & {"second", "after_first", "of_large", "elsewhere_0", "elsewhere_1"}
    # The same reads on a device of their own, from handles there, form a group of two.
    for name in ("elsewhere_0", "elsewhere_1"):
        handle = graph_def.node.add(name=f"{name}/handle", op="VarHandleOp", device=nodes[name].device)
        handle.attr["dtype"].type = DT_FLOAT
        handle.attr["shape"].shape.dim.add(size=2)
        nodes[name].input[0] = handle.name
    groups = _groups(group_variable_reads(graph_def))
    assert ["elsewhere_0", "elsewhere_1"] in [_parts(group) for group in groups]


def test_a_value_read_in_a_group_is_not_changed_by_an_update_later_in_the_step(server):
    # The update runs after the read (a control edge) while the fetch still holds the
    # value: it must replace the variable's array, not write into the one read.
    with ds.Graph().as_default() as graph:
        u, v = ds.Variable(np.zeros(4, F32), name="u"), ds.Variable(np.zeros(4, F32), name="v")
        read_u, read_v = _read(u, "read_u"), _read(v, "read_v")
        with ds.control_dependencies([read_u.op, read_v.op]):
            bump = ds.group(u.assign_add(np.ones(4, F32)), v.assign_add(np.ones(4, F32)))
        init = ds.global_variables_initializer()
    assert len(_groups(group_variable_reads(graph.as_graph_def()))) == 1
    with ds.Session(server.target, graph=graph) as sess:
        sess.run(init)
        for step in range(4):
            got_u, got_v, _ = sess.run([read_u, read_v, bump])
            np.testing.assert_array_equal(got_u, np.full(4, step, F32))
            np.testing.assert_array_equal(got_v, np.full(4, step, F32))
        np.testing.assert_array_equal(sess.run(u.read_value()), np.full(4, 4, F32))


def test_a_failing_read_is_named_and_a_destroyed_variable_is_looked_up_again(server):
    with ds.Graph().as_default() as graph:
        # (names of their own: the server keeps the other tests' variables)
        u, v = ds.Variable(np.zeros(2, F32), name="named_u"), ds.Variable(np.zeros(2, F32), name="named_v")
        read_u, read_v = _read(u, "read_u"), _read(v, "read_v")
        as_ints = _read(v, "read_v_as_int32", np.int32)
        init_u = u.initializer
        init_v = v.initializer
        destroy_v = ds.get_default_graph().create_op("DestroyResourceOp", [v.handle], name="destroy_v")
        recreate_v = ds.get_default_graph().create_op(
            "AssignVariableOp",
            [v.handle, ds.constant(np.full(2, 7.0, F32))],
            name="recreate_v",
            attrs={"dtype": AttrValue(type=DT_FLOAT)},
        )
    with ds.Session(server.target, graph=graph) as sess:
        sess.run(init_u)
        with pytest.raises(errors.FailedPreconditionError, match="read_v") as caught:
            sess.run([read_u, read_v])
        assert "Could not find variable named_v" in caught.value.message
        sess.run(init_v)
        np.testing.assert_array_equal(sess.run([read_u, read_v]), np.zeros((2, 2), F32))
        with pytest.raises(errors.InvalidArgumentError, match="read_v_as_int32") as caught:
            sess.run([read_u, read_v, as_ints])
        assert "Trying to read variable with wrong dtype" in caught.value.message
        # The group found v's variable before; a new one of the same name is another.
        sess.run(destroy_v)
        sess.run(recreate_v)
        np.testing.assert_array_equal(sess.run([read_u, read_v]), [[0.0, 0.0], [7.0, 7.0]])
