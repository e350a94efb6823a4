"""Tests of resource variables, their initializers and `replica_device_setter`.

Expected graphs were checked against TensorFlow 2.21's `tf.compat.v1` graph mode
(`tf.compat.v1.Variable`, which builds resource variables in TF 2.x).
"""

import numpy as np
import pytest

import distserver.graph as tf
from distserver.protos import types_pb2


@pytest.fixture(autouse=True)
def graph():
    with tf.Graph().as_default() as g:
        yield g


def _structure(graph):
    return [(n.name, n.op, list(n.input), n.device) for n in graph.as_graph_def().node]


def test_variable_graph_matches_tensorflow(graph):
    v = tf.Variable([1.0, 2.0], name="v")
    v.assign_add([1.0, 1.0])
    v.assign([3.0, 3.0])
    v.assign_sub([3.0, 3.0], read_value=False)
    tf.global_variables_initializer()
    assert _structure(graph) == [
        ("v/Initializer/initial_value", "Const", [], ""),
        ("v", "VarHandleOp", [], ""),
        ("v/IsInitialized/VarIsInitializedOp", "VarIsInitializedOp", ["v"], ""),
        ("v/Assign", "AssignVariableOp", ["v", "v/Initializer/initial_value"], ""),
        ("v/Read/ReadVariableOp", "ReadVariableOp", ["v"], ""),
        ("Const", "Const", [], ""),
        ("AssignAddVariableOp", "AssignAddVariableOp", ["v", "Const"], ""),
        ("ReadVariableOp", "ReadVariableOp", ["v", "^AssignAddVariableOp"], ""),
        ("Const_1", "Const", [], ""),
        ("AssignVariableOp", "AssignVariableOp", ["v", "Const_1"], ""),
        ("ReadVariableOp_1", "ReadVariableOp", ["v", "^AssignVariableOp"], ""),
        ("Const_2", "Const", [], ""),
        ("AssignSubVariableOp", "AssignSubVariableOp", ["v", "Const_2"], ""),
        ("init", "NoOp", ["^v/Assign"], ""),
    ]
    attrs = {op.name: {k: op.get_attr(k) for k in op.node_def.attr} for op in graph.get_operations()}
    assert attrs["v"] == {
        "_class": [b"loc:@v"],
        "allowed_devices": [],
        "container": b"",
        "debug_name": b"v/",
        "dtype": np.float32,
        "shape": (2,),
        "shared_name": b"v",
    }
    assert attrs["v/Assign"] == {
        "_has_manual_control_dependencies": True,
        "dtype": np.float32,
        "validate_shape": False,
    }
    assert attrs["AssignVariableOp"]["validate_shape"] is True
    assert attrs["AssignAddVariableOp"] == {"_has_manual_control_dependencies": True, "dtype": np.float32}
    assert attrs["AssignSubVariableOp"] == {"dtype": np.float32}
    assert attrs["v/Read/ReadVariableOp"] == {"dtype": np.float32}
    assert attrs["v/IsInitialized/VarIsInitializedOp"] == {}
    assert attrs["v/Initializer/initial_value"]["_class"] == [b"loc:@v"]
    np.testing.assert_array_equal(attrs["v/Initializer/initial_value"]["value"], [1.0, 2.0])


