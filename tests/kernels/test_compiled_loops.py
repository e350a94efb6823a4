"""The compiled loops (`kernels._compiled`): the bits of numpy's calls, taken only for
the inputs they are made for, compiled off the kernels' path, and never required."""

from __future__ import annotations

import collections
import os
import subprocess
import sys
import textwrap
import types

import numpy as np
import pytest

import distserver as ds
from distserver import errors
from distserver.kernels import _compiled, create_kernel
from distserver.kernels.math import FUSED_MATMUL_GRAD_OP, FUSED_NODES_ATTR

from .conftest import Context, make_node
from .test_in_place_updates import _variable, torn_reads

LOOPS = (
    "adam",
    "momentum",
    "adagrad",
    "sparse_adagrad",
    "segment_sum_rows",
    "activation_gradient_with_sums",
    "sum_middle_axis",
    "set_rows_at",
    "bounds",
    "first_occurrences",
    "partition_order",
    "take_rows",
    "split_ids_by_blocks",
    "split_ids_by_remainder",
    "elementwise_program",
)


@pytest.fixture
def counted(monkeypatch):
    """The compiled loops, each call counted (by loop name)."""
    assert _compiled.wait(300), "the compiled loops are not there: numba missing? (pip install -e '.[dev]')"
    real = _compiled.loops()
    calls: collections.Counter[str] = collections.Counter()

    def count(name):
        def call(*args):
            calls[name] += 1
            return getattr(real, name)(*args)

        return call

    monkeypatch.setattr(_compiled, "_loops", types.SimpleNamespace(**{name: count(name) for name in LOOPS}))
    return calls


def _received(value):
    """`value` read-only, as a tensor a task received is."""
    value.flags.writeable = False
    return value


def _both_ways(monkeypatch, run):
    """`run()` with the compiled loops (counted), then with numpy's calls: both results."""
    compiled = run()
    monkeypatch.setattr(_compiled, "_loops", None)
    return compiled, run()


def _assert_same_bits(got, expected):
    for a, b in zip(got, expected, strict=True):
        assert (a.dtype, a.shape) == (b.dtype, b.shape)
        np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))


def _adam(make_node, dtype, start, grads, *, epsilon=1e-7, **attrs):
    ctx = Context()
    handles = [_variable(make_node, ctx, f"v{i}", value.copy())[0] for i, value in enumerate(start)]
    kernel = create_kernel(make_node("ResourceApplyAdam", T=dtype, **attrs))
    s = lambda x: np.array(x, dtype)  # noqa: E731
    for t, grad in enumerate(grads, start=1):
        scalars = [s(0.9**t), s(0.999**t), s(0.01), s(0.9), s(0.999), s(epsilon)]
        kernel.compute(ctx, [*handles, *scalars, grad])
    return [ctx.resources.lookup(h[()].container, h[()].name).value.copy() for h in handles]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape", [(1,), (7, 3), (300, 1001)], ids=["one", "small", "large"])
def test_adam_loop_gives_numpys_bits(make_node, monkeypatch, counted, dtype, shape):
    rng = np.random.default_rng(3)
    start = [rng.normal(size=shape).astype(dtype), np.zeros(shape, dtype), np.zeros(shape, dtype)]
    scales = [10.0 ** rng.integers(-20, 20, size=shape) for _ in range(4)]  # small and large values
    grads = [_received((rng.normal(size=shape) * scale).astype(dtype)) for scale in scales]
    compiled, numpy = _both_ways(monkeypatch, lambda: _adam(make_node, dtype, start, grads))
    assert counted["adam"] == len(grads)
    _assert_same_bits(compiled, numpy)


def test_adam_loop_gives_numpys_infinities_and_nans(make_node, monkeypatch, counted):
    # A zero second moment with epsilon 0 divides by zero; inf and nan gradients flow on.
    start = [np.ones(6, np.float32), np.zeros(6, np.float32), np.zeros(6, np.float32)]
    grads = [np.array([0.0, np.inf, -np.inf, np.nan, 1e30, -0.0], np.float32)]
    compiled, numpy = _both_ways(monkeypatch, lambda: _adam(make_node, np.float32, start, grads, epsilon=0.0))
    assert counted["adam"] == 1
    assert np.isnan(numpy[0]).any()  # (the case is what it says)
    assert np.isinf(numpy[1]).any()
    _assert_same_bits(compiled, numpy)


