"""glibc malloc settings that keep large buffers out of fresh pages.

A step allocates and frees the same large buffers every time: a 784 KiB feed encoded,
framed and sent, a 1.6 MB variable received and decoded, a gradient, an optimizer's
temporaries. With glibc's defaults, buffers above the (dynamic) mmap threshold are
mapped and unmapped per allocation, and memory freed at the top of a heap beyond the
trim threshold is handed back to the kernel (`madvise` in a thread's arena), so the
next buffer page-faults and zeroes its pages again, 4 KiB at a time. Two settings:

* `apply_for_any_process`, when distserver is imported (clients included): buffers
  below `MMAP_THRESHOLD` (32 MiB, the most glibc's own adjustment would reach) come
  from the heap and are reused, larger ones (a bulk tensor) are still mapped and
  given back when freed; a heap keeps up to `TRIM_THRESHOLD` free at its top.
  Measured with distserver's own client (one task): on `mlp`, 1,009 page faults a
  step, client CPU 4.4 -> 1.4 ms a step, the step 13.7 -> 9.9 ms; fetching a 16 MiB
  variable, 27.8-31.4 -> 21.7-26.5 ms (docs/benchmarks.md, round 7). (An 8 MiB
  threshold, tried first, mapped every 16 MiB fetch: 31.5 -> 50.8 ms.)
* `keep_freed_memory`, for `distserver serve` (a task, which moves the large tensors):
  no mapped buffers at all and a 1 GiB trim threshold, so even bulk tensors reuse
  the heap (a 64 MiB RecvTensor ~0.4 -> ~1.4 GB/s; docs/benchmarks.md, "the gRPC
  transfer probe"). The cost: the task keeps its peak heap.

Setting either also turns off glibc's own adjustment of the mmap threshold. Neither
applies off glibc, over a setting the user made (the `MALLOC_*_` environment variables
and `GLIBC_TUNABLES`, which glibc reads), or with `DISTSERVER_MALLOC_TUNING=0`.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable

MMAP_THRESHOLD = 32 << 20
TRIM_THRESHOLD = 64 << 20
SERVE_TRIM_THRESHOLD = 1 << 30

# mallopt parameters, from glibc's malloc.h
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_MMAP_MAX = -4
# The environment variables through which a user sets glibc's malloc tunables.
_USER_SETTINGS = (
    "MALLOC_MMAP_THRESHOLD_",
    "MALLOC_TRIM_THRESHOLD_",
    "MALLOC_TOP_PAD_",
    "MALLOC_MMAP_MAX_",
    "GLIBC_TUNABLES",
)


def _mallopt() -> Callable[[int, int], int] | None:
    """glibc's `mallopt`, when this process runs on glibc and the settings are wanted."""
    if os.environ.get("DISTSERVER_MALLOC_TUNING", "1") == "0":
        return None
    if any(name in os.environ for name in _USER_SETTINGS):
        return None
    try:
        if not os.confstr("CS_GNU_LIBC_VERSION"):
            return None
        mallopt = ctypes.CDLL(None).mallopt
    except (AttributeError, OSError, ValueError):  # not glibc
        return None
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    return mallopt  # type: ignore[no-any-return]


def apply_for_any_process() -> bool:
    """Heap reuse below `MMAP_THRESHOLD` (see the module docstring); True when set."""
    mallopt = _mallopt()
    if mallopt is None:
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
        mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    )


def keep_freed_memory() -> bool:
    """A task's setting: no mapped buffers, freed memory kept (see the module docstring)."""
    mallopt = _mallopt()
    if mallopt is None:
        return False
    return bool(mallopt(_M_MMAP_MAX, 0)) and bool(mallopt(_M_TRIM_THRESHOLD, SERVE_TRIM_THRESHOLD))


APPLIED = apply_for_any_process()
