"""While loops of control flow v2 run by the executor (kernels/functional.py with
executor.FunctionLibraryRuntime): counting loops, nested loops, a cond inside a loop,
a loop that never ends stopped by the step's timeout, malformed loops refused."""

from __future__ import annotations

import numpy as np
import pytest

import distserver as ds
from distserver import errors
from distserver.protos import master_pb2 as m
from distserver.protos.config_pb2 import RunOptions
from distserver.protos.graph_pb2 import GraphDef
from distserver.protos.types_pb2 import DT_BOOL, DT_FLOAT, DT_INT32
from tests.runtime.test_functions import func_attr, function, node


def while_node(name, inputs, cond, body, types, op="While"):
    made = node(name, op, inputs, cond=func_attr(cond), body=func_attr(body))
    made.attr["T"].list.type.extend(types)
    made.attr["parallel_iterations"].i = 10
    return made


def scalar(name, value, dtype):
    return node(
        name,
        "Const",
        dtype=dtype,
        value=np.asarray(value, dtype=np.int32 if dtype == DT_INT32 else np.float32),
    )


# cond(i, total, n): i < n
LESS = function(
    "less",
    [("i", DT_INT32), ("total", DT_FLOAT), ("n", DT_INT32)],
    [("keep", DT_BOOL)],
    [node("lt", "Less", ["i", "n"], T=DT_INT32)],
    {"keep": "lt:z:0"},
)
# inner body: (j, s, m) -> (j + 1, s + 1, m)
COUNT = function(
    "count",
    [("i", DT_INT32), ("total", DT_FLOAT), ("n", DT_INT32)],
    [("i2", DT_INT32), ("total2", DT_FLOAT), ("n2", DT_INT32)],
    [
        scalar("one", 1, DT_INT32),
        scalar("onef", 1.0, DT_FLOAT),
        node("next", "AddV2", ["i", "one:output:0"], T=DT_INT32),
        node("sum", "AddV2", ["total", "onef:output:0"], T=DT_FLOAT),
    ],
    {"i2": "next:z:0", "total2": "sum:z:0", "n2": "n"},
)


def outer_body():
    """(i, total, n) -> (i + 1, total + (i even ? inner(i) : -inner(i)), n): a loop and a cond inside."""
    negate = function(
        "negate",
        [("x", DT_FLOAT)],
        [("y", DT_FLOAT)],
        [node("neg", "Neg", ["x"], T=DT_FLOAT)],
        {"y": "neg:y:0"},
    )
    keep = function("keep", [("x", DT_FLOAT)], [("y", DT_FLOAT)], [], {"y": "x"})
    body = function(
        "outer",
        [("i", DT_INT32), ("total", DT_FLOAT), ("n", DT_INT32)],
        [("i2", DT_INT32), ("total2", DT_FLOAT), ("n2", DT_INT32)],
        [
            scalar("zero", 0, DT_INT32),
            scalar("zerof", 0.0, DT_FLOAT),
            scalar("one", 1, DT_INT32),
            scalar("two", 2, DT_INT32),
            while_node(
                "inner",
                ["zero:output:0", "zerof:output:0", "i"],
                "less",
                "count",
                [DT_INT32, DT_FLOAT, DT_INT32],
                op="StatelessWhile",
            ),
            node("mod", "FloorMod", ["i", "two:output:0"], T=DT_INT32),
            node("even", "Equal", ["mod:z:0", "zero:output:0"], T=DT_INT32),
            node(
                "pick",
                "StatelessIf",
                ["even:z:0", "inner:output:1"],
                then_branch=func_attr("keep"),
                else_branch=func_attr("negate"),
            ),
            node("next", "AddV2", ["i", "one:output:0"], T=DT_INT32),
            node("sum", "AddV2", ["total", "pick:output:0"], T=DT_FLOAT),
        ],
        {"i2": "next:z:0", "total2": "sum:z:0", "n2": "n"},
    )
    pick = body.node_def[7]
    pick.attr["Tin"].list.type.append(DT_FLOAT)
    pick.attr["Tout"].list.type.append(DT_FLOAT)
    pick.attr["Tcond"].type = DT_BOOL
    return [negate, keep, body]


