"""make_server_def, TensorFlow-proto conversion and the C++ server's construction checks."""

from __future__ import annotations

import functools
from typing import Any

import pytest
from google.protobuf import descriptor, descriptor_pb2, descriptor_pool, message_factory

from distserver import errors
from distserver.cluster import (
    ClusterSpec,
    coerce_proto,
    local_address,
    make_server_def,
    parse_host_port,
    validate_cluster,
)
from distserver.protos import cluster_pb2, config_pb2, tensorflow_server_pb2

ServerDef = tensorflow_server_pb2.ServerDef


# --- TensorFlow's protos, built for real in a fresh pool ------------------------------
#
# TensorFlow itself is not installed in the test environment. Its messages are the
# same as ours except for the package, so copy our file descriptors into package
# "tensorflow" in a separate DescriptorPool: the resulting classes are genuine protobuf
# messages named "tensorflow.ClusterDef" etc. that are *not* our classes.


def _tensorflow_name(name: str) -> str:
    return "tensorflow" + name.removeprefix("distserver") if name.startswith("distserver") else name


def _rename_types(message_proto: descriptor_pb2.DescriptorProto) -> None:
    for field in message_proto.field:
        if field.type_name:
            field.type_name = "." + _tensorflow_name(field.type_name.removeprefix("."))
    for nested in message_proto.nested_type:
        _rename_types(nested)


def _add_as_tensorflow(
    pool: descriptor_pool.DescriptorPool, file: descriptor.FileDescriptor, added: set[str]
) -> None:
    if file.name in added:
        return
    for dependency in file.dependencies:
        _add_as_tensorflow(pool, dependency, added)
    proto = descriptor_pb2.FileDescriptorProto()
    file.CopyToProto(proto)
    if proto.package.startswith("distserver"):
        proto.name = proto.name.replace("distserver/protos/", "tensorflow/core/protobuf/")
        proto.package = _tensorflow_name(proto.package)
        proto.dependency[:] = [
            name.replace("distserver/protos/", "tensorflow/core/protobuf/") for name in proto.dependency
        ]
        for message_proto in proto.message_type:
            _rename_types(message_proto)
    pool.Add(proto)
    added.add(file.name)


@functools.cache
def _tensorflow_pool() -> descriptor_pool.DescriptorPool:
    pool = descriptor_pool.DescriptorPool()
    _add_as_tensorflow(pool, tensorflow_server_pb2.DESCRIPTOR, set())
    return pool


def tensorflow_class(full_name: str) -> Any:
    return message_factory.GetMessageClass(_tensorflow_pool().FindMessageTypeByName(full_name))


def tf_cluster_def(**jobs: dict[int, str]) -> Any:
    cluster_def = tensorflow_class("tensorflow.ClusterDef")()
    for name, tasks in jobs.items():
        job = cluster_def.job.add(name=name)
        for index, address in tasks.items():
            job.tasks[index] = address
    return cluster_def


def test_tensorflow_classes_are_real_and_foreign():
    cluster_def = tf_cluster_def(worker={0: "w0:2222"})
    assert type(cluster_def).DESCRIPTOR.full_name == "tensorflow.ClusterDef"
    assert not isinstance(cluster_def, cluster_pb2.ClusterDef)
    server_def = tensorflow_class("tensorflow.ServerDef")()
    assert server_def.DESCRIPTOR.fields_by_name["cluster"].message_type.full_name == "tensorflow.ClusterDef"
    assert server_def.DESCRIPTOR.fields_by_name["default_session_config"].message_type.full_name == (
        "tensorflow.ConfigProto"
    )


# --- coerce_proto ---------------------------------------------------------------------


def test_coerce_proto_returns_ours_unchanged():
    ours = cluster_pb2.ClusterDef()
    assert coerce_proto(ours, cluster_pb2.ClusterDef) is ours


def test_coerce_proto_converts_tensorflow_message():
    theirs = tf_cluster_def(worker={0: "w0:2222", 3: "w3:2222"})
    ours = coerce_proto(theirs, cluster_pb2.ClusterDef)
    assert type(ours) is cluster_pb2.ClusterDef
    assert ours.job[0].name == "worker"
    assert dict(ours.job[0].tasks) == {0: "w0:2222", 3: "w3:2222"}


