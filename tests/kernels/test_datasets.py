"""tf.data kernels (kernels/datasets.py) driven directly: seeded shuffles, repeat of an
empty dataset, bounds on buffers, iterator errors, anonymous iterators (owned by their
handles, deleted by DeleteIterator), GetNextAsOptional at the end, padded batches,
unbatch, the in-memory cache, prefetching ahead."""

from __future__ import annotations

import asyncio
import weakref

import numpy as np
import pytest

from distserver import errors
from distserver.kernels.datasets import (
    Batch,
    Cache,
    Dataset,
    ElementIterator,
    Interleave,
    IteratorResource,
    PaddedBatch,
    Prefetch,
    Range,
    Repeat,
    Shuffle,
    Tensors,
    TensorSlices,
    Unbatch,
)
from distserver.kernels.registry import create_kernel
from distserver.tensors import to_tensor_proto


async def drain(dataset):
    iterator, out = dataset.iterate(), []
    while (element := await iterator.next(None)) is not None:
        out.append([np.asarray(v).tolist() for v in element])
    return out


async def test_a_seeded_shuffle_is_a_repeatable_permutation_reshuffled_each_pass():
    shuffled = Shuffle(Range(0, 20, 1, np.dtype(np.int64)), 5, seed=3, seed2=4, reshuffle=True)
    first, second = await drain(shuffled), await drain(shuffled)
    assert sorted(first) == sorted(second) == [[i] for i in range(20)]
    assert first != second
    again = Shuffle(Range(0, 20, 1, np.dtype(np.int64)), 5, seed=3, seed2=4, reshuffle=True)
    assert await drain(again) == first


async def test_batches_repeat_and_an_empty_input_ends():
    slices = TensorSlices([np.arange(5, dtype=np.float32)])
    batches = await drain(Repeat(Batch(slices, 2, drop_remainder=True), 2))
    assert batches == [[[0, 1]], [[2, 3]], [[0, 1]], [[2, 3]]]
    assert await drain(Repeat(Range(0, 0, 1, np.dtype(np.int64)), -1)) == []  # not forever


def test_hostile_sizes_are_refused():
    with pytest.raises(errors.InvalidArgumentError, match="buffer_size"):
        Shuffle(Range(0, 1, 1, np.dtype(np.int64)), 1 << 40, 0, 0, True)
    with pytest.raises(errors.InvalidArgumentError, match="Batch size"):
        Batch(Range(0, 1, 1, np.dtype(np.int64)), 0, False)
    with pytest.raises(errors.InvalidArgumentError, match="same first dimension"):
        TensorSlices([np.arange(3), np.arange(4)])


async def test_an_iterator_says_uninitialized_then_end_of_sequence():
    resource = IteratorResource()
    with pytest.raises(errors.FailedPreconditionError, match="not been initialized"):
        await resource.next(None)
    resource.current = Range(0, 1, 1, np.dtype(np.int64)).iterate()
    assert (await resource.next(None))[0] == 0
    with pytest.raises(errors.OutOfRangeError, match="End of sequence"):
        await resource.next(None)


async def run_async(make_node, op, *inputs, ctx, **attrs):
    kernel = create_kernel(make_node(op, [f"input_{i}" for i in range(len(inputs))], **attrs))
    return await kernel.compute_async(ctx, list(inputs))


def range_dataset(stop):
    value = np.empty((), dtype=object)
    value[()] = Range(0, stop, 1, np.dtype(np.int64))
    return value


async def test_an_anonymous_iterator_is_new_each_run_and_owned_by_its_handle(make_node, ctx):
    (first,) = await run_async(make_node, "AnonymousIteratorV3", ctx=ctx)
    (second,) = await run_async(make_node, "AnonymousIteratorV3", ctx=ctx)
    assert first[()].name != second[()].name
    assert ctx.resources.containers() == []  # not in the task's resource manager
    await run_async(make_node, "MakeIterator", range_dataset(2), first, ctx=ctx)
    with pytest.raises(errors.FailedPreconditionError, match="not been initialized"):
        await run_async(make_node, "IteratorGetNext", second, ctx=ctx, output_types=[np.int64])
    (value,) = await run_async(make_node, "IteratorGetNext", first, ctx=ctx, output_types=[np.int64])
    assert int(value) == 0
    iterator = weakref.ref(first[()].iterator)
    del first
    assert iterator() is None  # the last copy of the handle took the iterator with it


