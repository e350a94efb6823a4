"""FIFO queue kernels: ordering, waiting, cancellation, closing, timeouts, validation."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from distserver import errors
from distserver.kernels import create_kernel
from distserver.kernels.resources import FIFOQueue, RandomShuffleQueue, ResourceManager

F32 = np.float32


class QueueOps:
    """Runs queue kernels on one context, as the executor would."""

    def __init__(self, make_node, ctx):
        self.make_node = make_node
        self.ctx = ctx

    async def run(self, op, *inputs, name=None, **attrs):
        node = self.make_node(op, [f"input_{i}" for i in range(len(inputs))], name=name, **attrs)
        kernel = create_kernel(node)
        assert kernel.is_async
        return await kernel.compute_async(self.ctx, [np.asarray(x) for x in inputs])

    async def create(self, shared_name="q", types=(F32,), shapes=((),), capacity=-1, name="fifo"):
        (handle,) = await self.run(
            "FIFOQueueV2",
            name=name,
            component_types=list(types),
            shapes=list(shapes),
            capacity=capacity,
            shared_name=shared_name,
        )
        return handle

    def queue(self, handle) -> FIFOQueue:
        resource = handle[()]
        return self.ctx.resources.lookup(resource.container, resource.name)

    async def enqueue(self, handle, *values, **attrs):
        values = [np.asarray(v, F32) if isinstance(v, float | int) else v for v in values]
        return await self.run(
            "QueueEnqueueV2", handle, *values, Tcomponents=[v.dtype for v in values], **attrs
        )

    async def enqueue_many(self, handle, *values):
        return await self.run("QueueEnqueueManyV2", handle, *values, Tcomponents=[v.dtype for v in values])

    async def dequeue(self, handle, types=(F32,), **attrs):
        return await self.run("QueueDequeueV2", handle, name="dequeue", component_types=list(types), **attrs)

    async def dequeue_many(self, handle, n, types=(F32,), **attrs):
        return await self.run(
            "QueueDequeueManyV2",
            handle,
            np.int32(n),
            name="dequeue_many",
            component_types=list(types),
            **attrs,
        )

    async def close(self, handle, cancel_pending_enqueues=False):
        return await self.run("QueueCloseV2", handle, cancel_pending_enqueues=cancel_pending_enqueues)

    async def size(self, handle):
        (size,) = await self.run("QueueSizeV2", handle)
        assert size.dtype == np.int32
        return int(size)


@pytest.fixture
def ops(make_node, ctx):
    return QueueOps(make_node, ctx)


async def waiting(coroutine):
    """Start `coroutine` as a task and check that it is blocked (not finished)."""
    task = asyncio.ensure_future(coroutine)
    for _ in range(3):  # the kernels reach their wait without any real suspension
        await asyncio.sleep(0)
    assert not task.done()
    return task


async def test_fifo_order_and_size(ops):
    q = await ops.create()
    for value in (1.0, 2.0, 3.0):
        assert await ops.enqueue(q, value) == []
    assert await ops.size(q) == 3
    got = [float((await ops.dequeue(q))[0]) for _ in range(3)]
    assert got == [1.0, 2.0, 3.0]
    assert await ops.size(q) == 0


async def test_dequeue_waits_for_a_later_enqueue(ops):
    q = await ops.create()
    task = await waiting(ops.dequeue(q))
    await ops.enqueue(q, 42.0)
    (value,) = await task
    assert value == 42.0
    assert value.dtype == np.float32


async def test_waiting_dequeues_are_served_in_order(ops):
    q = await ops.create()
    first = await waiting(ops.dequeue(q))
    second = await waiting(ops.dequeue(q))
    await ops.enqueue(q, 1.0)
    await ops.enqueue(q, 2.0)
    assert float((await first)[0]) == 1.0
    assert float((await second)[0]) == 2.0


async def test_cancelled_dequeue_leaves_queue_usable(ops):
    q = await ops.create()
    task = await waiting(ops.dequeue(q))
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await ops.enqueue(q, 7.0)
    assert await ops.size(q) == 1  # the cancelled dequeue did not take it
    assert float((await ops.dequeue(q))[0]) == 7.0


async def test_cancelled_dequeue_many_puts_collected_elements_back(ops):
    q = await ops.create()
    task = await waiting(ops.dequeue_many(q, 3))
    await ops.enqueue(q, 1.0)
    await ops.enqueue(q, 2.0)
    assert await ops.size(q) == 0  # collected by the waiting DequeueMany
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await ops.size(q) == 2
    assert [float((await ops.dequeue(q))[0]) for _ in range(2)] == [1.0, 2.0]


async def test_dequeue_timeout(ops):
    q = await ops.create()
    with pytest.raises(errors.DeadlineExceededError) as info:
        await ops.dequeue(q, timeout_ms=20)
    assert info.value.node_name == "dequeue"
    await ops.enqueue(q, 1.0)
    assert float((await ops.dequeue(q, timeout_ms=20))[0]) == 1.0


async def test_enqueue_timeout_on_full_queue(ops):
    q = await ops.create(capacity=1)
    await ops.enqueue(q, 1.0)
    with pytest.raises(errors.DeadlineExceededError):
        await ops.enqueue(q, 2.0, timeout_ms=20)
    assert await ops.size(q) == 1
    assert float((await ops.dequeue(q))[0]) == 1.0


async def test_closed_empty_queue_errors(ops):
    q = await ops.create()
    await ops.close(q)
    with pytest.raises(errors.OutOfRangeError) as info:
        await ops.dequeue(q)
    assert info.value.message == (
        "FIFOQueue 'q' is closed and has insufficient elements (requested 1, current size 0)"
        "\n\t [[{{node dequeue}}]]"
    )
    assert info.value.node_name == "dequeue"
    with pytest.raises(errors.CancelledError, match=r"FIFOQueue 'q' is closed."):
        await ops.enqueue(q, 1.0)
    with pytest.raises(errors.AbortedError, match=r"Queue 'q' is already closed."):
        await ops.close(q)
    await ops.close(q, cancel_pending_enqueues=True)  # no error with cancellation


async def test_close_wakes_a_waiting_dequeue(ops):
    q = await ops.create()
    task = await waiting(ops.dequeue(q))
    await ops.close(q)
    with pytest.raises(errors.OutOfRangeError, match="is closed and has insufficient elements"):
        await task


async def test_closed_queue_drains_first(ops):
    q = await ops.create()
    await ops.enqueue(q, 1.0)
    await ops.enqueue(q, 2.0)
    await ops.close(q)
    assert [float((await ops.dequeue(q))[0]) for _ in range(2)] == [1.0, 2.0]
    with pytest.raises(errors.OutOfRangeError):
        await ops.dequeue(q)


async def test_full_queue_blocks_enqueue_until_dequeue(ops):
    q = await ops.create(capacity=1)
    await ops.enqueue(q, 1.0)
    task = await waiting(ops.enqueue(q, 2.0))
    assert float((await ops.dequeue(q))[0]) == 1.0
    assert await task == []
    assert float((await ops.dequeue(q))[0]) == 2.0


async def test_close_cancels_pending_enqueues_when_asked(ops):
    q = await ops.create(capacity=1)
    await ops.enqueue(q, 1.0)
    task = await waiting(ops.enqueue(q, 2.0))
    await ops.close(q, cancel_pending_enqueues=True)
    with pytest.raises(errors.CancelledError, match="Enqueue operation was cancelled"):
        await task
    assert float((await ops.dequeue(q))[0]) == 1.0
    with pytest.raises(errors.OutOfRangeError):
        await ops.dequeue(q)


async def test_close_waits_behind_pending_enqueues(ops):
    q = await ops.create(capacity=1)
    await ops.enqueue(q, 1.0)
    enqueue = await waiting(ops.enqueue(q, 2.0))
    close = await waiting(ops.close(q))  # TF orders the close after the pending enqueue
    assert float((await ops.dequeue(q))[0]) == 1.0
    await enqueue
    await close
    assert float((await ops.dequeue(q))[0]) == 2.0
    with pytest.raises(errors.OutOfRangeError):
        await ops.dequeue(q)


async def test_close_and_cancel_from_another_thread_wakes_the_loop(ops):
    q = await ops.create(capacity=1)
    await ops.enqueue(q, 1.0)
    task = await waiting(ops.enqueue(q, 2.0))
    await asyncio.to_thread(ops.queue(q).close_and_cancel)
    with pytest.raises(errors.CancelledError):
        await task


async def test_enqueue_many_and_dequeue_many(ops):
    types = (F32, np.int32)
    q = await ops.create(types=types, shapes=[(2,), ()])
    await ops.enqueue_many(q, np.arange(6, dtype=F32).reshape(3, 2), np.array([10, 11, 12], np.int32))
    assert await ops.size(q) == 3
    floats, ints = await ops.dequeue_many(q, 2, types)
    np.testing.assert_array_equal(floats, [[0, 1], [2, 3]])
    np.testing.assert_array_equal(ints, [10, 11])
    last = await ops.dequeue(q, types)
    np.testing.assert_array_equal(last[0], [4, 5])
    assert last[1].shape == ()
    assert last[1] == 12
    empty = await ops.dequeue_many(q, 0, types)
    assert [e.shape for e in empty] == [(0, 2), (0,)]


async def test_enqueue_many_larger_than_capacity_fills_as_room_frees(ops):
    q = await ops.create(capacity=2)
    task = await waiting(ops.enqueue_many(q, np.arange(5, dtype=F32)))
    assert await ops.size(q) == 2
    (values,) = await ops.dequeue_many(q, 5)
    await task
    np.testing.assert_array_equal(values, np.arange(5))


async def test_dequeue_many_from_closed_queue_keeps_elements(ops):
    q = await ops.create()
    await ops.enqueue(q, 1.0)
    await ops.close(q)
    with pytest.raises(errors.OutOfRangeError, match=r"\(requested 2, current size 1\)"):
        await ops.dequeue_many(q, 2)
    assert await ops.size(q) == 1


async def test_dequeue_many_needs_shapes(ops):
    q = await ops.create(shapes=())
    with pytest.raises(errors.InvalidArgumentError, match="require the components to have specified shapes"):
        await ops.dequeue_many(q, 1)


async def test_enqueue_validation(ops):
    q = await ops.create(shapes=[(2,)])
    with pytest.raises(
        errors.InvalidArgumentError, match=r"Type mismatch in tuple component 0. Expected float, got int32"
    ):
        await ops.enqueue(q, np.zeros(2, np.int32))
    with pytest.raises(
        errors.InvalidArgumentError, match=r"Shape mismatch in tuple component 0. Expected \[2\], got \[3\]"
    ):
        await ops.enqueue(q, np.zeros(3, F32))
    with pytest.raises(
        errors.InvalidArgumentError, match=r"Wrong number of components in tuple. Expected 1, got 2"
    ):
        await ops.enqueue(q, np.zeros(2, F32), np.zeros(2, F32))
    with pytest.raises(errors.InvalidArgumentError, match=r"Expected \[3,2\], got \[3,3\]"):
        await ops.enqueue_many(q, np.zeros((3, 3), F32))
    assert await ops.size(q) == 0


async def test_enqueue_stores_a_copy(ops):
    q = await ops.create(shapes=[(2,)])
    value = np.array([1.0, 2.0], F32)
    await ops.enqueue(q, value)
    value[:] = 0
    np.testing.assert_array_equal((await ops.dequeue(q))[0], [1.0, 2.0])


async def test_shared_queue_must_match(ops):
    await ops.create(capacity=10)
    with pytest.raises(
        errors.InvalidArgumentError, match="Shared queue 'q' has capacity 10 but requested capacity was 5"
    ):
        await ops.create(capacity=5)
    with pytest.raises(
        errors.InvalidArgumentError,
        match="has component types float but requested component types were int32",
    ):
        await ops.create(capacity=10, types=(np.int32,))
    same = await ops.create(capacity=10)
    assert same[()].name == "q"


async def test_anonymous_queues_are_private_to_their_kernel(make_node, ctx):
    node = make_node("FIFOQueueV2", name="fifo", component_types=[F32], shapes=[], capacity=-1)
    first, second = create_kernel(node), create_kernel(node)
    (a,) = await first.compute_async(ctx, [])
    (a_again,) = await first.compute_async(ctx, [])
    (b,) = await second.compute_async(ctx, [])
    assert a[()] == a_again[()]
    assert a[()].name != b[()].name
    assert a[()].name.endswith("_fifo")


async def test_missing_queue_is_not_found(ops, ctx):

    q = await ops.create()
    ctx.resources = ResourceManager()
    with pytest.raises(
        errors.NotFoundError, match=r"Resource localhost/q/N10tensorflow14QueueInterfaceE does not exist."
    ):
        await ops.size(q)


async def test_dequeue_type_signature_must_match(ops):
    q = await ops.create()
    with pytest.raises(errors.InvalidArgumentError, match="holds components of types"):
        await ops.dequeue(q, types=(np.int32,))


async def test_a_shuffle_queue_keeps_min_after_dequeue_until_closed():
    queue = RandomShuffleQueue("shuffled", [F32], [()], 10, min_after_dequeue=3, seed=1)
    await queue.enqueue([(np.float32(i),) for i in range(5)])
    taken = await queue.dequeue(2, timeout=5)  # 5 - 3 may go
    with pytest.raises(errors.DeadlineExceededError, match="RandomShuffleQueue 'shuffled'"):
        await queue.dequeue(1, timeout=0.05)
    await queue.close()
    rest = await queue.dequeue(3, timeout=5)
    assert sorted(float(e[0]) for e in taken + rest) == [0, 1, 2, 3, 4]


async def test_dequeue_up_to_takes_what_a_closed_queue_has_left():
    queue = FIFOQueue("up_to", [F32], [()], 10)
    await queue.enqueue([(np.float32(i),) for i in range(3)])
    assert len(await queue.dequeue(2, timeout=5, allow_fewer=True)) == 2
    await queue.close()
    assert [float(e[0]) for e in await queue.dequeue(5, timeout=5, allow_fewer=True)] == [2.0]
    with pytest.raises(errors.OutOfRangeError, match="is closed and has insufficient elements"):
        await queue.dequeue(5, timeout=5, allow_fewer=True)
