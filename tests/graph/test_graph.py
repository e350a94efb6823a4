"""Tests of graphs, tensors, operations and scopes (names, devices, control deps, versions).

Naming, device-merge and error-message expectations follow TensorFlow 2.21's
`tf.compat.v1` graph builder (checked against it; see also test_ops.py).
"""

import threading

import numpy as np
import pytest

import distserver.graph as tf
from distserver.devices import DeviceSpec
from distserver.protos import types_pb2


@pytest.fixture(autouse=True)
def graph():
    with tf.Graph().as_default() as g:
        yield g


def _names(graph):
    return [op.name for op in graph.get_operations()]


# --------------------------------------------------------------------------- default graphs


def test_as_default_nests_and_restores(graph):
    assert tf.get_default_graph() is graph
    inner = tf.Graph()
    with inner.as_default() as entered:
        assert entered is inner
        assert tf.get_default_graph() is inner
    assert tf.get_default_graph() is graph


def test_default_graph_stack_is_per_thread(graph):
    seen = []
    for _ in range(2):
        worker = threading.Thread(target=lambda: seen.append(tf.get_default_graph()))
        worker.start()
        worker.join()
    # Other threads do not see this thread's `as_default`; they share the global graph.
    assert seen[0] is not graph
    assert seen[0] is seen[1]


def test_reset_default_graph_replaces_the_global_graph():
    with pytest.raises(AssertionError, match=r"Do not use tf\.reset_default_graph"):
        tf.reset_default_graph()
    seen = []

    def outside_any_as_default():
        before = tf.get_default_graph()
        tf.reset_default_graph()
        seen.extend([before, tf.get_default_graph(), tf.get_default_graph()])

    worker = threading.Thread(target=outside_any_as_default)
    worker.start()
    worker.join()
    assert seen[0] is not seen[1]
    assert seen[1] is seen[2]


# --------------------------------------------------------------------------- names


def test_unique_names_follow_tensorflow(graph):
    assert [graph.unique_name("foo"), graph.unique_name("foo"), graph.unique_name("Foo")] == [
        "foo",
        "foo_1",
        "Foo_2",
    ]
    assert graph.unique_name("foo", mark_as_used=False) == "foo_3"
    assert graph.unique_name("foo") == "foo_3"
    # A name that looks like a suffixed one is skipped by later suffixes.
    assert [graph.unique_name("a"), graph.unique_name("a_1"), graph.unique_name("a")] == ["a", "a_1", "a_2"]


def test_op_names_are_deduplicated_case_insensitively(graph):
    x = tf.placeholder(tf.float32, name="x")
    ops = [tf.add(x, x), x + x, tf.add(x, x, name="add"), tf.identity(x, name="x")]
    assert [t.op.name for t in ops] == ["Add", "add_1", "add_2", "x_1"]


def test_name_scopes(graph):
    x = tf.placeholder(tf.float32, name="x")
    with tf.name_scope("outer") as outer:
        assert outer == "outer/"
        with tf.name_scope("inner") as inner:
            assert (inner, graph.get_name_scope()) == ("outer/inner/", "outer/inner")
            assert tf.identity(x).name == "outer/inner/Identity:0"
        with tf.name_scope("inner") as again:
            assert again == "outer/inner_1/"
        with tf.name_scope("abs/"):
            assert tf.identity(x).name == "abs/Identity:0"
        with tf.name_scope(None) as root:
            assert (root, tf.identity(x).name) == ("", "Identity:0")
        assert tf.identity(x, name="given").name == "outer/given:0"
        assert tf.identity(x, name="exact/").name == "exact:0"
    with tf.name_scope("outer") as second:
        assert second == "outer_1/"
    assert tf.identity(x, name="outer").name == "outer_2:0"
    with tf.name_scope(None, default_name="dflt") as default:
        assert default == "dflt/"


@pytest.mark.parametrize("bad", ["-x", "/x", "a b", "x:0"])
def test_invalid_names_are_refused(graph, bad):
    with pytest.raises(ValueError, match="is not a valid"):
        tf.placeholder(tf.float32, name=bad)
    if not bad.startswith(("-", "/")):
        with pytest.raises(ValueError, match="is not a valid scope name"), tf.name_scope(bad):
            pass


# --------------------------------------------------------------------------- lookups


def test_lookups_by_name(graph):
    x = tf.placeholder(tf.float32, name="x")
    assert graph.get_tensor_by_name("x:0") is x
    assert graph.get_operation_by_name("x") is x.op
    assert graph.as_graph_element("x:0") is x
    assert graph.as_graph_element(x.op) is x.op