def _momentum(make_node, dtype, start, grads, scalar_shape):
    ctx = Context()
    handles = [_variable(make_node, ctx, f"v{i}", value.copy())[0] for i, value in enumerate(start)]
    kernel = create_kernel(make_node("ResourceApplyMomentum", T=dtype))
    lr, momentum = (np.full(scalar_shape, x, dtype) for x in (0.05, 0.9))
    for grad in grads:
        kernel.compute(ctx, [*handles, lr, grad, momentum])
    return [ctx.resources.lookup(h[()].container, h[()].name).value.copy() for h in handles]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("scalar_shape", [(), (1,)], ids=["short-path", "legacy-scalars"])
def test_momentum_loop_gives_numpys_bits(make_node, monkeypatch, counted, dtype, scalar_shape):
    # Scalars of shape [1] (TF 1.x's legacy scalars) leave Momentum's short path for
    # `_ApplyKernel`'s: both take the loop.
    rng = np.random.default_rng(4)
    shape = (300, 1001)
    start = [rng.normal(size=shape).astype(dtype), np.zeros(shape, dtype)]
    scales = [10.0 ** rng.integers(-20, 20, size=shape) for _ in range(3)]
    grads = [_received((rng.normal(size=shape) * scale).astype(dtype)) for scale in scales]
    compiled, numpy = _both_ways(monkeypatch, lambda: _momentum(make_node, dtype, start, grads, scalar_shape))
    assert counted["momentum"] == len(grads)
    _assert_same_bits(compiled, numpy)


def _adagrad(make_node, op, dtype, start, grads, **attrs):
    ctx = Context()
    handles = [_variable(make_node, ctx, f"v{i}", value.copy())[0] for i, value in enumerate(start)]
    kernel = create_kernel(make_node(op, T=dtype, **attrs))
    epsilon = [np.array(1e-7, dtype)] if op == "ResourceApplyAdagradV2" else []
    for grad in grads:
        kernel.compute(ctx, [*handles, np.array(0.1, dtype), *epsilon, grad])
    return [ctx.resources.lookup(h[()].container, h[()].name).value.copy() for h in handles]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("op", ["ResourceApplyAdagrad", "ResourceApplyAdagradV2"])
@pytest.mark.parametrize("update_slots", [True, False])
def test_adagrad_loop_gives_numpys_bits(make_node, monkeypatch, counted, dtype, op, update_slots):
    rng = np.random.default_rng(6)
    shape = (300, 1001)
    # (an accumulator of zeros where a zero gradient meets no epsilon: 0 / 0)
    start = [rng.normal(size=shape).astype(dtype), np.abs(rng.normal(size=shape)).astype(dtype)]
    start[1][rng.random(shape) < 0.01] = 0.0
    scales = [10.0 ** rng.integers(-20, 20, size=shape) for _ in range(3)]
    grads = [_received((rng.normal(size=shape) * scale).astype(dtype)) for scale in scales]
    grads[0].flags.writeable = True
    grads[0][rng.random(shape) < 0.01] = 0.0
    grads[0].flags.writeable = False

    def run():
        return _adagrad(make_node, op, dtype, start, grads, update_slots=update_slots)

    compiled, numpy = _both_ways(monkeypatch, run)
    assert counted["adagrad"] == len(grads)
    _assert_same_bits(compiled, numpy)


def _sparse_adagrad(make_node, dtype, index_type, start, grad, rows, **attrs):
    ctx = Context()
    handles = [_variable(make_node, ctx, f"v{i}", value.copy())[0] for i, value in enumerate(start)]
    kernel = create_kernel(make_node("ResourceSparseApplyAdagrad", T=dtype, Tindices=index_type, **attrs))
    kernel.compute(ctx, [*handles, np.array(0.1, dtype), grad, _received(np.array(rows, index_type))])
    return [ctx.resources.lookup(h[()].container, h[()].name).value.copy() for h in handles]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("index_type", [np.int32, np.int64])
@pytest.mark.parametrize("update_slots", [True, False])
@pytest.mark.parametrize(
    "rows", [[5, 0, 17, 3, 9], [5, 0, 5, 3, 0, 5], list(range(40))], ids=["distinct", "repeated", "every-row"]
)
@pytest.mark.parametrize("shape", [(40, 6), (40, 2, 3)], ids=["matrix", "blocks"])
def test_sparse_adagrad_loop_gives_numpys_bits(
    make_node, monkeypatch, counted, dtype, index_type, update_slots, rows, shape
):
    # (a matrix takes `SparseApplyAdagradKernel`'s short path, blocks the general one)
    rng = np.random.default_rng(5)
    start = [rng.normal(size=shape).astype(dtype), np.abs(rng.normal(size=shape)).astype(dtype) + 0.1]
    grad = _received(rng.normal(size=(len(rows), *shape[1:])).astype(dtype))

    def run():
        return _sparse_adagrad(make_node, dtype, index_type, start, grad, rows, update_slots=update_slots)

    compiled, numpy = _both_ways(monkeypatch, run)
    assert counted["sparse_adagrad"] == 1
    _assert_same_bits(compiled, numpy)


