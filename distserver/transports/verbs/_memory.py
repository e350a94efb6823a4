"""Registered memory: protection domains, memory regions and the region pool.

Every region is an anonymous `memfd` (never a file under /dev/shm), sealed against
shrinking and growing, mapped shared and pre-faulted. Because nothing is named, the
memory goes away with the last fd or mapping, so a crashed process leaks nothing.

Lifetime rule (why closing can be deferred): numpy arrays made with `np.frombuffer`
over a mapping keep the `mmap` object alive and exported, and `mmap.close()` refuses
(`BufferError`) while such exports exist. A region's `close()` therefore closes its fd
and drops its own reference to the mapping at once; the kernel mapping is removed
then, or -- when arrays over it are still alive -- when the last of them is garbage
collected. No code path ever unmaps memory that a live array points into.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import fcntl
import itertools
import math
import mmap
import os
import secrets
import threading
import weakref
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import numpy as np
from numpy.typing import DTypeLike, NDArray

from distserver import errors

__all__ = [
    "ALIGNMENT",
    "OFFLOAD_BYTES",
    "SHARED_COPY_BYTES",
    "MemoryRegion",
    "PoolSlice",
    "PoolStatistics",
    "ProtectionDomain",
    "RegionPool",
]

PAGE_SIZE = mmap.PAGESIZE
ALIGNMENT = 64
"""Byte alignment of every pool slice (enough for any numpy dtype and a cache line)."""

OFFLOAD_BYTES = 1 << 20
"""Copies and registrations larger than this run in the executor, off the event loop."""
MIN_COPY_PIECE = 1 << 20
"""The smallest piece a shared copy is cut into as threads take them (`SharedCopy`)."""
COPY_THREADS = max(1, min(4, os.cpu_count() or 1))
"""Executor threads that copy one large write together."""
SHARED_COPY_BYTES = 4 << 20
"""A copy up to this size the event loop makes alone: a thread's share of it would
end in a GIL hand-off (50-150 us when both threads want the GIL at once) costing more
than the share saves (a 1.6 MiB copy: ~130 us alone, the shared one done ~250 us
after it started, traced in a training step)."""
INLINE_COPY_BYTES = 12 << 20
"""How much of one large write the event loop copies itself while the threads start
(at most ~0.8 ms of copying: a bounded stall, and the threads' wake-up is hidden)."""

KEY_BYTES = 16  # 128-bit keys, like an unguessable rkey
_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL

T = TypeVar("T")


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def memfd_name(kind: str) -> str:
    """The memfd name (visible in /proc/<pid>/maps): names the owning process."""
    return f"distserver-verbs-{os.getpid()}-{kind}"


def create_shared_mapping(name: str, size: int) -> tuple[int, mmap.mmap]:
    """A sealed memfd of `size` bytes (a page multiple) and a pre-faulted shared mapping of it.

    Raises:
        ResourceExhaustedError: the kernel refused the memory.
    """
    try:
        fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    except OSError as exc:
        raise errors.ResourceExhaustedError(f"memfd_create({name!r}) failed: {exc}") from exc
    try:
        os.ftruncate(fd, size)
        # Sealed: a peer holding the fd can neither shrink it (which would turn our
        # accesses into SIGBUS) nor grow it.
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
        # MAP_POPULATE allocates and maps every page now: first-touch faults on a fresh
        # memfd make copies ~15x slower, so registration pays them once.
        mapping = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
    except OSError as exc:
        os.close(fd)
        raise errors.ResourceExhaustedError(f"cannot register {size} bytes of shared memory: {exc}") from exc
    except BaseException:
        os.close(fd)
        raise
    return fd, mapping


def map_peer_fd(fd: int, size: int, what: str) -> mmap.mmap:
    """Map a memfd received from a peer, after checking it cannot shrink under us.

    Pre-faulted (MAP_POPULATE): the pages exist already, but this process's page
    tables do not, and first-touch faults would make the first copy ~20x slower.

    Raises:
        InternalError: the fd is too small or not sealed against shrinking.
    """
    st = os.fstat(fd)
    if st.st_size < size:
        raise errors.InternalError(f"{what}: the peer's fd holds {st.st_size} bytes, it announced {size}")
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError as exc:
        raise errors.InternalError(f"{what}: the peer sent an fd that is not a memfd ({exc})") from exc
    if not seals & fcntl.F_SEAL_SHRINK:
        raise errors.InternalError(f"{what}: the peer's memfd is not sealed against shrinking")
    return mmap.mmap(fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)


def release_mapping(mapping: mmap.mmap) -> None:
    """Unmap now, or -- if arrays over it are alive -- when the last of them dies."""
    with contextlib.suppress(BufferError):
        mapping.close()
    # On BufferError the exporters hold the mmap object; dropping our reference lets
    # its deallocation unmap it once they are gone.


def check_access(
    *,
    what: str,
    nbytes: int,
    expected_key: bytes,
    key: bytes,
    offset: int,
    length: int,
) -> None:
    """The key and bounds check every remote access goes through (IBV_WC_REM_ACCESS_ERR).

    Raises:
        PermissionDeniedError: `key` is not the region's key.
        OutOfRangeError: `[offset, offset + length)` is not inside the region.
    """
    if not secrets.compare_digest(bytes(key), expected_key):
        raise errors.PermissionDeniedError(f"{what}: wrong key (IBV_WC_REM_ACCESS_ERR)")
    if offset < 0 or length < 0 or offset + length > nbytes:
        raise errors.OutOfRangeError(
            f"{what}: access [{offset}, {offset + length}) outside the region's {nbytes} bytes "
            "(IBV_WC_REM_ACCESS_ERR)"
        )


async def finish_offloaded(future: asyncio.Future[T]) -> tuple[T, bool]:
    """Await an executor job even through cancellation; returns (result, was_cancelled).

    A copy running in a thread cannot be stopped. Returning before it ends would let
    the caller free or reuse memory the thread still writes, so a cancellation is
    remembered and reported only after the job is over.
    """
    cancelled = await wait_offloaded([future])
    return future.result(), cancelled


async def wait_offloaded(futures: Sequence[asyncio.Future[Any]]) -> bool:
    """`finish_offloaded` for several jobs: waits for all of them, then raises the
    first job's error (CancelledError instead when the caller was cancelled
    meanwhile); returns whether the caller was cancelled."""
    cancelled = False
    while not all(future.done() for future in futures):
        try:
            await asyncio.wait(futures)
        except asyncio.CancelledError:
            cancelled = True
    for future in futures:
        if future.exception() is not None:
            if cancelled:
                raise asyncio.CancelledError
            future.result()
    return cancelled


class _RegionObserver(Protocol):
    def _local_region_closed(self, region_id: int) -> None: ...


class _AsyncResource(Protocol):
    async def close(self) -> None: ...


class ProtectionDomain:
    """The registered memory and queue pairs of one process.

    Contract:
        * `register(nbytes)` / `await register_async(nbytes)` create a `MemoryRegion`
          with an id unique within this domain (ids are never reused) and a fresh
          128-bit key.
        * Queue pairs, listeners and pools made with this domain belong to it.
        * `await close()` closes them all (queue pairs first, so no copy still runs),
          then every region. It is idempotent. Use it as `async with
          ProtectionDomain() as pd:`.
        * Large copies and registrations run in `executor` (None: the loop's default
          executor), never on the event loop.
        * Objects are used from one event loop; only the release of pool slices may
          happen on any thread (a numpy array can be garbage collected anywhere).
    """

    def __init__(self, *, executor: Executor | None = None) -> None:
        self._executor = executor
        self._ids = itertools.count(1)
        # Regions can be closed by a finalizer on any thread, even re-entrantly in the
        # middle of our own code (a GC run). So no lock (it could deadlock) and only
        # single, atomic dict operations: get, pop, set, copy.
        self._regions: dict[int, MemoryRegion] = {}
        self._resources: dict[int, _AsyncResource] = {}
        self._pools: weakref.WeakSet[RegionPool] = weakref.WeakSet()
        self._unmapping: set[asyncio.Future[None]] = set()
        self._closed = False

    @property
    def executor(self) -> Executor | None:
        return self._executor

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def regions(self) -> tuple[MemoryRegion, ...]:
        """The open regions of this domain."""
        return tuple(self._regions.copy().values())

    def region(self, region_id: int) -> MemoryRegion:
        """The open region with this id.

        Raises:
            NotFoundError: no open region has this id.
        """
        region = self._regions.get(region_id)
        if region is None:
            raise errors.NotFoundError(f"no open memory region {region_id} in this protection domain")
        return region

    def register(self, nbytes: int) -> MemoryRegion:
        """Register a new region of at least `nbytes` bytes (rounded up to whole pages).

        This allocates and pre-faults the memory, which takes time proportional to
        its size; from a coroutine use `register_async` for anything large.
        """
        size = self._checked_size(nbytes)
        region_id = next(self._ids)
        fd, mapping = create_shared_mapping(memfd_name(f"mr{region_id}"), size)
        return self._adopt(region_id, fd, mapping, size)

    async def register_async(self, nbytes: int) -> MemoryRegion:
        """`register`, with the allocation and pre-faulting of large regions off the loop."""
        size = self._checked_size(nbytes)
        if size <= OFFLOAD_BYTES:
            return self.register(size)
        region_id = next(self._ids)
        loop = asyncio.get_running_loop()
        job = loop.run_in_executor(self._executor, create_shared_mapping, memfd_name(f"mr{region_id}"), size)
        (fd, mapping), cancelled = await finish_offloaded(job)
        if cancelled or self._closed:
            mapping.close()
            os.close(fd)
            if cancelled:
                raise asyncio.CancelledError
            self._check_open()
        return self._adopt(region_id, fd, mapping, size)

    def _checked_size(self, nbytes: int) -> int:
        self._check_open()
        if nbytes <= 0:
            raise ValueError(f"a memory region needs a positive size, got {nbytes}")
        return round_up(nbytes, PAGE_SIZE)

    def _adopt(self, region_id: int, fd: int, mapping: mmap.mmap, size: int) -> MemoryRegion:
        region = MemoryRegion(self, region_id, fd, mapping, size)
        self._regions[region_id] = region
        return region

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the protection domain is closed; create a new ProtectionDomain")

    def _release_mapping(self, mapping: mmap.mmap) -> None:
        """`release_mapping`, but off the event loop for large mappings.

        Unmapping a populated 256 MiB shared mapping takes ~70 ms when it frees the
        pages (munmap releases the GIL, so a thread helps). Called on a loop thread, a
        large unmap goes to the executor; elsewhere (a finalizer on a worker thread) it
        runs inline. `wait_unmapped()` waits for the ones in flight.
        """
        if not mapping.closed and len(mapping) > OFFLOAD_BYTES:
            try:
                loop = asyncio.get_running_loop()
                job = loop.run_in_executor(self._executor, release_mapping, mapping)
            except RuntimeError:  # no running loop here, or its executor is shut down
                pass
            else:
                self._unmapping.add(job)
                job.add_done_callback(self._unmapping.discard)
                return
        release_mapping(mapping)

    async def wait_unmapped(self) -> None:
        """Wait until the large unmaps started on this loop are done."""
        while self._unmapping:
            await asyncio.gather(*self._unmapping, return_exceptions=True)

    def _forget_region(self, region_id: int) -> None:
        self._regions.pop(region_id, None)

    def _attach(self, resource: _AsyncResource) -> None:
        self._check_open()
        self._resources[id(resource)] = resource

    def _detach(self, resource: _AsyncResource) -> None:
        self._resources.pop(id(resource), None)

    def _attach_pool(self, pool: RegionPool) -> None:
        self._check_open()
        self._pools.add(pool)

    async def close(self) -> None:
        """Close every queue pair, listener, pool and region of this domain."""
        if self._closed:
            return
        self._closed = True
        # Queue pairs first: their close waits for copies in flight, which must not
        # find their memory gone.
        for resource in list(self._resources.values()):
            await resource.close()
        self._resources.clear()
        for pool in list(self._pools):
            pool.close()
        for region in self.regions:
            region.close()
        await self.wait_unmapped()

    async def __aenter__(self) -> ProtectionDomain:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()


class MemoryRegion:
    """A registered, shared, pre-faulted block of memory (like `ibv_reg_mr`).

    Contract:
        * `id` is unique in its protection domain; `key` is 16 random bytes that a peer
          must present to write or read it (`check_access`). The key guards against
          stale or misdirected requests; a peer that holds the fd could bypass it, so
          it is not a defence against a hostile process of the same user.
        * The memory is a sealed memfd: a peer that maps it can neither shrink nor
          grow it. `fd` stays open while the region is open so the region can be
          exposed to more peers later.
        * `view(offset, length)` and `array(dtype, shape, offset)` are bounds-checked
          and pin the mapping (see the module docstring).
        * `close()` closes the fd, tells the peers the region was exposed to, and
          unmaps the memory now or when its last array dies. Idempotent; also a
          context manager.
    """

    def __init__(self, pd: ProtectionDomain, region_id: int, fd: int, mapping: mmap.mmap, nbytes: int):
        self._pd = pd
        self.id = region_id
        self.key = secrets.token_bytes(KEY_BYTES)
        self.nbytes = nbytes
        self._fd: int | None = fd
        self._mapping: mmap.mmap | None = mapping
        self._mapping_ref = weakref.ref(mapping)
        self._observers: weakref.WeakSet[_RegionObserver] = weakref.WeakSet()
        self._lock = threading.RLock()  # RLock: a finalizer may re-enter during a GC run

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return f"<MemoryRegion {self.id} {self.nbytes} bytes {state}>"

    @property
    def closed(self) -> bool:
        return self._mapping is None

    @property
    def mapped(self) -> bool:
        """True while the memory is mapped in this process (after `close()`: while arrays pin it)."""
        return self._mapping_ref() is not None

    @property
    def fd(self) -> int:
        """The memfd, to pass to a peer. Raises RuntimeError when the region is closed."""
        if self._fd is None:
            raise RuntimeError(f"memory region {self.id} is closed")
        return self._fd

    def _live_mapping(self) -> mmap.mmap:
        mapping = self._mapping
        if mapping is None:
            raise RuntimeError(f"memory region {self.id} is closed")
        return mapping

    def _check_bounds(self, offset: int, length: int) -> None:
        if offset < 0 or length < 0 or offset + length > self.nbytes:
            raise ValueError(
                f"[{offset}, {offset + length}) is outside memory region {self.id} ({self.nbytes} bytes)"
            )

    def view(self, offset: int = 0, length: int | None = None) -> memoryview:
        """A writable memoryview of `[offset, offset + length)` (default: to the end)."""
        if length is None:
            length = self.nbytes - offset
        self._check_bounds(offset, length)
        return memoryview(self._live_mapping())[offset : offset + length]

    def array(self, dtype: DTypeLike, shape: Sequence[int], offset: int = 0) -> NDArray[Any]:
        """A writable numpy array over the region's memory (no copy)."""
        dt = np.dtype(dtype)
        count = math.prod(shape)
        self._check_bounds(offset, count * dt.itemsize)
        return np.frombuffer(self._live_mapping(), dtype=dt, count=count, offset=offset).reshape(shape)

    def check_access(self, key: bytes, offset: int, length: int) -> None:
        """Raise the error a peer would get for this access (wrong key, out of bounds)."""
        check_access(
            what=f"memory region {self.id}",
            nbytes=self.nbytes,
            expected_key=self.key,
            key=key,
            offset=offset,
            length=length,
        )

    def _observe(self, observer: _RegionObserver) -> None:
        with self._lock:
            self._observers.add(observer)

    def _unobserve(self, observer: _RegionObserver) -> None:
        with self._lock:
            self._observers.discard(observer)

    def close(self) -> None:
        """Release the region (see the class docstring). Safe from any thread."""
        with self._lock:
            mapping, fd = self._mapping, self._fd
            self._mapping = self._fd = None
            observers = list(self._observers)
            self._observers.clear()
        if mapping is None:
            return
        self._pd._forget_region(self.id)
        for observer in observers:
            observer._local_region_closed(self.id)
        if fd is not None:
            os.close(fd)
        self._pd._release_mapping(mapping)

    def __enter__(self) -> MemoryRegion:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class _Arena:
    """First-fit allocator over one pooled region: a sorted list of free extents."""

    def __init__(self, region: MemoryRegion) -> None:
        self.region = region
        self.free: list[tuple[int, int]] = [(0, region.nbytes)]
        self.used = 0

    def take(self, size: int) -> int | None:
        for i, (offset, length) in enumerate(self.free):
            if length >= size:
                if length == size:
                    del self.free[i]
                else:
                    self.free[i] = (offset + size, length - size)
                self.used += size
                return offset
        return None

    def give(self, offset: int, size: int) -> None:
        self.used -= size
        i = bisect.bisect(self.free, (offset, size))
        # Coalesce with the neighbours so the region does not fragment for good.
        if i < len(self.free) and offset + size == self.free[i][0]:
            size += self.free.pop(i)[1]
        if i > 0 and self.free[i - 1][0] + self.free[i - 1][1] == offset:
            prev_offset, prev_size = self.free[i - 1]
            self.free[i - 1] = (prev_offset, prev_size + size)
        else:
            self.free.insert(i, (offset, size))


@dataclass(frozen=True)
class PoolStatistics:
    """A snapshot of a `RegionPool`."""

    regions: int
    pooled_bytes: int
    dedicated_bytes: int
    allocated_bytes: int
    live_slices: int
    allocations: int
    regions_registered: int


class PoolSlice:
    """A piece `[offset, offset + capacity)` of a registered region, handed out by a `RegionPool`.

    Contract:
        * `nbytes` is what was asked for, `capacity` that rounded up to `ALIGNMENT`.
        * `array(dtype, shape)` and `view()` give zero-copy views. Each view holds
          the slice: the memory goes back to the pool only when the owner called
          `release()` (or left the `with` block) *and* every view made from the slice
          (including numpy views of those views) has been garbage collected. So a
          view can never see its memory reused.
        * `release()` is idempotent; views cannot be made after it.
    """

    def __init__(
        self,
        pool: RegionPool,
        region: MemoryRegion,
        arena: _Arena | None,
        offset: int,
        nbytes: int,
        capacity: int,
    ) -> None:
        self._pool = pool
        self.region = region
        self._arena = arena
        self.offset = offset
        self.nbytes = nbytes
        self.capacity = capacity
        self._holds = 1  # the owner's; each view root adds one
        self._released = False
        # Guards two ints; nothing inside allocates, so no GC (and no finalizer) can
        # run while it is held.
        self._hold_lock = threading.Lock()

    def __repr__(self) -> str:
        return f"<PoolSlice region={self.region.id} offset={self.offset} nbytes={self.nbytes}>"

    @property
    def released(self) -> bool:
        """True once the owner released the slice (views may still hold the memory)."""
        return self._released

    @property
    def freed(self) -> bool:
        """True once the memory went back to the pool."""
        return self._holds == 0

    def array(self, dtype: DTypeLike, shape: Sequence[int]) -> NDArray[Any]:
        """A writable array over the slice's first bytes, holding the slice while it lives."""
        dt = np.dtype(dtype)
        count = math.prod(shape)
        if count * dt.itemsize > self.nbytes:
            raise ValueError(f"{count} x {dt} does not fit in a slice of {self.nbytes} bytes")
        with self._hold_lock:
            released = self._released
            if not released:
                self._holds += 1
        if released:
            raise RuntimeError("this pool slice was released; allocate a new one")
        try:
            root = np.frombuffer(self.region._live_mapping(), dtype=dt, count=count, offset=self.offset)
        except BaseException:
            self._drop_hold()
            raise
        # numpy collapses the base of every derived view to `root` (the first array
        # whose base is not an ndarray), so `root` lives exactly as long as any view.
        finalizer = weakref.finalize(root, self._drop_hold)
        finalizer.atexit = False
        return root.reshape(shape)

    def view(self) -> memoryview:
        """A writable byte view of the slice (holds the slice while it lives)."""
        return self.array(np.uint8, (self.nbytes,)).data

    def release(self) -> None:
        """Give up the owner's hold (see the class docstring). Safe from any thread."""
        with self._hold_lock:
            released = self._released
            self._released = True
        if not released:
            self._drop_hold()

    def _drop_hold(self) -> None:
        with self._hold_lock:
            self._holds -= 1
            last = self._holds == 0
        if last:
            self._pool._free(self)

    def __enter__(self) -> PoolSlice:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()


class RegionPool:
    """Slices of registered memory, from a few large regions registered once and reused.

    Registering memory is expensive (allocating and pre-faulting a fresh memfd runs at
    well under 1 GB/s), copying into registered memory is cheap; so, as TF verbs did
    with its allocator pools, tensors are placed inside long-lived regions.

    Contract:
        * `await allocate(nbytes)` returns a `PoolSlice` (first fit, `ALIGNMENT`-aligned).
          When no region has room, the pool registers a new one of `region_bytes` (or
          the request's size, when larger). While the pooled regions total at most
          `max_pooled_bytes` new regions join the pool; beyond that, wholly free
          pooled regions are released first, and if that is not enough the slice gets
          a dedicated region, released as soon as the slice is freed. The pool itself
          never blocks an allocation; bounding bytes in flight is the caller's job
          (`TensorEndpoint` does it).
        * `try_allocate(nbytes)` only uses room that exists (None otherwise).
        * Slices may be released from any thread.
        * `close()` closes every region (mappings that arrays still use are unmapped
          when those arrays die). Slices released afterwards are simply dropped.
    """

    def __init__(
        self,
        pd: ProtectionDomain,
        *,
        region_bytes: int = 64 << 20,
        max_pooled_bytes: int = 1 << 30,
    ) -> None:
        if region_bytes <= 0 or max_pooled_bytes < 0:
            raise ValueError("region_bytes must be positive and max_pooled_bytes non-negative")
        self._pd = pd
        self._region_bytes = round_up(region_bytes, PAGE_SIZE)
        self._max_pooled = max_pooled_bytes
        # Slices come back from finalizers, on any thread and even re-entrantly while
        # this thread is inside a guarded section (a GC run triggered by an
        # allocation there). Frees are therefore queued and applied by the outermost
        # guarded section of the current holder (see `_guard`).
        self._lock = threading.RLock()
        self._local = threading.local()
        self._frees: deque[PoolSlice] = deque()
        self._grow_lock: asyncio.Lock | None = None
        self._arenas: list[_Arena] = []
        self._dedicated: dict[int, MemoryRegion] = {}
        self._live_slices = 0
        self._allocations = 0
        self._registered = 0
        self._closed = False
        pd._attach_pool(self)

    @property
    def regions(self) -> tuple[MemoryRegion, ...]:
        """Every open region of the pool, pooled and dedicated."""
        with self._guard():
            return tuple(a.region for a in self._arenas) + tuple(self._dedicated.values())

    def statistics(self) -> PoolStatistics:
        with self._guard():
            return PoolStatistics(
                regions=len(self._arenas) + len(self._dedicated),
                pooled_bytes=sum(a.region.nbytes for a in self._arenas),
                dedicated_bytes=sum(r.nbytes for r in self._dedicated.values()),
                allocated_bytes=sum(a.used for a in self._arenas)
                + sum(r.nbytes for r in self._dedicated.values()),
                live_slices=self._live_slices,
                allocations=self._allocations,
                regions_registered=self._registered,
            )

    def try_allocate(self, nbytes: int) -> PoolSlice | None:
        """A slice from existing pooled room, or None when none has room."""
        capacity = self._capacity(nbytes)
        with self._guard():
            for arena in self._arenas:
                offset = arena.take(capacity)
                if offset is not None:
                    self._live_slices += 1
                    self._allocations += 1
                    return PoolSlice(self, arena.region, arena, offset, nbytes, capacity)
        return None

    async def allocate(self, nbytes: int) -> PoolSlice:
        """A slice of at least `nbytes` bytes (see the class docstring)."""
        found = self.try_allocate(nbytes)
        if found is not None:
            return found
        if self._grow_lock is None:
            self._grow_lock = asyncio.Lock()
        async with self._grow_lock:
            # Someone may have grown the pool or freed room while we waited.
            found = self.try_allocate(nbytes)
            if found is not None:
                return found
            capacity = self._capacity(nbytes)
            size = max(self._region_bytes, round_up(capacity, PAGE_SIZE))
            pooled = self._make_room(size)
            region = await self._pd.register_async(size)
            with self._guard():
                if self._closed:
                    region.close()
                    raise RuntimeError("the region pool is closed")
                self._registered += 1
                self._live_slices += 1
                self._allocations += 1
                if not pooled:
                    self._dedicated[region.id] = region
                    return PoolSlice(self, region, None, 0, nbytes, capacity)
                arena = _Arena(region)
                self._arenas.append(arena)
                offset = arena.take(capacity)
                assert offset == 0
                return PoolSlice(self, region, arena, offset, nbytes, capacity)

    def _capacity(self, nbytes: int) -> int:
        if self._closed:
            raise RuntimeError("the region pool is closed")
        if nbytes <= 0:
            raise ValueError(f"a pool slice needs a positive size, got {nbytes}")
        return round_up(nbytes, ALIGNMENT)

    def _make_room(self, size: int) -> bool:
        """Whether a new region of `size` bytes may join the pool, releasing idle regions if needed."""
        idle: list[MemoryRegion] = []
        with self._guard():
            pooled = sum(a.region.nbytes for a in self._arenas)
            for arena in list(self._arenas):
                if pooled + size <= self._max_pooled:
                    break
                if arena.used == 0:
                    self._arenas.remove(arena)
                    pooled -= arena.region.nbytes
                    idle.append(arena.region)
            fits = pooled + size <= self._max_pooled
        for region in idle:
            region.close()
        return fits

    @contextlib.contextmanager
    def _guard(self) -> Iterator[None]:
        with self._lock:
            depth = getattr(self._local, "depth", 0)
            self._local.depth = depth + 1
            try:
                yield
            finally:
                self._local.depth = depth
        if depth == 0 and self._frees:
            self._apply_frees()

    def _free(self, piece: PoolSlice) -> None:
        self._frees.append(piece)  # atomic; applied now unless a guarded section is open here
        if getattr(self._local, "depth", 0) == 0:
            self._apply_frees()

    def _apply_frees(self) -> None:
        dedicated: list[MemoryRegion] = []
        with self._lock:
            depth = getattr(self._local, "depth", 0)
            self._local.depth = depth + 1
            try:
                while self._frees:
                    piece = self._frees.popleft()
                    self._live_slices -= 1
                    if piece._arena is not None:
                        if piece._arena in self._arenas:
                            piece._arena.give(piece.offset, piece.capacity)
                    elif (region := self._dedicated.pop(piece.region.id, None)) is not None:
                        dedicated.append(region)
            finally:
                self._local.depth = depth
        for region in dedicated:
            region.close()

    def close(self) -> None:
        """Close every region of the pool (idempotent)."""
        with self._guard():
            self._closed = True
            regions = [a.region for a in self._arenas] + list(self._dedicated.values())
            self._arenas.clear()
            self._dedicated.clear()
        for region in regions:
            region.close()

    def __enter__(self) -> RegionPool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def copy_bytes(dst: memoryview, src: object) -> None:
    """Copy a bytes-like object or numpy array into `dst` (a byte view), in one pass.

    numpy arrays of any layout are copied element-wise into a C-ordered view of the
    destination (`np.copyto`, which releases the GIL), so a strided or Fortran-ordered
    tensor still costs exactly one copy.
    """
    if isinstance(src, np.ndarray):
        if src.size == 0:
            return
        target = np.frombuffer(dst, dtype=src.dtype, count=src.size).reshape(src.shape)
        np.copyto(target, src, casting="no")
        return
    source = as_byte_view(src)
    if source.nbytes:
        np.copyto(np.frombuffer(dst, dtype=np.uint8, count=source.nbytes), np.frombuffer(source, np.uint8))


class SharedCopy:
    """One large copy of `src` into `dst` that several threads share (`run`).

    One memcpy stream does not saturate memory bandwidth (two threads copied 16 MiB
    in 0.71 ms where one took 1.14 ms, 2-vCPU VM), and a pool thread takes ~0.1 ms to
    wake up; so the event loop copies too, up to a bound, while the threads start.
    Each take is the next `ceil(left / participants)` bytes, at least `MIN_COPY_PIECE`
    (guided scheduling: 8, 4, 2, 1, 1 MiB for 16 MiB and two participants), so few
    pieces -- each ends in a GIL hand-off, 50-150 µs when both threads want the GIL
    at once -- and participants that finish within a small piece of each other,
    however late a thread started. A strided array is one
    piece (`copy_bytes` handles its layout). After a failed piece no thread takes
    another; `run` raises that piece's error.

    `then`, if given, is called once by the thread that copies the last byte, as
    soon as every byte is in place (and not at all after a failure); its error is
    that `run`'s error. A completion posted there reaches the peer without waiting
    for the threads to hand back to the event loop (~0.1 ms).
    """

    def __init__(
        self,
        dst: memoryview,
        src: object,
        nbytes: int,
        *,
        then: Callable[[], None] | None = None,
    ) -> None:
        self._dst = dst
        self._src = src
        self._nbytes = nbytes
        self._flat: Any = None  # the source as contiguous bytes, when it is
        if isinstance(src, np.ndarray):
            if src.flags.c_contiguous:
                self._flat = src.reshape(-1).view(np.uint8)
        else:
            self._flat = np.frombuffer(as_byte_view(src), np.uint8)
        # Executor threads besides the event loop: the loop stands in for one of
        # `COPY_THREADS` when its share is a good part of the copy.
        wanted = COPY_THREADS if nbytes > 2 * INLINE_COPY_BYTES else max(1, COPY_THREADS - 1)
        self.threads_wanted = 1 if self._flat is None else wanted
        self._participants = self.threads_wanted + 1
        self._lock = threading.Lock()
        self._taken = 0
        self._unfinished = nbytes
        self._failed = False
        self._then = then

    def _take(self, budget: float) -> tuple[int, int] | None:
        """The next piece (start, stop), at most `budget` bytes; None when none is left."""
        with self._lock:
            left = self._nbytes - self._taken
            if self._failed or left <= 0:
                return None
            if self._flat is None:  # one piece, all or nothing
                size = left
            else:
                size = min(left, max(MIN_COPY_PIECE, -(-left // self._participants)))
                if size > budget >= MIN_COPY_PIECE:
                    size = int(budget)
            if size > budget:
                return None
            start = self._taken
            self._taken += size
            return start, start + size

    def run(self, limit: int | None = None) -> int:
        """Copy pieces until none is left (or `limit` bytes are copied); returns the bytes copied."""
        copied = 0
        while (piece := self._take(math.inf if limit is None else limit - copied)) is not None:
            start, stop = piece
            try:
                if self._flat is None:
                    copy_bytes(self._dst, self._src)
                else:
                    with self._dst[start:stop] as target:
                        copy_bytes(target, self._flat[start:stop])
            except BaseException:
                self._failed = True
                raise
            copied += stop - start
            with self._lock:
                self._unfinished -= stop - start
                last = not self._unfinished and not self._failed
            if last and self._then is not None:
                self._then()
        return copied


def as_byte_view(data: object) -> memoryview:
    """A flat byte memoryview of a C-contiguous bytes-like object."""
    view = memoryview(data)  # type: ignore[arg-type]
    if not view.c_contiguous:
        raise ValueError("the data must be C-contiguous (or pass a numpy array)")
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def nbytes_of(data: object) -> int:
    if isinstance(data, np.ndarray):
        return int(data.nbytes)
    return as_byte_view(data).nbytes


def checked_array(data: object) -> None:
    if isinstance(data, np.ndarray) and data.dtype.hasobject:
        raise TypeError(f"arrays of dtype {data.dtype} hold Python objects and cannot be copied as bytes")