@pytest.mark.parametrize(
    ("lookup", "error", "message"),
    [
        (
            lambda g: g.get_tensor_by_name("nope:0"),
            KeyError,
            "The name 'nope:0' refers to a Tensor which does not exist. The operation, 'nope', does not "
            "exist in the graph.",
        ),
        (
            lambda g: g.get_tensor_by_name("x:1"),
            KeyError,
            "The name 'x:1' refers to a Tensor which does not exist. The operation, 'x', exists but only "
            "has 1 outputs.",
        ),
        (
            lambda g: g.get_tensor_by_name("x"),
            ValueError,
            "The name 'x' refers to an Operation, not a Tensor. Tensor names must be of the form "
            '"<op_name>:<output_index>".',
        ),
        (lambda g: g.get_tensor_by_name("nope"), ValueError, "looks like an \\(invalid\\) Operation name"),
        (
            lambda g: g.get_tensor_by_name("x:y"),
            ValueError,
            "looks a like a Tensor name, but is not a valid one",
        ),
        (lambda g: g.get_tensor_by_name(3), TypeError, "Tensor names are strings \\(or similar\\), not int."),
        (
            lambda g: g.get_operation_by_name("nope"),
            KeyError,
            "The name 'nope' refers to an Operation not in the graph.",
        ),
        (
            lambda g: g.get_operation_by_name("x:0"),
            ValueError,
            "Name 'x:0' appears to refer to a Tensor, not a Operation.",
        ),
        (lambda g: g.get_operation_by_name(None), TypeError, "Operation names are strings"),
        (lambda g: g.as_graph_element(1.0), TypeError, "Can not convert a float into a Tensor or Operation."),
    ],
)
def test_lookup_errors_read_like_tensorflow(graph, lookup, error, message):
    tf.placeholder(tf.float32, name="x")
    with pytest.raises(error, match=message):
        lookup(graph)


def test_elements_of_other_graphs_are_refused(graph):
    with tf.Graph().as_default():
        other = tf.placeholder(tf.float32, name="other")
    with pytest.raises(ValueError, match="is not an element of this graph"):
        graph.as_graph_element(other)
    with pytest.raises(ValueError, match="is not an element of this graph"):
        graph.as_graph_element(other.op)


# --------------------------------------------------------------------------- graph defs and versions


def test_graph_def_has_nodes_in_creation_order_and_a_producer(graph):
    assert graph.version == 0
    x = tf.placeholder(tf.float32, shape=[2], name="x")
    y = tf.square(x)
    graph_def = graph.as_graph_def()
    assert [n.name for n in graph_def.node] == ["x", "Square"]
    assert graph_def.versions.producer == tf.GRAPH_DEF_VERSION == 2474
    assert graph.graph_def_versions.producer == 2474
    assert list(graph_def.node[1].input) == ["x"]
    assert graph.version == 2
    assert y.op.node_def == graph_def.node[1]


def test_from_version_gives_the_nodes_added_since(graph):
    x = tf.placeholder(tf.float32, name="x")
    first = graph.version
    assert list(graph.as_graph_def(from_version=first).node) == []
    with tf.name_scope("later"):
        tf.add(x, 1.0)
    second = graph.version
    tf.identity(x)
    delta = graph.as_graph_def(from_version=first)
    assert [n.name for n in delta.node] == ["later/Add/y", "later/Add", "Identity"]
    assert [n.name for n in graph.as_graph_def(from_version=second).node] == ["Identity"]
    assert graph.version == second + 1
    assert delta.versions.producer == tf.GRAPH_DEF_VERSION


def test_output_shapes_can_be_added(graph):
    x = tf.placeholder(tf.float32, shape=[None, 3], name="x")
    tf.group(tf.reduce_sum(x, 1))
    nodes = {n.name: n for n in graph.as_graph_def(add_shapes=True).node}
    dims = [[d.size for d in s.dim] for s in nodes["Sum"].attr["_output_shapes"].list.shape]
    assert dims == [[-1]]
    assert "_output_shapes" not in nodes["group_deps"].attr


def test_finalized_graphs_refuse_new_ops(graph):
    tf.placeholder(tf.float32)
    graph.finalize()
    assert graph.finalized
    with pytest.raises(RuntimeError, match=r"Graph is finalized and cannot be modified\."):
        tf.placeholder(tf.float32)
    with pytest.raises(RuntimeError, match="finalized"):
        graph.add_to_collection("c", 1)