@pytest.mark.parametrize("bad", [-1, 40], ids=["negative", "past-the-end"])
def test_a_sparse_adagrad_loop_refuses_a_row_out_of_range_having_changed_nothing(
    make_node, monkeypatch, counted, bad
):
    start = [np.ones((40, 6), np.float32), np.full((40, 6), 0.5, np.float32)]
    grad = _received(np.ones((3, 6), np.float32))
    ctx = Context()
    handles = [_variable(make_node, ctx, f"v{i}", value.copy())[0] for i, value in enumerate(start)]
    kernel = create_kernel(make_node("ResourceSparseApplyAdagrad", T=np.float32, Tindices=np.int64))

    def run():
        with pytest.raises(errors.InvalidArgumentError) as raised:
            kernel.compute(ctx, [*handles, np.array(0.1, np.float32), grad, np.array([4, bad, 7], np.int64)])
        return raised.value.message

    compiled, numpy = _both_ways(monkeypatch, run)
    assert counted["sparse_adagrad"] == 1
    assert compiled == numpy
    assert f"Index {bad} at offset 1 in indices is out of range" in compiled
    for handle, value in zip(handles, start, strict=True):
        np.testing.assert_array_equal(
            ctx.resources.lookup(handle[()].container, handle[()].name).value, value
        )


def _segment_sum(data, ids, num_segments, index_type):
    kernel = create_kernel(_segment_node(data.dtype, index_type))
    ids = _received(np.array(ids, index_type))
    return kernel.compute(Context(), [data, ids, np.array(num_segments, np.int32)])


def _segment_node(dtype, index_type, op="UnsortedSegmentSum"):
    return make_node(op, ["data", "ids", "num"], T=dtype, Tindices=index_type, Tnumsegments=np.int32)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("index_type", [np.int32, np.int64])
@pytest.mark.parametrize(
    ("ids", "inner"),
    [([3, 0, 3, 3, 1, 0], (4, 2)), ([2, -1, 2, 0, -1], (3,)), (list(range(9))[::-1], ())],
    ids=["repeated", "negative-dropped", "distinct-scalar-rows"],
)
def test_segment_sum_loop_gives_numpys_bits(monkeypatch, counted, dtype, index_type, ids, inner):
    rng = np.random.default_rng(9)
    shape = (len(ids), *inner)
    data = _received((rng.normal(size=shape) * 10.0 ** rng.integers(-8, 8, size=shape)).astype(dtype))
    compiled, numpy = _both_ways(monkeypatch, lambda: _segment_sum(data, ids, 10, index_type))
    assert counted["segment_sum_rows"] == 1
    _assert_same_bits(compiled, numpy)
    expected = np.zeros((10, *inner), dtype)
    kept = np.array(ids) >= 0
    np.add.at(expected, np.array(ids)[kept], data[kept])
    _assert_same_bits(compiled, [expected])


@pytest.mark.parametrize("index_type", [np.int32, np.int64])
def test_a_segment_sum_loop_names_an_id_out_of_range_as_numpys_way(monkeypatch, counted, index_type):
    # Matrix ids, a negative one (dropped) before the one past the segments.
    data = np.ones((2, 2, 3), np.float32)

    def run():
        with pytest.raises(errors.InvalidArgumentError) as raised:
            _segment_sum(data, [[1, -1], [4, 0]], 4, index_type)
        return raised.value.message

    compiled, numpy = _both_ways(monkeypatch, run)
    assert counted["segment_sum_rows"] == 1
    assert compiled == numpy
    assert "segment_ids[1,0] = 4 is out of range [0, 4)" in compiled


@pytest.mark.parametrize(("num_segments", "inner"), [(0, (3,)), (5, (0,))], ids=["no-segments", "empty-rows"])
def test_a_segment_sum_loop_of_nothing_gives_numpys_shape(monkeypatch, counted, num_segments, inner):
    data = np.ones((0, *inner), np.float64)
    compiled, numpy = _both_ways(monkeypatch, lambda: _segment_sum(data, [], num_segments, np.int64))
    assert counted["segment_sum_rows"] == 1
    _assert_same_bits(compiled, numpy)
    assert compiled[0].shape == (num_segments, *inner)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize(("op", "keep_dims"), [("Sum", False), ("Sum", True), ("Mean", False)])
