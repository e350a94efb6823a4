"""TF 1.x variables (resource and reference) on ps tasks, used from worker sessions."""

from __future__ import annotations

import numpy as np
import pytest

from distserver.testing import LocalCluster

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120, func_only=True)]

FLAVOURS = ["resource", "ref"]


@pytest.fixture(scope="module")
def results(tf_client):
    with LocalCluster({"ps": 2, "worker": 2}) as cluster:
        yield tf_client.run("variables.py", {"cluster": cluster.cluster})


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_initialization_is_reported_and_required(results, check, check_error, flavour):
    suffix = "res" if flavour == "resource" else "ref"
    assert check(results, f"{flavour}_uninitialized_before") == [f"counter_{suffix}", f"table_{suffix}"]
    raised, _ = check_error(results, f"{flavour}_read_uninitialized")
    assert raised == "FailedPreconditionError"
    assert check(results, f"{flavour}_uninitialized_after") == []


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_updates_from_a_worker(results, check, flavour):
    assert check(results, f"{flavour}_increment") == [11.0, 22.0]
    # read_value() after the update (control dependency) sees it.
    assert check(results, f"{flavour}_read_after_increment") == [21.0, 42.0]
    assert check(results, f"{flavour}_rows") == [[4.0, 5.0], [0.0, 1.0]]


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_ps_state_is_shared_by_the_sessions_of_every_master(results, check, flavour):
    counter, total = check(results, f"{flavour}_seen_from_worker1")
    assert counter == [21.0, 42.0]
    assert total == 63.0 + 15.0
    assert check(results, f"{flavour}_replaced") == [[1.0, 1.0]] * 3


def test_replica_device_setter_spreads_variables_over_ps_tasks(results, check):
    devices = check(results, "setter_devices")
    assert devices[:4] == ["/job:ps/task:0", "/job:ps/task:1", "/job:ps/task:0", "/job:ps/task:1"]
    assert check(results, "setter_bumps") == [1, 2, 3]
    assert check(results, "setter_step_after_reinit") == 0


def test_seeded_random_initializers(results, check):
    assert all(check(results, "seeded_initializers_repeat"))
    stats = check(results, "initializer_statistics")
    mean, std = stats["normal"]
    assert abs(mean) < 0.1
    assert abs(std - 1.0) < 0.1
    low, high, uniform_mean = stats["uniform"]
    assert -2.0 <= low < -1.9
    assert 1.9 < high < 2.0
    assert abs(uniform_mean) < 0.1
    largest, truncated_std = stats["truncated"]
    assert largest <= 2.0
    assert abs(truncated_std - 0.88) < 0.05
    assert stats["distinct"]


def test_a_queue_without_shared_name_is_one_queue_across_runs(results, check):
    assert check(results, "unshared_queue_across_runs") == [1.0, 2.0]


def test_reset_drops_the_variables(results, check, check_error):
    assert check(results, "reset") is None
    raised, message = check_error(results, "after_reset")
    assert raised == "FailedPreconditionError", message
    assert np.isfinite(1.0)
