"""Tests of the op constructors: TensorFlow's GraphDefs, static shapes and dtypes, errors.

The expected node lists (`TF_*`) were captured from TensorFlow 2.21 building the same
graphs with `tf.compat.v1` in graph mode (`tf.where`, `tf.argmax`, `tf.nn.bias_add`
from TF 2.x). Const values are compared as values: TensorFlow sometimes stores a
repeated scalar once where we store every element.
"""

import numpy as np
import pytest

import distserver.graph as tf
from distserver import tensors
from distserver.protos import types_pb2


def summarize(graph):
    """(name, op, inputs, device, attrs) per node, attrs as plain Python values."""
    return [
        (node.name, node.op, list(node.input), node.device, {k: _attr(v) for k, v in node.attr.items()})
        for node in graph.as_graph_def().node
    ]


def _attr(value):
    kind = value.WhichOneof("value")
    if kind == "type":
        return types_pb2.DataType.Name(value.type)
    if kind == "tensor":
        array = tensors.from_tensor_proto(value.tensor)
        items = [v.decode() if isinstance(v, bytes) else v for v in array.ravel().tolist()]
        return (types_pb2.DataType.Name(value.tensor.dtype), array.shape, items)
    if kind == "shape":
        return None if value.shape.unknown_rank else tuple(d.size for d in value.shape.dim)
    if kind == "list":
        items = value.list
        return (
            [s.decode() for s in items.s] or list(items.i) or [types_pb2.DataType.Name(t) for t in items.type]
        )
    if kind == "s":
        return value.s.decode()
    return getattr(value, kind)


@pytest.fixture(autouse=True)
def graph():
    with tf.Graph().as_default() as g:
        yield g


@pytest.fixture
def x():
    return tf.placeholder(tf.float32, shape=[3, 4], name="x")


@pytest.fixture
def n():
    return tf.placeholder(tf.float32, shape=[None, 4], name="n")


@pytest.fixture
def u():
    return tf.placeholder(tf.float32, name="u")


@pytest.fixture
def i():
    return tf.placeholder(tf.int32, shape=[3], name="i")


# --------------------------------------------------------------------------- TensorFlow's GraphDefs

TF_BASIC = [
    ("Const", "Const", [], "", {"dtype": "DT_FLOAT", "value": ("DT_FLOAT", (2, 2), [1.0, 2.0, 3.0, 4.0])}),
    ("x", "Placeholder", [], "", {"dtype": "DT_FLOAT", "shape": (-1, 2)}),
    (
        "MatMul",
        "MatMul",
        ["x", "Const"],
        "",
        {"T": "DT_FLOAT", "grad_a": False, "grad_b": False, "transpose_a": False, "transpose_b": False},
    ),
    ("Const_1", "Const", [], "", {"dtype": "DT_INT32", "value": ("DT_INT32", (2,), [0, 1])}),
    ("Sum", "Sum", ["MatMul", "Const_1"], "", {"T": "DT_FLOAT", "Tidx": "DT_INT32", "keep_dims": False}),
    ("Sum_1/reduction_indices", "Const", [], "", {"dtype": "DT_INT32", "value": ("DT_INT32", (), [1])}),
    (
        "Sum_1",
        "Sum",
        ["MatMul", "Sum_1/reduction_indices"],
        "",
        {"T": "DT_FLOAT", "Tidx": "DT_INT32", "keep_dims": True},
    ),
    ("Const_2", "Const", [], "", {"dtype": "DT_INT32", "value": ("DT_INT32", (2,), [0, 1])}),
    ("Mean", "Mean", ["x", "Const_2"], "", {"T": "DT_FLOAT", "Tidx": "DT_INT32", "keep_dims": False}),
    ("outer/inner/Add/y", "Const", [], "", {"dtype": "DT_FLOAT", "value": ("DT_FLOAT", (), [1.0])}),
    ("outer/inner/Add", "AddV2", ["x", "outer/inner/Add/y"], "", {"T": "DT_FLOAT"}),
    ("Identity", "Identity", ["x"], "/job:ps/task:1", {"T": "DT_FLOAT"}),
]

