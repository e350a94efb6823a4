"""TensorArray split and concat (and their gradients, in a v1 loop and training a weight on
the ps), TensorArrayGradWithShape, and TensorFlow's error texts, from a real TensorFlow
client; compared with TensorFlow alone."""

from __future__ import annotations

import numpy as np
import pytest

from distserver.testing import LocalCluster

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240, func_only=True)]

SAME = ["split_concat", "split_read", "grown_1", "grown_3", "with_shape"]
CLOSE = ["gradients", "trained"]
ERRORS = ["bad_sum", "bad_size", "scalars", "inferred_shape"]


@pytest.fixture(scope="module")
def results(tf_client):
    with LocalCluster({"ps": 1, "worker": 1}) as cluster:
        yield tf_client.run("tensor_arrays.py", {"cluster": cluster.cluster})


@pytest.mark.parametrize("name", SAME)
def test_the_same_values_as_tensorflow(results, check, name):
    assert check(results, f"distserver/{name}") == check(results, f"tensorflow/{name}")


@pytest.mark.parametrize("name", CLOSE)
def test_the_same_gradients_and_training_as_tensorflow(results, check, name):
    # tanh differs from TensorFlow's kernel in the last bits.
    for ours, theirs in zip(
        check(results, f"distserver/{name}"), check(results, f"tensorflow/{name}"), strict=True
    ):
        np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ERRORS)
def test_tensorflows_errors(results, check_error, name):
    ours = check_error(results, f"distserver/{name}")
    theirs = check_error(results, f"tensorflow/{name}")
    assert ours[0] == theirs[0] == "InvalidArgumentError"
    # TensorFlow prefixes some texts with "TensorArray <its internal name>: ".
    assert theirs[1].splitlines()[-2].endswith(ours[1].splitlines()[-2])
