"""Graph functions: FunctionDef instantiation, call inlining, If lowering (runtime/functions.py)."""

from __future__ import annotations

import re

import numpy as np
import pytest

import distserver as ds
from distserver import errors
from distserver.kernels import registered_ops
from distserver.protos import master_pb2 as m
from distserver.protos.attr_value_pb2 import AttrValue
from distserver.protos.function_pb2 import FunctionDef, FunctionDefLibrary
from distserver.protos.graph_pb2 import GraphDef
from distserver.protos.node_def_pb2 import NodeDef
from distserver.protos.types_pb2 import DT_BOOL, DT_FLOAT, DT_INT32, DT_RESOURCE
from distserver.runtime import functions
from distserver.runtime.functions import (
    INLINED_OPS,
    index_library,
    inline_functions,
    instantiate,
    op_signatures,
)
from distserver.tensors import to_tensor_proto


def node(name, op, inputs=(), device="", **attrs):
    made = NodeDef(name=name, op=op, input=list(inputs), device=device)
    for key, value in attrs.items():
        if isinstance(value, AttrValue):
            made.attr[key].CopyFrom(value)
        elif isinstance(value, np.ndarray | np.generic):
            made.attr[key].tensor.CopyFrom(to_tensor_proto(value))
        elif isinstance(value, int):
            made.attr[key].type = value
        else:
            raise TypeError(value)
    return made


def placeholder(name):
    return AttrValue(placeholder=name)


def int_attr(value):
    return AttrValue(i=value)


def func_attr(name, **attrs):
    value = AttrValue()
    value.func.name = name
    for key, attr in attrs.items():
        value.func.attr[key].CopyFrom(attr)
    return value


def function(name, inputs, outputs, body, ret, *, attrs=(), control_ret=None):
    """inputs/outputs: [(name, DataType or attr name)]."""
    made = FunctionDef()
    made.signature.name = name
    for arg_name, dtype in inputs:
        arg = made.signature.input_arg.add(name=arg_name)
        if isinstance(dtype, str):
            arg.type_attr = dtype
        else:
            arg.type = dtype
    for arg_name, dtype in outputs:
        arg = made.signature.output_arg.add(name=arg_name)
        if isinstance(dtype, str):
            arg.type_attr = dtype
        else:
            arg.type = dtype
    for attr in attrs:
        made.signature.attr.add(name=attr, type="type")
    made.node_def.extend(body)
    made.ret.update(ret)
    for key, target in (control_ret or {}).items():
        made.signature.control_output.append(key)
        made.control_ret[key] = target
    return made


def library(*defs):
    lib = FunctionDefLibrary()
    lib.function.extend(defs)
    return index_library(lib)


SCALE = function(
    "scale",
    [("x", "T"), ("k", "T")],
    [("y", "T")],
    [node("mul", "Mul", ["x", "k"], T=placeholder("T"))],
    {"y": "mul:z:0"},
    attrs=["T"],
)


def test_the_op_table_covers_every_registered_kernel_and_the_inlined_ops():
    table = op_signatures()
    missing = sorted((set(registered_ops()) | INLINED_OPS) - set(table))
    assert not missing, f"run scripts/gen_op_signatures.py; no signature for {missing}"
    assert table["Unpack"]["outputs"] == [["output", "num"]]
    assert table["Switch"]["outputs"] == [["output_false", 1], ["output_true", 1]]
    assert table["IdentityN"]["outputs"] == [["output", "list:T"]]


def test_instantiate_substitutes_attrs_and_makes_args_and_retvals():
    body = instantiate(library(SCALE), "scale", {"T": AttrValue(type=DT_FLOAT)})
    nodes = {n.name: n for n in body.graph_def.node}
    assert body.args == ["x", "k"]
    assert body.retvals == ["y_RetVal"]
    assert body.arg_types == [DT_FLOAT, DT_FLOAT]
    assert body.ret_types == [DT_FLOAT]
    assert nodes["x"].op == "_Arg"
    assert nodes["x"].attr["index"].i == 0
    assert nodes["k"].attr["index"].i == 1
    assert nodes["k"].attr["T"].type == DT_FLOAT
    assert list(nodes["mul"].input) == ["x:0", "k:0"]
    assert nodes["mul"].attr["T"].type == DT_FLOAT
    assert nodes["y_RetVal"].op == "_Retval"
    assert list(nodes["y_RetVal"].input) == ["mul:0"]