TF_OPERATORS = [
    ("x", "Placeholder", [], "", {"dtype": "DT_FLOAT", "shape": (3, 4)}),
    ("i", "Placeholder", [], "", {"dtype": "DT_INT32", "shape": (3,)}),
    ("sub/x", "Const", [], "", {"dtype": "DT_FLOAT", "value": ("DT_FLOAT", (), [2.0])}),
    ("sub", "Sub", ["sub/x", "x"], "", {"T": "DT_FLOAT"}),
    ("mul/x", "Const", [], "", {"dtype": "DT_FLOAT", "value": ("DT_FLOAT", (), [3.0])}),
    ("mul", "Mul", ["mul/x", "x"], "", {"T": "DT_FLOAT"}),
    (
        "matmul/b",
        "Const",
        [],
        "",
        {"dtype": "DT_FLOAT", "value": ("DT_FLOAT", (4, 2), [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0])},
    ),
    (
        "matmul",
        "MatMul",
        ["x", "matmul/b"],
        "",
        {"T": "DT_FLOAT", "grad_a": False, "grad_b": False, "transpose_a": False, "transpose_b": False},
    ),
    ("Neg", "Neg", ["x"], "", {"T": "DT_FLOAT"}),
    ("Less/y", "Const", [], "", {"dtype": "DT_FLOAT", "value": ("DT_FLOAT", (), [3.0])}),
    ("Less", "Less", ["x", "Less/y"], "", {"T": "DT_FLOAT"}),
    ("pow/y", "Const", [], "", {"dtype": "DT_FLOAT", "value": ("DT_FLOAT", (), [2.0])}),
    ("pow", "Pow", ["x", "pow/y"], "", {"T": "DT_FLOAT"}),
    ("truediv/x", "Const", [], "", {"dtype": "DT_FLOAT", "value": ("DT_FLOAT", (), [1.0])}),
    ("truediv", "RealDiv", ["truediv/x", "x"], "", {"T": "DT_FLOAT"}),
    ("truediv_1/y", "Const", [], "", {"dtype": "DT_INT32", "value": ("DT_INT32", (), [2])}),
    ("truediv_1/Cast", "Cast", ["i"], "", {"DstT": "DT_DOUBLE", "SrcT": "DT_INT32", "Truncate": False}),
    (
        "truediv_1/Cast_1",
        "Cast",
        ["truediv_1/y"],
        "",
        {"DstT": "DT_DOUBLE", "SrcT": "DT_INT32", "Truncate": False},
    ),
    ("truediv_1", "RealDiv", ["truediv_1/Cast", "truediv_1/Cast_1"], "", {"T": "DT_DOUBLE"}),
    ("floordiv", "FloorDiv", ["i", "i"], "", {"T": "DT_INT32"}),
    ("strided_slice/stack", "Const", [], "", {"dtype": "DT_INT32", "value": ("DT_INT32", (2,), [1, 2])}),
    ("strided_slice/stack_1", "Const", [], "", {"dtype": "DT_INT32", "value": ("DT_INT32", (2,), [0, 3])}),
    ("strided_slice/stack_2", "Const", [], "", {"dtype": "DT_INT32", "value": ("DT_INT32", (2,), [1, 1])}),
    (
        "strided_slice",
        "StridedSlice",
        ["x", "strided_slice/stack", "strided_slice/stack_1", "strided_slice/stack_2"],
        "",
        {
            "Index": "DT_INT32",
            "T": "DT_FLOAT",
            "begin_mask": 0,
            "ellipsis_mask": 0,
            "end_mask": 1,
            "new_axis_mask": 0,
            "shrink_axis_mask": 2,
        },
    ),
    ("strided_slice_1/stack", "Const", [], "", {"dtype": "DT_INT32", "value": ("DT_INT32", (3,), [0, 0, 0])}),
    (
        "strided_slice_1/stack_1",
        "Const",
        [],
        "",
        {"dtype": "DT_INT32", "value": ("DT_INT32", (3,), [0, 0, 1])},
    ),
    (
        "strided_slice_1/stack_2",
        "Const",
        [],
        "",
        {"dtype": "DT_INT32", "value": ("DT_INT32", (3,), [1, 1, 1])},
    ),
    (
        "strided_slice_1",
        "StridedSlice",
        ["x", "strided_slice_1/stack", "strided_slice_1/stack_1", "strided_slice_1/stack_2"],
        "",
        {
            "Index": "DT_INT32",
            "T": "DT_FLOAT",
            "begin_mask": 0,
            "ellipsis_mask": 1,
            "end_mask": 0,
            "new_axis_mask": 2,
            "shrink_axis_mask": 4,
        },
    ),
    ("strided_slice_2/stack", "Const", [], "", {"dtype": "DT_INT32", "value": ("DT_INT32", (2,), [0, 0])}),
    ("strided_slice_2/stack_1", "Const", [], "", {"dtype": "DT_INT32", "value": ("DT_INT32", (2,), [0, 0])}),
    ("strided_slice_2/stack_2", "Const", [], "", {"dtype": "DT_INT32", "value": ("DT_INT32", (2,), [1, -1])}),
    (
        "strided_slice_2",
        "StridedSlice",
        ["x", "strided_slice_2/stack", "strided_slice_2/stack_1", "strided_slice_2/stack_2"],
        "",
        {
            "Index": "DT_INT32",
            "T": "DT_FLOAT",
            "begin_mask": 3,
            "ellipsis_mask": 0,
            "end_mask": 3,
            "new_axis_mask": 0,
            "shrink_axis_mask": 0,
        },
    ),
    ("GreaterEqual/y", "Const", [], "", {"dtype": "DT_FLOAT", "value": ("DT_FLOAT", (), [0.0])}),
    ("GreaterEqual", "GreaterEqual", ["x", "GreaterEqual/y"], "", {"T": "DT_FLOAT"}),
    ("and", "LogicalAnd", ["GreaterEqual", "GreaterEqual"], "", {}),
    ("LogicalNot", "LogicalNot", ["GreaterEqual"], "", {}),
]

