"""tf.compat.v1.train.Saver against distserver: V2 checkpoints interchangeable with TensorFlow."""

from __future__ import annotations

import os

import numpy as np
import pytest

from distserver.testing import LocalCluster

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120, func_only=True)]

FLAVOURS = ["plain", "sharded"]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    base = tmp_path_factory.mktemp("checkpoints")
    root, outside = base / "root", base / "outside"
    root.mkdir()
    outside.mkdir()
    return os.path.realpath(root), os.path.realpath(outside)


@pytest.fixture(scope="module")
def results(tf_client, dirs):
    root, outside = dirs
    with LocalCluster({"ps": 2, "worker": 1}, serve_args=["--checkpoint-root", root]) as cluster:
        yield tf_client.run("checkpoints.py", {"cluster": cluster.cluster, "root": root, "outside": outside})


def expected(results, side):
    index = 0 if side == "ours" else 1
    return {name: pair[index] for name, pair in results["values"].items()}


def assert_values(actual, wanted):
    assert sorted(actual) == sorted(wanted)
    for name, value in wanted.items():
        if isinstance(value, list) and value and isinstance(value[0], float):
            np.testing.assert_allclose(actual[name], value, err_msg=name)
        else:
            assert actual[name] == value, name


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_distserver_checkpoint_restored_by_tensorflow(results, check, dirs, flavour):
    root, _ = dirs
    paths = check(results, f"{flavour}_saved_paths")
    assert paths == [os.path.join(root, flavour, f"model-{step}") for step in (1, 2, 3)]
    files = check(results, f"{flavour}_files")
    shards = 2 if flavour == "sharded" else 1
    # max_to_keep=2: the first checkpoint was deleted by the client; no temporary files remain.
    for step in (2, 3):
        assert f"model-{step}.index" in files
        for shard in range(shards):
            assert f"model-{step}.data-{shard:05d}-of-{shards:05d}" in files
    assert not [f for f in files if "model-1" in f or "temp" in f]
    assert_values(check(results, f"{flavour}_restored_by_tf"), expected(results, "ours"))
    assert check(results, f"{flavour}_tf_reader_keys") == sorted(results["values"])


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_tensorflow_checkpoint_restored_by_distserver(results, check, flavour):
    assert_values(check(results, f"{flavour}_restored_by_distserver"), expected(results, "tfs"))


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_latest_checkpoint_and_state(results, check, dirs, flavour):
    root, _ = dirs
    latest = os.path.join(root, flavour, "model-3")
    assert check(results, f"{flavour}_latest") == latest
    assert check(results, f"{flavour}_state") == [latest, [os.path.join(root, flavour, "model-2"), latest]]


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_paths_outside_the_root_are_refused(results, check_error, check, flavour):
    for name in (f"{flavour}_save_outside", f"{flavour}_save_dotdot"):
        raised, message = check_error(results, name)
        assert raised == "PermissionDeniedError", message
        assert "checkpoint root" in message
        assert "--checkpoint-root" in message
    assert check(results, f"{flavour}_outside_files") == []


def test_restoring_from_outside_the_root_is_refused(results, check_error):
    raised, message = check_error(results, "restore_outside")
    assert raised == "PermissionDeniedError", message
    assert "outside this server's checkpoint root" in message