def test_replica_device_setter_graph(graph):
    q = tf.constant(3.0, name="q")
    with tf.device(tf.replica_device_setter(ps_tasks=2)):
        with tf.control_dependencies([q]):
            a = tf.Variable(1.0, name="a")  # Variables ignore control dependencies...
            b = tf.Variable(tf.zeros([2, 3]), name="b", trainable=False)  # ...their initial values do not.
        with tf.name_scope("sc"):
            tf.Variable(np.ones(3, np.int64))
        _ = a + 1.0
        _ = a * b
        a.read_value()
    tf.global_variables_initializer()
    # TensorFlow builds the same nodes; it differs (deliberately) only in devices: it puts
    # the IsInitialized ops and Read/ReadVariableOp on /job:worker and leaves the plain
    # reads (ReadVariableOp, ReadVariableOp_1, mul/ReadVariableOp) to its placer, where
    # we pin every op that takes a handle to the handle's device.
    assert _structure(graph) == [
        ("q", "Const", [], ""),
        ("a/Initializer/initial_value", "Const", [], ""),
        ("a", "VarHandleOp", [], "/job:ps/task:0"),
        ("a/IsInitialized/VarIsInitializedOp", "VarIsInitializedOp", ["a"], "/job:ps/task:0"),
        ("a/Assign", "AssignVariableOp", ["a", "a/Initializer/initial_value"], "/job:ps/task:0"),
        ("a/Read/ReadVariableOp", "ReadVariableOp", ["a"], "/job:ps/task:0"),
        ("zeros", "Const", ["^q"], "/job:worker"),
        ("b", "VarHandleOp", [], "/job:ps/task:1"),
        ("b/IsInitialized/VarIsInitializedOp", "VarIsInitializedOp", ["b"], "/job:ps/task:1"),
        ("b/Assign", "AssignVariableOp", ["b", "zeros"], "/job:ps/task:1"),
        ("b/Read/ReadVariableOp", "ReadVariableOp", ["b"], "/job:ps/task:1"),
        ("sc/Variable/Initializer/initial_value", "Const", [], ""),
        ("sc/Variable", "VarHandleOp", [], "/job:ps/task:0"),
        (
            "sc/Variable/IsInitialized/VarIsInitializedOp",
            "VarIsInitializedOp",
            ["sc/Variable"],
            "/job:ps/task:0",
        ),
        (
            "sc/Variable/Assign",
            "AssignVariableOp",
            ["sc/Variable", "sc/Variable/Initializer/initial_value"],
            "/job:ps/task:0",
        ),
        ("sc/Variable/Read/ReadVariableOp", "ReadVariableOp", ["sc/Variable"], "/job:ps/task:0"),
        ("ReadVariableOp", "ReadVariableOp", ["a"], "/job:ps/task:0"),
        ("add/y", "Const", [], "/job:worker"),
        ("add", "AddV2", ["ReadVariableOp", "add/y"], "/job:worker"),
        ("ReadVariableOp_1", "ReadVariableOp", ["a"], "/job:ps/task:0"),
        ("mul/ReadVariableOp", "ReadVariableOp", ["b"], "/job:ps/task:1"),
        ("mul", "Mul", ["ReadVariableOp_1", "mul/ReadVariableOp"], "/job:worker"),
        ("Read/ReadVariableOp", "ReadVariableOp", ["a"], "/job:ps/task:0"),
        ("Identity", "Identity", ["Read/ReadVariableOp"], "/job:worker"),
        ("init/NoOp", "NoOp", ["^a/Assign", "^sc/Variable/Assign"], "/job:ps/task:0"),
        ("init/NoOp_1", "NoOp", ["^b/Assign"], "/job:ps/task:1"),
        ("init", "NoOp", ["^init/NoOp", "^init/NoOp_1"], ""),
    ]
    assert graph.get_operation_by_name("sc/Variable").get_attr("debug_name") == b"sc/Variable/"


def test_variable_properties(graph):
    with tf.device("/job:ps/task:0"):
        v = tf.Variable(np.zeros((2, 3), np.float64), name="w")
    assert (v.name, v.op.name, v.op.type, v.handle.name) == ("w:0", "w", "VarHandleOp", "w:0")
    assert (v.dtype, v.datatype, v.shape, v.get_shape()) == (np.float64, types_pb2.DT_DOUBLE, (2, 3), (2, 3))
    assert (v.device, v.graph, v.trainable) == ("/job:ps/task:0", graph, True)
    assert (v.handle.dtype, v.handle.datatype, v.handle.shape) == (
        np.dtype(object),
        types_pb2.DT_RESOURCE,
        (),
    )
    assert v.initializer.name == "w/Assign"
    assert v.initial_value.name == "w/Initializer/initial_value:0"
    assert repr(v) == "<distserver.graph.Variable 'w:0' shape=(2, 3) dtype=float64>"
    # Fetching a variable fetches its Read/ReadVariableOp, as in TensorFlow.
    assert graph.as_graph_element(v).name == "w/Read/ReadVariableOp:0"


def test_names_are_made_unique(graph):
    first, second = tf.Variable(1.0), tf.Variable(1.0)
    named = [tf.Variable(1.0, name="v"), tf.Variable(1.0, name="v")]
    assert [first.name, second.name, named[0].name, named[1].name] == [
        "Variable:0",
        "Variable_1:0",
        "v:0",
        "v_1:0",
    ]
    assert named[1].op.get_attr("shared_name") == b"v_1"