TF_ARRAY = [
    ("x", "Placeholder", [], "", {"dtype": "DT_FLOAT", "shape": (3, 4)}),
    ("u", "Placeholder", [], "", {"dtype": "DT_FLOAT", "shape": None}),
    ("Rank", "Rank", ["u"], "", {"T": "DT_FLOAT"}),
    ("range/start", "Const", [], "", {"dtype": "DT_INT32", "value": ("DT_INT32", (), [0])}),
    ("range/delta", "Const", [], "", {"dtype": "DT_INT32", "value": ("DT_INT32", (), [1])}),
    ("range", "Range", ["range/start", "Rank", "range/delta"], "", {"Tidx": "DT_INT32"}),
    ("Sum", "Sum", ["u", "range"], "", {"T": "DT_FLOAT", "Tidx": "DT_INT32", "keep_dims": False}),
    ("transpose/Rank", "Rank", ["u"], "", {"T": "DT_FLOAT"}),
    ("transpose/sub/y", "Const", [], "", {"dtype": "DT_INT32", "value": ("DT_INT32", (), [1])}),
    ("transpose/sub", "Sub", ["transpose/Rank", "transpose/sub/y"], "", {"T": "DT_INT32"}),
    ("transpose/Range/limit", "Const", [], "", {"dtype": "DT_INT32", "value": ("DT_INT32", (), [-1])}),
    ("transpose/Range/delta", "Const", [], "", {"dtype": "DT_INT32", "value": ("DT_INT32", (), [-1])}),
    (
        "transpose/Range",
        "Range",
        ["transpose/sub", "transpose/Range/limit", "transpose/Range/delta"],
        "",
        {"Tidx": "DT_INT32"},
    ),
    ("transpose", "Transpose", ["u", "transpose/Range"], "", {"T": "DT_FLOAT", "Tperm": "DT_INT32"}),
    ("Shape", "Shape", ["u"], "", {"T": "DT_FLOAT", "out_type": "DT_INT32"}),
    ("strided_slice/stack", "Const", [], "", {"dtype": "DT_INT32", "value": ("DT_INT32", (1,), [0])}),
    ("strided_slice/stack_1", "Const", [], "", {"dtype": "DT_INT32", "value": ("DT_INT32", (1,), [1])}),
    ("strided_slice/stack_2", "Const", [], "", {"dtype": "DT_INT32", "value": ("DT_INT32", (1,), [1])}),
    (
        "strided_slice",
        "StridedSlice",
        ["Shape", "strided_slice/stack", "strided_slice/stack_1", "strided_slice/stack_2"],
        "",
        {
            "Index": "DT_INT32",
            "T": "DT_INT32",
            "begin_mask": 0,
            "ellipsis_mask": 0,
            "end_mask": 0,
            "new_axis_mask": 0,
            "shrink_axis_mask": 1,
        },
    ),
    ("Reshape/shape/1", "Const", [], "", {"dtype": "DT_INT32", "value": ("DT_INT32", (), [-1])}),
    ("Reshape/shape/2", "Const", [], "", {"dtype": "DT_INT32", "value": ("DT_INT32", (), [2])}),
    (
        "Reshape/shape",
        "Pack",
        ["strided_slice", "Reshape/shape/1", "Reshape/shape/2"],
        "",
        {"N": 3, "T": "DT_INT32", "axis": 0},
    ),
    ("Reshape", "Reshape", ["x", "Reshape/shape"], "", {"T": "DT_FLOAT", "Tshape": "DT_INT32"}),
    ("concat/concat_dim", "Const", [], "", {"dtype": "DT_INT32", "value": ("DT_INT32", (), [0])}),
    ("concat/concat", "Identity", ["x"], "", {"T": "DT_FLOAT"}),
    ("concat_1/axis", "Const", [], "", {"dtype": "DT_INT32", "value": ("DT_INT32", (), [-1])}),
    ("concat_1", "ConcatV2", ["x", "x", "concat_1/axis"], "", {"N": 2, "T": "DT_FLOAT", "Tidx": "DT_INT32"}),
    ("strided_slice_1/stack", "Const", [], "", {"dtype": "DT_INT32", "value": ("DT_INT32", (2,), [0, 0])}),
    ("strided_slice_1/stack_1", "Const", [], "", {"dtype": "DT_INT32", "value": ("DT_INT32", (2,), [1, 1])}),
    ("strided_slice_1/stack_2", "Const", [], "", {"dtype": "DT_INT32", "value": ("DT_INT32", (2,), [1, 1])}),
    (
        "strided_slice_1",
        "StridedSlice",
        ["x", "strided_slice_1/stack", "strided_slice_1/stack_1", "strided_slice_1/stack_2"],
        "",
        {
            "Index": "DT_INT32",
            "T": "DT_FLOAT",
            "begin_mask": 0,
            "ellipsis_mask": 0,
            "end_mask": 0,
            "new_axis_mask": 0,
            "shrink_axis_mask": 3,
        },
    ),
    ("stack/1", "Const", [], "", {"dtype": "DT_FLOAT", "value": ("DT_FLOAT", (), [2.0])}),
    ("stack", "Pack", ["strided_slice_1", "stack/1"], "", {"N": 2, "T": "DT_FLOAT", "axis": 0}),
    ("zeros/shape_as_tensor", "Const", [], "", {"dtype": "DT_INT32", "value": ("DT_INT32", (2,), [2000, 3])}),
    ("zeros/Const", "Const", [], "", {"dtype": "DT_FLOAT", "value": ("DT_FLOAT", (), [0.0])}),
    (
        "zeros",
        "Fill",
        ["zeros/shape_as_tensor", "zeros/Const"],
        "",
        {"T": "DT_FLOAT", "index_type": "DT_INT32"},
    ),
    ("zeros_like", "ZerosLike", ["u"], "", {"T": "DT_FLOAT"}),
    ("Shape_1", "Const", [], "", {"dtype": "DT_INT32", "value": ("DT_INT32", (2,), [3, 4])}),
    ("range_1/start", "Const", [], "", {"dtype": "DT_FLOAT", "value": ("DT_FLOAT", (), [1.0])}),
    ("range_1/limit", "Const", [], "", {"dtype": "DT_FLOAT", "value": ("DT_FLOAT", (), [5.0])}),
    ("range_1/delta", "Const", [], "", {"dtype": "DT_INT32", "value": ("DT_INT32", (), [1])}),
    (
        "range_1/Cast",
        "Cast",
        ["range_1/delta"],
        "",
        {"DstT": "DT_FLOAT", "SrcT": "DT_INT32", "Truncate": False},
    ),
    ("range_1", "Range", ["range_1/start", "range_1/limit", "range_1/Cast"], "", {"Tidx": "DT_FLOAT"}),
    ("one_hot/on_value", "Const", [], "", {"dtype": "DT_FLOAT", "value": ("DT_FLOAT", (), [1.0])}),
    ("one_hot/off_value", "Const", [], "", {"dtype": "DT_FLOAT", "value": ("DT_FLOAT", (), [0.0])}),
    ("one_hot/indices", "Const", [], "", {"dtype": "DT_INT32", "value": ("DT_INT32", (2,), [1, 2])}),
    ("one_hot/depth", "Const", [], "", {"dtype": "DT_INT32", "value": ("DT_INT32", (), [4])}),
    (
        "one_hot",
        "OneHot",
        ["one_hot/indices", "one_hot/depth", "one_hot/on_value", "one_hot/off_value"],
        "",
        {"T": "DT_FLOAT", "TI": "DT_INT32", "axis": -1},
    ),
    ("GatherV2/indices", "Const", [], "", {"dtype": "DT_INT32", "value": ("DT_INT32", (2,), [0, 2])}),
    ("GatherV2/axis", "Const", [], "", {"dtype": "DT_INT32", "value": ("DT_INT32", (), [1])}),
    (
        "GatherV2",
        "GatherV2",
        ["x", "GatherV2/indices", "GatherV2/axis"],
        "",
        {"Taxis": "DT_INT32", "Tindices": "DT_INT32", "Tparams": "DT_FLOAT", "batch_dims": 0},
    ),
    ("ExpandDims/dim", "Const", [], "", {"dtype": "DT_INT32", "value": ("DT_INT32", (), [0])}),
    ("ExpandDims", "ExpandDims", ["x", "ExpandDims/dim"], "", {"T": "DT_FLOAT", "Tdim": "DT_INT32"}),
    ("Squeeze", "Squeeze", ["ExpandDims"], "", {"T": "DT_FLOAT", "squeeze_dims": []}),
    ("Greater/y", "Const", [], "", {"dtype": "DT_FLOAT", "value": ("DT_FLOAT", (), [0.0])}),
    ("Greater", "Greater", ["x", "Greater/y"], "", {"T": "DT_FLOAT"}),
    ("Neg", "Neg", ["x"], "", {"T": "DT_FLOAT"}),
    ("SelectV2", "SelectV2", ["Greater", "x", "Neg"], "", {"T": "DT_FLOAT"}),
    (
        "BiasAdd/bias",
        "Const",
        [],
        "",
        {"dtype": "DT_FLOAT", "value": ("DT_FLOAT", (4,), [1.0, 2.0, 3.0, 4.0])},
    ),
    ("BiasAdd", "BiasAdd", ["x", "BiasAdd/bias"], "", {"T": "DT_FLOAT", "data_format": "NHWC"}),
    ("AddN", "AddN", ["x", "x"], "", {"N": 2, "T": "DT_FLOAT"}),
    ("ArgMax/dimension", "Const", [], "", {"dtype": "DT_INT32", "value": ("DT_INT32", (), [1])}),
    (
        "ArgMax",
        "ArgMax",
        ["x", "ArgMax/dimension"],
        "",
        {"T": "DT_FLOAT", "Tidx": "DT_INT32", "output_type": "DT_INT64"},
    ),
    ("Cast", "Cast", ["x"], "", {"DstT": "DT_INT32", "SrcT": "DT_FLOAT", "Truncate": False}),
    ("PlaceholderWithDefault", "PlaceholderWithDefault", ["x"], "", {"dtype": "DT_FLOAT", "shape": (-1, 4)}),
]

