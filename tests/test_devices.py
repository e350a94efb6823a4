"""Tests for distserver.devices: device names, scope merging, rendezvous keys."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

from distserver import devices, errors
from distserver.devices import (
    DeviceSpec,
    RendezvousKey,
    full_device_name,
    parse_rendezvous_key,
    rendezvous_key,
    task_name,
    task_of_device,
)

PS0 = "/job:ps/replica:0/task:0/device:CPU:0"
WORKER0 = "/job:worker/replica:0/task:0/device:CPU:0"


def test_all_is_sorted():
    assert devices.__all__ == sorted(devices.__all__)
    assert all(hasattr(devices, name) for name in devices.__all__)


@pytest.mark.parametrize(
    ("text", "expected", "canonical"),
    [
        ("", DeviceSpec(), ""),
        ("/", DeviceSpec(), ""),
        ("/job:ps", DeviceSpec(job="ps"), "/job:ps"),
        ("/job:ps/replica:0/task:1/device:CPU:0", DeviceSpec("ps", 0, 1, "CPU", 0), None),
        ("/job:ps/task:1/cpu:0", DeviceSpec("ps", None, 1, "CPU", 0), "/job:ps/task:1/device:CPU:0"),
        ("/job:ps/task:1/CPU:0", DeviceSpec("ps", None, 1, "CPU", 0), "/job:ps/task:1/device:CPU:0"),
        ("/device:CPU:*", DeviceSpec(device_type="CPU"), "/device:CPU:*"),
        ("/device:GPU", DeviceSpec(device_type="GPU"), "/device:GPU:*"),
        ("/device:*:3", DeviceSpec(device_index=3), "/device:*:3"),
        ("/device:XLA_CPU:2", DeviceSpec(device_type="XLA_CPU", device_index=2), None),
        ("/device:gpu:1", DeviceSpec(device_type="GPU", device_index=1), "/device:GPU:1"),
        ("/cpu:0", DeviceSpec(device_type="CPU", device_index=0), "/device:CPU:0"),
        ("/gpu:1", DeviceSpec(device_type="GPU", device_index=1), "/device:GPU:1"),
        ("/GPU:*", DeviceSpec(device_type="GPU"), "/device:GPU:*"),
        ("CPU:0", DeviceSpec(device_type="CPU", device_index=0), "/device:CPU:0"),
        ("gpu:2", DeviceSpec(device_type="GPU", device_index=2), "/device:GPU:2"),
        ("job:ps/task:0", DeviceSpec(job="ps", task=0), "/job:ps/task:0"),
        ("/task:3/job:w_1", DeviceSpec(job="w_1", task=3), "/job:w_1/task:3"),
        ("/job:*/replica:*/task:*/device:*:*", DeviceSpec(), ""),
        ("/job:Worker2/replica:12/task:345", DeviceSpec("Worker2", 12, 345), None),
    ],
)
def test_parse(text, expected, canonical):
    spec = DeviceSpec.from_string(text)
    assert spec == expected
    assert spec.to_string() == (text if canonical is None else canonical)
    assert str(spec) == spec.to_string()
    assert DeviceSpec.from_string(spec.to_string()) == spec


@pytest.mark.parametrize(
    "text",
    [
        "x",
        "ps",
        "/job:",
        "/job:1ps",
        "/job:p-s",
        "/job:ps/",
        "//job:ps",
        "/job:ps//task:0",
        "/replica:a",
        "/task:-1",
        "/task:1x",
        "/device:0",
        "/device:CPU:",
        "/device:CPU:0:1",
        "/device:CPU:x",
        "/cpu",
        "/job:ps task:0",
        " /job:ps",
    ],
)
def test_parse_malformed(text):
    with pytest.raises(ValueError, match="Malformed device name") as info:
        DeviceSpec.from_string(text)
    assert repr(text) in str(info.value)
    assert "/job:<name>/replica:<int>/task:<int>/device:<TYPE>" in str(info.value)


@pytest.mark.parametrize("text", ["/job:a/job:b", "/task:0/task:1", "/device:CPU:0/gpu:0", "/cpu:0/CPU:0"])
def test_parse_repeated_component(text):
    with pytest.raises(ValueError, match="more than once"):
        DeviceSpec.from_string(text)


@pytest.mark.parametrize(
    "fields",
    [
        {"job": "1x"},
        {"job": ""},
        {"device_type": "C P U"},
        {"task": -1},
        {"replica": True},
        {"device_index": 1.0},
    ],
)
def test_constructor_validates(fields):
    with pytest.raises(ValueError, match="Invalid"):
        DeviceSpec(**fields)


def test_frozen():
    spec = DeviceSpec(job="ps")
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.job = "worker"  # type: ignore[misc]
    assert {spec, DeviceSpec.from_string("/job:ps")} == {spec}


@pytest.mark.parametrize(
    ("outer", "inner", "merged"),
    [
        ("/job:ps/task:0", "/device:CPU:0", "/job:ps/task:0/device:CPU:0"),
        ("/job:ps/task:0", "/job:worker", "/job:worker/task:0"),
        ("/job:ps/replica:0/task:0/device:GPU:1", "/task:2", "/job:ps/replica:0/task:2/device:GPU:1"),
        # Fields merge one by one, like tf.DeviceSpec.make_merged_spec.
        ("/device:GPU:1", "/device:CPU:*", "/device:CPU:1"),
        ("/device:GPU:1", "/cpu:0", "/device:CPU:0"),
        ("", "/job:ps", "/job:ps"),
        ("/job:ps", "", "/job:ps"),
    ],
)
def test_merge_like_nested_scopes(outer, inner, merged):
    result = DeviceSpec.from_string(outer).make_merged_spec(DeviceSpec.from_string(inner))
    assert result.to_string() == merged
    assert DeviceSpec.from_string(outer).make_merged_spec(inner) == result


def test_three_nested_scopes():
    scopes = ["/job:worker/replica:0", "/task:3", "/device:GPU:0"]
    spec = DeviceSpec()
    for scope in scopes:
        spec = spec.make_merged_spec(scope)
    assert spec.to_string() == "/job:worker/replica:0/task:3/device:GPU:0"
    assert spec.is_fully_specified


def test_is_fully_specified_and_task_spec():
    full = DeviceSpec.from_string(PS0)
    assert full.is_fully_specified
    assert full.task_spec() == DeviceSpec("ps", 0, 0)
    assert full.task_spec().to_string() == "/job:ps/replica:0/task:0"
    assert not DeviceSpec.from_string("/job:ps/replica:0/task:0/device:CPU:*").is_fully_specified
    assert not DeviceSpec.from_string("/job:ps/task:0/cpu:0").is_fully_specified


def test_names():
    assert full_device_name("worker", 1) == "/job:worker/replica:0/task:1/device:CPU:0"
    assert (
        full_device_name("ps", 0, replica=2, device_type="GPU", index=3)
        == "/job:ps/replica:2/task:0/device:GPU:3"
    )
    assert task_name("worker", 1) == "/job:worker/replica:0/task:1"
    assert task_name("ps", 4, replica=1) == "/job:ps/replica:1/task:4"
    with pytest.raises(ValueError, match="Invalid job"):
        task_name("bad job", 0)


def test_task_of_device():
    assert task_of_device(PS0) == "/job:ps/replica:0/task:0"
    assert task_of_device("/job:w/replica:1/task:7/device:GPU:2") == "/job:w/replica:1/task:7"
    assert task_of_device("/job:w/replica:1/task:7") == "/job:w/replica:1/task:7"
    with pytest.raises(ValueError, match="does not name a task"):
        task_of_device("/job:ps/task:1/cpu:0")
    with pytest.raises(ValueError, match="Malformed"):
        task_of_device("nonsense")


# --------------------------------------------------------------------------- rendezvous keys


def test_rendezvous_key_matches_reference_examples():
    assert (
        rendezvous_key(PS0, 0x00A3F1C2D4E5F607, WORKER0, "edge_7_Variable/read")
        == "/job:ps/replica:0/task:0/device:CPU:0;00a3f1c2d4e5f607;"
        "/job:worker/replica:0/task:0/device:CPU:0;edge_7_Variable/read;0:0"
    )
    assert rendezvous_key(WORKER0, 0x1234, WORKER0, "x:0") == f"{WORKER0};0000000000001234;{WORKER0};x:0;0:0"


def test_rendezvous_key_incarnation_is_unsigned_hex():
    assert rendezvous_key(PS0, -1, WORKER0, "t").split(";")[1] == "ffffffffffffffff"
    assert rendezvous_key(PS0, -(1 << 63), WORKER0, "t").split(";")[1] == "8000000000000000"
    assert rendezvous_key(PS0, (1 << 64) - 2, WORKER0, "t").split(";")[1] == "fffffffffffffffe"
    assert rendezvous_key(PS0, 0, WORKER0, "t").split(";")[1] == "0" * 16


def test_rendezvous_key_frame_and_iter():
    assert rendezvous_key(PS0, 1, WORKER0, "t", frame_id=12, iter_id=3).endswith(";t;12:3")


@pytest.mark.parametrize("incarnation", [1 << 64, -(1 << 63) - 1])
def test_rendezvous_key_incarnation_out_of_range(incarnation):
    with pytest.raises(ValueError, match="64 bits"):
        rendezvous_key(PS0, incarnation, WORKER0, "t")


def test_rendezvous_key_rejects_separator():
    with pytest.raises(ValueError, match="';'"):
        rendezvous_key(PS0, 1, WORKER0, "a;b")


def test_parse_rendezvous_key():
    key = f"{PS0};00a3f1c2d4e5f607;{WORKER0};edge_7_Variable/read;0:0"
    parsed = parse_rendezvous_key(key)
    assert parsed == RendezvousKey(PS0, 0x00A3F1C2D4E5F607, WORKER0, "edge_7_Variable/read", 0, 0)
    assert parsed.text == key
    assert str(parsed) == key
    assert (parsed.src_task, parsed.dst_task) == ("/job:ps/replica:0/task:0", "/job:worker/replica:0/task:0")
    # Built from its parts, a key writes TensorFlow's text.
    assert RendezvousKey(PS0, 0x00A3F1C2D4E5F607, WORKER0, "edge_7_Variable/read").text == key
    assert parse_rendezvous_key(f"{PS0};FFFFFFFFFFFFFFFF;{WORKER0};x:0;4:5") == RendezvousKey(
        PS0, (1 << 64) - 1, WORKER0, "x:0", 4, 5
    )


@given(
    incarnation=st.integers(-(1 << 63), (1 << 64) - 1),
    name=st.text(st.characters(blacklist_characters=";", blacklist_categories=["Cs"]), min_size=1),
    frame=st.integers(0, (1 << 64) - 1),
    iteration=st.integers(0, (1 << 63) - 1),
)
def test_rendezvous_key_roundtrip_property(incarnation, name, frame, iteration):
    key = rendezvous_key(PS0, incarnation, WORKER0, name, frame, iteration)
    assert parse_rendezvous_key(key) == RendezvousKey(
        PS0, incarnation & ((1 << 64) - 1), WORKER0, name, frame, iteration
    )


def test_a_key_whose_device_names_no_task_is_invalid():
    with pytest.raises(errors.InvalidArgumentError, match="Invalid rendezvous key: /cpu:0;"):
        RendezvousKey("/cpu:0", 1, WORKER0, "x:0")


@pytest.mark.parametrize(
    "key",
    [
        "",
        "garbage",
        f"{PS0};0001;{WORKER0};x:0",  # four parts
        f"{PS0};0001;{WORKER0};x:0;0:0;extra",  # six parts
        f"{PS0};0001;{WORKER0};x;0;0:0",  # a ';' in the name
        f"{PS0};0001;{WORKER0};;0:0",  # empty tensor name
        f"{PS0};;{WORKER0};x:0;0:0",  # empty incarnation
        f"{PS0};00000000000000001;{WORKER0};x:0;0:0",  # 17 hex digits
        f"{PS0};00zz;{WORKER0};x:0;0:0",
        f"{PS0};-1;{WORKER0};x:0;0:0",
        f"/job:ps/task:0;0001;{WORKER0};x:0;0:0",  # partial source device
        f"{PS0};0001;/job:worker/replica:0/task:0/device:CPU:*;x:0;0:0",  # partial destination
        f"{PS0};0001;/cpu:0;x:0;0:0",
        f";0001;{WORKER0};x:0;0:0",
        f"{PS0};0001;{WORKER0};x:0;",
        f"{PS0};0001;{WORKER0};x:0;0",
        f"{PS0};0001;{WORKER0};x:0;a:b",
        f"{PS0};0001;{WORKER0};x:0;-1:0",
    ],
)
def test_parse_rendezvous_key_invalid(key):
    with pytest.raises(errors.InvalidArgumentError) as info:
        parse_rendezvous_key(key)
    assert str(info.value) == f"Invalid rendezvous key: {key}"


def test_long_names_and_keys_parse_but_are_not_kept():
    # Peers choose these strings (a RecvTensor's key): the caches keep short ones only,
    # or 16,384 keys of 1 MiB would hold ~40 GB.
    device = "/job:worker/replica:0/task:0/device:CPU:0"
    short = rendezvous_key(device, 1, device, "x:0")
    long = rendezvous_key(device, 1, device, "x" * devices.CACHED_TEXT_CHARS)
    assert parse_rendezvous_key(short) is parse_rendezvous_key(short)
    first, again = parse_rendezvous_key(long), parse_rendezvous_key(long)
    assert first == again
    assert first is not again
    assert (first.tensor_name, first.src_task, first.text) == (
        "x" * devices.CACHED_TEXT_CHARS,
        task_of_device(device),
        long,
    )

    long_job = "w" * devices.CACHED_TEXT_CHARS
    long_device = f"/job:{long_job}/replica:0/task:0/device:CPU:0"
    assert DeviceSpec.from_string(long_device) is not DeviceSpec.from_string(long_device)
    assert DeviceSpec.from_string(long_device).job == long_job
    assert task_of_device(long_device) == f"/job:{long_job}/replica:0/task:0"
    with pytest.raises(errors.InvalidArgumentError, match="Invalid rendezvous key"):
        parse_rendezvous_key(long + ";")
