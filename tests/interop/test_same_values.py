"""Split/SplitV, ReverseV2, Cumsum/Cumprod, TopKV2, InTopKV2, CountUpTo (both variable kinds)
and RandomShuffle on a distserver task, compared with TensorFlow alone."""

from __future__ import annotations

import numpy as np
import pytest

from distserver.testing import LocalCluster

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180, func_only=True)]

NAMES = [
    "split", "split_v", "reverse", "cumsum", "cumsum_exclusive_reverse", "cumprod", "top_k", "in_top_k",
    "count_up_to", "resource_count_up_to", "count_up_to_again", "count_up_to_limit", "shuffle",
    "words", "weights", "table_size", "bytes_length", "char_length", "numbers", "integers", "split_rows",
    "split_on_comma", "hash_buckets",
]  # fmt: skip


@pytest.fixture(scope="module")
def results(tf_client):
    with LocalCluster({"ps": 1, "worker": 1}) as cluster:
        yield tf_client.run("same_values.py", {"cluster": cluster.cluster})


@pytest.mark.parametrize("name", NAMES)
def test_the_same_as_tensorflow(results, check, name):
    assert_close(check(results, f"ours/{name}"), check(results, f"theirs/{name}"))


def assert_close(ours, theirs):
    """Equal strings, or numbers within float32 rounding (output by output when shapes differ)."""
    if isinstance(theirs, str) or (isinstance(theirs, list) and any(isinstance(t, str) for t in theirs)):
        assert ours == theirs
        return
    try:
        mine, other = np.asarray(ours, dtype=float), np.asarray(theirs, dtype=float)
    except ValueError:  # a list of outputs of different shapes
        assert len(ours) == len(theirs)
        for one, another in zip(ours, theirs, strict=True):
            assert_close(one, another)
        return
    np.testing.assert_allclose(mine, other, rtol=1e-6)
