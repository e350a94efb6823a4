"""TensorFlow's protobuf objects in distserver's API, and TF-serialized bytes in our parsers."""

from __future__ import annotations

import base64

import pytest

from distserver.kernels import has_kernel
from distserver.protos import cluster_pb2, config_pb2, graph_pb2, tensorflow_server_pb2

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120, func_only=True)]

CLASSES = {
    "GraphDef/ref": graph_pb2.GraphDef,
    "GraphDef/resource": graph_pb2.GraphDef,
    "ConfigProto": config_pb2.ConfigProto,
    "RunOptions": config_pb2.RunOptions,
    "CallableOptions": config_pb2.CallableOptions,
    "ServerDef": tensorflow_server_pb2.ServerDef,
    "ClusterDef": cluster_pb2.ClusterDef,
}


@pytest.fixture(scope="module")
def results(tf_client):
    return tf_client.run("tf_protos.py", {})


def test_servers_from_tf_server_def_cluster_def_and_config_proto(results, check):
    built = check(results, "server_from_tf_server_def")
    assert built["target"] == "grpc://" + built["cluster"]["ps"][0]
    assert built["config"] == 30000
    assert check(results, "cluster_spec_from_tf_cluster_def") == built["cluster"]
    assert check(results, "worker_default_config") is True


def test_a_tf_session_runs_on_servers_built_from_tf_protos(results, check):
    assert check(results, "tf_session_on_servers_from_tf_protos") == [2.0, 4.0]
    assert check(results, "distserver_session_with_tf_config") == [1.0, 2.0, 3.0, 4.0]


@pytest.mark.parametrize("name", sorted(CLASSES))
def test_tf_serialized_messages_parse_and_round_trip(results, name):
    data = base64.b64decode(results["messages"][name])
    message = CLASSES[name].FromString(data)
    assert message.SerializeToString(deterministic=True) == data


def test_tf_serialized_graphs_keep_their_nodes(results):
    graph = graph_pb2.GraphDef.FromString(base64.b64decode(results["messages"]["GraphDef/ref"]))
    by_name = {node.name: node for node in graph.node}
    assert by_name["w1"].op == "VariableV2"
    assert by_name["w1"].device == "/job:ps/task:0"
    assert by_name["b1"].device == "/job:ps/task:1"
    assert list(by_name["w1/read"].attr["_class"].list.s) == [b"loc:@w1"]
    options = config_pb2.ConfigProto.FromString(base64.b64decode(results["messages"]["ConfigProto"]))
    assert list(options.device_filters) == ["/job:ps", "/job:worker/task:1"]
    assert options.operation_timeout_in_ms == 1234


@pytest.mark.parametrize("name", ["GraphDef/ref", "GraphDef/resource"])
def test_every_op_of_tf1_training_graphs_has_a_kernel(results, name):
    missing = [op for op in results["ops"][name] if not has_kernel(op)]
    assert missing == []