def test_a_sum_over_a_middle_axis_loop_gives_numpys_bits(monkeypatch, counted, dtype, op, keep_dims):
    # An embedding's looked-up rows pooled: [256, 8, 32] over axis 1, with values of
    # many magnitudes (the order of the additions shows), infinities and negative zeros.
    rng = np.random.default_rng(4)
    shape = (256, 8, 32)
    x = (rng.normal(size=shape) * 10.0 ** rng.integers(-8, 8, size=shape)).astype(dtype)
    x.flat[::97], x[:2] = np.inf, -0.0
    kernel = create_kernel(make_node(op, ["x", "axes"], T=dtype, Tidx=np.int32, keep_dims=keep_dims))
    run = lambda: kernel.compute(Context(), [_received(x), np.array([1], np.int32)])  # noqa: E731
    compiled, numpy = _both_ways(monkeypatch, run)
    assert counted["sum_middle_axis"] == 1
    _assert_same_bits(compiled, numpy)
    total = np.add.reduce(x, axis=1, keepdims=keep_dims)
    _assert_same_bits(compiled, [total if op == "Sum" else np.true_divide(total, dtype(8))])
    # (the rows of negative zeros sum to zero, as numpy's reduction and TensorFlow's
    # start from zero)
    assert np.isinf(total).any()
    assert np.signbit(x[0]).all()
    assert not np.signbit(total[0]).any()


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("op", ["DynamicStitch", "ParallelDynamicStitch"])
@pytest.mark.parametrize("trailing", [(), (3,), (2, 4)])
def test_a_stitch_loop_gives_numpys_bits(monkeypatch, counted, dtype, op, trailing):
    # Rows from three inputs, ids repeated within an input and across them (the later
    # row wins), one row no id names (zeros), NaNs, infinities and negative zeros copied
    # as they are.
    rng = np.random.default_rng(6)
    ids = [np.array([4, 0, 4, 7], np.int32), np.array([[1, 7], [3, 0]], np.int32), np.array([5, 6], np.int32)]
    values = [(rng.normal(size=(*i.shape, *trailing)) * 1e30).astype(dtype) for i in ids]
    values[0].flat[::3], values[1].flat[::4], values[2].flat[:1] = np.nan, -0.0, -np.inf
    kernel = create_kernel(make_node(op, [f"in{i}" for i in range(6)], N=3, T=dtype))
    run = lambda: kernel.compute(Context(), [*map(_received, ids), *map(_received, values)])  # noqa: E731
    loops = _compiled.loops()
    compiled, numpy = _both_ways(monkeypatch, run)
    assert counted["set_rows_at"] == 3
    _assert_same_bits(compiled, numpy)
    expected = np.zeros((8, *trailing), dtype)
    for i, v in zip(ids, values, strict=True):
        expected[i.reshape(-1)] = v.reshape(-1, *trailing)
    _assert_same_bits(compiled, [expected])
    # Rows that are not C-contiguous (every other row of a larger array): every input
    # takes numpy's path.
    monkeypatch.setattr(_compiled, "_loops", loops)
    counted.clear()
    strided = np.repeat(values[0], 2, axis=0)[::2]
    assert not strided.flags.c_contiguous
    (got,) = kernel.compute(Context(), [*ids, strided, *values[1:]])
    assert counted["set_rows_at"] == 0
    _assert_same_bits([got], [expected])