def test_collections(graph):
    x = tf.placeholder(tf.float32, name="scoped/x")
    graph.add_to_collection("things", x)
    tf.add_to_collection("things", 42)
    graph.add_to_collections(["a", "a", "b"], x)
    assert tf.get_collection("things") == [x, 42]
    assert graph.get_collection("things", scope="scoped") == [x]
    assert graph.get_collection("a") == [x]
    assert graph.get_collection("missing") == []
    graph.get_collection_ref("things").append(7)
    assert graph.get_collection("things") == [x, 42, 7]
    assert set(graph.get_all_collection_keys()) == {"things", "a", "b"}


def test_graph_building_is_thread_safe(graph):
    def build():
        for _ in range(50):
            tf.constant(1.0)

    workers = [threading.Thread(target=lambda: _in(graph, build)) for _ in range(8)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    names = _names(graph)
    assert len(names) == len(set(names)) == 400
    assert graph.version == 400


def _in(graph, build):
    with graph.as_default():
        build()


# --------------------------------------------------------------------------- devices


def test_device_scopes_merge_field_by_field(graph):
    x = tf.placeholder(tf.float32, name="x")
    with tf.device("/job:ps"):
        assert tf.identity(x).device == "/job:ps"
        with tf.device("/task:1"):
            assert tf.identity(x).device == "/job:ps/task:1"
            with tf.device("/job:worker/device:GPU:0"):
                assert tf.identity(x).device == "/job:worker/task:1/device:GPU:0"
        with tf.device(DeviceSpec(task=3, device_type="CPU", device_index=0)):
            assert tf.identity(x).device == "/job:ps/task:3/device:CPU:0"
        with tf.device(""):
            assert tf.identity(x).device == "/job:ps"
        with tf.device(None):
            assert tf.identity(x).device == ""
    assert tf.identity(x).device == ""


def test_device_functions_see_the_op_and_inner_devices(graph):
    seen = []

    def choose(op):
        seen.append((op.type, op.device))
        return "/job:chosen" if op.type == "Identity" else None

    x = tf.placeholder(tf.float32, name="x")
    with tf.device(choose):
        with tf.device("/task:7"):
            ident = tf.identity(x)
        neg = tf.negative(x)
    assert seen == [("Identity", "/task:7"), ("Neg", "")]
    assert (ident.device, neg.device) == ("/job:chosen", "")
    assert ident.op.device == ident.device


def test_device_rejects_other_values(graph):
    with pytest.raises(TypeError, match="device\\(\\) takes"), tf.device(3):
        pass
    with pytest.raises(ValueError, match="Malformed device name"), tf.device("/jobs:ps"):
        pass


def test_colocation_overrides_device_scopes(graph):
    with tf.device("/job:ps/task:1"):
        anchor = tf.placeholder(tf.float32, name="anchor")
    with tf.device("/job:worker"):
        with tf.colocate_with(anchor):
            near = tf.identity(anchor)
            with tf.colocate_with(None, ignore_existing=True):
                free = tf.identity(anchor)
        far = tf.identity(anchor)
    assert (near.device, near.op.get_attr("_class")) == ("/job:ps/task:1", [b"loc:@anchor"])
    assert near.op.colocation_groups() == [b"loc:@anchor"]
    assert free.device == ""
    assert "_class" not in free.op.node_def.attr
    assert far.device == "/job:worker"
    with tf.colocate_with(near.op):
        assert tf.identity(anchor).op.get_attr("_class") == [b"loc:@anchor"]
    with pytest.raises(ValueError, match="ignore_existing is not True"), tf.colocate_with(None):
        pass


# --------------------------------------------------------------------------- control dependencies


def test_control_dependencies(graph):
    x = tf.placeholder(tf.float32, name="x")
    first, second = tf.identity(x, name="first"), tf.identity(x, name="second")
    with tf.control_dependencies([second, first.op]):
        a = tf.identity(x, name="a")
        b = tf.identity(a, name="b")
        c = tf.identity(first, name="c")
        with tf.control_dependencies([first]):
            d = tf.identity(x, name="d")
        with tf.control_dependencies(None):
            e = tf.identity(x, name="e")
    assert a.op.control_inputs == (second.op, first.op)
    assert graph.get_operation_by_name("a").node_def.input == ["x", "^first", "^second"]
    assert b.op.control_inputs == ()  # Its input already runs after them.
    assert c.op.control_inputs == (second.op,)  # No control input on a data input.
    assert d.op.control_inputs == (second.op, first.op)
    assert e.op.control_inputs == ()
    assert first.op.get_attr("_has_manual_control_dependencies") is True


def test_control_dependencies_refuse_values(graph):
    with (
        pytest.raises(TypeError, match="Control input must be Operation or Tensor"),
        tf.control_dependencies([1.0]),
    ):
        pass


# --------------------------------------------------------------------------- tensors and operations


def test_tensor_properties(graph):
    with tf.device("/job:w"):
        x = tf.placeholder(tf.float32, shape=[None, 2], name="x")
    assert (x.name, x.value_index, x.op.name, x.graph, x.device) == ("x:0", 0, "x", graph, "/job:w")
    assert (x.dtype, x.datatype, x.shape, x.get_shape()) == (
        np.float32,
        types_pb2.DT_FLOAT,
        (None, 2),
        (None, 2),
    )
    assert repr(x) == "<distserver.graph.Tensor 'x:0' shape=(None, 2) dtype=float32>"
    assert str(x) == 'Tensor("x:0", shape=(None, 2), dtype=float32, device=/job:w)'
    assert str(tf.placeholder(tf.string)) == 'Tensor("Placeholder:0", dtype=string)'
    y = tf.identity(x)
    assert x.consumers() == [y.op]
    x.set_shape([5, None])
    assert x.shape == (5, 2)
    with pytest.raises(ValueError, match="is not compatible with supplied shape"):
        x.set_shape([5, 3])


def test_operation_properties(graph):
    x = tf.placeholder(tf.float32, shape=[2, 2], name="x")
    total = tf.reduce_sum(x, axis=[0], keepdims=True, name="total")
    op = total.op
    assert (op.name, op.type, op.graph, op.device) == ("total", "Sum", graph, "")
    assert op.inputs == (x, graph.get_tensor_by_name("total/reduction_indices:0"))
    assert op.outputs == [total]
    assert op.values() == (total,)
    assert repr(op) == "<distserver.graph.Operation 'total' type=Sum>"
    assert op.get_attr("keep_dims") is True
    assert op.get_attr("T") == np.float32
    assert op.get_attr("Tidx") == np.int32
    assert x.op.get_attr("shape") == (2, 2)
    np.testing.assert_array_equal(op.inputs[1].op.get_attr("value"), [0])
    assert tf.squeeze(x).op.get_attr("squeeze_dims") == []
    with pytest.raises(ValueError, match=r"Operation 'total' has no attr named 'nope'\."):
        op.get_attr("nope")
    node = op.node_def
    node.name = "changed"
    assert op.name == "total"


def test_create_op_checks_its_inputs(graph):
    with pytest.raises(TypeError, match="must be Tensors"):
        graph.create_op("Identity", [1.0], [tf.float32])
    op = graph.create_op("Custom", [], [tf.float32, "int64"], shapes=[[1], None])
    assert [(t.name, t.dtype, t.shape) for t in op.outputs] == [
        ("Custom:0", np.float32, (1,)),
        ("Custom:1", np.int64, None),
    ]
    assert graph.create_op("Custom", [op.outputs[1]], []).node_def.input == ["Custom:1"]
    with pytest.raises(ValueError, match="Duplicate node name in graph: 'Custom'"):
        graph.create_op("Custom", [], [], name="Custom/")


# --------------------------------------------------------------------------- package


def test_public_api_is_exported():
    assert len(tf.__all__) == len(set(tf.__all__))
    assert all(hasattr(tf, name) for name in tf.__all__)
    public = {name for name in vars(tf) if not name.startswith("_")} - {
        "Final",
        "np",
        "graph",
        "autodiff",
        "gradient_functions",
        "ops",
        "queues",
        "variables",
    }
    assert public == set(tf.__all__)


@pytest.mark.parametrize(
    ("alias", "datatype"),
    [
        (tf.float32, types_pb2.DT_FLOAT),
        (tf.float64, types_pb2.DT_DOUBLE),
        (tf.bfloat16, types_pb2.DT_BFLOAT16),
        (tf.int32, types_pb2.DT_INT32),
        (tf.int64, types_pb2.DT_INT64),
        (tf.uint8, types_pb2.DT_UINT8),
        (tf.bool_, types_pb2.DT_BOOL),
        (tf.complex64, types_pb2.DT_COMPLEX64),
        (tf.string, types_pb2.DT_STRING),
    ],
)
def test_dtype_aliases_are_numpy_dtypes(alias, datatype):
    assert isinstance(alias, np.dtype)
    assert tf.placeholder(alias).datatype == datatype


@pytest.mark.parametrize("spelling", [np.float32, "float32", "DT_FLOAT", types_pb2.DT_FLOAT, np.dtype("<f4")])
def test_dtypes_are_accepted_in_any_spelling(spelling):
    assert tf.placeholder(spelling).dtype == np.float32