TF_CONTROL = [
    ("xf", "Placeholder", [], "", {"dtype": "DT_FLOAT", "shape": (3,)}),
    ("Add", "AddV2", ["xf", "xf"], "", {"T": "DT_FLOAT", "_has_manual_control_dependencies": True}),
    ("add_1", "AddV2", ["xf", "xf"], "", {"T": "DT_FLOAT", "_has_manual_control_dependencies": True}),
    ("Identity", "Identity", ["xf", "^Add"], "", {"T": "DT_FLOAT"}),
    ("Identity_1", "Identity", ["Identity"], "", {"T": "DT_FLOAT"}),
    ("Identity_2", "Identity", ["xf"], "", {"T": "DT_FLOAT"}),
    ("Const", "Const", ["^Add", "^add_1"], "", {"dtype": "DT_FLOAT", "value": ("DT_FLOAT", (), [1.0])}),
    ("Identity_3", "Identity", ["xf"], "/job:ignored", {"T": "DT_FLOAT", "_class": ["loc:@Add"]}),
    ("Identity_4", "Identity", ["xf"], "/job:worker/task:3", {"T": "DT_FLOAT"}),
    ("Neg", "Neg", ["xf"], "/cpu:0", {"T": "DT_FLOAT"}),
    ("Identity_5", "Identity", ["xf"], "/job:worker/task:3", {"T": "DT_FLOAT"}),
    ("Identity_6", "Identity", ["xf"], "/job:ps/task:2/device:CPU:0", {"T": "DT_FLOAT"}),
    ("Identity_7", "Identity", ["xf"], "/job:worker/task:0/device:CPU:0", {"T": "DT_FLOAT"}),
    ("Identity_8", "Identity", ["xf"], "", {"T": "DT_FLOAT"}),
    ("Identity_9", "Identity", ["xf"], "/job:ps/task:0", {"T": "DT_FLOAT"}),
    ("grp", "NoOp", ["^Add", "^add_1"], "/job:w", {}),
    (
        "Identity_10",
        "Identity",
        ["xf"],
        "/job:ps",
        {"T": "DT_FLOAT", "_has_manual_control_dependencies": True},
    ),
    ("group_deps/NoOp", "NoOp", ["^Add", "^add_1"], "", {"_has_manual_control_dependencies": True}),
    ("group_deps/NoOp_1", "NoOp", ["^Identity_10"], "/job:ps", {"_has_manual_control_dependencies": True}),
    ("group_deps", "NoOp", ["^group_deps/NoOp", "^group_deps/NoOp_1"], "", {}),
]


def test_basic_graph_matches_tensorflow(graph):
    c = tf.constant([[1.0, 2.0], [3.0, 4.0]])
    p = tf.placeholder(tf.float32, shape=[None, 2], name="x")
    m = tf.matmul(p, c)
    tf.reduce_sum(m)
    tf.reduce_sum(m, axis=1, keepdims=True)
    tf.reduce_mean(p)
    with tf.name_scope("outer"), tf.name_scope("inner"):
        tf.add(p, 1.0)
    with tf.device("/job:ps"), tf.device("/task:1"):
        tf.identity(p)
    assert summarize(graph) == TF_BASIC


def test_operators_match_tensorflow(graph, x, i):
    _ = 2.0 - x, np.float32(3) * x, x @ np.ones((4, 2), np.float32), -x, x < 3, x**2, 1 / x
    _ = i / 2, i // i, x[1:, 2], x[..., None, 0], x[:, ::-1]
    b = x >= 0
    _ = b & b, ~b
    assert summarize(graph) == TF_OPERATORS


