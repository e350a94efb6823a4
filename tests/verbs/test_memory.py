"""Memory regions and the region pool: memfd, seals, pre-faulting, keys, bounds, lifetimes."""

from __future__ import annotations

import asyncio
import fcntl
import gc
import math
import mmap
import os
import threading

import numpy as np
import pytest

from distserver import errors
from distserver.transports import verbs
from distserver.transports.verbs._memory import MIN_COPY_PIECE, SharedCopy, wait_offloaded


def _rss_of_mapping(region: verbs.MemoryRegion) -> int:
    """Resident bytes of the region's mapping in this process (from /proc/self/smaps)."""
    name = f"distserver-verbs-{os.getpid()}-mr{region.id} "
    with open("/proc/self/smaps") as smaps:
        lines = smaps.read().splitlines()
    for i, line in enumerate(lines):
        if name in line + " ":
            for detail in lines[i + 1 :]:
                if detail.startswith("Rss:"):
                    return int(detail.split()[1]) * 1024
    raise AssertionError(f"no mapping of region {region.id}")


async def test_region_is_a_sealed_prefaulted_memfd(pd):
    region = pd.register(3 * mmap.PAGESIZE + 1)
    assert region.nbytes == 4 * mmap.PAGESIZE  # whole pages
    target = os.readlink(f"/proc/self/fd/{region.fd}")
    assert target.startswith(f"/memfd:distserver-verbs-{os.getpid()}-mr{region.id}")
    seals = fcntl.fcntl(region.fd, fcntl.F_GET_SEALS)
    assert seals & fcntl.F_SEAL_SHRINK
    assert seals & fcntl.F_SEAL_GROW
    assert seals & fcntl.F_SEAL_SEAL
    with pytest.raises(PermissionError):
        os.ftruncate(region.fd, 0)
    assert _rss_of_mapping(region) == region.nbytes  # every page is mapped already
    assert not os.get_inheritable(region.fd)  # MFD_CLOEXEC


async def test_large_registration_is_prefaulted_off_the_loop(pd):
    region = await pd.register_async(64 << 20)
    assert _rss_of_mapping(region) == region.nbytes


async def test_ids_and_keys_are_unique(pd):
    regions = [pd.register(4096) for _ in range(20)]
    assert len({r.id for r in regions}) == 20
    assert len({r.key for r in regions}) == 20
    assert all(len(r.key) == 16 for r in regions)
    assert pd.region(regions[3].id) is regions[3]
    regions[3].close()
    with pytest.raises(errors.NotFoundError):
        pd.region(regions[3].id)
    assert pd.register(4096).id not in {r.id for r in regions}  # ids are never reused


async def test_views_are_bounds_checked(pd):
    region = pd.register(8192)
    view = region.view(8000, 192)
    view[:] = b"\x07" * 192
    assert region.array(np.uint8, (192,), offset=8000).sum() == 7 * 192
    for offset, length in [(8000, 193), (-1, 1), (0, 8193), (8192, 1)]:
        with pytest.raises(ValueError, match="outside memory region"):
            region.view(offset, length)
    with pytest.raises(ValueError, match="outside memory region"):
        region.array(np.float64, (1025,))
    view.release()


async def test_access_checks(pd):
    region = pd.register(4096)
    region.check_access(region.key, 0, 4096)
    with pytest.raises(errors.PermissionDeniedError, match="wrong key"):
        region.check_access(bytes(16), 0, 1)
    with pytest.raises(errors.OutOfRangeError, match="outside the region"):
        region.check_access(region.key, 4000, 97)


async def test_close_with_live_arrays_defers_the_unmap(pd, probes):
    region = pd.register(4096)
    array = region.array(np.int32, (1024,))
    array[:] = 5
    before = probes.fd_table()
    region.close()
    assert region.closed
    assert set(before) - set(probes.fd_table())  # the memfd fd is closed at once
    assert region.mapped  # ...but the memory stays while the array needs it
    assert int(array.sum()) == 5 * 1024
    name = f"distserver-verbs-{os.getpid()}-mr{region.id} "
    assert any(name in line + " " for line in probes.verbs_mappings(os.getpid()))
    del array
    gc.collect()
    assert not region.mapped
    assert not any(name in line + " " for line in probes.verbs_mappings(os.getpid()))
    with pytest.raises(RuntimeError, match="closed"):
        region.view()