def test_coerce_proto_nested_message_names():
    experimental = tensorflow_class("tensorflow.ConfigProto.Experimental")(collective_group_leader="x")
    ours = coerce_proto(experimental, config_pb2.ConfigProto.Experimental)
    assert ours.collective_group_leader == "x"


@pytest.mark.parametrize(
    ("value", "kind"),
    [
        ({"job": []}, "builtins.dict"),
        (cluster_pb2.JobDef(), "distserver.protos.cluster_pb2.JobDef"),
    ],
)
def test_coerce_proto_rejects_other_types(value, kind):
    with pytest.raises(TypeError) as info:
        coerce_proto(value, cluster_pb2.ClusterDef)
    assert str(info.value) == (
        f"Expected a `distserver.ClusterDef` or `tensorflow.ClusterDef` protocol buffer, got {kind}"
    )


def test_coerce_proto_rejects_other_tensorflow_types():
    job_def = tensorflow_class("tensorflow.JobDef")(name="w")
    with pytest.raises(TypeError, match=r"got .*JobDef"):
        coerce_proto(job_def, cluster_pb2.ClusterDef)


# --- ClusterSpec and make_server_def with TensorFlow protos ---------------------------


def test_cluster_spec_from_tensorflow_cluster_def():
    theirs = tf_cluster_def(worker={0: "w0:2222", 1: "w1:2222"}, ps={0: "ps0:2222"})
    spec = ClusterSpec(theirs)
    assert spec.jobs == ["worker", "ps"]
    assert spec == {"worker": {0: "w0:2222", 1: "w1:2222"}, "ps": {0: "ps0:2222"}}
    assert type(spec.as_cluster_def()) is cluster_pb2.ClusterDef


def test_cluster_spec_rejects_other_tensorflow_messages():
    with pytest.raises(TypeError, match=r"^`cluster` must be a dictionary"):
        ClusterSpec(tensorflow_class("tensorflow.ServerDef")())


def test_make_server_def_from_tensorflow_server_def():
    theirs = tensorflow_class("tensorflow.ServerDef")(
        cluster=tf_cluster_def(worker={0: "w0:2222", 1: "w1:2222"}),
        job_name="worker",
        task_index=1,
        protocol="grpc",
        port=3333,
    )
    server_def = make_server_def(theirs, task_index=0)
    assert type(server_def) is ServerDef
    assert server_def.job_name == "worker"
    assert server_def.task_index == 0
    assert server_def.protocol == "grpc"
    assert server_def.port == 3333
    assert dict(server_def.cluster.job[0].tasks) == {0: "w0:2222", 1: "w1:2222"}


def test_make_server_def_from_tensorflow_cluster_def():
    server_def = make_server_def(tf_cluster_def(worker={2: "w2:2222"}))
    assert (server_def.job_name, server_def.task_index, server_def.protocol) == ("worker", 2, "grpc")


def test_make_server_def_with_tensorflow_config():
    config = tensorflow_class("tensorflow.ConfigProto")(
        inter_op_parallelism_threads=4, device_count={"CPU": 2}, operation_timeout_in_ms=500
    )
    server_def = make_server_def({"w": ["a:1"]}, config=config)
    session_config = server_def.default_session_config
    assert session_config.inter_op_parallelism_threads == 4
    assert dict(session_config.device_count) == {"CPU": 2}
    assert session_config.operation_timeout_in_ms == 500


def test_local_address_and_validate_cluster_accept_tensorflow_protos():
    theirs = tensorflow_class("tensorflow.ServerDef")(
        cluster=tf_cluster_def(worker={0: "w0:2222"}), job_name="worker", task_index=0
    )
    assert local_address(theirs) == ("w0", 2222)
    assert validate_cluster(theirs.cluster) == {"worker": {0: "w0:2222"}}


# --- make_server_def ---------------------------------------------------------------------


def test_single_task_cluster_infers_everything():
    cluster = {"worker": ["localhost:2222"]}
    server_def = make_server_def(cluster)
    assert server_def.job_name == "worker"
    assert server_def.task_index == 0
    assert server_def.protocol == "grpc"
    assert server_def.port == 0
    assert not server_def.HasField("default_session_config")
    assert not server_def.HasField("cluster_device_filters")
    assert ClusterSpec(server_def.cluster) == ClusterSpec(cluster)


