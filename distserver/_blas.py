"""How many threads numpy's BLAS (OpenBLAS) may use in this process.

A task runs kernels on its event loop and in its own thread pool, so independent
kernels already run side by side; OpenBLAS adds, by default, one more thread per core
to every matrix product, and on a machine whose cores are busy those threads wait
for each other: a 256x784 @ 784x512 float32 product took 8.5 ms with OpenBLAS's
default threads and 1.3 ms with one, on a 2-core VM running other work
(docs/benchmarks.md, "Training steps"). `distserver serve` therefore gives BLAS
half of this task's share of the host's cores when tasks share the host
(`threads_per_local_task`: one thread for each of three tasks on this 2-core VM),
and every core to a task alone on it (two here, 32 on 32 cores), unless told
otherwise (`--blas-threads`, or OPENBLAS_NUM_THREADS / OMP_NUM_THREADS set by the
user, which OpenBLAS reads itself).
"""

from __future__ import annotations

import ctypes
import os
import socket
from collections.abc import Iterable
from typing import Any

# Setter names of the OpenBLAS builds numpy ships or links (scipy-openblas renames them).
_GETTERS = (
    "scipy_openblas_get_num_threads64_",
    "scipy_openblas_get_num_threads",
    "openblas_get_num_threads64_",
    "openblas_get_num_threads",
)
_CORE_NAMES = (
    "scipy_openblas_get_corename64_",
    "scipy_openblas_get_corename",
    "openblas_get_corename64_",
    "openblas_get_corename",
)
_SETTERS = (
    "scipy_openblas_set_num_threads64_",
    "scipy_openblas_set_num_threads",
    "openblas_set_num_threads64_",
    "openblas_set_num_threads",
)


def threads_per_local_task(addresses: Iterable[str], cpus: int) -> int:
    """Every one of `cpus` for a task alone on this host, as TensorFlow's intra-op pool
    takes; else half of this task's share of `cpus` among the tasks of `addresses` on
    this host, at least one (a task whose host is not recognised as this one does not
    count).

    Half: the task's own kernel pool, event loop and transport threads use the rest,
    and the other tasks' products run at the same time as this one's. A lone task's
    kernels mostly wait for each other: its large products are where the cores go
    (a one-task mlp step, 2 CPUs: 4.8 ms with one BLAS thread and the intra-op
    helper, 3.8 ms with two).
    """
    local = local_tasks(addresses)
    if local <= 1:
        return max(1, cpus)
    return max(1, cpus // local // 2)


def local_tasks(addresses: Iterable[str]) -> int:
    """How many of the tasks at `addresses` run on this host (an address whose host is
    not recognised as this one does not count)."""
    local_names = {"localhost", "127.0.0.1", "::1", "0.0.0.0", socket.gethostname()}
    local = 0
    for address in addresses:
        host = address.rpartition(":")[0].strip("[]") if ":" in address else address
        if host in local_names or host.startswith("127."):
            local += 1
    return local


def user_chose_threads() -> bool:
    """Whether the environment already sets OpenBLAS's thread count."""
    return any(os.environ.get(name) for name in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS"))


def set_blas_threads(threads: int) -> bool:
    """Set the thread count of every OpenBLAS this process has loaded (numpy's included).

    Returns whether one was found. Imports numpy first, so its BLAS is loaded.
    """
    if threads < 1:
        raise ValueError(f"BLAS threads must be at least 1, not {threads}")
    import numpy  # noqa: F401 - loads numpy's BLAS

    found = False
    for path in loaded_openblas():
        try:
            library = ctypes.CDLL(path)
        except OSError:
            continue
        for name in _SETTERS:
            setter = getattr(library, name, None)
            if setter is not None:
                setter.argtypes = [ctypes.c_int]
                setter.restype = None
                setter(threads)
                found = True
                break
    return found


def blas_threads() -> int | None:
    """The thread count of the first loaded OpenBLAS, or None when there is none."""
    threads = _ask_openblas(_GETTERS, ctypes.c_int)
    return None if threads is None else int(threads)


def blas_kernels() -> str | None:
    """The kernels the first loaded OpenBLAS runs ("SkylakeX", "Haswell", ...): the
    ones it chose for this CPU, or those `OPENBLAS_CORETYPE` named when it was loaded.
    None when there is no OpenBLAS."""
    name = _ask_openblas(_CORE_NAMES, ctypes.c_char_p)
    return None if name is None else bytes(name).decode(errors="replace")


def describe_kernels(kernels: str | None, coretype: str | None) -> str:
    """Which BLAS kernels run a process's products, and what chose them: `kernels` as
    `blas_kernels()` names them, `coretype` the OPENBLAS_CORETYPE of that process."""
    if kernels is None:
        return "numpy's BLAS is not OpenBLAS"
    chosen = f" (OPENBLAS_CORETYPE={coretype} in the environment chose them)" if coretype else ""
    return f"OpenBLAS's {kernels} kernels{chosen}"


def _ask_openblas(getters: tuple[str, ...], restype: Any) -> Any:
    """The answer of the first of `getters` that the first loaded OpenBLAS has."""
    import numpy  # noqa: F401 - loads numpy's BLAS

    for path in loaded_openblas():
        try:
            library = ctypes.CDLL(path)
        except OSError:
            continue
        for name in getters:
            getter = getattr(library, name, None)
            if getter is not None:
                getter.restype = restype
                return getter()
    return None


def loaded_openblas() -> list[str]:
    """Paths of the loaded shared objects whose name says OpenBLAS (Linux only)."""
    try:
        with open("/proc/self/maps") as maps:
            fields = [line.split(maxsplit=5) for line in maps]
        paths = {f[5].strip() for f in fields if len(f) == 6}
    except OSError:
        return []
    return sorted(p for p in paths if "openblas" in os.path.basename(p).lower() and ".so" in p)