async def test_get_next_as_optional_is_empty_at_the_end(make_node, ctx):
    (handle,) = await run_async(make_node, "AnonymousIteratorV3", ctx=ctx)
    await run_async(make_node, "MakeIterator", range_dataset(1), handle, ctx=ctx)
    got = []
    for _ in range(2):
        (optional,) = await run_async(
            make_node, "IteratorGetNextAsOptional", handle, ctx=ctx, output_types=[np.int64]
        )
        got.append(optional[()].components)
    assert [None if c is None else int(c[0]) for c in got] == [0, None]


async def test_delete_iterator_ends_an_anonymous_and_a_named_iterator(make_node, ctx):
    handle, deleter = await run_async(make_node, "AnonymousIteratorV2", ctx=ctx)
    await run_async(make_node, "MakeIterator", range_dataset(3), handle, ctx=ctx)
    await run_async(make_node, "DeleteIterator", handle, deleter, ctx=ctx)
    with pytest.raises(errors.NotFoundError, match="does not exist"):
        await run_async(make_node, "IteratorGetNext", handle, ctx=ctx, output_types=[np.int64])
    (named,) = await run_async(make_node, "IteratorV2", ctx=ctx, shared_name="it")
    assert ctx.resources.containers() == ["localhost"]
    await run_async(make_node, "DeleteIterator", named, deleter, ctx=ctx)
    assert ctx.resources.containers() == []


def test_a_dataset_says_it_cannot_cross_tasks():
    with pytest.raises(errors.UnimplementedError, match="cannot be sent to another task"):
        to_tensor_proto(range_dataset(3))


async def test_padded_batches_pad_each_component_to_its_shape_or_the_longest():
    rows = TensorSlices([np.array([[1, 2, 0], [3, 0, 0], [4, 5, 6]], np.int64)])
    ragged = Unbatch(
        PaddedBatch(rows, 1, [(3,)], [np.int64(0)], drop_remainder=False)
    )  # one row per element, shape [3]
    batches = await drain(PaddedBatch(ragged, 2, [(-1,)], [np.int64(-1)], drop_remainder=False))
    assert batches == [[[[1, 2, 0], [3, 0, 0]]], [[[4, 5, 6]]]]
    wide = await drain(PaddedBatch(ragged, 2, [(4,)], [np.int64(9)], drop_remainder=True))
    assert wide == [[[[1, 2, 0, 9], [3, 0, 0, 9]]]]
    with pytest.raises(errors.DataLossError, match="pad to a smaller size"):
        await drain(PaddedBatch(ragged, 2, [(2,)], [np.int64(0)], drop_remainder=False))
    with pytest.raises(errors.InvalidArgumentError, match="same rank as the padded shape for component0"):
        await drain(PaddedBatch(ragged, 2, [(3, 1)], [np.int64(0)], drop_remainder=False))
    with pytest.raises(errors.InvalidArgumentError, match="more than the"):
        await drain(PaddedBatch(ragged, 2, [(1 << 30,)], [np.int64(0)], drop_remainder=False))
    with pytest.raises(errors.InvalidArgumentError, match="must be a scalar"):
        PaddedBatch(ragged, 2, [(3,)], [np.zeros(2, np.int64)], drop_remainder=False)


async def test_unbatch_gives_rows_and_refuses_scalars_and_mismatched_sizes():
    pairs = TensorSlices([np.arange(6).reshape(3, 2), np.arange(3)])
    assert await drain(Unbatch(Batch(pairs, 2, drop_remainder=False))) == [
        [[0, 1], 0],
        [[2, 3], 1],
        [[4, 5], 2],
    ]
    with pytest.raises(errors.InvalidArgumentError, match="non-scalar value in each component"):
        await drain(Unbatch(Range(0, 2, 1, np.dtype(np.int64))))
    mixed = Tensors([np.zeros((2, 1)), np.zeros(3)])
    with pytest.raises(errors.InvalidArgumentError, match="same batch size in each component"):
        await drain(Unbatch(mixed))