def test_array_ops_match_tensorflow(graph, x, u):
    tf.reduce_sum(u)
    tf.transpose(u)
    tf.reshape(x, [tf.shape(u)[0], -1, 2])
    tf.concat([x], 0)
    tf.concat([x, x], -1)
    tf.stack([x[0, 0], 2.0])
    tf.zeros([2000, 3])
    tf.zeros_like(u)
    tf.shape(x)
    tf.range(1.0, 5.0)
    tf.one_hot([1, 2], 4)
    tf.gather(x, [0, 2], axis=1)
    tf.squeeze(tf.expand_dims(x, 0))
    tf.where(x > 0, x, -x)
    tf.bias_add(x, [1.0, 2.0, 3.0, 4.0])
    tf.add_n([x, x])
    tf.argmax(x, 1)
    tf.cast(x, tf.int32)
    tf.placeholder_with_default(x, [None, 4])
    assert summarize(graph) == TF_ARRAY


def test_scopes_match_tensorflow(graph):
    xf = tf.placeholder(tf.float32, shape=[3], name="xf")
    a = tf.add(xf, xf)
    b = xf + xf
    with tf.control_dependencies([a]):
        d = tf.identity(xf)
        tf.identity(d)  # Fed by an op of this scope: no control input of its own.
        with tf.control_dependencies(None):
            tf.identity(xf)
        with tf.control_dependencies([b.op, a]):
            tf.constant(1.0)
    with tf.colocate_with(a.op), tf.device("/job:ignored"):
        tf.identity(xf)
    with tf.device(lambda op: "/job:worker/task:3" if op.type == "Identity" else "/cpu:0"):
        tf.identity(xf)
        tf.negative(xf)
        with tf.device("/job:ps"):
            tf.identity(xf)  # An outer device function has the last word.
    with tf.device("/job:ps/task:0"):
        with tf.device(lambda op: "/task:2/device:CPU:0"):
            tf.identity(xf)
        with tf.device("/job:worker/cpu:0"):
            tf.identity(xf)
        with tf.device(None):
            tf.identity(xf)
        with tf.device(""):
            tf.identity(xf)
    with tf.device("/job:w"):
        tf.group(a, b, name="grp")
    with tf.device("/job:ps"):
        e = tf.identity(xf)
    tf.group(a, [e, b.op])
    assert summarize(graph) == TF_CONTROL


# --------------------------------------------------------------------------- static shapes and dtypes


def _p(shape, dtype=tf.float32):
    return tf.placeholder(dtype, shape=shape)


