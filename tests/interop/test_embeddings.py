"""Training a partitioned embedding + a dense head with TF 1.x optimizers across 2 ps + 1 worker.

The TF 1.x client program (tests/interop/clients/embeddings.py) runs against a
distserver cluster and in TensorFlow alone; both must end with the same weights.
The graphs exercise the embedding ops (DynamicPartition, Gather, DynamicStitch) and
the sparse updates (Unique, UnsortedSegmentSum, SparseApply*/ResourceSparseApply*).
"""

from __future__ import annotations

import numpy as np
import pytest

from distserver.testing import LocalCluster

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120, func_only=True)]

CONFIGS = [
    ("adagrad", "ref"),
    ("adagrad", "resource"),
    ("momentum", "ref"),
    ("nesterov", "resource"),
    ("ftrl", "ref"),
    ("rmsprop", "resource"),
]
SPARSE_OPS = {
    "adagrad": "SparseApplyAdagrad",
    "momentum": "SparseApplyMomentum",
    "nesterov": "SparseApplyMomentum",
    "ftrl": "SparseApplyFtrl",
    "rmsprop": "SparseApplyRMSProp",
}
# float32 sums in a different order (numpy vs Eigen) differ in the last bits.
WEIGHT_TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def results(tf_client):
    with LocalCluster({"ps": 2, "worker": 1}) as cluster:
        yield tf_client.run("embeddings.py", {"cluster": cluster.cluster, "configs": CONFIGS})


@pytest.mark.parametrize("config", CONFIGS, ids="/".join)
def test_partitioned_embedding_training_matches_tensorflow(results, check, config):
    run = check(results, "/".join(config))
    ours, theirs = run["distserver"], run["tensorflow"]
    losses = np.array(ours["losses"])
    assert losses[-3:].mean() < losses[:3].mean(), losses
    np.testing.assert_allclose(losses, theirs["losses"], rtol=1e-5, atol=1e-6)
    for name, difference in run["max_weight_difference"].items():
        assert difference < WEIGHT_TOLERANCE, (name, difference)
    assert ours["global_step"] == theirs["global_step"] == len(losses)
    embedding = np.array(ours["weights"]["embedding"])
    unused = results["unused_ids"]
    np.testing.assert_array_equal(embedding[unused], np.array(results["initial_embedding"])[unused])
    assert not np.allclose(embedding[: min(unused)], np.array(results["initial_embedding"])[: min(unused)])


@pytest.mark.parametrize("config", CONFIGS, ids="/".join)
def test_the_graph_uses_the_sparse_kernels(results, check, config):
    run = check(results, "/".join(config))
    optimizer, variables = config
    sparse_op = SPARSE_OPS[optimizer]
    expected = {"DynamicPartition", "DynamicStitch", "Unique", "UnsortedSegmentSum"}
    expected.add(f"Resource{sparse_op}" if variables == "resource" else sparse_op)
    assert expected <= set(run["ops"])


def test_the_embedding_halves_live_on_the_two_ps_tasks(results, check):
    devices = check(results, "adagrad/ref")["devices"]
    assert devices["embedding/part_0"] == "/job:ps/task:0"
    assert devices["embedding/part_1"] == "/job:ps/task:1"
    assert devices["loss"] == "/job:worker/task:0"