def test_cluster_is_copied_into_the_server_def():
    spec = ClusterSpec({"worker": ["w:1"]})
    server_def = make_server_def(spec)
    assert server_def.cluster == spec.as_cluster_def()
    assert server_def.cluster is not spec.as_cluster_def()


def test_sparse_single_task_uses_its_index():
    server_def = make_server_def({"worker": {3: "w3:2222"}})
    assert server_def.task_index == 3


def test_explicit_arguments():
    cluster = {"worker": ["w0:1", "w1:1"], "ps": ["p:1"]}
    server_def = make_server_def(cluster, job_name="worker", task_index=1, protocol="grpc+verbs")
    assert (server_def.job_name, server_def.task_index, server_def.protocol) == ("worker", 1, "grpc+verbs")
    assert [job.name for job in server_def.cluster.job] == ["ps", "worker"]


def test_job_name_inferred_task_index_given():
    server_def = make_server_def({"worker": ["w0:1", "w1:1"]}, task_index=1)
    assert (server_def.job_name, server_def.task_index) == ("worker", 1)


def test_unknown_job_with_task_index_is_accepted():
    # Python accepts it; the server fails later (local_address).
    server_def = make_server_def({"worker": ["w0:1"]}, job_name="ps", task_index=0)
    assert server_def.job_name == "ps"
    with pytest.raises(errors.InternalError):
        local_address(server_def)


@pytest.mark.parametrize("cluster", [{"worker": ["w:1"], "ps": ["p:1"]}, {}])
def test_job_name_required(cluster):
    with pytest.raises(ValueError, match=r"^Must specify") as info:
        make_server_def(cluster)
    assert str(info.value) == "Must specify an explicit `job_name`."


@pytest.mark.parametrize("tasks", [["w0:1", "w1:1"], [], {1: "a:1", 5: "b:1"}])
def test_task_index_required(tasks):
    with pytest.raises(ValueError, match=r"^Must specify") as info:
        make_server_def({"worker": tasks})
    assert str(info.value) == "Must specify an explicit `task_index`."


def test_unknown_job_without_task_index():
    with pytest.raises(ValueError, match=r"^No such job") as info:
        make_server_def({"worker": ["w:1"]}, job_name="ps")
    assert str(info.value) == "No such job in cluster: 'ps'"


@pytest.mark.parametrize("bad", [42, "worker", {"worker": "w:1"}, {1: ["a:1"]}, {"w": {"x": "a:1"}}])
def test_unconvertible_input(bad):
    with pytest.raises(TypeError) as info:
        make_server_def(bad)
    assert str(info.value) == (
        "Could not convert `server_or_cluster_def` to a `tf.train.ServerDef` or `tf.train.ClusterSpec`."
    )
    assert isinstance(info.value.__cause__, TypeError)


def test_config_merged_for_cluster_input():
    config = config_pb2.ConfigProto(intra_op_parallelism_threads=3)
    server_def = make_server_def({"w": ["a:1"]}, config=config)
    assert server_def.default_session_config == config
    assert server_def.default_session_config is not config


def test_bad_config_type():
    with pytest.raises(TypeError, match=r"`distserver\.ConfigProto` or `tensorflow\.ConfigProto`"):
        make_server_def({"w": ["a:1"]}, config={"intra_op_parallelism_threads": 3})  # type: ignore[arg-type]


def test_server_def_input_is_copied_not_checked():
    original = ServerDef(
        cluster=ClusterSpec({"w": ["a:1"]}).as_cluster_def(), job_name="nope", task_index=7, port=4000
    )
    server_def = make_server_def(original)
    assert server_def == original
    assert server_def is not original
    # No protocol default for ServerDef input.
    assert server_def.protocol == ""


def test_server_def_overrides_and_config_merge():
    original = ServerDef(
        cluster=ClusterSpec({"w": ["a:1", "b:1"]}).as_cluster_def(),
        job_name="w",
        task_index=0,
        protocol="grpc",
        default_session_config=config_pb2.ConfigProto(
            intra_op_parallelism_threads=1, inter_op_parallelism_threads=2
        ),
    )
    server_def = make_server_def(
        original,
        job_name="w",
        task_index=1,
        protocol="grpc+verbs",
        config=config_pb2.ConfigProto(inter_op_parallelism_threads=8, operation_timeout_in_ms=9),
    )
    assert (server_def.task_index, server_def.protocol) == (1, "grpc+verbs")
    session_config = server_def.default_session_config
    assert session_config.intra_op_parallelism_threads == 1
    assert session_config.inter_op_parallelism_threads == 8
    assert session_config.operation_timeout_in_ms == 9
    assert original.task_index == 0
    assert original.default_session_config.inter_op_parallelism_threads == 2