def test_instantiate_flattens_list_outputs_by_their_attrs():
    f = function(
        "pick",
        [("v", DT_FLOAT), ("p", DT_BOOL)],
        [("third", DT_FLOAT), ("taken", DT_FLOAT)],
        [
            node("parts", "Unpack", ["v"], T=DT_FLOAT, num=int_attr(4)),
            node("sw", "Switch", ["parts:output:2", "p", "^parts"], T=DT_FLOAT),
        ],
        {"third": "parts:output:2", "taken": "sw:output_true:0"},
    )
    body = instantiate(library(f), "pick", {})
    nodes = {n.name: n for n in body.graph_def.node}
    assert list(nodes["sw"].input) == ["parts:2", "p:0", "^parts"]
    assert list(nodes["third_RetVal"].input) == ["parts:2"]
    assert list(nodes["taken_RetVal"].input) == ["sw:1"]


@pytest.mark.parametrize(
    ("body", "ret", "error", "text"),
    [
        ([node("n", "Svd", ["x"])], {"y": "n:s:0"}, errors.UnimplementedError, "op 'Svd'"),
        (
            [node("n", "Neg", ["x"], T=DT_FLOAT)],
            {"y": "n:out:0"},
            errors.InvalidArgumentError,
            "no output 'out'",
        ),
        ([node("n", "Neg", ["x"], T=DT_FLOAT)], {"y": "n:y:1"}, errors.InvalidArgumentError, "has 1 tensors"),
        (
            [node("n", "Neg", ["z"], T=DT_FLOAT)],
            {"y": "n:y:0"},
            errors.InvalidArgumentError,
            "'z' is not an argument",
        ),
        (
            [node("n", "Neg", ["x", "^q"], T=DT_FLOAT)],
            {"y": "n:y:0"},
            errors.InvalidArgumentError,
            "'^q' names no",
        ),
        ([node("n", "Neg", ["x"], T=placeholder("U"))], {"y": "n:y:0"}, errors.InvalidArgumentError, "'$U'"),
        ([node("n", "Unpack", ["x"], T=DT_FLOAT)], {"y": "n:output:0"}, errors.InvalidArgumentError, "'num'"),
        ([node("n", "Neg", ["x"], T=DT_FLOAT)], {}, errors.InvalidArgumentError, "output 'y'"),
    ],
)
def test_instantiate_refuses_malformed_bodies_clearly(body, ret, error, text):
    f = function("f", [("x", DT_FLOAT)], [("y", DT_FLOAT)], body, ret)
    with pytest.raises(error, match=f"Function 'f'.*{re.escape(text)}"):
        instantiate(library(f), "f", {})


def test_instantiate_names_an_unknown_function_and_a_missing_type_attr():
    with pytest.raises(errors.NotFoundError, match="Function 'nope' is not defined"):
        instantiate(library(SCALE), "nope", {})
    with pytest.raises(errors.InvalidArgumentError, match=r"attr 'T' .*not given"):
        instantiate(library(SCALE), "scale", {})


def test_two_different_functions_of_one_name_are_refused():
    other = function("scale", [], [], [], {})
    with pytest.raises(errors.InvalidArgumentError, match="different function with the same name"):
        library(SCALE, other)


def call(name, f, inputs, device="", **attrs):
    return node(name, "StatefulPartitionedCall", inputs, device=device, f=func_attr(f, **attrs))


def test_inlining_renames_the_body_and_keeps_the_call_fetchable():
    graph = [
        node("a", "Placeholder", dtype=DT_FLOAT),
        node("go", "NoOp"),
        call("c", "scale", ["a", "a", "^go"], device="/job:ps/task:0", T=AttrValue(type=DT_FLOAT)),
        node("after", "Neg", ["c:0"], T=DT_FLOAT),
    ]
    out = {n.name: n for n in inline_functions(graph, library(SCALE))}
    assert set(out) == {"a", "go", "c/input_control_node", "c/x", "c/k", "c/mul", "c", "after"}
    assert list(out["c/x"].input) == ["a", "^c/input_control_node"]
    assert list(out["c/input_control_node"].input) == ["^go"]
    assert list(out["c/mul"].input) == ["c/x:0", "c/k:0"]
    assert out["c/mul"].device == "/job:ps/task:0"
    assert out["c"].op == "IdentityN"
    assert list(out["c"].input) == ["c/mul:0"]
    assert list(out["after"].input) == ["c:0"]


