"""tf.data iterated inside tf.functions called from a v1 graph, from a real TensorFlow client:
`for x in dataset` (reduce/scan/take_while), `iter`/`next` on anonymous iterators,
`for x in iter(dataset)` with optionals, `next` past the end, a training step on the ps
fed by `next` until OutOfRangeError; compared with TensorFlow alone."""

from __future__ import annotations

import numpy as np
import pytest

from distserver.testing import LocalCluster

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240, func_only=True)]

SAME = [
    "total",
    "until_break",
    "first_two",
    "over_iterator",
    "optional_at_end",
    "made_inside",
    "made_inside_empty",
    "cached_inside",
    "local_epoch",
    "train3",
]


@pytest.fixture(scope="module")
def results(tf_client):
    with LocalCluster({"ps": 1, "worker": 1}) as cluster:
        yield tf_client.run("function_datasets.py", {"cluster": cluster.cluster})


@pytest.mark.parametrize("name", SAME)
def test_the_same_values_as_tensorflow(results, check, name):
    np.testing.assert_allclose(
        np.asarray(check(results, f"distserver/{name}"), dtype=object).astype(float),
        np.asarray(check(results, f"tensorflow/{name}"), dtype=object).astype(float),
        rtol=1e-6,
    )


@pytest.mark.parametrize("name", ["past_end", "train4"])
def test_next_past_the_end_is_out_of_range_as_in_tensorflow(results, check_error, name):
    for side in ("distserver", "tensorflow"):
        kind, message = check_error(results, f"{side}/{name}")
        assert (kind, message.splitlines()[1]) == ("OutOfRangeError", "End of sequence")


def test_the_graphs_hold_the_ops_of_tf2_iteration(results, check):
    ops, library_ops = check(results, "tensorflow/ops")
    assert "StatefulPartitionedCall" in ops
    for op in (
        "AnonymousIteratorV3",
        "MakeIterator",
        "IteratorGetNext",
        "IteratorGetNextAsOptional",
        "ReduceDataset",
        "ScanDataset",
        "TakeWhileDataset",
        "While",
        "CacheDatasetV2",
        "DummyMemoryCache",
    ):
        assert op in library_ops


def test_a_loop_whose_function_updates_a_variable_of_another_task_is_refused(results, check, check_error):
    assert check(results, "tensorflow/ps_epoch") > 0
    kind, message = check_error(results, "distserver/ps_epoch")
    assert kind == "UnimplementedError"
    assert "A tf.data dataset cannot be sent to another task" in message
