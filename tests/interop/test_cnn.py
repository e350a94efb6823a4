"""A small CNN and the remaining dense optimizers trained on ps:1 worker:1, against TensorFlow alone.

The client (`clients/cnn.py`) trains each model through a worker session whose graph
comes from `replica_device_setter`, and again in an in-process TensorFlow session,
from the same initial values: losses and final weights must agree to float32
rounding.
"""

from __future__ import annotations

import numpy as np
import pytest

from distserver.testing import LocalCluster

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120, func_only=True)]

CNN_CONFIGS = [
    ("adam", "resource", "same"),
    ("momentum", "ref", "mirror"),
]
DENSE_CONFIGS = [
    ("adadelta", "ref"),
    ("adadelta", "resource"),
    ("ftrl", "ref"),
    ("ftrl", "resource"),
    ("ftrl_v2", "ref"),
    ("ftrl_v2", "resource"),
    ("centered_rmsprop", "ref"),
    ("centered_rmsprop", "resource"),
    ("proximal_adagrad", "ref"),
    ("proximal_adagrad", "resource"),
    ("proximal_gd", "ref"),
    ("proximal_gd", "resource"),
]
# The op each dense optimizer must have used (its reference-variable form).
APPLY_OPS = {
    "adadelta": "ApplyAdadelta",
    "ftrl": "ApplyFtrl",
    "ftrl_v2": "ApplyFtrlV2",
    "centered_rmsprop": "ApplyCenteredRMSProp",
    "proximal_adagrad": "ApplyProximalAdagrad",
    "proximal_gd": "ApplyProximalGradientDescent",
}
# float32 sums in a different order (numpy vs Eigen) differ in the last bits.
WEIGHT_TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def results(tf_client):
    with LocalCluster({"ps": 1, "worker": 1}) as cluster:
        yield tf_client.run(
            "cnn.py", {"cluster": cluster.cluster, "cnn": CNN_CONFIGS, "dense": DENSE_CONFIGS}, timeout=600
        )


def _matches_tensorflow(run):
    ours, theirs = run["distserver"], run["tensorflow"]
    np.testing.assert_allclose(ours["losses"], theirs["losses"], rtol=1e-4, atol=1e-5)
    for name, difference in run["max_weight_difference"].items():
        assert difference < WEIGHT_TOLERANCE, (name, difference)
    assert ours["global_step"] == theirs["global_step"] == len(ours["losses"])


@pytest.mark.parametrize("config", CNN_CONFIGS, ids="/".join)
def test_cnn_training_matches_tensorflow(results, check, config):
    run = check(results, "cnn/" + "/".join(config))
    _matches_tensorflow(run)
    losses = run["distserver"]["losses"]
    assert np.mean(losses[-3:]) < np.mean(losses[:3]), losses
    ops = set(run["ops"])
    assert {"Conv2D", "Conv2DBackpropInput", "Conv2DBackpropFilter", "MaxPool", "MaxPoolGrad"} <= ops
    assert {"AvgPool", "AvgPoolGrad", "ShapeN"} <= ops
    if config[2] == "mirror":
        assert {"MirrorPad", "MirrorPadGrad"} <= ops


def test_cnn_variables_live_on_the_ps_and_compute_on_the_worker(results, check):
    devices = check(results, "cnn/adam/resource/same")["devices"]
    assert devices.pop("compute") == "/job:worker/task:0"
    assert set(devices.values()) == {"/job:ps/task:0"}


@pytest.mark.parametrize("config", DENSE_CONFIGS, ids="/".join)
def test_optimizer_matches_tensorflow(results, check, config):
    run = check(results, "dense/" + "/".join(config))
    _matches_tensorflow(run)
    op = APPLY_OPS[config[0]]
    assert (op if config[1] == "ref" else f"Resource{op}") in run["ops"]