def test_nested_calls_by_op_name_and_device_merging():
    outer = function(
        "outer",
        [("x", DT_FLOAT)],
        [("y", DT_FLOAT)],
        [node("inner", "scale", ["x", "x"], device="/device:CPU:0", T=AttrValue(type=DT_FLOAT))],
        {"y": "inner:y:0"},
    )
    graph = [node("a", "Placeholder", dtype=DT_FLOAT), call("c", "outer", ["a"], device="/job:worker/task:1")]
    out = {n.name: n for n in inline_functions(graph, library(SCALE, outer))}
    assert out["c/inner/mul"].device == "/job:worker/task:1/device:CPU:0"
    assert list(out["c/inner/x"].input) == ["c/x:0"]
    assert list(out["c"].input) == ["c/inner:0"]


def test_hostile_libraries_get_clear_errors():
    selfish = function(
        "loop", [("x", DT_FLOAT)], [("y", DT_FLOAT)], [node("n", "loop", ["x"])], {"y": "n:y:0"}
    )
    with pytest.raises(errors.InvalidArgumentError, match=r"'loop' calls itself \(loop -> loop\)"):
        inline_functions([node("a", "Placeholder"), call("c", "loop", ["a"])], library(selfish))
    chain = [
        function(
            f"f{i}", [("x", DT_FLOAT)], [("y", DT_FLOAT)], [node("n", f"f{i + 1}", ["x"])], {"y": "n:y:0"}
        )
        for i in range(functions.MAX_NESTING + 1)
    ]
    chain.append(
        function(f"f{functions.MAX_NESTING + 1}", [("x", DT_FLOAT)], [("y", DT_FLOAT)], [], {"y": "x"})
    )
    with pytest.raises(errors.InvalidArgumentError, match="nest deeper than"):
        inline_functions([node("a", "Placeholder"), call("c", "f0", ["a"])], library(*chain))
    with pytest.raises(errors.InvalidArgumentError, match="with 1 inputs; it takes 2"):
        inline_functions(
            [node("a", "Placeholder"), call("c", "scale", ["a"], T=AttrValue(type=DT_FLOAT))], library(SCALE)
        )
    with pytest.raises(errors.NotFoundError, match=r"'nope' is not defined.*called by node 'c'"):
        inline_functions([call("c", "nope", [])], library(SCALE))


def test_a_wide_library_is_bounded_in_nodes(monkeypatch):
    monkeypatch.setattr(functions, "MAX_INLINED_NODES", 50)
    wide = function(
        "wide",
        [("x", DT_FLOAT)],
        [("y", DT_FLOAT)],
        [node(f"n{i}", "scale", ["x", "x"], T=AttrValue(type=DT_FLOAT)) for i in range(20)],
        {"y": "n0:y:0"},
    )
    with pytest.raises(errors.InvalidArgumentError, match="more than 50 nodes"):
        inline_functions([node("a", "Placeholder"), call("c", "wide", ["a"])], library(SCALE, wide))


# ---- end to end through a master: calls and If run on the kernels


def branch(name, op):
    return function(
        name,
        [("x", DT_FLOAT), ("v", DT_RESOURCE)],
        [("y", DT_FLOAT)],
        [
            node("one", "Const", dtype=DT_FLOAT, value=np.float32(1)),
            node("bump", "AssignAddVariableOp", ["v", "one:output:0"], dtype=DT_FLOAT),
            node("out", op, ["x"], T=DT_FLOAT),
        ],
        {"y": "out:y:0"},
        control_ret={"bump": "bump"},
    )


def if_graph():
    then_f, else_f = branch("then_f", "Neg"), branch("else_f", "Square")
    graph = GraphDef()
    graph.library.function.extend([then_f, else_f, SCALE])
    graph.node.extend(
        [
            node("p", "Placeholder", dtype=DT_BOOL),
            node("x", "Placeholder", dtype=DT_FLOAT),
            node(
                "v", "VarHandleOp", dtype=DT_FLOAT, shape=AttrValue(shape={}), shared_name=AttrValue(s=b"v")
            ),
            node("zero", "Const", dtype=DT_FLOAT, value=np.float32(0)),
            node("init", "AssignVariableOp", ["v", "zero"], dtype=DT_FLOAT),
            node("read", "ReadVariableOp", ["v"], dtype=DT_FLOAT),
            node(
                "cond",
                "If",
                ["p", "x", "v"],
                Tcond=DT_BOOL,
                then_branch=func_attr("then_f"),
                else_branch=func_attr("else_f"),
            ),
            call("scaled", "scale", ["cond:0", "x"], T=AttrValue(type=DT_FLOAT)),
        ]
    )
    tin = graph.node[6].attr["Tin"].list.type
    tin.extend([DT_FLOAT, DT_RESOURCE])
    graph.node[6].attr["Tout"].list.type.extend([DT_FLOAT])
    return graph


