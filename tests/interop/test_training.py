"""Training a 2-layer classifier with TF 1.x optimizers across 1 ps + 2 workers.

The same program run by TensorFlow alone must end with the same weights.
"""

from __future__ import annotations

import numpy as np
import pytest

from distserver.testing import LocalCluster

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120, func_only=True)]

CONFIGS = [
    ("gd", "sparse_xent", "ref"),
    ("adam", "xent", "resource"),
    ("momentum", "mse", "ref"),
    ("adam", "sparse_xent", "ref"),
    ("gd", "mse", "resource"),
    ("rmsprop", "sparse_xent", "resource"),
    ("adagrad", "xent", "ref"),
]
# float32 sums in a different order (numpy vs Eigen) differ in the last bits.
WEIGHT_TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def results(tf_client):
    with LocalCluster({"ps": 1, "worker": 2}) as cluster:
        yield tf_client.run("train.py", {"cluster": cluster.cluster, "configs": CONFIGS})


@pytest.mark.parametrize("config", CONFIGS, ids="/".join)
def test_training_matches_tensorflow(results, check, config):
    run = check(results, "/".join(config))
    ours, theirs = run["distserver"], run["tensorflow"]
    losses = np.array(ours["losses"])
    assert losses[-4:].mean() < losses[:4].mean() * 0.9, losses
    np.testing.assert_allclose(losses, theirs["losses"], rtol=1e-4, atol=1e-5)
    for name, difference in run["max_weight_difference"].items():
        assert difference < WEIGHT_TOLERANCE, (name, difference)
    assert ours["global_step"] == theirs["global_step"] == len(losses)
    assert ours["accuracy"] == pytest.approx(theirs["accuracy"], abs=0.02)


def test_variables_live_on_the_ps_task_and_compute_on_the_workers(results, check):
    devices = check(results, "gd/sparse_xent/ref")["devices"]
    assert devices.pop("compute") == "/job:worker/task:1"
    assert set(devices.values()) == {"/job:ps/task:0"}
