"""Partitioned variables (fixed_size_partitioner over two ps tasks) in checkpoints: saved
in slices by a Saver on distserver and restored by TensorFlow alone, and the other way
round, with the same and with a different partitioning; a partitioned embedding trained
under MonitoredTrainingSession restarts from its checkpoint as on TensorFlow alone."""

from __future__ import annotations

import os

import numpy as np
import pytest

from distserver.testing import LocalCluster

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300, func_only=True)]


@pytest.fixture(scope="module")
def results(tf_client, tmp_path_factory):
    root = os.path.realpath(tmp_path_factory.mktemp("checkpoint-root"))
    local = str(tmp_path_factory.mktemp("tensorflow-alone"))
    with LocalCluster({"ps": 2, "worker": 1}, serve_args=["--checkpoint-root", root]) as cluster:
        yield tf_client.run(
            "partitioned_checkpoints.py", {"cluster": cluster.cluster, "root": root, "local": local}
        )


@pytest.mark.parametrize("flavour", ["plain", "sharded"])
@pytest.mark.parametrize("parts", [2, 3])
def test_tensorflow_restores_distservers_slices(results, check, flavour, parts):
    restored = check(results, f"{flavour}/tf_restores_ours/{parts}")
    for name, value in results["ours"].items():
        np.testing.assert_array_equal(restored[name], value, err_msg=name)


@pytest.mark.parametrize("flavour", ["plain", "sharded"])
@pytest.mark.parametrize("parts", [2, 3])
def test_distserver_restores_tensorflows_slices(results, check, flavour, parts):
    restored = check(results, f"{flavour}/ours_restores_tf/{parts}")
    for name, value in results["theirs"].items():
        np.testing.assert_array_equal(restored[name], value, err_msg=name)


@pytest.mark.parametrize("flavour", ["plain", "sharded"])
def test_tensorflows_reader_sees_whole_tensors(results, check, flavour):
    assert check(results, f"{flavour}/tf_reader_keys") == [["emb", [10, 4]], ["w", [6, 3]]]


def test_a_partitioned_embedding_restarts_from_its_checkpoint_as_on_tensorflow(results, check):
    for run in ("first", "restarted"):
        ours, theirs = check(results, f"distserver/{run}"), check(results, f"tensorflow/{run}")
        assert ours["latest"] == theirs["latest"]
        assert len(ours["losses"]) == len(theirs["losses"]) == 4
        np.testing.assert_allclose(ours["losses"], theirs["losses"], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(ours["emb"], theirs["emb"], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(ours["accumulator"], theirs["accumulator"], rtol=1e-5, atol=1e-6)
    assert check(results, "distserver/restarted")["latest"] == "model.ckpt-8"