@pytest.mark.parametrize("op", ["DynamicStitch", "ParallelDynamicStitch"])
def test_a_stitch_names_a_negative_index_and_sizes_its_output_by_the_largest(monkeypatch, counted, op):
    kernel = create_kernel(make_node(op, [f"in{i}" for i in range(4)], N=2, T=np.float32))
    rows = [np.ones((3, 2), np.float32), np.ones((2, 2), np.float32)]

    def refused():
        with pytest.raises(errors.InvalidArgumentError) as raised:
            kernel.compute(Context(), [np.array([0, 9, 2], np.int32), np.array([4, -3], np.int32), *rows])
        return raised.value.message

    loops = _compiled.loops()
    compiled, numpy = _both_ways(monkeypatch, refused)
    assert counted["bounds"] == 2
    assert compiled == numpy
    assert "indices[1] contains a negative index -3" in compiled
    monkeypatch.setattr(_compiled, "_loops", loops)
    ids = [np.array([0, 9, 2], np.int32), np.array([4, 1], np.int32)]
    compiled, numpy = _both_ways(monkeypatch, lambda: kernel.compute(Context(), [*ids, *rows]))
    _assert_same_bits(compiled, numpy)
    assert compiled[0].shape == (10, 2)
    # (5 indices cannot name 10 rows: numpy's zeros, not the loop's output zeroed row by row)
    assert counted["set_rows_at"] == 0


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("index_type", [np.int32, np.int64])
@pytest.mark.parametrize(
    ("op", "params_shape", "ids_shape"),
    [
        ("GatherV2", (50, 4), (12,)),
        ("GatherV2", (50, 2, 3), (3, 4)),
        ("ResourceGather", (50, 4), (12,)),
        ("GatherV2", (50, 4), (0,)),
    ],
    ids=["rows", "blocks-by-a-matrix", "variable-rows", "none"],
)
def test_a_gather_loop_gives_numpys_rows(
    monkeypatch, counted, dtype, index_type, op, params_shape, ids_shape
):
    # Rows named in any order and more than once, the first and the last row, NaNs,
    # infinities and negative zeros copied as they are.
    rng = np.random.default_rng(8)
    params = (rng.normal(size=params_shape) * 1e30).astype(dtype)
    params.flat[::5], params.flat[1::7], params[-1] = np.nan, -np.inf, -0.0
    ids = rng.integers(0, params_shape[0], size=ids_shape).astype(index_type)
    if ids.size:
        ids.flat[:3] = [0, params_shape[0] - 1, 0]
    if op == "ResourceGather":
        kernel = create_kernel(make_node(op, ["v", "ids"], dtype=dtype, Tindices=index_type))
        context = Context()
        handle, _ = _variable(make_node, context, "v", params)
        run = lambda: kernel.compute(context, [handle, _received(ids)])  # noqa: E731
    else:
        kernel = create_kernel(
            make_node(op, ["p", "ids", "axis"], Tparams=dtype, Tindices=index_type, Taxis=np.int32)
        )
        run = lambda: kernel.compute(Context(), [_received(params), _received(ids), np.array(0, np.int32)])  # noqa: E731
    compiled, numpy = _both_ways(monkeypatch, run)
    assert counted["take_rows"] == 1
    _assert_same_bits(compiled, numpy)
    _assert_same_bits(compiled, [np.take(params, ids, axis=0)])


@pytest.mark.parametrize("bad", [-1, 50], ids=["negative", "past-the-end"])
def test_a_gather_loop_leaves_an_index_out_of_range_to_numpys_error(counted, bad):
    kernel = create_kernel(
        make_node("GatherV2", ["p", "ids", "axis"], Tparams=np.float32, Tindices=np.int64, Taxis=np.int32)
    )
    ids = np.array([[3, 4], [bad, 7]], np.int64)
    with pytest.raises(errors.InvalidArgumentError, match=rf"indices\[1,0\] = {bad} is not in \[0, 50\)"):
        kernel.compute(Context(), [np.ones((50, 3), np.float32), ids, np.array(0, np.int32)])
    assert counted["take_rows"] == 1


def _first_occurrence_answer(values):
    """Unique's outputs written out: distinct values in order of first appearance, each
    element's index among them, and the counts."""
    distinct, index = [], []
    for v in values.tolist():
        if v not in distinct:
            distinct.append(v)
        index.append(distinct.index(v))
    return distinct, index, [index.count(i) for i in range(len(distinct))]


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
@pytest.mark.parametrize("op", ["Unique", "UniqueWithCounts"])
@pytest.mark.parametrize(
    "values",
    [[7, 3, 7, 7, 1, 3, 9], [-5, 2, -5, 0, 2], [4], list(range(40))[::-1]],
    ids=["repeated", "negative", "one", "distinct"],
)
def test_a_unique_loop_gives_numpys_results(monkeypatch, counted, dtype, op, values):
    x = _received(np.array(values, dtype))
    kernel = create_kernel(make_node(op, ["x"], T=dtype, out_idx=np.int64))
    compiled, numpy = _both_ways(monkeypatch, lambda: kernel.compute(Context(), [x]))
    assert counted["first_occurrences"] == 1
    _assert_same_bits(compiled, numpy)
    distinct, index, counts = _first_occurrence_answer(x)
    assert compiled[0].tolist() == distinct
    assert compiled[1].tolist() == index
    assert op == "Unique" or compiled[2].tolist() == counts


def test_unique_values_in_a_wide_range_take_numpys_sort():
    # A table indexed by value would have 2**40 entries: the sort answers.
    assert _compiled.wait(300)
    x = np.array([2**40, 5, 2**40, -(2**40), 5], np.int64)
    y, index = create_kernel(make_node("Unique", ["x"], T=np.int64)).compute(Context(), [x])
    assert y.tolist() == [2**40, 5, -(2**40)]
    assert index.tolist() == [0, 1, 0, 2, 1]


