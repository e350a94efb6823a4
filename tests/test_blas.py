"""`distserver serve` limits numpy's BLAS threads (`distserver._blas`)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from distserver._blas import set_blas_threads, threads_per_local_task

PROBE = """
import sys
from distserver._blas import blas_threads, set_blas_threads
before = blas_threads()
assert set_blas_threads(int(sys.argv[1])), "no OpenBLAS found"
print(before, blas_threads())
"""


def _probe(threads: int, **env: str) -> tuple[int, int]:
    environment = {
        k: v for k, v in os.environ.items() if k not in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS")
    }
    out = subprocess.run(
        [sys.executable, "-c", PROBE, str(threads)],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
        env={**environment, **env},
    ).stdout.split()
    return int(out[0]), int(out[1])


def test_set_blas_threads_changes_numpys_openblas():
    before, after = _probe(1, OPENBLAS_NUM_THREADS="2")
    assert (before, after) == (2, 1)
    assert _probe(2, OPENBLAS_NUM_THREADS="1") == (1, 2)


def test_a_thread_count_below_one_is_refused():
    with pytest.raises(ValueError, match="at least 1"):
        set_blas_threads(0)


def test_tasks_sharing_a_host_get_half_their_share_of_its_cpus():
    three_local = ["localhost:1", "127.0.0.1:2", "[::1]:3"]
    assert threads_per_local_task(three_local, 2) == 1
    assert threads_per_local_task(three_local, 12) == 2
    assert threads_per_local_task(["localhost:1", "localhost:2"], 2) == 1
    assert threads_per_local_task(["localhost:1", "localhost:2"], 32) == 8


def test_a_task_alone_on_its_host_gets_every_cpu():
    assert threads_per_local_task(["localhost:1"], 2) == 2
    assert threads_per_local_task(["localhost:1"], 32) == 32
    assert threads_per_local_task(["localhost:1", "far.example.com:2"], 8) == 8  # another host
    assert threads_per_local_task([], 8) == 8
    assert threads_per_local_task(["localhost:1"], 1) == 1


def test_blas_kernels_names_the_kernels_openblas_loaded():
    from distserver._blas import blas_kernels

    kernels = blas_kernels()
    assert kernels
    assert kernels.isprintable()
    assert " " not in kernels
    pinned = os.environ.get("OPENBLAS_CORETYPE", "")
    if pinned.lower() in ("haswell", "skylakex"):  # hosts whose environment pins kernels
        assert kernels.lower() == pinned.lower()


def test_the_training_benchmark_says_which_kernels_its_products_ran():
    from distserver.bench.training import describe_openblas

    chosen = {"openblas": {"kernels": "SkylakeX", "OPENBLAS_CORETYPE": None}}
    pinned = {"openblas": {"kernels": "Haswell", "OPENBLAS_CORETYPE": "Haswell"}}
    assert describe_openblas(chosen) == "distserver's products: OpenBLAS's SkylakeX kernels"
    assert describe_openblas(pinned) == (
        "distserver's products: OpenBLAS's Haswell kernels (OPENBLAS_CORETYPE=Haswell in the "
        "environment chose them); TensorFlow's kernels do not read it"
    )
    assert describe_openblas({"openblas": {"kernels": None}}) == (
        "distserver's products: numpy's BLAS is not OpenBLAS"
    )