SHAPE_CASES = {
    "broadcast": (lambda x, n, u: x + _p([4]), (3, 4), tf.float32),
    "broadcast unknown dim": (lambda x, n, u: _p([None, 1]) * _p([1, 5]), (None, 5), tf.float32),
    "broadcast unknown rank": (lambda x, n, u: x + u, None, tf.float32),
    "comparison": (lambda x, n, u: x < 1, (3, 4), tf.bool_),
    "matmul": (lambda x, n, u: tf.matmul(x, tf.ones([4, 2])), (3, 2), tf.float32),
    "matmul transposed": (lambda x, n, u: tf.matmul(x, x, transpose_b=True), (3, 3), tf.float32),
    "matmul partial": (lambda x, n, u: n @ _p([4, None]), (None, None), tf.float32),
    "sum axis": (lambda x, n, u: tf.reduce_sum(x, 1), (3,), tf.float32),
    "sum keepdims": (lambda x, n, u: tf.reduce_sum(x, [0, 1], keepdims=True), (1, 1), tf.float32),
    "sum all": (lambda x, n, u: tf.reduce_sum(x), (), tf.float32),
    "mean all unknown rank": (lambda x, n, u: tf.reduce_mean(u), (), tf.float32),
    "max negative axis": (lambda x, n, u: tf.reduce_max(x, -1, keepdims=True), (3, 1), tf.float32),
    "sum axis unknown rank": (lambda x, n, u: tf.reduce_sum(u, 0), None, tf.float32),
    "sum dynamic axis": (lambda x, n, u: tf.reduce_sum(x, _p([], tf.int32)), None, tf.float32),
    "sum dynamic axis keepdims": (
        lambda x, n, u: tf.reduce_sum(x, _p([], tf.int32), True),
        (None, None),
        tf.float32,
    ),
    "reshape": (lambda x, n, u: tf.reshape(x, [-1, 2]), (6, 2), tf.float32),
    "reshape partial input": (lambda x, n, u: tf.reshape(n, [-1, 2]), (None, 2), tf.float32),
    "reshape packed": (lambda x, n, u: tf.reshape(x, [2, _p([], tf.int32)]), (2, None), tf.float32),
    "transpose": (lambda x, n, u: tf.transpose(x), (4, 3), tf.float32),
    "transpose perm": (lambda x, n, u: tf.transpose(_p([1, 2, 3]), [2, 0, 1]), (3, 1, 2), tf.float32),
    "concat": (lambda x, n, u: tf.concat([x, n], 0), (None, 4), tf.float32),
    "concat last": (lambda x, n, u: tf.concat([x, x], 1), (3, 8), tf.float32),
    "stack": (lambda x, n, u: tf.stack([x, x]), (2, 3, 4), tf.float32),
    "stack last": (lambda x, n, u: tf.stack([x, x], axis=-1), (3, 4, 2), tf.float32),
    "zeros": (lambda x, n, u: tf.zeros([2, 3]), (2, 3), tf.float32),
    "fill": (lambda x, n, u: tf.fill([2, 3], 1), (2, 3), tf.int32),
    "ones_like": (lambda x, n, u: tf.ones_like(n), (None, 4), tf.float32),
    "zeros_like dtype": (lambda x, n, u: tf.zeros_like(x, dtype=tf.int64), (3, 4), tf.int64),
    "shape": (lambda x, n, u: tf.shape(n), (2,), tf.int32),
    "shape int64": (lambda x, n, u: tf.shape(u, out_type=tf.int64), (None,), tf.int64),
    "size": (lambda x, n, u: tf.size(x), (), tf.int32),
    "rank": (lambda x, n, u: tf.rank(u), (), tf.int32),
    "argmax": (lambda x, n, u: tf.argmax(x, 1), (3,), tf.int64),
    "argmin int32": (lambda x, n, u: tf.argmin(x, output_type=tf.int32), (4,), tf.int32),
    "expand_dims": (lambda x, n, u: tf.expand_dims(x, -1), (3, 4, 1), tf.float32),
    "squeeze": (lambda x, n, u: tf.squeeze(_p([1, 3, 1])), (3,), tf.float32),
    "squeeze axis": (lambda x, n, u: tf.squeeze(_p([1, 3, 1]), [0]), (3, 1), tf.float32),
    "squeeze partial": (lambda x, n, u: tf.squeeze(n), None, tf.float32),
    "tile": (lambda x, n, u: tf.tile(x, [2, 3]), (6, 12), tf.float32),
    "range": (lambda x, n, u: tf.range(10), (10,), tf.int32),
    "range step": (lambda x, n, u: tf.range(2, 10, 3), (3,), tf.int32),
    "range down": (lambda x, n, u: tf.range(5, 0, -1), (5,), tf.int32),
    "range float": (lambda x, n, u: tf.range(0.0, 1.0, 0.25), (4,), tf.float32),
    "range int64": (lambda x, n, u: tf.range(4, dtype=tf.int64), (4,), tf.int64),
    "range dynamic": (lambda x, n, u: tf.range(_p([], tf.int32)), (None,), tf.int32),
    "select": (lambda x, n, u: tf.where(x > 0, x, 0.0), (3, 4), tf.float32),
    "select broadcast": (lambda x, n, u: tf.select(_p([3, 1], tf.bool_), x, n), (3, 4), tf.float32),
    "where coordinates": (lambda x, n, u: tf.where(x > 0), (None, 2), tf.int64),
    "gather": (lambda x, n, u: tf.gather(x, [1, 1, 1]), (3, 4), tf.float32),
    "gather axis": (lambda x, n, u: tf.gather(x, _p([5, 2], tf.int32), axis=1), (3, 5, 2), tf.float32),
    "one_hot": (lambda x, n, u: tf.one_hot([0, 1, 2], 5), (3, 5), tf.float32),
    "one_hot axis": (
        lambda x, n, u: tf.one_hot(_p([2], tf.int32), 3, axis=0, dtype=tf.int64),
        (3, 2),
        tf.int64,
    ),
    "cast": (lambda x, n, u: tf.cast(x, tf.int64), (3, 4), tf.int64),
    "int truediv": (lambda x, n, u: tf.divide(_p([2], tf.int32), 2), (2,), tf.float64),
    "int8 truediv": (lambda x, n, u: _p([2], tf.int8) / _p([2], tf.int8), (2,), tf.float32),
    "index": (lambda x, n, u: x[1], (4,), tf.float32),
    "slice": (lambda x, n, u: x[:, 1:3], (3, 2), tf.float32),
    "stride": (lambda x, n, u: x[::2], (2, 4), tf.float32),
    "ellipsis": (lambda x, n, u: x[..., 0], (3,), tf.float32),
    "new axes": (lambda x, n, u: x[None, :, None], (1, 3, 1, 4), tf.float32),
    "negative": (lambda x, n, u: x[-1, -2:], (2,), tf.float32),
    "partial index": (lambda x, n, u: n[0], (4,), tf.float32),
    "clamped slice": (lambda x, n, u: x[1:100], (2, 4), tf.float32),
    "tensor index": (lambda x, n, u: x[_p([], tf.int32)], None, tf.float32),
    "softmax": (lambda x, n, u: tf.softmax(x), (3, 4), tf.float32),
    "bias_add": (lambda x, n, u: tf.bias_add(n, [1.0, 2.0, 3.0, 4.0]), (None, 4), tf.float32),
    "add_n": (lambda x, n, u: tf.add_n([x, n]), (3, 4), tf.float32),
    "string add": (lambda x, n, u: tf.constant("a") + "b", (), tf.string),
    "logical": (lambda x, n, u: (x > 1) | (n < 0), (3, 4), tf.bool_),
}


@pytest.mark.parametrize("case", SHAPE_CASES, ids=list(SHAPE_CASES))
def test_static_shape_and_dtype(case, x, n, u):
    build, shape, dtype = SHAPE_CASES[case]
    result = build(x, n, u)
    assert (result.shape, result.dtype) == (shape, dtype)


def test_string_add_uses_add_op():
    assert (tf.constant("a") + "b").op.type == "Add"


