"""ClusterSpec: TensorFlow parity for every input form, method, message and equality rule."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from distserver.cluster import ClusterSpec
from distserver.protos import cluster_pb2

GENERIC_TYPE_ERROR = (
    "`cluster` must be a dictionary mapping one or more job names to lists of network "
    "addresses, or a `ClusterDef` protocol buffer"
)


def _cluster_def(*jobs: tuple[str, dict[int, str]]) -> cluster_pb2.ClusterDef:
    cluster_def = cluster_pb2.ClusterDef()
    for name, tasks in jobs:
        job = cluster_def.job.add(name=name)
        for index, address in tasks.items():
            job.tasks[index] = address
    return cluster_def


# --- input forms ------------------------------------------------------------------


def test_dict_of_lists():
    spec = ClusterSpec({"worker": ["w0:2222", "w1:2222"], "ps": ["ps0:2222"]})
    assert spec.jobs == ["worker", "ps"]  # input order, not sorted
    assert spec.num_tasks("worker") == 2
    assert spec.task_indices("worker") == [0, 1]
    assert spec.task_address("worker", 1) == "w1:2222"
    assert spec.job_tasks("ps") == ["ps0:2222"]
    assert spec.as_dict() == {"worker": ["w0:2222", "w1:2222"], "ps": ["ps0:2222"]}


def test_dict_of_tuples():
    spec = ClusterSpec({"worker": ("w0:2222", "w1:2222")})
    assert spec.as_dict() == {"worker": ["w0:2222", "w1:2222"]}
    assert spec == {"worker": {0: "w0:2222", 1: "w1:2222"}}


def test_sparse_dict():
    spec = ClusterSpec({"worker": {3: "w3:2222", 1: "w1:2222"}, "ps": ["ps0:2222"]})
    assert spec.task_indices("worker") == [1, 3]
    assert spec.num_tasks("worker") == 2
    assert spec.job_tasks("worker") == [None, "w1:2222", None, "w3:2222"]
    as_dict = spec.as_dict()
    assert as_dict == {"worker": {1: "w1:2222", 3: "w3:2222"}, "ps": ["ps0:2222"]}
    assert isinstance(as_dict["worker"], dict)
    assert isinstance(as_dict["ps"], list)


def test_dense_dict_is_a_list_in_as_dict():
    spec = ClusterSpec({"worker": {1: "w1:2222", 0: "w0:2222"}})
    assert spec.as_dict() == {"worker": ["w0:2222", "w1:2222"]}


def test_digit_string_task_keys_from_json():
    spec = ClusterSpec({"worker": {"1": "w1:2222", "0": "w0:2222"}, "ps": {"3": "ps3:2222"}})
    assert spec.task_indices("worker") == [0, 1]
    assert spec.task_address("ps", 3) == "ps3:2222"
    assert spec == {"worker": {0: "w0:2222", 1: "w1:2222"}, "ps": {3: "ps3:2222"}}


def test_integer_like_task_keys():
    spec = ClusterSpec({"worker": {np.int64(2): "w2:2222"}})
    assert spec.task_indices("worker") == [2]
    assert type(spec.task_indices("worker")[0]) is int


@pytest.mark.parametrize("key", ["one", "1.5", 1.0, None, (1,)])
def test_non_integer_task_key(key):
    with pytest.raises(TypeError, match=r"^Task index .* in job 'worker' must be an integer") as info:
        ClusterSpec({"worker": {key: "w:2222"}})
    assert repr(key) in str(info.value)


def test_cluster_def_input_is_shared_not_copied():
    cluster_def = _cluster_def(("worker", {0: "w0:2222", 1: "w1:2222"}), ("ps", {0: "ps0:2222"}))
    spec = ClusterSpec(cluster_def)
    assert spec.as_cluster_def() is cluster_def
    assert spec.jobs == ["worker", "ps"]  # ClusterDef order
    assert spec == {"worker": {0: "w0:2222", 1: "w1:2222"}, "ps": {0: "ps0:2222"}}


def test_cluster_def_with_repeated_job_keeps_the_last():
    cluster_def = _cluster_def(("w", {0: "a:1"}), ("w", {0: "b:1"}))
    spec = ClusterSpec(cluster_def)
    assert spec.jobs == ["w"]
    assert spec.task_address("w", 0) == "b:1"


def test_cluster_spec_input_is_copied():
    original = ClusterSpec({"worker": ["w0:2222"]})
    copy = ClusterSpec(original)
    assert copy == original
    assert copy.as_cluster_def() is not original.as_cluster_def()
    assert copy.as_cluster_def() == original.as_cluster_def()
    original.as_cluster_def().job[0].tasks[0] = "changed:1"
    assert copy.task_address("worker", 0) == "w0:2222"


def test_values_stored_as_given():
    spec = ClusterSpec({b"worker": [b"w0:2222"]})
    assert spec.jobs == [b"worker"]  # type: ignore[comparison-overlap]
    assert spec.task_address(b"worker", 0) == b"w0:2222"  # type: ignore[arg-type, comparison-overlap]
    job = spec.as_cluster_def().job[0]
    assert job.name == "worker"
    assert job.tasks[0] == "w0:2222"
    # ...while a ClusterDef yields str.
    assert ClusterSpec(spec.as_cluster_def()).jobs == ["worker"]


# --- as_cluster_def ---------------------------------------------------------------


def test_as_cluster_def_sorted_and_same_object():
    spec = ClusterSpec({"worker": {2: "w2:1", 0: "w0:1"}, "chief": ["c:1"], "ps": ["p:1"]})
    cluster_def = spec.as_cluster_def()
    assert [job.name for job in cluster_def.job] == ["chief", "ps", "worker"]
    assert dict(cluster_def.job[2].tasks) == {0: "w0:1", 2: "w2:1"}
    assert spec.as_cluster_def() is cluster_def
    assert spec.jobs == ["worker", "chief", "ps"]


def test_as_cluster_def_is_deterministic():
    a = ClusterSpec({"worker": {1: "w1:1", 0: "w0:1"}, "ps": ["p:1"]})
    b = ClusterSpec({"ps": ["p:1"], "worker": {0: "w0:1", 1: "w1:1"}})
    assert a.as_cluster_def().SerializeToString(deterministic=True) == b.as_cluster_def().SerializeToString(
        deterministic=True
    )


# --- empty jobs and clusters --------------------------------------------------------


def test_empty_cluster_is_falsy():
    spec = ClusterSpec({})
    assert not spec
    assert spec.jobs == []
    assert spec.as_dict() == {}
    assert len(spec.as_cluster_def().job) == 0


def test_job_without_tasks():
    spec = ClusterSpec({"worker": []})
    assert spec
    assert spec.num_tasks("worker") == 0
    assert spec.task_indices("worker") == []
    assert spec.as_dict() == {"worker": {}}
    with pytest.raises(ValueError, match=r"max\(\)"):
        spec.job_tasks("worker")


# --- equality, hashing, repr ---------------------------------------------------------


def test_equality_compares_the_dict_of_dicts():
    spec = ClusterSpec({"w": ["a:1"]})
    assert spec == {"w": {0: "a:1"}}
    assert (spec == {"w": ["a:1"]}) is False
    assert spec != {"w": ["a:1"]}
    assert (spec != {"w": {0: "a:1"}}) is False
    assert spec != 3
    assert spec is not None


def test_equality_between_specs():
    a = ClusterSpec({"w": ["a:1", "b:1"], "ps": ["p:1"]})
    b = ClusterSpec(_cluster_def(("ps", {0: "p:1"}), ("w", {1: "b:1", 0: "a:1"})))
    assert a == b
    assert (a != b) is False
    assert a != ClusterSpec({"w": ["a:1"]})
    assert ClusterSpec({}) == ClusterSpec({})


def test_unhashable():
    assert ClusterSpec.__hash__ is None
    with pytest.raises(TypeError, match="unhashable"):
        hash(ClusterSpec({"w": ["a:1"]}))


@pytest.mark.parametrize(
    ("cluster", "expected"),
    [
        (
            {"worker": ["w0:2222"], "ps": ["ps0:2222"]},
            "ClusterSpec({'ps': ['ps0:2222'], 'worker': ['w0:2222']})",
        ),
        ({"w": {1: "a:1", 3: "b:1"}}, "ClusterSpec({'w': {1: 'a:1', 3: 'b:1'}})"),
        ({"w": []}, "ClusterSpec({'w': {}})"),
        ({}, "ClusterSpec({})"),
    ],
)
def test_repr(cluster, expected):
    assert repr(ClusterSpec(cluster)) == expected


# --- error messages (byte-exact) -------------------------------------------------------


@pytest.mark.parametrize("bad", [42, "worker:2222", ["w:1"], None, cluster_pb2.JobDef()])
def test_unsupported_input(bad):
    with pytest.raises(TypeError) as info:
        ClusterSpec(bad)
    assert str(info.value) == GENERIC_TYPE_ERROR


@pytest.mark.parametrize("tasks", ["w0:2222", 3, None, {"w0:2222"}])
def test_bad_tasks_type(tasks):
    with pytest.raises(TypeError) as info:
        ClusterSpec({"worker": tasks})
    assert str(info.value) == (
        "The tasks for job 'worker' must be a list or a dictionary from integers to strings."
    )


def test_bad_job_name():
    with pytest.raises(TypeError) as info:
        ClusterSpec({1: ["a:1"]})
    assert str(info.value) == "Job name 1 must be bytes or unicode"


@pytest.mark.parametrize(("address", "text"), [(None, "None"), (2222, "2222"), (("h", 1), "('h', 1)")])
def test_bad_task_address(address, text):
    with pytest.raises(TypeError) as info:
        ClusterSpec({"w": [address]})
    assert str(info.value) == f"Task address {text} must be bytes or unicode"


def test_job_tasks_of_sparse_job_does_not_feed_back():
    spec = ClusterSpec({"w": {1: "a:1"}})
    with pytest.raises(TypeError) as info:
        ClusterSpec({"w": spec.job_tasks("w")})
    assert str(info.value) == "Task address None must be bytes or unicode"


@pytest.mark.parametrize(
    "call",
    [
        lambda spec: spec.num_tasks("ps"),
        lambda spec: spec.task_indices("ps"),
        lambda spec: spec.task_address("ps", 0),
        lambda spec: spec.job_tasks("ps"),
    ],
)
def test_unknown_job(call):
    with pytest.raises(ValueError, match=r"^No such job") as info:
        call(ClusterSpec({"worker": ["w:1"]}))
    assert str(info.value) == "No such job in cluster: 'ps'"


def test_unknown_task():
    spec = ClusterSpec({"worker": {0: "w0:1", 2: "w2:1"}})
    with pytest.raises(ValueError, match=r"^No task") as info:
        spec.task_address("worker", 1)
    assert str(info.value) == "No task with index 1 in job 'worker'"


def test_task_out_of_int32_range():
    with pytest.raises(ValueError, match="out of range"):
        ClusterSpec({"w": {2**31: "a:1"}})


# --- properties ----------------------------------------------------------------------

_JOB_NAMES = st.text(max_size=8)
_ADDRESSES = st.text(max_size=16)
_INT32 = st.integers(min_value=-(2**31), max_value=2**31 - 1)
_TASKS = st.one_of(
    st.lists(_ADDRESSES, max_size=4),
    st.dictionaries(_INT32, _ADDRESSES, max_size=4),
)


@settings(database=None, max_examples=150)
@given(st.dictionaries(_JOB_NAMES, _TASKS, max_size=4))
def test_round_trip_through_cluster_def(cluster):
    spec = ClusterSpec(cluster)
    from_def = ClusterSpec(spec.as_cluster_def())
    assert from_def == spec
    assert spec == from_def
    assert sorted(from_def.jobs) == sorted(spec.jobs)

    wire = cluster_pb2.ClusterDef.FromString(spec.as_cluster_def().SerializeToString())
    assert ClusterSpec(wire) == spec

    assert ClusterSpec(spec.as_dict()) == spec
    for job in spec.jobs:
        assert spec.num_tasks(job) == len(spec.task_indices(job))


def test_negative_indices_stay_sparse_in_as_dict():
    # TensorFlow would call this dense (max + 1 == len) and return [None, 'b:1'].
    spec = ClusterSpec({"w": {-1: "a:1", 1: "b:1"}})
    assert spec.as_dict() == {"w": {-1: "a:1", 1: "b:1"}}