def loop_graph():
    graph = GraphDef()
    graph.library.function.extend([LESS, COUNT, *outer_body()])
    graph.node.extend(
        [
            node("n", "Placeholder", dtype=DT_INT32),
            scalar("zero", 0, DT_INT32),
            scalar("zerof", 0.0, DT_FLOAT),
            while_node("counted", ["zero", "zerof", "n"], "less", "count", [DT_INT32, DT_FLOAT, DT_INT32]),
            while_node(
                "alternating", ["zero", "zerof", "n"], "less", "outer", [DT_INT32, DT_FLOAT, DT_INT32]
            ),
        ]
    )
    return graph


@pytest.fixture
async def master():
    async with ds.AsyncServer({"localhost": ["localhost:0"]}) as server:
        yield server.master


async def test_loops_count_nest_and_branch(master):
    handle = (await master.create_session(m.CreateSessionRequest(graph_def=loop_graph()))).session_handle
    for n in (0, 1, 5):
        got = await master.run_step(
            handle, {"n:0": np.int32(n)}, ["counted:0", "counted:1", "alternating:1"], []
        )
        assert got["counted:0"] == n
        assert got["counted:1"] == n
        # sum over i < n of (+i if i is even else -i)
        assert got["alternating:1"] == sum(i if i % 2 == 0 else -i for i in range(n))


async def test_a_loop_that_never_ends_stops_with_the_step(master):
    forever = function(
        "forever",
        [("i", DT_INT32)],
        [("keep", DT_BOOL)],
        [node("t", "Const", dtype=DT_BOOL, value=np.bool_(True))],
        {"keep": "t:output:0"},
    )
    step = function(
        "step",
        [("i", DT_INT32)],
        [("i2", DT_INT32)],
        [scalar("one", 1, DT_INT32), node("next", "AddV2", ["i", "one:output:0"], T=DT_INT32)],
        {"i2": "next:z:0"},
    )
    graph = GraphDef()
    graph.library.function.extend([forever, step])
    graph.node.extend(
        [scalar("zero", 0, DT_INT32), while_node("spin", ["zero"], "forever", "step", [DT_INT32])]
    )
    handle = (await master.create_session(m.CreateSessionRequest(graph_def=graph))).session_handle
    with pytest.raises(errors.DeadlineExceededError):
        await master.run_step(handle, {}, ["spin:0"], [], options=RunOptions(timeout_in_ms=300))
    # The session still runs steps afterwards.
    graph = GraphDef()
    graph.node.append(scalar("later", 2, DT_INT32))
    await master.extend_session(
        m.ExtendSessionRequest(session_handle=handle, graph_def=graph, current_graph_version=0)
    )
    assert (await master.run_step(handle, {}, ["later:0"], []))["later:0"] == 2


async def test_a_loop_whose_body_is_malformed_is_refused_when_the_graph_arrives(master):
    bad = function("bad", [("i", DT_INT32)], [("i2", DT_INT32)], [node("s", "Svd", ["i"])], {"i2": "s:s:0"})
    graph = GraphDef()
    graph.library.function.extend([LESS, bad])
    graph.node.extend([scalar("zero", 0, DT_INT32), while_node("w", ["zero"], "less", "bad", [DT_INT32])])
    with pytest.raises(errors.UnimplementedError, match="'Svd'"):
        await master.create_session(m.CreateSessionRequest(graph_def=graph))
    graph.node[1].attr["body"].CopyFrom(func_attr("missing"))
    with pytest.raises(errors.NotFoundError, match="'missing' is not defined"):
        await master.create_session(m.CreateSessionRequest(graph_def=graph))


async def test_a_loop_body_that_loops_over_itself_is_refused(master):
    selfish = function(
        "selfish",
        [("i", DT_INT32), ("total", DT_FLOAT), ("n", DT_INT32)],
        [("i2", DT_INT32), ("total2", DT_FLOAT), ("n2", DT_INT32)],
        [while_node("again", ["i", "total", "n"], "less", "selfish", [DT_INT32, DT_FLOAT, DT_INT32])],
        {"i2": "again:output:0", "total2": "again:output:1", "n2": "n"},
    )
    graph = GraphDef()
    graph.library.function.extend([LESS, selfish])
    graph.node.extend(
        [
            scalar("zero", 0, DT_INT32),
            scalar("zerof", 0.0, DT_FLOAT),
            scalar("n", 1, DT_INT32),
            while_node("w", ["zero", "zerof", "n"], "less", "selfish", [DT_INT32, DT_FLOAT, DT_INT32]),
        ]
    )
    # Loops are lowered (and their bodies inlined) when the graph arrives.
    with pytest.raises(errors.InvalidArgumentError, match="'selfish' calls itself"):
        await master.create_session(m.CreateSessionRequest(graph_def=graph))