# --- parse_host_port ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("address", "expected"),
    [
        ("localhost:2222", ("localhost", 2222)),
        ("10.0.0.5:0", ("10.0.0.5", 0)),
        ("[::1]:2222", ("[::1]", 2222)),
        ("host:4294967295", ("host", 4294967295)),
        ("host: 2222\t", ("host", 2222)),
        ("host:002222", ("host", 2222)),
        (":2222", ("", 2222)),
        ("2222", ("", 2222)),
        ("a:b:2222", ("a:b", 2222)),
    ],
)
def test_parse_host_port(address, expected):
    assert parse_host_port(address) == expected


@pytest.mark.parametrize(
    "address",
    [
        "localhost",
        "localhost:",
        "",
        "host:-1",
        "host:+1",
        "host:4294967296",
        "host:22a",
        "host:2 2",
        "host:\u0663",  # ARABIC-INDIC DIGIT THREE: not an ASCII digit
        "a/b:2222",
        "grpc://host:2222",
        "[::1]",
    ],
)
def test_parse_host_port_rejects(address):
    with pytest.raises(errors.InvalidArgumentError) as info:
        parse_host_port(address)
    assert str(info.value) == f'Could not interpret "{address}" as a host-port pair.'
    assert info.value.error_code == errors.INVALID_ARGUMENT


# --- local_address (GetHostAndPort) -------------------------------------------------------------


def _server_def(tasks: dict[int, str] | list[str], *, job="worker", task_index=0, port=0, **jobs):
    cluster = ClusterSpec({"worker": tasks, **jobs})
    return ServerDef(cluster=cluster.as_cluster_def(), job_name=job, task_index=task_index, port=port)


@pytest.mark.parametrize(
    ("address", "expected"),
    [
        ("w1:2222", ("w1", 2222)),
        ("localhost:0", ("localhost", 0)),
        ("10.0.0.5:2222", ("10.0.0.5", 2222)),
        ("[::1]:2222", ("[::1]", 2222)),
        (":2222", ("localhost", 2222)),
        ("2222", ("localhost", 2222)),
        (" h : 7 ", (" h ", 7)),
        ("h:-5", ("h", -5)),  # parsed as int32; binding it fails later
        ("h:70000", ("h", 70000)),
    ],
)
def test_local_address(address, expected):
    assert local_address(_server_def([address])) == expected


def test_local_address_port_override():
    assert local_address(_server_def(["10.0.0.5:2222"], port=3333)) == ("localhost", 3333)
    # The written address is not even parsed then.
    assert local_address(_server_def(["not an address"], port=3333)) == ("localhost", 3333)


def test_local_address_sparse_task():
    assert local_address(_server_def({5: "w5:1234"}, task_index=5)) == ("w5", 1234)


def test_task_not_defined():
    with pytest.raises(errors.InternalError) as info:
        local_address(_server_def(["w0:1"], task_index=3))
    assert str(info.value) == 'Task 3 was not defined in job "worker"'


def test_job_not_defined():
    with pytest.raises(errors.InternalError) as info:
        local_address(_server_def(["w0:1"], job="ps"))
    assert str(info.value) == 'Job "ps" was not defined in cluster'


@pytest.mark.parametrize("address", ["w0", "w0:", "w0:port", "w0:2147483648", "w0:+1", "w0:99999999999"])
def test_port_unparseable(address):
    with pytest.raises(errors.InvalidArgumentError) as info:
        local_address(_server_def([address]))
    assert str(info.value) == f'Could not parse port for local server from "{address}".'


def test_minus_one_port_reads_as_missing_job():
    # TensorFlow uses port -1 as "not found", so an explicit -1 reports the job missing.
    for server_def in (_server_def(["w0:-1"]), _server_def(["w0:1"], port=-1)):
        with pytest.raises(errors.InternalError) as info:
            local_address(server_def)
        assert str(info.value) == 'Job "worker" was not defined in cluster'


