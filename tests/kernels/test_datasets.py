"""tf.data kernels (kernels/datasets.py) driven directly: seeded shuffles, repeat of an
empty dataset, bounds on buffers, iterator errors."""

from __future__ import annotations

import numpy as np
import pytest

from distserver import errors
from distserver.kernels.datasets import Batch, IteratorResource, Range, Repeat, Shuffle, TensorSlices


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