async def test_a_cache_replays_the_first_complete_pass_only():
    cache = Cache(Shuffle(Range(0, 6, 1, np.dtype(np.int64)), 6, seed=1, seed2=2, reshuffle=True))
    partial = cache.iterate()
    await partial.next(None)  # a pass that stops early records nothing
    assert cache.elements is None
    first = await drain(cache)
    assert await drain(cache) == await drain(cache) == first  # replayed, not reshuffled
    assert sorted(first) == [[i] for i in range(6)]


class Counted(Dataset):
    """0, 1, ... up to `stop`, with `failing` raising instead; counts the elements made and
    says when a pass was cancelled (a source that runs only when asked)."""

    def __init__(self, stop, failing=(), block_at=None):
        self.stop, self.failing, self.block_at = stop, set(failing), block_at
        self.made = 0
        self.enough = asyncio.Event()  # `made` reached `wanted`
        self.wanted = 0
        self.cancelled = asyncio.Event()

    def iterate(self):
        dataset = self

        class Counting(ElementIterator):
            position = 0

            async def next(self, ctx):
                if self.position == dataset.block_at:
                    try:
                        await asyncio.get_running_loop().create_future()  # never set
                    finally:
                        dataset.cancelled.set()
                if self.position >= dataset.stop:
                    return None
                self.position += 1
                dataset.made += 1
                if dataset.made >= dataset.wanted:
                    dataset.enough.set()
                if self.position - 1 in dataset.failing:
                    raise errors.InvalidArgumentError(f"element {self.position - 1} failed")
                return [np.int64(self.position - 1)]

        return Counting()


async def test_prefetch_computes_ahead_into_a_bounded_buffer():
    source = Counted(100)
    source.wanted = 1 + 3  # the element taken and a full buffer
    elements = Prefetch(source, 3).iterate()
    assert int((await elements.next(None))[0]) == 0
    await source.enough.wait()  # made ahead, without being asked
    for _ in range(50):
        await asyncio.sleep(0)
    assert source.made == 4  # and no further: the buffer is full


async def test_prefetch_gives_errors_and_the_end_in_order():
    elements = Prefetch(Counted(3, failing={1}), -1).iterate()
    assert int((await elements.next(None))[0]) == 0
    with pytest.raises(errors.InvalidArgumentError, match="element 1 failed"):
        await elements.next(None)
    assert int((await elements.next(None))[0]) == 2
    assert await elements.next(None) is None
    assert await elements.next(None) is None
    assert await drain(Prefetch(Range(0, 3, 1, np.dtype(np.int64)), 0)) == [[0], [1], [2]]


async def test_dropping_a_prefetching_pass_cancels_its_producer():
    source = Counted(10, block_at=2)
    elements = Prefetch(source, 5).iterate()
    assert int((await elements.next(None))[0]) == 0
    del elements  # the iterator's pass is gone (a new MakeIterator, DeleteIterator, ...)
    await source.cancelled.wait()


async def test_an_iterator_without_shared_name_goes_with_its_kernel(make_node, ctx):
    kernel = create_kernel(make_node("IteratorV2", output_types=[np.int64]))
    (handle,) = await kernel.compute_async(ctx, [])
    await create_kernel(make_node("MakeIterator", ["d", "h"])).compute_async(ctx, [range_dataset(3), handle])
    assert ctx.resources.containers() == ["localhost"]
    del kernel  # its session is gone
    await asyncio.sleep(0)  # the loop drops the iterator
    assert ctx.resources.containers() == []
    await run_async(make_node, "IteratorV2", ctx=ctx, shared_name="kept")  # its kernel is gone at once
    await asyncio.sleep(0)
    assert ctx.resources.lookup("", "kept") is not None  # a shared iterator stays


def test_interleave_refuses_empty_cycles_and_blocks():
    source = Range(0, 3, 1, np.dtype(np.int64))
    with pytest.raises(errors.InvalidArgumentError, match="cycle_length must be greater than zero"):
        Interleave(source, None, [], 0, 1)
    with pytest.raises(errors.InvalidArgumentError, match="cycle_length must be greater than zero"):
        Interleave(source, None, [], 1 << 40, 1)
    with pytest.raises(errors.InvalidArgumentError, match="block_length must be greater than zero"):
        Interleave(source, None, [], 2, 0)
