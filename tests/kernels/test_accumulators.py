"""Conditional accumulator kernels (SyncReplicasOptimizer's gradient aggregation).

Expected values were produced once by TensorFlow 2.21's kernels (tf.compat.v1's
ConditionalAccumulator and SparseConditionalAccumulator) on the same inputs.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from distserver import errors
from distserver.kernels import create_kernel

F32 = np.float32
I64 = np.int64


class Accumulators:
    """Runs accumulator kernels on one context, as the executor would."""

    def __init__(self, make_node, ctx):
        self.make_node = make_node
        self.ctx = ctx

    def kernel(self, op, n_inputs, **attrs):
        return create_kernel(
            self.make_node(op, [f"input_{i}" for i in range(n_inputs)], name=op.lower(), **attrs)
        )

    def run(self, op, *inputs, **attrs):
        return self.kernel(op, len(inputs), **attrs).compute(self.ctx, [np.asarray(x) for x in inputs])

    async def run_async(self, op, *inputs, **attrs):
        kernel = self.kernel(op, len(inputs), **attrs)
        assert kernel.is_async
        return await kernel.compute_async(self.ctx, [np.asarray(x) for x in inputs])

    def create(self, op="ResourceConditionalAccumulator", shape=(2,), name="acc", reduction="MEAN"):
        (handle,) = self.run(op, dtype=F32, shape=shape, shared_name=name, reduction_type=reduction)
        return handle

    def apply(self, handle, step, gradient, op="ResourceAccumulatorApplyGradient"):
        self.run(op, handle, np.int64(step), np.asarray(gradient, F32), dtype=F32)

    def apply_sparse(self, handle, step, indices, values, shape=(10, 2)):
        self.run(
            "SparseAccumulatorApplyGradient",
            handle,
            np.int64(step),
            np.asarray(indices, I64),
            np.asarray(values, F32),
            np.asarray(shape, I64),
            dtype=F32,
            has_known_shape=True,
        )

    async def take(self, handle, required, op="ResourceAccumulatorTakeGradient"):
        return await self.run_async(op, handle, np.int32(required), dtype=F32)

    def count(self, handle, op="ResourceAccumulatorNumAccumulated"):
        (value,) = self.run(op, handle)
        return int(value)

    def set_step(self, handle, step, op="ResourceAccumulatorSetGlobalStep"):
        self.run(op, handle, np.int64(step))


@pytest.fixture
def acc(make_node, ctx):
    return Accumulators(make_node, ctx)


async def test_take_returns_the_mean_resets_and_steps_the_accumulator(acc):
    handle = acc.create()
    acc.apply(handle, 0, [1, 2])
    acc.apply(handle, 0, [3, 5])
    assert acc.count(handle) == 2
    (mean,) = await acc.take(handle, 2)
    np.testing.assert_array_equal(mean, [2.0, 3.5])
    assert mean.dtype == F32
    assert acc.count(handle) == 0
    # The take moved the global step to 1: a gradient of step 0 is stale and dropped.
    acc.apply(handle, 0, [100, 100])
    assert acc.count(handle) == 0
    acc.apply(handle, 1, [1, 1])
    acc.apply(handle, 5, [2, 2])  # newer than the accumulator: accepted
    (mean,) = await acc.take(handle, 2)
    np.testing.assert_array_equal(mean, [1.5, 1.5])


async def test_sum_reduction_and_the_reference_handle_ops(acc):
    handle = acc.create(op="ConditionalAccumulator", reduction="SUM")
    assert handle.shape == (2,)
    assert handle.tolist() == [b"localhost", b"acc"]
    acc.apply(handle, 0, [1, 2], op="AccumulatorApplyGradient")
    acc.apply(handle, 0, [3, 5], op="AccumulatorApplyGradient")
    acc.apply(handle, 0, [1, 1], op="AccumulatorApplyGradient")
    assert acc.count(handle, op="AccumulatorNumAccumulated") == 3
    (total,) = await acc.take(handle, 2, op="AccumulatorTakeGradient")
    np.testing.assert_array_equal(total, [5, 8])


async def test_take_waits_until_enough_gradients_then_serves_takes_in_order(acc):
    handle = acc.create()
    first = asyncio.create_task(acc.take(handle, 2))
    second = asyncio.create_task(acc.take(handle, 1))
    await asyncio.sleep(0)
    acc.apply(handle, 0, [2, 2])
    await asyncio.sleep(0)
    assert not first.done()
    assert not second.done()
    acc.apply(handle, 0, [4, 4])
    np.testing.assert_array_equal((await first)[0], [3, 3])
    assert not second.done()
    acc.apply(handle, 1, [7, 7])
    np.testing.assert_array_equal((await second)[0], [7, 7])


async def test_a_gradient_applied_from_another_thread_wakes_the_take(acc):
    handle = acc.create()
    take = asyncio.create_task(acc.take(handle, 1))
    await asyncio.sleep(0)
    await asyncio.to_thread(acc.apply, handle, 0, [1, 2])
    np.testing.assert_array_equal((await asyncio.wait_for(take, 30))[0], [1, 2])


async def test_a_cancelled_take_is_withdrawn_and_takes_nothing(acc):
    handle = acc.create()
    waiting = asyncio.create_task(acc.take(handle, 2))
    await asyncio.sleep(0)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    acc.apply(handle, 0, [1, 1])
    acc.apply(handle, 0, [3, 3])
    assert acc.count(handle) == 2  # nobody took them
    (mean,) = await acc.take(handle, 2)
    np.testing.assert_array_equal(mean, [2, 2])


async def test_set_global_step_makes_older_gradients_stale_and_may_go_back(acc):
    handle = acc.create()
    acc.set_step(handle, 5)
    acc.apply(handle, 4, [1, 1])
    assert acc.count(handle) == 0
    acc.set_step(handle, 3)  # lowering is allowed (TensorFlow only logs it)
    acc.apply(handle, 4, [1, 1])
    assert acc.count(handle) == 1


def test_shape_and_type_errors(acc):
    handle = acc.create()
    with pytest.raises(errors.InvalidArgumentError, match=r"Shape mismatch: expected \[2\], got \[3\]"):
        acc.apply(handle, 0, [1, 2, 3])
    open_handle = acc.create(shape=(None,), name="open")
    acc.apply(open_handle, 0, [1, 2, 3])
    with pytest.raises(errors.InvalidArgumentError, match=r"Shape mismatch: expected \[3\], got \[2\]"):
        acc.apply(open_handle, 0, [1, 2])
    with pytest.raises(
        errors.InvalidArgumentError, match="has type double but accumulator 'acc' accumulates float"
    ):
        acc.run("ResourceAccumulatorApplyGradient", handle, np.int64(0), np.zeros(2), dtype=np.float64)
    with pytest.raises(errors.InvalidArgumentError, match="local_step must be scalar"):
        acc.run("ResourceAccumulatorApplyGradient", handle, np.zeros(2, I64), np.zeros(2, F32), dtype=F32)
    with pytest.raises(errors.InvalidArgumentError, match="reduction_type must be one of"):
        acc.create(name="bad", reduction="MAX")
    with pytest.raises(errors.InvalidArgumentError, match="distserver supports dtype"):
        acc.run("ResourceConditionalAccumulator", dtype=np.int32, shape=(2,), shared_name="ints")


def test_a_stale_gradient_is_dropped_before_it_is_checked(acc):
    handle = acc.create()
    acc.set_step(handle, 2)
    acc.apply(handle, 1, [1, 2, 3])  # wrong shape, but stale: TensorFlow drops it silently
    assert acc.count(handle) == 0


async def test_take_refuses_a_non_positive_count_and_unknown_accumulators(acc, new_context):
    handle = acc.create()
    with pytest.raises(errors.InvalidArgumentError, match="num_required must be positive, but was 0"):
        await acc.take(handle, 0)
    other = Accumulators(acc.make_node, new_context())
    with pytest.raises(errors.NotFoundError, match=r"Resource localhost/acc/.*does not exist"):
        await other.take(handle, 1)
    with pytest.raises(errors.NotFoundError, match="does not exist"):
        acc.apply_sparse(handle, 0, [1], [[1, 1]])  # a dense accumulator is not a sparse one


def test_shared_name_joins_and_conflicting_kinds_are_refused(acc):
    first, second = acc.create(name="shared"), acc.create(name="shared")
    acc.apply(first, 0, [1, 1])
    assert acc.count(second) == 1
    with pytest.raises(errors.InvalidArgumentError, match="exists and is not a SparseConditionalAccumulator"):
        acc.create(op="SparseConditionalAccumulator", shape=(), name="shared")


async def test_sparse_mean_averages_each_index_by_its_count(acc):
    handle = acc.create(op="SparseConditionalAccumulator", shape=())
    acc.apply_sparse(handle, 0, [1, 3], [[1, 1], [2, 2]])
    acc.apply_sparse(handle, 0, [0, 3, 5], [[4, 4], [6, 6], [8, 8]])
    indices, values, shape = await acc.take(handle, 2, op="SparseAccumulatorTakeGradient")
    np.testing.assert_array_equal(indices, [0, 1, 3, 5])
    np.testing.assert_array_equal(values, [[4, 4], [1, 1], [4, 4], [8, 8]])
    np.testing.assert_array_equal(shape, [-1, 2])
    assert indices.dtype == I64
    assert shape.dtype == I64
    # Unsorted indices merge as TensorFlow's walk does (values checked against TF 2.21).
    acc.apply_sparse(handle, 1, [5, 1, 5], [[1, 1], [2, 2], [3, 3]])
    acc.apply_sparse(handle, 1, [1, 5], [[10, 10], [20, 20]])
    indices, values, _ = await acc.take(handle, 2, op="SparseAccumulatorTakeGradient")
    np.testing.assert_array_equal(indices, [1, 5, 1, 5])
    np.testing.assert_array_equal(values, [[10, 10], [10.5, 10.5], [2, 2], [3, 3]])


async def test_sparse_sum_declared_shape_and_errors(acc):
    handle = acc.create(op="SparseConditionalAccumulator", shape=(4, 2), reduction="SUM")
    acc.apply_sparse(handle, 0, [1, 2], [[1, 1], [2, 2]], shape=(4, 2))
    acc.apply_sparse(handle, 0, [2], [[5, 5]], shape=(4, 2))
    indices, values, shape = await acc.take(handle, 2, op="SparseAccumulatorTakeGradient")
    np.testing.assert_array_equal(indices, [1, 2])
    np.testing.assert_array_equal(values, [[1, 1], [7, 7]])
    np.testing.assert_array_equal(shape, [4, 2])
    with pytest.raises(
        errors.InvalidArgumentError, match="index of slice 0 exceeded limits of shape; index is 4"
    ):
        acc.apply_sparse(handle, 1, [4], [[1, 1]], shape=(4, 2))
    with pytest.raises(errors.InvalidArgumentError, match="expected shape dim 0 to be 4, got 5"):
        acc.apply_sparse(handle, 1, [1], [[1, 1]], shape=(5, 2))
    with pytest.raises(errors.InvalidArgumentError, match="expected values dim 1 to be 2, got 3"):
        acc.apply_sparse(handle, 1, [1], [[1, 1, 1]], shape=(4, 2))
    acc.apply_sparse(handle, 1, [1], [[1, 1]], shape=(4, 2))
    with pytest.raises(errors.InvalidArgumentError, match="Expected 2 non-empty input values, got 1"):
        acc.apply_sparse(handle, 1, [1, 2], [[1, 1]], shape=(4, 2))
    with pytest.raises(errors.InvalidArgumentError, match="Values cannot be 0-dimensional"):
        acc.run(
            "SparseAccumulatorApplyGradient", handle, np.int64(1), np.zeros(0, I64), np.float32(1),
            np.zeros(0, I64), dtype=F32, has_known_shape=False,
        )  # fmt: skip
