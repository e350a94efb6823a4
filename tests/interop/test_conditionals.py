"""TF 1.x conditionals from a real TensorFlow client: tf.cond across tasks, tf.case,
piecewise_constant, one-branch variable updates, float assertions, dead fetches."""

from __future__ import annotations

import numpy as np
import pytest

from distserver.testing import LocalCluster

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240, func_only=True)]

SAME = [
    "cond_True",
    "cond_False",
    "case_0",
    "case_1",
    "case_2",
    "piecewise_constant",
    "one_branch_updates",
    "assert_passes",
    "fetch_live",
]


@pytest.fixture(scope="module")
def results(tf_client):
    with LocalCluster({"ps": 1, "worker": 1}) as cluster:
        yield tf_client.run("conditionals.py", {"cluster": cluster.cluster})


@pytest.mark.parametrize("name", SAME)
def test_the_same_values_as_tensorflow(results, check, name):
    ours = check(results, f"distserver/{name}")
    theirs = check(results, f"tensorflow/{name}")
    np.testing.assert_allclose(ours, theirs, rtol=1e-6)


def test_a_failing_assertion_in_a_cond_fails_the_step_as_in_tensorflow(results, check_error):
    ours = check_error(results, "distserver/assert_fails")
    theirs = check_error(results, "tensorflow/assert_fails")
    assert ours[0] == theirs[0] == "InvalidArgumentError"
    assert "x too large" in ours[1]


def test_fetching_the_untaken_branch_is_an_invalid_argument(results, check_error):
    ours = check_error(results, "distserver/fetch_dead")
    assert ours[0] == check_error(results, "tensorflow/fetch_dead")[0] == "InvalidArgumentError"
    assert "not valid" in ours[1]


def test_stop_at_step_hook_stops_where_tensorflows_does(results, check):
    assert check(results, "distserver/monitored_session") == check(results, "tensorflow/monitored_session")
