"""Graph functions from a real TensorFlow client: tf.function calls in a graph (nested,
spanning tasks, with gradients, updating a variable on the ps) and control flow v2's
tf.cond and tf.switch_case, compared with TensorFlow alone."""

from __future__ import annotations

import numpy as np
import pytest

from distserver.testing import LocalCluster

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240, func_only=True)]

SAME = [
    "call",
    "nested_call",
    "body_on_each_task",
    "cond_True",
    "cond_False",
    "cond_grad_True",
    "cond_grad_False",
    "call_grad",
    *(f"switch_case_{index}" for index in (-1, 0, 1, 2, 7)),
    "one_branch_updates",
    "update",
    "train",
    "after_train",
]


@pytest.fixture(scope="module")
def results(tf_client):
    with LocalCluster({"ps": 1, "worker": 1}) as cluster:
        yield tf_client.run("functions.py", {"cluster": cluster.cluster})


@pytest.mark.parametrize("name", SAME)
def test_the_same_values_as_tensorflow(results, check, name):
    ours = check(results, f"distserver/{name}")
    theirs = check(results, f"tensorflow/{name}")
    np.testing.assert_allclose(ours, theirs, rtol=1e-6)