@pytest.mark.parametrize(
    ("data", "partitions"),
    [
        (np.arange(12, dtype=np.float32).reshape(6, 2), [[1, 0, 1], [2, 0, 1]]),  # partition 3 empty
        (np.array([b"a", b"b", b"c", b"d"], object), [3, 3, 0, 3]),
        (np.arange(5, dtype=np.int64), [0, 0, 0, 0, 0]),
        (np.zeros((0, 3), np.float32), np.zeros(0, np.int32)),
    ],
    ids=["matrix-rows", "strings", "one-partition", "empty"],
)
def test_a_partition_loop_gives_numpys_results(monkeypatch, counted, data, partitions):
    partitions = _received(np.array(partitions, np.int32))
    data = _received(data.reshape(*partitions.shape, *data.shape[1:]) if partitions.ndim == 2 else data)
    node = make_node("DynamicPartition", ["data", "partitions"], T=data.dtype, num_partitions=4)
    kernel = create_kernel(node)
    compiled, numpy = _both_ways(monkeypatch, lambda: kernel.compute(Context(), [data, partitions]))
    assert counted["partition_order"] == 1
    flat_partitions = partitions.reshape(-1)
    rows = data.reshape(flat_partitions.size, *data.shape[partitions.ndim :])
    for i, (got, other) in enumerate(zip(compiled, numpy, strict=True)):
        assert got.dtype == data.dtype
        assert got.shape == other.shape
        assert got.tolist() == other.tolist() == rows[flat_partitions == i].tolist()


def test_a_partition_number_out_of_range_is_named_the_same_both_ways(monkeypatch, counted):
    node = make_node("DynamicPartition", ["data", "partitions"], T=np.float32, num_partitions=2)
    kernel = create_kernel(node)
    data, partitions = np.ones((2, 3), np.float32), np.array([[0, 1, 1], [2, 0, -1]], np.int32)

    def message():
        with pytest.raises(errors.InvalidArgumentError) as caught:
            kernel.compute(Context(), [data, partitions])
        return str(caught.value)

    compiled, numpy = _both_ways(monkeypatch, message)
    assert counted["partition_order"] == 1
    assert compiled == numpy
    assert "partitions[1,0] = 2 is not in [0, 2)" in compiled


def _dense_gradients(op, a, b, h, w=None):
    """A dense layer's backward pass as one node (`FusedMatMulGradKernel`): the gradient
    `op` of (a, b), the bias's gradient, the weights' [and the input's]."""
    axes, shape = np.array([0], np.int32), np.array([a.shape[1]], np.int32)
    inputs = [a, b, axes, shape, h] + ([] if w is None else [w])
    return _dense_gradient_kernel(op, a.dtype.type, w is not None).compute(Context(), inputs)


def _dense_gradient_kernel(op, dtype, with_input_gradient):
    """The kernel of `_dense_gradients`."""
    parts = [
        make_node(op, ["a", "b"], name="g", T=dtype),
        make_node("Sum", ["g", "axes"], name="s", T=dtype, Tidx=np.int32, keep_dims=True),
        make_node("Reshape", ["s", "shape"], name="r", T=dtype, Tshape=np.int32),
        make_node("MatMul", ["h", "g"], name="m", T=dtype, transpose_a=True),
    ]
    if with_input_gradient:
        parts.append(make_node("MatMul", ["g", "w"], name="i", T=dtype, transpose_b=True))
    node = make_node(FUSED_MATMUL_GRAD_OP, name="layer_grad", T=dtype, N=len(parts) - 4)
    node.attr[FUSED_NODES_ATTR].list.s.extend(part.SerializeToString() for part in parts)
    return create_kernel(node)


