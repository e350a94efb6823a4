"""A helper thread that shares a task's largest kernels with them (intra-op parallelism).

`distserver serve` gives numpy's BLAS one thread per product when a task's share of
the host is small (`distserver/_blas.py`): OpenBLAS's own threads spin while they
wait for each other, which a busy machine punishes. With `enable()`, a kernel with
a large element of work cuts it in two independent halves (a matrix product: two
blocks of rows) and hands one to this module's helper thread while its own thread
computes the other; numpy releases the GIL for both, and a half whose thread was
descheduled is waited for on a future, without spinning. The halves are cut where
each keeps the bits of one whole call (`row_cut`: on the row panels of BLAS's
kernels, probed once per dtype; not at all while BLAS runs more than one thread).
The helper may run on every CPU but the one its caller is on (see `_keep_helper_off`).

Off unless `enable()` was called (`distserver serve` does for a task with one BLAS
thread on a host of two or more CPUs). The helper only ever runs such halves, never
a kernel, so a kernel that waits for it cannot wait for itself.

`share_while(allowed)` makes the cut depend on the host: products are cut only while
`allowed()` (asked at most every `ALLOWED_EVERY` seconds) says the tasks working on
it leave a CPU for the helper (`distserver serve` passes `_cpus.HostTasks.leave_a_cpu`
when the host has more tasks than CPUs). A ps and a worker on two CPUs: the ps waits
while the worker computes, and the helper takes the free CPU. A ps and two workers:
both workers compute at once, and four halves on two CPUs wait for each other (a
two-worker `mlp` step 1-5% faster without the cut; docs/benchmarks.md, round 40).
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from distserver._blas import blas_threads
from distserver._cpus import current_cpu

# A matrix product of at least this many multiply-adds is cut in two (256x784 @
# 784x512, an mlp's layer, is 103M: 2.4 -> 1.3 ms on this 2-CPU VM; a hand-off
# costs ~0.05 ms).
SPLIT_MACS = 8 << 20
# ... and of at least this many rows (see `row_cut`).
SPLIT_MIN_ROWS = 128

# How often `share_while`'s `allowed` is asked again (seconds).
ALLOWED_EVERY = 0.01

_helper: concurrent.futures.ThreadPoolExecutor | None = None
_lock = threading.Lock()
_allowed: Callable[[], bool] | None = None
# `allowed()`'s last answer and when it is asked again (`time.monotonic()`); read and
# written without a lock: a stale answer decides one product.
_may_split = True
_asked_again_at = 0.0


def enable() -> None:
    """Start the helper thread (idempotent)."""
    global _helper, _one_blas_thread, _helper_thread, _kept_off, _allowed_cpus
    with _lock:
        _row_alignments.clear()  # (probed again, with the BLAS threads set by now)
        _one_blas_thread = blas_threads() in (None, 1)
        if _helper is None:
            _helper = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="distserver-intra-op")
            _helper_thread = _helper.submit(threading.get_native_id).result()
            _kept_off = -1
            _allowed_cpus = (
                frozenset(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else frozenset()
            )


def disable() -> None:
    """Stop the helper thread, after the halves it was given (idempotent)."""
    global _helper
    with _lock:
        helper, _helper = _helper, None
    if helper is not None:
        helper.shutdown(wait=True)


def share_while(allowed: Callable[[], bool] | None) -> None:
    """Cut products only while `allowed()` (None: always, as after `enable()`)."""
    global _allowed, _asked_again_at
    _allowed = allowed
    _asked_again_at = 0.0


def enabled() -> bool:
    """Whether a large product is cut in two now: the helper is on, and
    `share_while`'s `allowed()` (if any) said so when last asked."""
    global _may_split, _asked_again_at
    if _helper is None:
        return False
    allowed = _allowed
    if allowed is None:
        return True
    now = time.monotonic()
    if now >= _asked_again_at:
        _asked_again_at = now + ALLOWED_EVERY
        _may_split = allowed()
    return _may_split


def run_halves(first: Callable[[], Any], second: Callable[[], Any]) -> None:
    """Run `second` on the helper thread and `first` on this one; return once both
    are done (raising the first's error, else the second's). Both inline, one after
    the other, when the helper is off."""
    helper = _helper
    if helper is None:
        first()
        second()
        return
    _keep_helper_off(current_cpu())
    try:
        pending = helper.submit(second)
    except RuntimeError:  # disabled meanwhile: shut down
        first()
        second()
        return
    try:
        first()
    finally:
        pending.result()