def test_initial_values(graph):
    assert tf.Variable(1, dtype=tf.float32).dtype == np.float32
    assert tf.Variable(lambda: tf.ones([2]), name="w").initial_value.name == "w/Initializer/ones:0"
    partial = tf.Variable(tf.placeholder_with_default([1.0, 2.0], [None]), shape=[None])
    assert partial.shape == (None,)
    assert partial.op.get_attr("shape") == (None,)
    with pytest.raises(ValueError, match="is not compatible with the explicitly supplied `shape`"):
        tf.Variable([1.0, 2.0], shape=[3])
    with pytest.raises(ValueError, match="initial_value must be specified"):
        tf.Variable(None)


def test_variables_ignore_enclosing_control_dependencies_and_initializer_devices(graph):
    q = tf.constant(1.0, name="q")
    with tf.control_dependencies([q]), tf.device("/job:ps/task:1"):
        v = tf.Variable(2.0, name="v")
        after = tf.constant(0.0)
    assert [op.control_inputs for op in (v.op, v.initializer, v.initial_value.op)] == [(), (), ()]
    assert after.op.control_inputs == (q.op,)
    assert v.initial_value.device == ""  # Placed through its _class colocation, as in TensorFlow.
    assert v.initializer.device == v.device == "/job:ps/task:1"


def test_variables_read_when_used_as_tensors(graph):
    v = tf.Variable([[1.0, 2.0]], name="v")
    product = tf.matmul(v, v, transpose_b=True)
    assert [t.op.name for t in product.op.inputs] == ["MatMul/ReadVariableOp", "MatMul/ReadVariableOp_1"]
    assert all(t.op.type == "ReadVariableOp" for t in product.op.inputs)
    assert (2 * v).op.inputs[1].op.type == "ReadVariableOp"
    assert (-v).op.type == "Neg"
    assert v[0].shape == (2,)
    assert tf.convert_to_tensor(v).op.type == "ReadVariableOp"
    with pytest.raises(ValueError, match="Incompatible type conversion requested to type 'int32'"):
        tf.convert_to_tensor(v, dtype=tf.int32)
    with pytest.raises(TypeError, match="as a Python `bool`"):
        bool(v)


def test_reads(graph):
    with tf.device("/job:ps"):
        v = tf.Variable(1.0, name="v")
    with tf.device("/job:worker"):
        value, read, initialized = v.value(), v.read_value(), v.is_initialized()
    assert (value.op.name, value.device) == ("ReadVariableOp", "/job:ps")
    assert (read.op.type, read.device) == ("Identity", "/job:worker")
    assert (read.op.inputs[0].op.name, read.op.inputs[0].device) == ("Read/ReadVariableOp", "/job:ps")
    assert (initialized.op.type, initialized.dtype, initialized.device) == (
        "VarIsInitializedOp",
        np.bool_,
        "/job:ps",
    )


def test_assignments(graph):
    v = tf.Variable([1.0, 2.0], name="v")
    new_value = v.assign([5, 6])
    assert (new_value.op.type, new_value.op.control_inputs[0].type) == ("ReadVariableOp", "AssignVariableOp")
    assert new_value.op.control_inputs[0].inputs[1].dtype == np.float32
    op = v.assign_add(1.0, name="bump", read_value=False)
    assert (op.name, op.type, op.outputs) == ("bump", "AssignAddVariableOp", [])
    assert v.assign_sub(1.0).op.control_inputs[0].type == "AssignSubVariableOp"
    with pytest.raises(ValueError, match="Shape mismatch"):
        v.assign([1.0, 2.0, 3.0])
    with pytest.raises(ValueError, match="Tensor conversion requested dtype float32"):
        v.assign(tf.constant([1, 2]))


def test_collections_and_initializers(graph):
    assert tf.global_variables_initializer().type == "NoOp"
    a = tf.Variable(1.0, name="a")
    b = tf.Variable(1.0, name="b", trainable=False)
    with tf.name_scope("scope"):
        c = tf.Variable(1.0, name="c")
    d = tf.Variable(1.0, name="d", collections=["mine"])
    assert tf.global_variables() == [a, b, c]
    assert tf.trainable_variables() == [a, c]
    assert tf.global_variables(scope="scope") == [c]
    assert graph.get_collection("mine") == [d]
    init = tf.variables_initializer([b, a], name="start")
    assert (init.name, init.device) == ("start", "")
    assert [op.name for op in init.control_inputs] == ["b/Assign", "a/Assign"]
    assert init.node_def.input == ["^a/Assign", "^b/Assign"]
    assert tf.variables_initializer([]).name == "init_1"