async def test_a_session_runs_calls_and_lowered_ifs():
    async with ds.AsyncServer({"localhost": ["localhost:0"]}) as server:
        master = server.master
        handle = (await master.create_session(m.CreateSessionRequest(graph_def=if_graph()))).session_handle
        await master.run_step(handle, {}, [], ["init"])
        x = np.float32(3)
        taken = await master.run_step(handle, {"p:0": np.bool_(True), "x:0": x}, ["cond:0", "scaled:0"], [])
        assert taken["cond:0"] == -3
        assert taken["scaled:0"] == -9
        assert (await master.run_step(handle, {}, ["read:0"], []))["read:0"] == 1  # one branch's side effect
        other = await master.run_step(handle, {"p:0": np.bool_(False), "x:0": x}, ["cond:0"], [])
        assert other["cond:0"] == 9
        assert (await master.run_step(handle, {}, ["read:0"], []))["read:0"] == 2
        # ^cond runs the taken branch's side effects.
        await master.run_step(handle, {"p:0": np.bool_(True), "x:0": x}, [], ["cond"])
        assert (await master.run_step(handle, {}, ["read:0"], []))["read:0"] == 3

        # ExtendSession: a later graph calls a function of the first one's library.
        extension = GraphDef()
        extension.node.append(call("again", "scale", ["x", "x"], T=AttrValue(type=DT_FLOAT)))
        await master.extend_session(
            m.ExtendSessionRequest(session_handle=handle, graph_def=extension, current_graph_version=0)
        )
        assert (await master.run_step(handle, {"x:0": x}, ["again:0"], []))["again:0"] == 9


def test_readers_of_a_variable_passed_to_a_function_are_placed_with_the_variable():
    from distserver.runtime.placement import place

    reader = function(
        "reader",
        [("v", DT_RESOURCE)],
        [("y", DT_FLOAT)],
        [
            node("read", "ReadVariableOp", ["v"], dtype=DT_FLOAT),
            node("neg", "Neg", ["read:value:0"], T=DT_FLOAT),
        ],
        {"y": "neg:y:0"},
    )
    ps, worker = "/job:ps/replica:0/task:0/device:CPU:0", "/job:worker/replica:0/task:0/device:CPU:0"
    graph = [
        node("v", "VarHandleOp", device="/job:ps/task:0", dtype=DT_FLOAT),
        call("c", "reader", ["v"], device=worker),
    ]
    nodes = inline_functions(graph, library(reader))
    place(nodes, devices=[ps, worker], client_device=worker)
    devices = {n.name: n.device for n in nodes}
    assert devices["c/v"] == devices["c/read"] == ps  # the handle's Identity and its reader
    assert devices["c/neg"] == worker


async def test_a_session_runs_a_lowered_case_with_the_last_branch_for_indexes_out_of_range():
    def unary(name, op):
        return function(
            name, [("x", DT_FLOAT)], [("y", DT_FLOAT)], [node("out", op, ["x"], T=DT_FLOAT)], {"y": "out:y:0"}
        )

    graph = GraphDef()
    graph.library.function.extend([unary("neg", "Neg"), unary("square", "Square"), unary("exp", "Exp")])
    case = node("case", "Case", ["i", "x"])
    case.attr["branches"].list.func.extend([func_attr(name).func for name in ("neg", "square", "exp")])
    case.attr["Tin"].list.type.append(DT_FLOAT)
    case.attr["Tout"].list.type.append(DT_FLOAT)
    graph.node.extend(
        [node("i", "Placeholder", dtype=DT_INT32), node("x", "Placeholder", dtype=DT_FLOAT), case]
    )
    async with ds.AsyncServer({"localhost": ["localhost:0"]}) as server:
        master = server.master
        handle = (await master.create_session(m.CreateSessionRequest(graph_def=graph))).session_handle
        x = np.float32(2)
        for index, expected in ((0, -2.0), (1, 4.0), (2, np.exp(2.0)), (5, np.exp(2.0)), (-1, np.exp(2.0))):
            got = await master.run_step(handle, {"i:0": np.int32(index), "x:0": x}, ["case:0"], [])
            np.testing.assert_allclose(got["case:0"], expected, rtol=1e-6)