async def test_protection_domain_close_releases_everything(probes):
    before = probes.fd_table()
    pd = verbs.ProtectionDomain()
    regions = [pd.register(1 << 16) for _ in range(3)]
    pool = verbs.RegionPool(pd, region_bytes=1 << 20)
    piece = await pool.allocate(1000)
    await pd.close()
    assert all(r.closed for r in regions)
    assert piece.region.closed
    del piece
    gc.collect()
    assert probes.new_fds(before) == {}
    assert probes.verbs_mappings(os.getpid()) == []
    with pytest.raises(RuntimeError, match="protection domain is closed"):
        pd.register(10)
    await pd.close()  # idempotent


async def test_pool_allocates_aligned_slices_and_reuses_memory(pd):
    pool = verbs.RegionPool(pd, region_bytes=1 << 20)
    a = await pool.allocate(100)
    b = await pool.allocate(1000)
    assert a.region is b.region
    assert a.capacity == 128
    assert b.offset % verbs.ALIGNMENT == 0
    assert not (a.offset <= b.offset < a.offset + a.capacity)
    a.release()
    b.release()
    assert pool.statistics().allocated_bytes == 0
    c = await pool.allocate(1 << 20)  # the whole region: coalesced free space
    assert c.region is a.region
    assert c.offset == 0
    assert pool.statistics().regions_registered == 1
    c.release()


async def test_pool_grows_then_uses_dedicated_regions(pd):
    pool = verbs.RegionPool(pd, region_bytes=1 << 20, max_pooled_bytes=2 << 20)
    first = await pool.allocate(1 << 20)
    second = await pool.allocate(1 << 20)
    assert first.region is not second.region
    big = await pool.allocate(3 << 20)  # over the pooled budget: a dedicated region
    stats = pool.statistics()
    assert (stats.pooled_bytes, stats.dedicated_bytes, stats.regions) == (2 << 20, 3 << 20, 3)
    big_region = big.region
    big.release()
    assert big_region.closed  # dedicated regions go away with their slice
    first.release()
    # To stay within budget the pool lets go of idle pooled regions first.
    again = await pool.allocate(2 << 20)
    stats = pool.statistics()
    assert first.region.closed
    assert not second.region.closed
    assert (stats.pooled_bytes, stats.dedicated_bytes) == (1 << 20, 2 << 20)
    again.release()
    second.release()
    assert pool.statistics().live_slices == 0


async def test_try_allocate_never_grows(pd):
    pool = verbs.RegionPool(pd, region_bytes=1 << 20)
    assert pool.try_allocate(10) is None
    piece = await pool.allocate(10)
    other = pool.try_allocate(10)
    assert other is not None
    assert other.region is piece.region
    piece.release()
    other.release()


async def test_slice_views_hold_the_slice_until_collected(pd):
    pool = verbs.RegionPool(pd, region_bytes=1 << 20)
    piece = await pool.allocate(4096)
    array = piece.array(np.float32, (32, 32))
    derived = array[1:3, ::2].T  # numpy views of the view hold it too
    view = piece.view()
    piece.release()
    assert piece.released
    assert not piece.freed
    del array
    gc.collect()
    assert not piece.freed  # `derived` and `view` still point into it
    del derived
    gc.collect()
    assert not piece.freed
    view.release()
    del view
    gc.collect()
    assert piece.freed
    assert pool.statistics().allocated_bytes == 0
    with pytest.raises(RuntimeError, match="released"):
        piece.array(np.uint8, (1,))


async def test_slices_can_be_freed_from_another_thread(pd):
    pool = verbs.RegionPool(pd, region_bytes=1 << 20)
    pieces = [await pool.allocate(1000) for _ in range(50)]
    arrays = [p.array(np.uint8, (1000,)) for p in pieces]
    for p in pieces:
        p.release()

    def drop() -> None:
        arrays.clear()
        gc.collect()

    worker = threading.Thread(target=drop)
    worker.start()
    worker.join()
    assert pool.statistics().live_slices == 0
    assert all(p.freed for p in pieces)