# The helper runs on any CPU but the one its caller is on. On a VM, Linux counts a
# vCPU that has sat idle (halted) as taken by the host, and wakes a thread on its
# waker's CPU instead, behind the waker's own half: two GIL-free 500 us loops side by side
# took 1,002-1,072 us after 2-5 ms of idle (546 hot), and 554-602 us with the two
# threads on different CPUs. The helper's CPUs are set from its caller's thread, before
# the half is handed over, and only when the caller is on another CPU than last time.
_helper_thread = 0  # its native thread id
_kept_off = -1  # the CPU it was last kept off, or -1
_allowed_cpus: frozenset[int] = frozenset()  # those this process may use, when enabled


def _keep_helper_off(cpu: int | None) -> None:
    """Let the helper thread run on every CPU this process may use but `cpu`."""
    global _kept_off
    if cpu is None or cpu == _kept_off or not _helper_thread:
        return
    others = _allowed_cpus - {cpu}
    if not others:
        return
    try:
        os.sched_setaffinity(_helper_thread, others)
    except OSError:  # (gone, or not allowed: it runs where Linux puts it)
        return
    _kept_off = cpu


# Where a product's rows may be cut. BLAS's kernels compute rows a panel of a few at a
# time, and a panel cut short is summed by another kernel, in another order: a block
# must start and end on the whole's panel boundaries (OpenBLAS's Haswell kernels, float32:
# every 24 rows; its SkylakeX ones: any row), and keep `SPLIT_MIN_ROWS` // 2 rows or more
# (a product of a row or a few takes other kernels still). The panel is found once per
# dtype by trying cuts (`_probe_row_alignment`). BLAS on more threads shares a product's
# rows among them by its size, so no cut keeps the bits: products are then not cut.
# `enable()` asks the BLAS threads, and forgets the panels (`distserver serve` sets the
# threads first).
_ROW_ALIGNMENTS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96)
_row_alignments: dict[np.dtype, int] = {}
_one_blas_thread = False


def row_cut(rows: int, dtype: np.dtype) -> int:
    """Where to cut a product of `rows` rows of `dtype` in two blocks of the whole's
    bits, nearest the middle; 0 where there is no such cut."""
    alignment = _row_alignments.get(dtype)
    if alignment is None:
        alignment = _row_alignments[dtype] = _probe_row_alignment(dtype)
    if not alignment or not _one_blas_thread:
        return 0
    least = SPLIT_MIN_ROWS // 2
    below = rows // 2 // alignment * alignment
    for cut in sorted((below, below + alignment), key=lambda cut: abs(rows - 2 * cut)):
        if least <= cut <= rows - least:
            return cut
    return 0


def _probe_row_alignment(dtype: np.dtype) -> int:
    """The fewest of `_ROW_ALIGNMENTS` rows such that BLAS gives both blocks of a
    product cut at a multiple of it the bits of the whole (the left operand as rows
    and as a transposed view); 0 when none does. Integers sum exactly: 1."""
    if dtype.kind in "iub":
        return 1
    rng = np.random.default_rng(0)
    rows, inner, columns = 384, 256, 128  # (blocks of 2M+ multiply-adds: BLAS's large-product kernels)
    values = rng.standard_normal((rows, inner)) + (
        1j * rng.standard_normal((rows, inner)) if dtype.kind == "c" else 0
    )
    rhs = np.asarray(rng.standard_normal((inner, columns)), dtype)
    lefts = [np.asarray(values, dtype), np.asarray(values, dtype).T.copy().T]
    wholes = [np.matmul(lhs, rhs) for lhs in lefts]

    def keeps_bits(cut: int) -> bool:
        return all(
            np.matmul(lhs[part], rhs).tobytes() == whole[part].tobytes()
            for lhs, whole in zip(lefts, wholes, strict=True)
            for part in (slice(None, cut), slice(cut, None))
        )

    for alignment in _ROW_ALIGNMENTS:
        below = rows // 2 // alignment * alignment
        # Two cuts a multiple apart: both keep the bits only where the panel divides it.
        if keeps_bits(below) and keeps_bits(below + alignment):
            return alignment
    return 0
