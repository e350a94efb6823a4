"""The backward pass of a dense layer run as one node (`executor._fuse_dense_gradients`,
`kernels.math.FusedMatMulGradKernel`): fewer nodes, the same bits, errors naming the
part, and nothing fused that something else reads or that would wait for itself."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import distserver as ds
from distserver import errors
from distserver.kernels import create_kernel
from distserver.kernels.math import DENSE_STACK_OP, FUSED_MATMUL_GRAD_OP, FUSED_NODES_ATTR
from distserver.protos.attr_value_pb2 import AttrValue
from distserver.protos.node_def_pb2 import NodeDef
from distserver.protos.types_pb2 import DT_BOOL, DT_DOUBLE, DT_FLOAT, DT_HALF, DT_INT32
from distserver.runtime.executor import Executor

F32 = np.float32
RNG = np.random.default_rng(5)
X = RNG.standard_normal((64, 40)).astype(F32)
W1 = RNG.standard_normal((40, 24)).astype(F32) * F32(0.3)
B1 = RNG.standard_normal(24).astype(F32)
W2 = RNG.standard_normal((24, 16)).astype(F32) * F32(0.3)
B2 = RNG.standard_normal(16).astype(F32)
TARGET = RNG.standard_normal((64, 16)).astype(F32)

# activation -> (graph op, numpy forward, numpy gradient(output, dy))
_ACTIVATIONS: dict[str, tuple[Callable[[Any], Any], Callable[..., Any], Callable[..., Any]]] = {
    "Tanh": (ds.tanh, np.tanh, lambda y, dy: dy * (1 - y * y)),
    "Sigmoid": (ds.sigmoid, lambda x: 1 / (1 + np.exp(-x)), lambda y, dy: dy * y * (1 - y)),
    "Relu": (ds.relu, lambda x: np.maximum(x, F32(0)), lambda y, dy: dy * (y > 0)),
}


def _live_ops(graph_def: Any) -> list[str]:
    """The ops the executor of `graph_def` runs (after leaving out and fusing nodes), a
    stack of fused gradients (`test_dense_stacks.py`) counted as its members."""
    ops = []
    for node in Executor(graph_def)._nodes:
        if not node.left_out:
            stacked = node.kernel.op == DENSE_STACK_OP
            ops += [member.op for member in node.kernel.members] if stacked else [node.kernel.op]
    return ops


def _two_layers(activation: str) -> tuple[ds.Graph, Any, list[Any]]:
    """relu(x @ w1 + b1), then `activation`; the loss sum(y * target); the gradients
    of w1, b1, w2, b2."""
    with ds.Graph().as_default() as graph:
        x = ds.placeholder(ds.float32, [64, 40], name="x")
        w1, b1 = ds.constant(W1, name="w1"), ds.constant(B1, name="b1")
        w2, b2 = ds.constant(W2, name="w2"), ds.constant(B2, name="b2")
        hidden = ds.relu(ds.matmul(x, w1) + b1)
        y = _ACTIVATIONS[activation][0](ds.matmul(hidden, w2) + b2)
        loss = ds.reduce_sum(y * ds.constant(TARGET))
        grads = ds.gradients(loss, [w1, b1, w2, b2])
    return graph, x, grads


@pytest.mark.parametrize("activation", list(_ACTIVATIONS))
def test_a_dense_layers_gradients_run_as_one_node_with_the_bits_of_its_parts(server, activation):
    graph, x, grads = _two_layers(activation)
    ops = _live_ops(graph.as_graph_def())
    assert ops.count(FUSED_MATMUL_GRAD_OP) == 2
    assert ops.count("MatMul") == 2  # (the forward products: the worker fuses those, `fuse_dense_layers`)
    assert not {"TanhGrad", "SigmoidGrad", "ReluGrad"} & set(ops)

    with ds.Session(server.target, graph=graph) as sess:
        got = sess.run(grads, {x: X})
    _, forward, gradient = _ACTIVATIONS[activation]
    hidden = np.maximum(np.matmul(X, W1) + B1, F32(0))
    y = forward(np.matmul(hidden, W2) + B2).astype(F32)
    g2 = gradient(y, TARGET).astype(F32)
    g1 = np.matmul(g2, W2.T) * (hidden > 0)
    want = [np.matmul(X.T, g1), np.add.reduce(g1, axis=0), np.matmul(hidden.T, g2), np.add.reduce(g2, axis=0)]
    for got_value, want_value in zip(got, want, strict=True):
        assert got_value.dtype == F32
        assert got_value.shape == want_value.shape
        np.testing.assert_array_equal(got_value.view(np.uint32), want_value.view(np.uint32))


_TYPES = {
    np.float32: (ds.float32, DT_FLOAT),
    np.float64: (ds.float64, DT_DOUBLE),
    np.float16: (ds.float16, DT_HALF),
}


def _gradient_graph(
    axes: list[int],
    shape: list[int],
    h_from_bias: bool = False,
    dtype: type = np.float32,
    keep_dims: bool = True,
) -> tuple[ds.Graph, dict[str, Any]]:
    """The five nodes of a layer's gradient as TensorFlow 2 writes them (the Sum keeps
    its dims), with `axes` for the Sum and `shape` for the Reshape; y, dy and h fed (or
    h computed from the bias's gradient)."""
    tensor_type, datatype = _TYPES[dtype]
    with ds.Graph().as_default() as graph:
        y = ds.placeholder(tensor_type, None, name="y")
        dy = ds.placeholder(tensor_type, None, name="dy")
        h = ds.placeholder(tensor_type, None, name="h")
        w = ds.constant(W2.astype(dtype), name="w")
        t = {"T": AttrValue(type=datatype)}
        g = graph.create_op("TanhGrad", [y, dy], [tensor_type], name="g", attrs=t).outputs[0]
        summed = graph.create_op(
            "Sum",
            [g, ds.constant(np.array(axes, np.int32))],
            [tensor_type],
            name="bias_sum",
            attrs={**t, "Tidx": AttrValue(type=DT_INT32), "keep_dims": AttrValue(b=keep_dims)},
        ).outputs[0]
        bias = graph.create_op(
            "Reshape",
            [summed, ds.constant(np.array(shape, np.int32))],
            [tensor_type],
            name="bias",
            attrs={**t, "Tshape": AttrValue(type=DT_INT32)},
        ).outputs[0]
        lhs = ds.tile(ds.reshape(ds.concat([bias, bias[:8]], 0), [1, 24]), [64, 1]) if h_from_bias else h
        weights = ds.matmul(lhs, g, transpose_a=True, name="weights")
        layer_input = ds.matmul(g, w, transpose_b=True, name="layer_input")
    return graph, {"y": y, "dy": dy, "h": h, "g": g, "outputs": [bias, weights, layer_input]}


def _feeds(parts: dict[str, Any], rows: int = 64, dtype: type = np.float32) -> dict[Any, np.ndarray]:
    y = np.tanh(RNG.standard_normal((64, 16))).astype(dtype)
    h = RNG.standard_normal((rows, 24)).astype(dtype)
    return {parts["y"]: y, parts["dy"]: TARGET.astype(dtype), parts["h"]: h}


@pytest.mark.parametrize("dtype", [np.float64, np.float16])
def test_float64_gradients_are_fused_and_float16_ones_are_not(server, dtype):
    graph, parts = _gradient_graph(axes=[0], shape=[16], dtype=dtype)
    assert (FUSED_MATMUL_GRAD_OP in _live_ops(graph.as_graph_def())) == (dtype == np.float64)
    feeds = _feeds(parts, dtype=dtype)
    with ds.Session(server.target, graph=graph) as sess:
        bias, weights, layer_input = sess.run(parts["outputs"], feeds)
    y, dy, h = feeds[parts["y"]], feeds[parts["dy"]], feeds[parts["h"]]
    if dtype == np.float16:  # (computed in float32, as TensorFlow's kernels do)
        y, dy, h = y.astype(F32), dy.astype(F32), h.astype(F32)
    g = (dy * (1 - y * y)).astype(dtype)
    np.testing.assert_array_equal(bias, np.add.reduce(g.astype(y.dtype), axis=0).astype(dtype))
    np.testing.assert_array_equal(weights, np.matmul(h.T, g.astype(y.dtype)).astype(dtype))
    np.testing.assert_array_equal(
        layer_input, np.matmul(g.astype(y.dtype), W2.astype(dtype).astype(y.dtype).T).astype(dtype)
    )


@pytest.mark.parametrize("keep_dims", [True, False])
def test_tensorflows_bias_gradient_with_or_without_kept_dims_is_fused(server, keep_dims):
    graph, parts = _gradient_graph(axes=[0], shape=[16], keep_dims=keep_dims)
    assert _live_ops(graph.as_graph_def()).count(FUSED_MATMUL_GRAD_OP) == 1
    feeds = _feeds(parts)
    with ds.Session(server.target, graph=graph) as sess:
        bias, weights, layer_input = sess.run(parts["outputs"], feeds)
    g = TARGET * (1 - feeds[parts["y"]] * feeds[parts["y"]])
    assert bias.shape == (16,)
    np.testing.assert_array_equal(bias, np.add.reduce(g, axis=0))
    np.testing.assert_array_equal(weights, np.matmul(feeds[parts["h"]].T, g))
    np.testing.assert_array_equal(layer_input, np.matmul(g, W2.T))


def test_inputs_the_fast_path_does_not_take_go_through_the_parts(server):
    # Sum over axis 1 and a Reshape to [64]: fused all the same (the pass looks at the
    # wiring, not at the values), computed by the parts' kernels.
    graph, parts = _gradient_graph(axes=[1], shape=[64])
    assert FUSED_MATMUL_GRAD_OP in _live_ops(graph.as_graph_def())
    feeds = _feeds(parts)
    with ds.Session(server.target, graph=graph) as sess:
        bias, weights, layer_input = sess.run(parts["outputs"], feeds)
    g = TARGET * (1 - feeds[parts["y"]] * feeds[parts["y"]])
    np.testing.assert_array_equal(bias, np.add.reduce(g, axis=1))
    np.testing.assert_array_equal(weights, np.matmul(feeds[parts["h"]].T, g))
    np.testing.assert_array_equal(layer_input, np.matmul(g, W2.T))


def test_a_fused_gradient_reports_bad_inputs_as_its_part_would(server):
    graph, parts = _gradient_graph(axes=[0], shape=[16])
    with ds.Session(server.target, graph=graph) as sess:
        with pytest.raises(
            errors.InvalidArgumentError, match=r"(?s)Matrix size-incompatible.*\{\{node weights\}\}"
        ):
            sess.run(parts["outputs"], _feeds(parts, rows=7))
        feeds = _feeds(parts)
        feeds[parts["dy"]] = TARGET[:, :5].copy()
        with pytest.raises(errors.InvalidArgumentError, match=r"(?s)same shape.*\{\{node g\}\}"):
            sess.run(parts["outputs"], feeds)
    graph, parts = _gradient_graph(axes=[0], shape=[15])
    with (
        ds.Session(server.target, graph=graph) as sess,
        pytest.raises(errors.InvalidArgumentError, match=r"(?s)requested shape.*\{\{node bias\}\}"),
    ):
        sess.run(parts["outputs"], _feeds(parts))


def test_a_gradient_something_else_reads_is_not_fused(server):
    graph, parts = _gradient_graph(axes=[0], shape=[16])
    with graph.as_default():
        also = ds.reduce_max(parts["g"], name="also")
    assert FUSED_MATMUL_GRAD_OP not in _live_ops(graph.as_graph_def())
    feeds = _feeds(parts)
    with ds.Session(server.target, graph=graph) as sess:
        bias, got_also = sess.run([parts["outputs"][0], also], feeds)
    g = TARGET * (1 - feeds[parts["y"]] * feeds[parts["y"]])
    np.testing.assert_array_equal(bias, np.add.reduce(g, axis=0))
    assert got_also == g.max()


def test_parts_that_would_wait_for_the_fused_node_are_not_fused(server):
    # The weights' product reads h computed from the bias's gradient: one node for both
    # would wait for itself.
    graph, parts = _gradient_graph(axes=[0], shape=[16], h_from_bias=True)
    ops = _live_ops(graph.as_graph_def())
    assert FUSED_MATMUL_GRAD_OP not in ops
    assert "TanhGrad" in ops
    feeds = _feeds(parts)
    with ds.Session(server.target, graph=graph) as sess:
        got = sess.run(parts["outputs"][1], feeds)
    g = TARGET * (1 - feeds[parts["y"]] * feeds[parts["y"]])
    b = np.add.reduce(g, axis=0)
    np.testing.assert_array_equal(got, np.matmul(np.tile(np.concatenate([b, b[:8]])[None], (64, 1)).T, g))


def test_what_waited_for_a_part_waits_for_the_fused_node(server):
    graph, parts = _gradient_graph(axes=[0], shape=[16])
    with graph.as_default():
        weights = parts["outputs"][1]
        total = ds.reduce_sum(weights, name="total")  # (a product only waited for is never computed)
        with ds.control_dependencies([weights.op, parts["g"].op]):
            after = ds.identity(parts["dy"], name="after_weights")
    assert FUSED_MATMUL_GRAD_OP in _live_ops(graph.as_graph_def())
    feeds = _feeds(parts)
    with ds.Session(server.target, graph=graph) as sess:
        got_after, got_total = sess.run([after, total], feeds)
    np.testing.assert_array_equal(got_after, TARGET)
    g = TARGET * (1 - feeds[parts["y"]] * feeds[parts["y"]])
    assert got_total == np.sum(np.matmul(feeds[parts["h"]].T, g))


def test_a_graph_with_a_switch_keeps_its_gradients_apart():
    graph, parts = _gradient_graph(axes=[0], shape=[16])
    graph_def = graph.as_graph_def()
    predicate = graph_def.node.add(name="predicate", op="Const")
    predicate.attr["dtype"].type = DT_BOOL
    predicate.attr["value"].tensor.dtype = DT_BOOL
    predicate.attr["value"].tensor.bool_val.append(True)
    switch = graph_def.node.add(name="switch", op="Switch", input=[parts["dy"].op.name, "predicate"])
    switch.attr["T"].type = DT_FLOAT
    ops = _live_ops(graph_def)
    assert FUSED_MATMUL_GRAD_OP not in ops
    assert "TanhGrad" in ops


def test_a_fused_gradient_node_with_other_parts_is_refused():
    def fused(*parts: NodeDef, products: int | None = None) -> NodeDef:
        node = NodeDef(name="layer_grad", op=FUSED_MATMUL_GRAD_OP)
        node.attr["T"].CopyFrom(AttrValue(type=DT_FLOAT))
        node.attr["N"].CopyFrom(AttrValue(i=max(len(parts) - 4, 0) if products is None else products))
        node.attr[FUSED_NODES_ATTR].list.s.extend(part.SerializeToString() for part in parts)
        return node

    def part(name: str, op: str, *inputs: str, **flags: bool) -> NodeDef:
        node = NodeDef(name=name, op=op, input=list(inputs))
        node.attr["T"].CopyFrom(AttrValue(type=DT_FLOAT))
        for key, value in flags.items():
            node.attr[key].CopyFrom(AttrValue(b=value))
        return node

    good = [
        part("g", "TanhGrad", "y", "dy"),
        part("s", "Sum", "g", "axes"),
        part("r", "Reshape", "s", "shape"),
        part("m", "MatMul", "h", "g", transpose_a=True),
    ]
    assert create_kernel(fused(*good)).op == FUSED_MATMUL_GRAD_OP
    for bad in (
        [part("g", "Tanh", "y"), *good[1:]],  # not a gradient
        [good[0], part("s", "Sum", "other", "axes"), *good[2:]],  # a Sum of something else
        [*good[:3], part("m", "MatMul", "h", "g")],  # no transpose_a
        [*good, part("i", "MatMul", "g", "w")],  # the input's product without transpose_b
        good[:3],
    ):
        with pytest.raises(errors.InvalidArgumentError, match="expected one of"):
            create_kernel(fused(*bad))
    with pytest.raises(errors.InvalidArgumentError, match="has N = 1, but 0 products"):
        create_kernel(fused(*good, products=1))
    broken = fused(*good)
    broken.attr[FUSED_NODES_ATTR].list.s.append(b"\xff\xff")
    with pytest.raises(errors.InvalidArgumentError, match="not a NodeDef"):
        create_kernel(broken)