ERROR_CASES = {
    "tensor dtypes": (
        lambda x, i: tf.add(x[0], i),
        TypeError,
        "Input 'y' of 'AddV2' Op has type int32 that does not match type float32 of argument 'x'.",
    ),
    "operator dtypes": (lambda x, i: i + x[0], TypeError, "Input 'y' of 'AddV2' Op has type float32"),
    "float to int operand": (lambda x, i: i + 1.5, TypeError, "DT_INT32"),
    "matmul dtypes": (lambda x, i: tf.matmul(x, tf.cast(x, tf.int32)), TypeError, "Input 'b' of 'MatMul' Op"),
    "allowed types": (
        lambda x, i: tf.sqrt(i),
        TypeError,
        "Value passed to parameter 'x' has DataType int32 not in list of allowed values: bfloat16",
    ),
    "list dtypes": (
        lambda x, i: tf.concat([x[0], i], 0),
        TypeError,
        r"Tensors in list passed to 'values' of 'ConcatV2' Op have types \[float32, int32\] "
        "that don't all match.",
    ),
    "logical of floats": (lambda x, i: tf.logical_and(x, x), TypeError, "DataType float32 not in list"),
    "bool division": (lambda x, i: (x > 0) / (x > 1), TypeError, "Invalid dtype bool in __truediv__"),
    "conversion": (
        lambda x, i: tf.convert_to_tensor(x, dtype=tf.int32),
        ValueError,
        "Tensor conversion requested dtype int32 for Tensor with dtype float32",
    ),
    "constant": (lambda x, i: tf.constant(1.5, dtype=tf.int32), TypeError, "DT_INT32"),
    "constant of tensor": (lambda x, i: tf.constant(x), TypeError, "Python or numpy value"),
    "index list": (lambda x, i: x[[1, 2]], TypeError, "Only integers, slices"),
    "index float": (lambda x, i: x[1.0], TypeError, "Only integers, slices"),
    "select branches": (lambda x, i: tf.where(i > 0, i, x[0]), TypeError, "Input 'e' of 'SelectV2'"),
    "select one branch": (lambda x, i: tf.where(x > 0, x), ValueError, "both be non-None"),
    "matmul shapes": (
        lambda x, i: tf.matmul(x, x),
        ValueError,
        r"Dimensions must be equal, but are 4 and 3 for '\{\{node MatMul\}\} = MatMul' with input shapes: "
        r"\[3,4\], \[3,4\].",
    ),
    "matmul rank": (
        lambda x, i: tf.matmul(x, _p([2, 4, 3])),
        ValueError,
        "Shape must be rank 2 but is rank 3",
    ),
    "broadcast": (
        lambda x, i: x + _p([3]),
        ValueError,
        r"Dimensions must be equal, but are 4 and 3 for '\{\{node add\}\} = AddV2' "
        r"with input shapes: \[3,4\], \[3\].",
    ),
    "reshape": (
        lambda x, i: tf.reshape(x, [5, 2]),
        ValueError,
        r"Cannot reshape a tensor with 12 elements to shape \[5,2\] \(10 elements\)",
    ),
    "reshape wildcard": (lambda x, i: tf.reshape(x, [-1, 5]), ValueError, "Cannot reshape a tensor with 12"),
    "reshape wildcards": (lambda x, i: tf.reshape(x, [-1, -1]), ValueError, "multiple unknown dimensions"),
    "concat ranks": (lambda x, i: tf.concat([x, x[0]], 0), ValueError, "Shape must be rank 2 but is rank 1"),
    "concat dims": (lambda x, i: tf.concat([x, _p([3, 5])], 0), ValueError, "Dimensions must be equal"),
    "stack shapes": (lambda x, i: tf.stack([x, x[0]]), ValueError, "Shapes must be equal"),
    "squeeze": (
        lambda x, i: tf.squeeze(x, [0]),
        ValueError,
        "Can not squeeze dim\\[0\\], expected a dimension of 1",
    ),
    "index bounds": (lambda x, i: x[5], ValueError, "slice index 5 of dimension 0 out of bounds"),
    "too many indices": (lambda x, i: x[1, 2, 3], ValueError, "Index out of range using input dim 2"),
    "ellipses": (lambda x, i: x[..., ...], ValueError, "Multiple ellipses"),
    "reduction axis": (
        lambda x, i: tf.reduce_sum(x, 2),
        ValueError,
        "Invalid reduction dimension 2 for input with 2",
    ),
    "expand_dims axis": (lambda x, i: tf.expand_dims(x, 4), ValueError, "Invalid axis 4"),
    "default shape": (
        lambda x, i: tf.placeholder_with_default(x, [3, 5]),
        ValueError,
        "not compatible with the default's shape",
    ),
    "bias size": (
        lambda x, i: tf.bias_add(x, [1.0, 2.0]),
        ValueError,
        "Dimensions must be equal, but are 4 and 2",
    ),
    "softmax axis": (lambda x, i: tf.softmax(x, axis=0), ValueError, "only the last axis"),
    "constant shape": (lambda x, i: tf.constant([1, 2, 3], shape=[2, 2]), ValueError, "give one value or 4"),
    "zero delta": (lambda x, i: tf.range(0, 5, 0), ValueError, "Requires delta != 0"),
    "add_n empty": (lambda x, i: tf.add_n([]), ValueError, "at least one Tensor"),
}


@pytest.mark.parametrize("case", ERROR_CASES, ids=list(ERROR_CASES))
def test_build_time_errors(case, x, i):
    build, error, message = ERROR_CASES[case]
    with pytest.raises(error, match=message):
        build(x, i)


# --------------------------------------------------------------------------- conversions and operators


def _const_value(tensor):
    assert tensor.op.type == "Const"
    return tensor.op.get_attr("value")


