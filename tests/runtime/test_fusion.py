"""Dense layers fused when a worker registers a graph (`runtime.fusion`): fewer nodes,
the same bits, the same errors, and nothing fused that something else reads."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import distserver as ds
from distserver import errors
from distserver.kernels.math import FUSED_MATMUL_OP, FUSED_NODES_ATTR
from distserver.protos.attr_value_pb2 import AttrValue
from distserver.protos.node_def_pb2 import NodeDef
from distserver.runtime.fusion import fuse_dense_layers

RNG = np.random.default_rng(7)
X = RNG.standard_normal((64, 40)).astype(np.float32)
W = RNG.standard_normal((40, 24)).astype(np.float32)
B = RNG.standard_normal(24).astype(np.float32)

_ADDS: dict[str, Callable[[Any, Any], Any]] = {
    "AddV2": lambda product, bias: product + bias,
    "AddV2, bias first": lambda product, bias: bias + product,
    "BiasAdd": lambda product, bias: ds.bias_add(product, bias),
}
_ACTIVATIONS: dict[str, tuple[Callable[[Any], Any] | None, Callable[[np.ndarray], np.ndarray]]] = {
    "none": (None, lambda x: x),
    "Tanh": (ds.tanh, np.tanh),
    "Relu": (ds.relu, lambda x: np.maximum(x, np.float32(0))),
    "Sigmoid": (ds.sigmoid, lambda x: 1 / (1 + np.exp(-x))),
}


def _layer(add: str, activation: str, transpose_b: bool = False) -> tuple[ds.Graph, Any, Any]:
    with ds.Graph().as_default() as graph:
        x = ds.placeholder(ds.float32, [None, 40], name="x")
        w = ds.constant(W.T.copy() if transpose_b else W, name="w")
        b = ds.constant(B, name="b")
        y = _ADDS[add](ds.matmul(x, w, transpose_b=transpose_b, name="product"), b)
        tf_activation = _ACTIVATIONS[activation][0]
        if tf_activation is not None:
            y = tf_activation(y)
    return graph, x, y


@pytest.mark.parametrize("activation", list(_ACTIVATIONS))
@pytest.mark.parametrize("add", list(_ADDS))
def test_a_dense_layer_runs_as_one_node_with_the_bits_of_its_parts(server, add, activation):
    graph, x, y = _layer(add, activation, transpose_b=add == "BiasAdd")
    fused = fuse_dense_layers(graph.as_graph_def())
    ops = [node.op for node in fused.node]
    assert ops.count(FUSED_MATMUL_OP) == 1
    assert not {"MatMul", "AddV2", "BiasAdd", "Tanh", "Relu", "Sigmoid"} & set(ops)
    (node,) = [node for node in fused.node if node.op == FUSED_MATMUL_OP]
    assert node.name == y.op.name  # consumers of the layer read it by the same name

    with ds.Session(server.target, graph=graph) as sess:
        got = sess.run(y, {x: X})
    product = np.matmul(X, W.T.copy().T if add == "BiasAdd" else W)  # (BLAS reads a transposed b its own way)
    sum_ = product + B if add != "AddV2, bias first" else B + product
    want = _ACTIVATIONS[activation][1](sum_)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


def test_inner_values_that_something_else_reads_are_not_fused(server):
    with ds.Graph().as_default() as graph:
        x = ds.placeholder(ds.float32, [None, 40], name="x")
        product = ds.matmul(x, ds.constant(W), name="product")
        sum_ = ds.add(product, ds.constant(B), name="sum")
        y = ds.tanh(sum_, name="y")
        also = ds.reduce_sum(product, name="also")  # a second reader of the product
    assert fuse_dense_layers(graph.as_graph_def()).node[:] == graph.as_graph_def().node[:]

    with ds.Graph().as_default() as graph:
        x = ds.placeholder(ds.float32, [None, 40], name="x")
        sum_ = ds.add(ds.matmul(x, ds.constant(W), name="product"), ds.constant(B), name="sum")
        with ds.control_dependencies([sum_]):  # a control edge out of the sum
            marker = ds.identity(x, name="after_sum")
        y = ds.tanh(sum_, name="y")
    ops = {node.name: node.op for node in fuse_dense_layers(graph.as_graph_def()).node}
    assert (ops["sum"], ops["y"]) == (FUSED_MATMUL_OP, "Tanh")  # MatMul + add fused, not the Tanh
    with ds.Session(server.target, graph=graph) as sess:
        got_y, got_marker = sess.run([y, marker], {x: X})
    np.testing.assert_array_equal(got_y, np.tanh(np.matmul(X, W) + B))
    np.testing.assert_array_equal(got_marker, X)
    # A fetched product, or a sum fetched with the layer: read by the client, so left as is.
    with ds.Session(server.target, graph=graph) as sess:
        product_node = graph.get_operation_by_name("product").outputs[0]
        got_product, got_y = sess.run([product_node, y], {x: X})
    np.testing.assert_array_equal(got_product, np.matmul(X, W))
    np.testing.assert_array_equal(got_y, np.tanh(np.matmul(X, W) + B))
    del also


def test_a_sum_of_two_products_is_fused_with_one_of_them(server):
    # An RNN cell: tanh(h @ w + x @ u). The add reads both products; one chain takes it.
    with ds.Graph().as_default() as graph:
        h = ds.placeholder(ds.float32, [None, 40], name="h")
        x = ds.placeholder(ds.float32, [None, 40], name="x")
        first = ds.matmul(h, ds.constant(W), name="first")
        second = ds.matmul(x, ds.constant(W[::-1].copy()), name="second")
        y = ds.tanh(first + second, name="y")
    ops = {node.name: node.op for node in fuse_dense_layers(graph.as_graph_def()).node}
    assert ops["y"] == FUSED_MATMUL_OP
    assert sum(op == "MatMul" for op in ops.values()) == 1
    with ds.Session(server.target, graph=graph) as sess:
        got = sess.run(y, {h: X, x: X[::-1].copy()})
    want = np.tanh(np.matmul(X, W) + np.matmul(X[::-1].copy(), W[::-1].copy()))
    np.testing.assert_array_equal(got, want)


def test_layers_of_other_dtypes_or_devices_are_not_fused():
    with ds.Graph().as_default() as graph:
        x = ds.placeholder(ds.int32, [4, 4], name="x")
        ds.tanh(ds.cast(ds.matmul(x, x) + ds.constant(np.ones(4, np.int32)), ds.float32))
        with ds.device("/job:localhost/replica:0/task:0/device:CPU:0"):
            product = ds.matmul(ds.constant(W), ds.constant(W.T.copy()), name="here")
        with ds.device("/job:other/replica:0/task:0/device:CPU:0"):
            ds.add(product, ds.constant(np.ones(40, np.float32)), name="there")
    graph_def = graph.as_graph_def()
    assert fuse_dense_layers(graph_def) is graph_def


def test_control_inputs_of_the_parts_stay_on_the_fused_node():
    with ds.Graph().as_default() as graph:
        x = ds.placeholder(ds.float32, [None, 40], name="x")
        w, b = ds.constant(W, name="w"), ds.constant(B, name="b")
        first = ds.identity(x, name="first")
        second = ds.identity(x, name="second")
        with ds.control_dependencies([first]):
            product = ds.matmul(x, w, name="product")
        with ds.control_dependencies([second]):
            ds.relu(ds.add(product, b, name="sum"), name="y")
    (node,) = [n for n in fuse_dense_layers(graph.as_graph_def()).node if n.name == "y"]
    assert node.op == FUSED_MATMUL_OP
    assert list(node.input) == ["x", "w", "b", "^first", "^second"]


def test_a_fused_layer_reports_bad_inputs_as_its_part_would(server):
    with ds.Graph().as_default() as graph:
        x = ds.placeholder(ds.float32, None, name="x")
        bias = ds.placeholder(ds.float32, None, name="bias")
        y = ds.tanh(ds.add(ds.matmul(x, ds.constant(W), name="product"), bias, name="sum"), name="y")
    assert any(node.op == FUSED_MATMUL_OP for node in fuse_dense_layers(graph.as_graph_def()).node)
    with ds.Session(server.target, graph=graph) as sess:
        with pytest.raises(
            errors.InvalidArgumentError, match=r"(?s)Matrix size-incompatible.*\{\{node product\}\}"
        ):
            sess.run(y, {x: np.ones((2, 7), np.float32), bias: B})
        with pytest.raises(errors.InvalidArgumentError, match=r"(?s)Incompatible shapes.*\{\{node sum\}\}"):
            sess.run(y, {x: X, bias: np.ones(5, np.float32)})
        # A bias that broadcasts otherwise (a matrix): the parts' own way, the same values.
        matrix = RNG.standard_normal((64, 24)).astype(np.float32)
        np.testing.assert_array_equal(sess.run(y, {x: X, bias: matrix}), np.tanh(np.matmul(X, W) + matrix))


def test_a_fused_node_with_parts_that_are_not_a_dense_layer_is_refused():
    from distserver.kernels.registry import create_kernel

    def fused(*parts: NodeDef) -> NodeDef:
        node = NodeDef(name="layer", op=FUSED_MATMUL_OP)
        node.attr["T"].CopyFrom(AttrValue(type=1))
        node.attr[FUSED_NODES_ATTR].list.s.extend(part.SerializeToString() for part in parts)
        return node

    def part(name: str, op: str, *inputs: str) -> NodeDef:
        node = NodeDef(name=name, op=op, input=list(inputs))
        node.attr["T"].CopyFrom(AttrValue(type=1))
        return node

    with pytest.raises(errors.InvalidArgumentError, match="expected MatMul"):
        create_kernel(fused(part("a", "MatMul", "x", "w"), part("q", "FIFOQueueV2")))
    with pytest.raises(errors.InvalidArgumentError, match="expected MatMul"):
        create_kernel(fused(part("a", "MatMul", "x", "w")))
    bad = fused()
    bad.attr[FUSED_NODES_ATTR].list.s.append(b"\xff\xff")
    with pytest.raises(errors.InvalidArgumentError, match="not a NodeDef"):
        create_kernel(bad)