async def test_pool_close_with_a_live_view(pd, probes):
    pool = verbs.RegionPool(pd, region_bytes=1 << 20)
    piece = await pool.allocate(64)
    array = piece.array(np.int64, (8,))
    array[:] = 3
    region = piece.region
    pool.close()
    assert region.closed
    assert region.mapped
    assert int(array.sum()) == 24
    piece.release()
    del array
    gc.collect()
    assert not region.mapped
    with pytest.raises(RuntimeError, match="pool is closed"):
        await pool.allocate(1)


async def test_invalid_sizes(pd):
    with pytest.raises(ValueError, match="positive size"):
        pd.register(0)
    pool = verbs.RegionPool(pd)
    with pytest.raises(ValueError, match="positive size"):
        await pool.allocate(0)


@pytest.mark.parametrize("nbytes", [0, 1, (1 << 20) - 1, 8 << 20, (16 << 20) + 3])
def test_a_shared_copy_covers_the_destination_once_with_any_number_of_threads(nbytes):

    source = np.random.default_rng(nbytes).integers(0, 256, nbytes, dtype=np.uint8)
    destination = bytearray(nbytes)
    then = []
    work = SharedCopy(memoryview(destination), source, nbytes, then=lambda: then.append(bytes(destination)))
    inline = work.run(limit=3 * MIN_COPY_PIECE)  # the event loop's bounded share
    assert inline == min(nbytes, 3 * MIN_COPY_PIECE) or nbytes <= MIN_COPY_PIECE
    threads = [threading.Thread(target=work.run) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert bytes(destination) == source.tobytes()
    assert then == ([source.tobytes()] if nbytes else [])  # once, with every byte in place


def test_a_shared_copy_takes_pieces_that_shrink_as_the_copy_ends():

    nbytes = 16 * MIN_COPY_PIECE
    work = SharedCopy(memoryview(bytearray(nbytes)), np.zeros(nbytes, np.uint8), nbytes)
    sizes = []
    while (piece := work._take(math.inf)) is not None:
        sizes.append(piece[1] - piece[0])
    # a share per participant (the loop and one thread), then halves, then the floor
    assert sizes == [8 * MIN_COPY_PIECE, 4 * MIN_COPY_PIECE, 2 * MIN_COPY_PIECE] + [MIN_COPY_PIECE] * 2


def test_a_shared_copy_keeps_a_strided_array_whole_and_off_a_bounded_loop():

    source = np.arange(2 * (8 << 20) // 4, dtype=np.float32).reshape(2, -1).T  # Fortran order
    destination = bytearray(source.nbytes)
    work = SharedCopy(memoryview(destination), source, source.nbytes)
    assert work.threads_wanted == 1
    assert work.run(limit=1 << 20) == 0  # too large for the loop's share
    assert work.run() == source.nbytes
    assert bytes(destination) == np.ascontiguousarray(source).tobytes()


def test_after_a_failed_piece_no_thread_takes_another():

    nbytes = 4 * MIN_COPY_PIECE
    read_only = memoryview(bytearray(nbytes)).toreadonly()  # every piece fails
    then = []
    work = SharedCopy(read_only, np.zeros(nbytes, np.uint8), nbytes, then=lambda: then.append(1))
    with pytest.raises(ValueError, match="read-only"):
        work.run()
    assert work.run() == 0  # the rest is abandoned, not copied by another thread
    assert then == []  # and no completion for a failed copy


async def test_wait_offloaded_waits_for_every_job_and_raises_the_first_error():

    loop = asyncio.get_running_loop()
    finished = []

    def job(i: int) -> None:
        threading.Event().wait(0.05 * (2 - i))
        finished.append(i)
        if i == 0:
            raise ValueError("piece 0 failed")

    jobs = [loop.run_in_executor(None, job, i) for i in range(2)]
    with pytest.raises(ValueError, match="piece 0 failed"):
        await wait_offloaded(jobs)
    assert sorted(finished) == [0, 1]  # the failure did not return before the other job ended
