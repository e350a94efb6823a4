"""TF 1.x summaries computed on a distserver task, compared with TensorFlow's by a TF client."""

from __future__ import annotations

import pytest

from distserver.testing import LocalCluster

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240, func_only=True)]


@pytest.fixture(scope="module")
def results(tf_client):
    with LocalCluster({"ps": 1, "worker": 1}) as cluster:
        yield tf_client.run("summaries.py", {"cluster": cluster.cluster})


@pytest.mark.parametrize("name", ["scalar", "histogram", "empty_histogram", "merged", "audio"])
def test_tensorflows_bytes(results, check, name):
    assert check(results, f"{name}_bytes_equal") is True


@pytest.mark.parametrize("name", ["float_images", "positive_image", "byte_images"])
def test_images_decode_to_tensorflows_pixels(results, check, name):
    compared = check(results, f"{name}_pixels")
    assert compared["ours"] == compared["theirs"]  # tags, sizes, colorspaces
    assert compared["max_difference"] == 0


def test_duplicate_tags_in_a_merge_are_refused(results, check):
    error, message = check(results, "duplicate_tags")
    assert error == "InvalidArgumentError"
    assert "Duplicate tag loss found in summary inputs" in message
