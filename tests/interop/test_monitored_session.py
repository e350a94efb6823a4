"""The typical TF 1.x training script: MonitoredTrainingSession with a checkpoint directory,
StopAtStepHook and summaries over ps:2 + worker:2, stopped and restarted from its
checkpoint, compared with TensorFlow alone."""

from __future__ import annotations

import numpy as np
import pytest

from distserver.testing import LocalCluster

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300, func_only=True)]


@pytest.fixture(scope="module")
def results(tf_client, tmp_path_factory):
    root = tmp_path_factory.mktemp("checkpoint-root")
    local = tmp_path_factory.mktemp("tensorflow-alone")
    serve_args = ["--checkpoint-root", str(root)]
    with LocalCluster({"ps": 2, "worker": 2}, serve_args=serve_args) as cluster:
        yield tf_client.run(
            "monitored.py",
            {
                "cluster": cluster.cluster,
                "checkpoint_dir": str(root / "run"),
                "local_dir": str(local / "run"),
            },
        )


def test_the_first_run_stops_at_its_step_and_checkpoints(results, check):
    ours, theirs = check(results, "distserver/first"), check(results, "tensorflow/first")
    assert ours["steps"] == theirs["steps"] == list(range(1, 11))
    assert ours["latest"] == theirs["latest"] == "model.ckpt-10"
    assert ours["events"] >= 1  # summaries written by the client


def test_the_restart_resumes_from_the_checkpoint(results, check):
    ours, theirs = check(results, "distserver/restarted"), check(results, "tensorflow/restarted")
    assert ours["steps"] == theirs["steps"] == list(range(11, 16))
    assert ours["latest"] == theirs["latest"] == "model.ckpt-15"
    np.testing.assert_allclose(ours["w"], theirs["w"], rtol=1e-5, atol=1e-6)
    assert ours["b"] == pytest.approx(theirs["b"], rel=1e-5, abs=1e-6)
