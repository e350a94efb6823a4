"""TFConfigClusterResolver: reading TF_CONFIG as TensorFlow does."""

from __future__ import annotations

import json

import pytest

from distserver.cluster import ClusterSpec, TFConfigClusterResolver

CLUSTER = {
    "chief": ["host0:2222"],
    "worker": ["host1:2222", "host2:2222"],
    "ps": ["host3:2222"],
}


def set_tf_config(monkeypatch: pytest.MonkeyPatch, **config: object) -> None:
    monkeypatch.setenv("TF_CONFIG", json.dumps(config))


@pytest.fixture(autouse=True)
def no_tf_config(monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)


def test_without_tf_config():
    resolver = TFConfigClusterResolver()
    assert resolver.task_type is None
    assert resolver.task_id is None
    assert resolver.rpc_layer is None
    assert resolver.environment is None
    spec = resolver.cluster_spec()
    assert isinstance(spec, ClusterSpec)
    assert not spec
    assert resolver.master() == ""
    assert resolver.num_accelerators() == {}


def test_full_tf_config(monkeypatch):
    set_tf_config(
        monkeypatch,
        cluster=CLUSTER,
        task={"type": "worker", "index": 1},
        rpc_layer="grpc",
        environment="cloud",
    )
    resolver = TFConfigClusterResolver()
    assert resolver.task_type == "worker"
    assert resolver.task_id == 1
    assert resolver.rpc_layer == "grpc"
    assert resolver.environment is None  # TF_CONFIG's "environment" is not read
    assert resolver.cluster_spec() == ClusterSpec(CLUSTER)
    assert resolver.cluster_spec().jobs == ["chief", "worker", "ps"]
    assert resolver.master() == "grpc://host2:2222"
    assert resolver.master("ps", 0) == "grpc://host3:2222"
    assert resolver.master("chief", 0, rpc_layer="grpc+verbs") == "grpc+verbs://host0:2222"


def test_session_master_wins(monkeypatch):
    set_tf_config(
        monkeypatch,
        cluster=CLUSTER,
        task={"type": "worker", "index": 0},
        session_master="grpc://elsewhere:1",
    )
    resolver = TFConfigClusterResolver(rpc_layer="other")
    assert resolver.master() == "grpc://elsewhere:1"
    assert resolver.master("ps", 0, "x") == "grpc://elsewhere:1"


def test_master_without_rpc_layer(monkeypatch):
    set_tf_config(monkeypatch, cluster=CLUSTER, task={"type": "worker", "index": 0})
    assert TFConfigClusterResolver().master() == "host1:2222"


def test_master_of_single_task_cluster_is_local(monkeypatch):
    set_tf_config(
        monkeypatch, cluster={"worker": ["h:1"]}, task={"type": "worker", "index": 0}, rpc_layer="grpc"
    )
    assert TFConfigClusterResolver().master() == ""


def test_master_unknown_task(monkeypatch):
    set_tf_config(monkeypatch, cluster=CLUSTER, task={"type": "worker", "index": 7})
    with pytest.raises(ValueError, match=r"^No task with index 7 in job 'worker'$"):
        TFConfigClusterResolver().master()


def test_master_without_task(monkeypatch):
    set_tf_config(monkeypatch, cluster=CLUSTER)
    with pytest.raises(ValueError, match=r"^No such job in cluster: None$"):
        TFConfigClusterResolver().master()


def test_tf_config_read_on_every_access(monkeypatch):
    resolver = TFConfigClusterResolver()
    set_tf_config(monkeypatch, cluster=CLUSTER, task={"type": "worker", "index": 0})
    assert (resolver.task_type, resolver.task_id) == ("worker", 0)
    set_tf_config(monkeypatch, cluster={"ps": ["p:1", "p:2"]}, task={"type": "ps", "index": 1}, rpc_layer="g")
    assert (resolver.task_type, resolver.task_id, resolver.rpc_layer) == ("ps", 1, "g")
    assert resolver.cluster_spec() == {"ps": {0: "p:1", 1: "p:2"}}
    assert resolver.master() == "g://p:2"
    monkeypatch.delenv("TF_CONFIG")
    assert resolver.task_type is None
    assert not resolver.cluster_spec()


def test_constructor_values_override(monkeypatch):
    set_tf_config(monkeypatch, cluster=CLUSTER, task={"type": "worker", "index": 1}, rpc_layer="grpc")
    resolver = TFConfigClusterResolver(
        task_type="ps", task_id=0, rpc_layer="grpc+verbs", environment="google"
    )
    assert (resolver.task_type, resolver.task_id, resolver.rpc_layer) == ("ps", 0, "grpc+verbs")
    assert resolver.environment == "google"
    assert resolver.master() == "grpc+verbs://host3:2222"


def test_constructor_values_are_converted():
    resolver = TFConfigClusterResolver(task_type=7, task_id="3")  # type: ignore[arg-type]
    assert resolver.task_type == "7"
    assert resolver.task_id == 3


def test_setters(monkeypatch):
    set_tf_config(monkeypatch, cluster=CLUSTER, task={"type": "worker", "index": 1})
    resolver = TFConfigClusterResolver()
    resolver.task_type = "chief"
    resolver.task_id = 0
    resolver.rpc_layer = "grpc"
    assert resolver.master() == "grpc://host0:2222"
    resolver.task_type = None  # back to TF_CONFIG
    assert resolver.task_type == "worker"


def test_string_values_in_tf_config(monkeypatch):
    set_tf_config(
        monkeypatch,
        cluster={"worker": {"0": "w0:1", "2": "w2:1"}, "ps": ["p:1"]},
        task={"type": "worker", "index": "2"},
    )
    resolver = TFConfigClusterResolver()
    assert resolver.task_id == 2
    assert resolver.cluster_spec().as_dict() == {"worker": {0: "w0:1", 2: "w2:1"}, "ps": ["p:1"]}
    assert resolver.master() == "w2:1"


def test_task_without_index(monkeypatch):
    set_tf_config(monkeypatch, task={"type": "chief"})
    resolver = TFConfigClusterResolver()
    assert resolver.task_type == "chief"
    assert resolver.task_id is None


def test_invalid_json(monkeypatch):
    monkeypatch.setenv("TF_CONFIG", "{not json")
    with pytest.raises(json.JSONDecodeError):
        _ = TFConfigClusterResolver().task_type
