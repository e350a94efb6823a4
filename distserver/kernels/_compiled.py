"""Compiled loops for a few hot kernels, when numba is installed (`pip install
distserver[compiled]`); numpy's calls otherwise.

Some kernels are a dozen element-wise numpy passes over the same arrays: Adam's
update of a 784x512 variable takes twelve (~0.67 ms here) where one compiled loop
over the elements takes ~0.23 ms; a sparse update or a segment sum walks rows that
numpy can only gather, update and scatter back; a sum over a middle axis (an
embedding's pooled rows) is one numpy pass per entry, a stitch one indexed
assignment per input, a gather of rows a pass for each bound of its indices before
the copy, and the distinct ids of a sparse update or an embedding's split by shard
several passes and masks, and finding each id's shard and row there (`id_split`)
eleven integer passes, four of them divisions; a region of small element-wise parts
(a logistic loss and its gradient) is a numpy call a part, which one program over
its values replaces (`region_plans`). `_loops` has those loops, each giving the bits
of the numpy code it stands in for.

Compiling them all takes ~4.4 s of CPU here (~0.35 s once numba's cache in
`__pycache__` has them), so it never happens in a kernel's call: the first kernel
built that can use a loop (or the first sum over a middle axis) calls `prepare`,
which compiles them all in a background thread, and until they are ready (or when
numba is missing, fails, or `DISTSERVER_COMPILED_KERNELS=0`) `loops()` is None and
kernels use numpy.
"""

from __future__ import annotations

import atexit
import importlib.util
import logging
import os
import shutil
import sys
import tempfile
import threading
import time
from types import ModuleType

import numpy as np

logger = logging.getLogger(__name__)

_ENV = "DISTSERVER_COMPILED_KERNELS"

# The dtypes the loops are compiled for.
DTYPES = frozenset({np.dtype(np.float32), np.dtype(np.float64)})

_lock = threading.Lock()
_started = False
_done = threading.Event()
_loops: ModuleType | None = None


def enabled() -> bool:
    """Whether this process may use compiled loops (numba installed, not turned off)."""
    return os.environ.get(_ENV, "1") != "0" and importlib.util.find_spec("numba") is not None


def loops() -> ModuleType | None:
    """The compiled loops (`_loops`), or None while they compile or when there are none."""
    return _loops


def state() -> str:
    """Where the loops are, for a task's statistics: "unused" (no kernel has asked for
    them yet), "compiling", "ready", or "off" (numba missing or unusable, or
    `DISTSERVER_COMPILED_KERNELS=0`)."""
    if _loops is not None:
        return "ready"
    if not _started:
        return "unused" if enabled() else "off"
    return "off" if _done.is_set() else "compiling"


def contiguous(*arrays: np.ndarray) -> bool:
    """Whether every one of `arrays` is C-contiguous, as the loops take them."""
    return all(a.flags.c_contiguous for a in arrays)


def read_only(array: np.ndarray, *shape: int) -> np.ndarray:
    """A read-only view of C-contiguous `array` in `shape`: how the loops take the
    arrays they only read (their signatures say read-only, as received tensors are;
    numba converts a writeable array to that type too, at the same call cost, so an
    array already in the loop's shape needs no view)."""
    view = array.reshape(shape)
    view.flags.writeable = False
    return view


def prepare() -> None:
    """Start compiling the loops in a background thread, once a process; never waits."""
    global _started
    if _started:
        return
    with _lock:
        if _started:
            return
        _started = True
    if not enabled():
        _done.set()
        return
    threading.Thread(target=_compile, name="distserver-compile", daemon=True).start()


def wait(timeout: float) -> bool:
    """Start compiling if nothing has (`prepare`), wait up to `timeout` seconds for it to
    end, and say whether the loops are ready (benchmarks and tests, not kernels)."""
    prepare()
    _done.wait(timeout)
    return _loops is not None


def _compile() -> None:
    global _loops
    started = time.monotonic()
    try:
        compiled = _import_loops()
    except Exception as exc:  # numba present but unusable (e.g. numpy too new for it)
        logger.warning("compiled kernels are off, numpy's calls run instead: %s: %s", type(exc).__name__, exc)
    else:
        _loops = compiled
        logger.info("compiled kernels ready in %.2f s", time.monotonic() - started)
    finally:
        _done.set()


def _import_loops() -> ModuleType:
    """`_loops`, compiled (or loaded from numba's cache) as it is imported."""
    try:
        from distserver.kernels import _loops
    except RuntimeError as exc:
        if "cannot cache" not in str(exc):
            raise
        # Nowhere numba may keep its cache: the package's directory is read-only and
        # there is no usable home (a container's non-root user). The loops compile
        # anyway, caching into a directory of this process's own.
        import numba

        directory = tempfile.mkdtemp(prefix="distserver-numba-")
        atexit.register(shutil.rmtree, directory, ignore_errors=True)
        numba.config.CACHE_DIR = directory  # type: ignore[attr-defined]  # (read at caching)
        sys.modules.pop("distserver.kernels._loops", None)
        from distserver.kernels import _loops
    return _loops