def test_a_layer_gradient_checks_its_sum_and_reshape_again_unless_the_same_constants_fit():
    # The fast path's Sum axes and Reshape shape are checked once for the same read-only
    # arrays (a graph's constants) and the same number of columns; otherwise again.
    kernel = _dense_gradient_kernel("TanhGrad", np.float32, False)
    rng = np.random.default_rng(9)
    a, b = (rng.normal(size=(32, 16)).astype(np.float32) for _ in "ab")
    h = rng.normal(size=(32, 8)).astype(np.float32)
    axes, shape = _received(np.array([0], np.int32)), _received(np.array([16], np.int32))
    first = kernel.compute(Context(), [a, b, axes, shape, h])
    _assert_same_bits(kernel.compute(Context(), [a, b, axes, shape, h]), first)
    # The same shape array, but a gradient of 8 columns: the Reshape to [16] refuses.
    narrow = [a[:, :8].copy(), b[:, :8].copy(), axes, shape, h]
    with pytest.raises(errors.InvalidArgumentError, match="requested shape"):
        kernel.compute(Context(), narrow)
    # Arrays that may change are checked every time: axis 1 sums the rows' other way.
    changing = np.array([0], np.int32)
    kernel.compute(Context(), [a, b, changing, shape, h])
    changing[0] = 1
    with pytest.raises(errors.InvalidArgumentError, match="requested shape"):
        kernel.compute(Context(), [a, b, changing, shape, h])


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("op", ["ReluGrad", "TanhGrad", "SigmoidGrad"])
@pytest.mark.parametrize(("rows", "columns"), [(256, 512), (3, 2), (1, 7), (0, 4)])
# Received from another task (read-only), or computed by this one's step (writeable):
# the loop takes either as it is.
@pytest.mark.parametrize("received", [True, False], ids=["received", "computed"])
def test_a_dense_layers_gradient_and_bias_sums_loop_gives_numpys_bits(
    monkeypatch, counted, dtype, op, rows, columns, received
):
    rng = np.random.default_rng(rows + columns)
    shape = (rows, columns)
    a, b = ((rng.normal(size=shape) * 10.0 ** rng.integers(-20, 20, size=shape)).astype(dtype) for _ in "ab")
    if received:
        a, b = _received(a), _received(b)
    h = _received(rng.normal(size=(rows, 5)).astype(dtype))
    w = _received(rng.normal(size=(3, columns)).astype(dtype))
    compiled, numpy = _both_ways(monkeypatch, lambda: _dense_gradients(op, a, b, h, w))
    assert counted["activation_gradient_with_sums"] == 1
    _assert_same_bits(compiled, numpy)


@pytest.mark.parametrize("op", ["ReluGrad", "TanhGrad", "SigmoidGrad"])
def test_a_dense_layers_gradient_loop_gives_numpys_infinities_and_nans(monkeypatch, counted, op):
    rng = np.random.default_rng(2)
    a, b = (rng.normal(size=(64, 32)).astype(np.float32) for _ in "ab")
    a.flat[::7], b.flat[::11], a.flat[::13], b.flat[::17] = -0.0, np.inf, np.nan, -np.inf
    h = _received(rng.normal(size=(64, 8)).astype(np.float32))
    compiled, numpy = _both_ways(monkeypatch, lambda: _dense_gradients(op, _received(a), _received(b), h))
    assert counted["activation_gradient_with_sums"] == 1
    _assert_same_bits(compiled[1:], numpy[1:])  # the weights' gradient, and through it the layer's
    # The bias's: a NaN added to a NaN may keep the other one (its sign bit), as `_loops` says.
    assert np.isnan(numpy[0]).any()
    np.testing.assert_array_equal(compiled[0], numpy[0])
    _assert_same_bits(compiled[0][~np.isnan(numpy[0])], numpy[0][~np.isnan(numpy[0])])


def test_inputs_a_loop_is_not_made_for_take_numpys_calls(make_node, monkeypatch, counted):
    rng = np.random.default_rng(1)
    start = [rng.normal(size=(6, 5)).astype(np.float32) for _ in range(3)]
    strided = [np.ones((5, 6), np.float32).T]  # not contiguous
    nesterov = [np.ones((6, 5), np.float32)]
    got = [
        _adam(make_node, np.float32, start, strided),
        _adam(make_node, np.float32, start, nesterov, use_nesterov=True),
        _sparse_adagrad(make_node, np.float32, np.int32, start[:2], np.ones((0, 5), np.float32), []),
        _segment_sum(np.ones((3, 2), np.int32), [0, 1, 0], 2, np.int32),  # integers
        create_kernel(_segment_node(np.float32, np.int32, op="UnsortedSegmentProd")).compute(
            Context(), [np.ones((3, 2), np.float32), np.array([0, 1, 0], np.int32), np.array(2, np.int32)]
        ),
        _dense_gradients(
            "ReluGrad", *[np.ones((4, 1), np.float32)] * 2, np.ones((4, 3), np.float32)
        ),  # a column
        _dense_gradients(
            "TanhGrad", *[np.ones((3, 4), np.float32).T] * 2, np.ones((4, 3), np.float32)
        ),  # strided
    ]
    assert sum(counted.values()) == 0
    monkeypatch.setattr(_compiled, "_loops", None)
    _assert_same_bits(got[0], _adam(make_node, np.float32, start, strided))
    _assert_same_bits(got[1], _adam(make_node, np.float32, start, nesterov, use_nesterov=True))


