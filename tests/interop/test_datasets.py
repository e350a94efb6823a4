"""tf.data in graph mode from a real TensorFlow client: one-shot and initializable
iterators over from_tensor_slices -> map -> shuffle -> batch -> repeat, filter / skip /
take / prefetch, zip, padded_batch / cache / unbatch, flat_map / interleave, a training
loop fed by a pipeline, each ending in OutOfRangeError where TensorFlow's does. Shuffled orders differ from
TensorFlow's (documented), so the shuffled pipeline is compared as a multiset with the
same batch shapes."""

from __future__ import annotations

import pytest

from distserver.testing import LocalCluster

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240, func_only=True)]

SAME = [
    "one_shot_end",
    "one_shot_shapes",
    "one_shot_elements",
    "initializable_10",
    "initializable_3",
    "zip",
    "train",
    "in_order",
    "padded_cached",
    "unbatched",
    "prefetched_0",
    "prefetched_1",
    "flat_map",
    "interleave",
    "parallel_interleave",
    "parallel_batch",
]


@pytest.fixture(scope="module")
def results(tf_client):
    with LocalCluster({"ps": 1, "worker": 1}) as cluster:
        yield tf_client.run("datasets.py", {"cluster": cluster.cluster})


@pytest.mark.parametrize("name", SAME)
def test_the_same_values_as_tensorflow(results, check, name):
    assert check(results, f"distserver/{name}") == check(results, f"tensorflow/{name}")


def test_padding_to_a_smaller_shape_is_tensorflows_data_loss_error(results, check_error):
    for side in ("distserver", "tensorflow"):
        kind, message = check_error(results, f"{side}/padded_too_small")
        assert kind == "DataLossError"
        assert "Attempted to pad to a smaller size than the input element." in message