def test_control_dependencies_on_variables_use_the_handle(graph):
    v = tf.Variable(1.0, name="v")
    with tf.control_dependencies([v]):
        after = tf.no_op()
    assert after.control_inputs == (v.op,)


# --------------------------------------------------------------------------- replica_device_setter


def _devices(variables):
    return [v.device for v in variables]


def test_round_robin_over_ps_tasks(graph):
    with tf.device(tf.replica_device_setter(ps_tasks=2, worker_device="/job:worker/task:3")):
        variables = [tf.Variable(float(k)) for k in range(5)]
        other = tf.identity(variables[0])
    assert _devices(variables) == ["/job:ps/task:0", "/job:ps/task:1"] * 2 + ["/job:ps/task:0"]
    assert other.device == "/job:worker/task:3"


class _Cluster:
    def as_dict(self):
        return {"ps": ["ps0:1", "ps1:1", "ps2:1"], "worker": ["w0:1"]}


@pytest.mark.parametrize("cluster", [_Cluster(), {"ps": ["ps0:1", "ps1:1", "ps2:1"], "worker": ["w0:1"]}])
def test_ps_tasks_come_from_the_cluster(graph, cluster):
    with tf.device(tf.replica_device_setter(cluster=cluster)):
        variables = [tf.Variable(1.0) for _ in range(4)]
    assert _devices(variables) == ["/job:ps/task:0", "/job:ps/task:1", "/job:ps/task:2", "/job:ps/task:0"]


def test_without_ps_tasks_there_is_no_device_function():
    assert tf.replica_device_setter() is None
    assert tf.replica_device_setter(cluster={"worker": ["w:1"]}) is None


def test_inner_devices_are_merged(graph):
    with tf.device(tf.replica_device_setter(ps_tasks=3)):
        with tf.device("/device:CPU:0"):
            on_cpu = tf.Variable(1.0)
        with tf.device("/job:worker/task:1"):
            pinned = tf.Variable(1.0)
        with tf.device("/task:2"):
            chosen = tf.Variable(1.0)
    assert _devices([on_cpu, pinned, chosen]) == [
        "/job:ps/task:0/device:CPU:0",
        "/job:worker/task:1",  # Another job than the ps job: left where the inner scope put it.
        "/job:ps/task:2",  # The inner task wins, but the round robin still moved on.
    ]


def test_setter_options(graph):
    setter = tf.replica_device_setter(
        ps_tasks=4, ps_device="/job:params", ps_ops=["Placeholder"], ps_strategy=lambda op: 3
    )
    with tf.device(setter):
        fed = tf.placeholder(tf.float32)
        v = tf.Variable(1.0)
    assert (fed.device, v.device) == ("/job:params/task:3", "/job:worker")
    with tf.device(tf.replica_device_setter(ps_tasks=1, merge_devices=False)):
        with tf.device("/cpu:0"):
            kept = tf.Variable(1.0)
        moved = tf.Variable(1.0)
    assert _devices([kept, moved]) == ["/device:CPU:0", "/job:ps/task:0"]


def test_gathering_rows_of_a_variable_reads_only_those_rows(graph):
    # As TF's tf.gather on a resource variable: ResourceGather on the handle, not a full read.
    with tf.device("/job:ps/task:0"):
        v = tf.Variable(np.ones((5, 3), np.float32), name="v")
    rows = tf.gather(v, [4, 0])
    other_axis = tf.gather(v, [1], axis=1)
    assert rows.op.type == "ResourceGather"
    assert rows.op.name == "Gather"
    assert [t.name for t in rows.op.inputs] == ["v:0", "Gather/indices:0"]
    assert rows.device == "/job:ps/task:0"
    assert rows.shape == (2, 3)
    assert {k: rows.op.get_attr(k) for k in ("batch_dims", "validate_indices", "dtype", "Tindices")} == {
        "batch_dims": 0,
        "validate_indices": True,
        "dtype": np.float32,
        "Tindices": np.int32,
    }
    assert other_axis.op.type == "GatherV2"