def test_readers_never_see_a_compiled_update_half_done(make_node, counted):
    # The loops run without the GIL, under the variables' locks. Every element starts
    # equal and gets the same gradient, so each Adam step keeps the variable uniform: a
    # read that is not uniform saw an update half done.
    ctx = Context()
    size = 1 << 18
    handles = [_variable(make_node, ctx, f"v{i}", np.full(size, 0.5, np.float32))[0] for i in range(3)]
    adam = create_kernel(make_node("ResourceApplyAdam", T=np.float32))
    s = lambda x: np.array(x, np.float32)  # noqa: E731
    grad = _received(np.full(size, 0.25, np.float32))
    steps = 100

    def update():
        for t in range(1, steps + 1):
            scalars = [s(0.9**t), s(0.999**t), s(0.01), s(0.9), s(0.999), s(1e-7)]
            adam.compute(ctx, [*handles, *scalars, grad])

    assert torn_reads(make_node, ctx, handles[0], np.float32, update) == []
    # (~10-20 of the steps find no reader holding the value and take the loop in place;
    # the others copy)
    assert 0 < counted["adam"] <= steps
    final = ctx.resources.lookup(handles[0][()].container, handles[0][()].name).value
    assert final.min() == final.max() < 0.5


def _python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def test_building_a_kernel_starts_the_compilation_in_the_background():
    result = _python(
        """
        from distserver.kernels import _compiled, create_kernel
        from distserver.protos.node_def_pb2 import NodeDef
        assert _compiled.state() == "unused" and _compiled.loops() is None
        node = NodeDef(name="adam", op="ResourceApplyAdam")
        node.attr["T"].type = 1  # float32
        create_kernel(node)
        assert _compiled.state() in ("compiling", "ready")
        assert _compiled.wait(240), "not compiled"
        assert _compiled.state() == "ready" and _compiled.loops() is not None
        print("ok")
        """
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_the_loops_compile_where_numba_has_nowhere_to_cache_them(tmp_path):
    # As for a container's user with a read-only package directory and no home:
    # numba's locators find no cache directory (here: only those that cannot).
    result = _python(
        """
        import numba, sys
        from distserver.kernels import _compiled
        assert _compiled.wait(240), "not compiled"
        print(numba.config.CACHE_DIR)
        """,
        NUMBA_CACHE_LOCATOR_CLASSES="IPythonCacheLocator,UserProvidedCacheLocator",
        TMPDIR=str(tmp_path),
    )
    assert result.returncode == 0, result.stderr
    directory = result.stdout.strip()
    assert directory.startswith(str(tmp_path / "distserver-numba-"))
    assert list(tmp_path.iterdir()) == []  # (removed at exit)


def test_the_environment_turns_the_loops_off():
    result = _python(
        """
        import threading
        from distserver.kernels import _compiled
        assert not _compiled.enabled()
        assert _compiled.state() == "off"
        assert not _compiled.wait(5)
        assert _compiled.state() == "off"
        assert not any(t.name == "distserver-compile" for t in threading.enumerate())
        assert "numba" not in __import__("sys").modules
        print("off")
        """,
        DISTSERVER_COMPILED_KERNELS="0",
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "off"


def test_a_servers_statistics_say_whether_its_kernels_run_compiled_loops():
    assert _compiled.wait(300)
    with ds.Server({"local": ["localhost:0"]}) as server:
        assert server.statistics().compiled_kernels == "ready"
        assert server.statistics().as_dict()["compiled_kernels"] == "ready"


@pytest.mark.skipif(not _compiled.enabled(), reason="numba is not installed")
def test_warming_a_copied_tree_fills_that_trees_cache_not_the_running_ones(tmp_path, monkeypatch):
    # What an A/B of two trees runs before their tasks start (bench_training --tree,
    # scripts/ab_tf_client.py): each tree's tasks then load the loops. Run from this
    # repository's root, where `python -c` would import the repository's package.
    import shutil
    from pathlib import Path

    from distserver.bench.training import warm_compiled_loops

    source = Path(ds.__file__).resolve().parent
    shutil.copytree(source, tmp_path / "distserver", ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.chdir(source.parent)
    warm_compiled_loops(tmp_path)
    cached = tmp_path / "distserver" / "kernels" / "__pycache__"
    assert sorted(p.name for p in cached.glob("_loops.adam-*.nbi"))