def test_first_job_with_the_name_wins():
    cluster_def = cluster_pb2.ClusterDef()
    cluster_def.job.add(name="w").tasks[0] = "first:1"
    cluster_def.job.add(name="w").tasks[0] = "second:2"
    assert local_address(ServerDef(cluster=cluster_def, job_name="w")) == ("first", 1)


def test_empty_job_name_without_such_job():
    with pytest.raises(errors.InternalError) as info:
        local_address(_server_def(["w0:1"], job=""))
    assert str(info.value) == 'Job "" was not defined in cluster'


def test_empty_job_name_is_not_a_master():
    cluster_def = cluster_pb2.ClusterDef()
    cluster_def.job.add(name="").tasks[0] = "localhost:2222"
    with pytest.raises(errors.InvalidArgumentError) as info:
        local_address(ServerDef(cluster=cluster_def, job_name=""))
    assert str(info.value) == (
        "The master (current machine) is not included in the provided cluster_def. "
        'job {\n  tasks {\n    key: 0\n    value: "localhost:2222"\n  }\n}\n'
    )


def test_master_error_lists_the_whole_cluster():
    cluster_def = cluster_pb2.ClusterDef()
    cluster_def.job.add(name="").tasks.update({1: "h\u00e9:1", 0: 'q"uote:2'})
    cluster_def.job.add(name="ps").tasks[0] = "p:3"
    with pytest.raises(errors.InvalidArgumentError) as info:
        local_address(ServerDef(cluster=cluster_def, job_name=""))
    assert str(info.value).endswith(
        "cluster_def. job {\n"
        '  tasks {\n    key: 0\n    value: "q\\"uote:2"\n  }\n'
        '  tasks {\n    key: 1\n    value: "h\\303\\251:1"\n  }\n'
        "}\n"
        'job {\n  name: "ps"\n  tasks {\n    key: 0\n    value: "p:3"\n  }\n}\n'
    )


# --- validate_cluster (ParseChannelSpec) -------------------------------------------------------


def test_validate_cluster_returns_channel_spec():
    cluster_def = cluster_pb2.ClusterDef()
    cluster_def.job.add(name="worker").tasks.update({2: "w2:1", 0: "w0:1"})
    cluster_def.job.add(name="ps").tasks[0] = "[::1]:5"
    spec = validate_cluster(cluster_def)
    assert spec == {"worker": {0: "w0:1", 2: "w2:1"}, "ps": {0: "[::1]:5"}}
    assert list(spec) == ["worker", "ps"]
    assert list(spec["worker"]) == [0, 2]


def test_duplicate_job():
    cluster_def = cluster_pb2.ClusterDef()
    cluster_def.job.add(name="worker").tasks[0] = "w0:1"
    cluster_def.job.add(name="worker").tasks[0] = "w1:1"
    with pytest.raises(errors.InvalidArgumentError) as info:
        validate_cluster(cluster_def)
    assert str(info.value) == "Duplicate job ID in cluster specification: worker"


def test_invalid_address():
    cluster_def = ClusterSpec({"ps": ["p:1"], "worker": ["w0:1", "w1"]}).as_cluster_def()
    with pytest.raises(errors.InvalidArgumentError) as info:
        validate_cluster(cluster_def)
    assert str(info.value) == 'Could not interpret "w1" as a host-port pair.'


def test_errors_reported_in_job_order():
    cluster_def = cluster_pb2.ClusterDef()
    cluster_def.job.add(name="a").tasks[0] = "bad"
    cluster_def.job.add(name="a").tasks[0] = "a:1"
    with pytest.raises(errors.InvalidArgumentError, match='"bad"'):
        validate_cluster(cluster_def)


def test_local_task_address_is_replaced_before_checking():
    cluster_def = ClusterSpec({"worker": ["localhost", "w1:1"]}).as_cluster_def()
    spec = validate_cluster(cluster_def, local_task=("worker", 0, "localhost:40001"))
    assert spec == {"worker": {0: "localhost:40001", 1: "w1:1"}}
    # Replacing another task does not hide the bad address.
    with pytest.raises(errors.InvalidArgumentError, match='"localhost"'):
        validate_cluster(cluster_def, local_task=("worker", 1, "w1:1"))