@pytest.mark.parametrize(
    ("build", "const_name", "value"),
    [
        (lambda t: t + 1, "add/y", np.float32(1)),
        (lambda t: 1 + t, "add/x", np.float32(1)),
        (lambda t: np.float64(2.5) * t, "mul/x", np.float32(2.5)),
        (lambda t: np.arange(2) - t, "sub/x", np.array([0, 1], np.float32)),
        (lambda t: t / np.array(2), "truediv/y", np.float32(2)),
        (lambda t: t @ np.ones((2, 1)), "matmul/b", np.ones((2, 1), np.float32)),
        (lambda t: 2**t, "pow/x", np.float32(2)),
        (lambda t: t // 2, "floordiv/y", np.float32(2)),
        (lambda t: 7 % t, "mod/x", np.float32(7)),
        (lambda t: t >= np.float16(0.5), "GreaterEqual/y", np.float32(0.5)),
    ],
)
def test_python_and_numpy_operands_take_the_tensor_dtype(graph, build, const_name, value):
    t = tf.placeholder(tf.float32, shape=[2, 2], name="t")
    result = build(t)
    const = graph.get_tensor_by_name(const_name + ":0")
    assert const.dtype == np.float32
    np.testing.assert_array_equal(_const_value(const), value)
    assert const in result.op.inputs
    assert t in result.op.inputs


def test_integer_tensors_convert_operands_to_their_type(i):
    assert (i * np.float32(2)).op.inputs[1].dtype == np.int32
    big = tf.placeholder(tf.int64, name="big")
    assert (big + 1).op.inputs[1].dtype == np.int64
    assert (1 - big).op.inputs[0].dtype == np.int64


def test_function_forms_accept_a_python_first_operand(x):
    result = tf.subtract(2.0, x)
    assert [t.name for t in result.op.inputs] == ["Sub/x:0", "x:0"]
    assert result.op.inputs[0].dtype == np.float32


def test_equality_is_identity(x):
    y = tf.identity(x)
    assert x == x
    assert x != y
    assert len({x, y, x}) == 2
    assert {x: 1}[x] == 1


@pytest.mark.parametrize(
    ("use", "error"),
    [(bool, TypeError), (len, TypeError), (iter, TypeError), (np.asarray, NotImplementedError)],
)
def test_tensors_have_no_python_value(x, use, error):
    with pytest.raises(error):
        use(x)


def test_operators_build_in_the_graph_of_their_tensor(graph):
    other = tf.Graph()
    with other.as_default():
        t = tf.placeholder(tf.float32, name="t")
    result = t * 2.0
    assert result.graph is other
    assert [op.name for op in other.get_operations()] == ["t", "mul/y", "mul"]
    assert graph.get_operations() == []


def test_inputs_from_two_graphs_are_refused(x):
    with tf.Graph().as_default():
        other = tf.placeholder(tf.float32, shape=[3, 4])
    with pytest.raises(ValueError, match="must be from the same graph"):
        tf.add(x, other)


def test_lists_holding_tensors_are_packed(graph, x):
    packed = tf.convert_to_tensor([[x[0, 0], 1.0], [2.0, 3.0]])
    assert packed.op.type == "Pack"
    assert packed.shape == (2, 2)
    assert [t.op.name for t in packed.op.inputs] == ["packed/0", "packed/1"]
    assert graph.get_operation_by_name("packed/0/1").type == "Const"
    assert graph.get_operation_by_name("packed/1").type == "Const"
    np.testing.assert_array_equal(_const_value(packed.op.inputs[1]), np.array([2.0, 3.0], np.float32))
    with pytest.raises(
        TypeError, match="Cannot convert a list containing a tensor of dtype float32 to int32"
    ):
        tf.convert_to_tensor([x[0, 0], 1], dtype=tf.int32)


# --------------------------------------------------------------------------- constants and foldings


@pytest.mark.parametrize(
    ("value", "dtype", "datatype"),
    [
        (1.0, np.float32, types_pb2.DT_FLOAT),
        (1, np.int32, types_pb2.DT_INT32),
        (2**40, np.int64, types_pb2.DT_INT64),
        (True, np.bool_, types_pb2.DT_BOOL),
        ([1.5, 2], np.float32, types_pb2.DT_FLOAT),
        (np.float64(1), np.float64, types_pb2.DT_DOUBLE),
        (np.arange(3, dtype=np.uint8), np.uint8, types_pb2.DT_UINT8),
        ("text", object, types_pb2.DT_STRING),
        ([b"a", b"bc"], object, types_pb2.DT_STRING),
    ],
)
def test_constant_dtypes_follow_tensorflow(value, dtype, datatype):
    const = tf.constant(value)
    assert (const.dtype, const.datatype, const.op.get_attr("dtype")) == (
        np.dtype(dtype),
        datatype,
        np.dtype(dtype),
    )
    assert const.shape == np.shape(value)


def test_constant_with_shape_fills_or_reshapes():
    np.testing.assert_array_equal(_const_value(tf.constant(7, shape=[2, 3])), np.full((2, 3), 7, np.int32))
    np.testing.assert_array_equal(_const_value(tf.constant([1, 2, 3, 4], shape=[2, 2])), [[1, 2], [3, 4]])
    assert tf.constant(0.5, dtype=tf.float64, shape=(3,)).shape == (3,)


def test_zeros_switch_from_const_to_fill_at_1000_elements(graph):
    assert tf.zeros([999]).op.type == "Const"
    big = tf.ones([1000], dtype=tf.int64)
    assert (big.op.type, big.shape, big.dtype) == ("Fill", (1000,), np.int64)
    assert [t.op.name for t in big.op.inputs] == ["ones/shape_as_tensor", "ones/Const"]
    dynamic = tf.zeros(tf.placeholder(tf.int32, shape=[2]))
    assert (dynamic.op.type, dynamic.shape) == ("Fill", (None, None))
    assert _const_value(tf.zeros([2], dtype=tf.string)).tolist() == [b"", b""]


def test_shape_size_and_rank_fold_when_known(x, u):
    assert [tf.shape(x).op.type, tf.size(x).op.type, tf.rank(x).op.type] == ["Const", "Const", "Const"]
    assert [tf.shape(u).op.type, tf.size(u).op.type, tf.rank(u).op.type] == ["Shape", "Size", "Rank"]
    np.testing.assert_array_equal(_const_value(tf.shape(x, out_type=tf.int64)), np.array([3, 4], np.int64))


def test_cast_and_add_n_return_their_input_when_nothing_to_do(x):
    assert tf.cast(x, "float32") is x
    assert tf.add_n([x]) is x
    assert tf.add_n([x], name="sum").op.type == "Identity"


def test_placeholders(graph):
    unknown = tf.placeholder("int64")
    assert unknown.name == "Placeholder:0"
    assert unknown.op.node_def.attr["shape"].shape.unknown_rank
    partial = tf.placeholder(tf.float32, shape=[None, -1, 3])
    assert partial.shape == (None, None, 3)
    assert partial.op.get_attr("shape") == (None, None, 3)


def test_group_without_inputs_is_a_no_op():
    op = tf.group()
    assert (op.name, op.type, op.control_inputs) == ("group_deps", "NoOp", ())
    assert tf.no_op(name="nothing").name == "nothing"


def test_group_refuses_values_without_a_device():
    with pytest.raises(TypeError, match="'inputs' should be zero or more"):
        tf.group(1.0)


def test_strided_slice_with_tensor_indices(graph, x):
    k = tf.placeholder(tf.int32, shape=[], name="k")
    row = x[k]
    begin, end, strides = row.op.inputs[1:]
    assert (begin.op.type, end.op.type, strides.op.type) == ("Pack", "Pack", "Const")
    assert end.op.inputs[0].op.type == "AddV2"
    assert row.op.get_attr("shrink_axis_mask") == 1
