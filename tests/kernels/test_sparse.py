"""Embedding and sparse-training kernels against hand-computed numpy expectations.

Expected values are written out from the ops' definitions (and were checked once
against TensorFlow 2.21's kernels, duplicates included).
"""

from __future__ import annotations

import numpy as np
import pytest

from distserver import errors
from distserver.kernels import create_kernel, sparse
from distserver.kernels.sparse import sparse_rows_passes

F32 = np.float32


# --------------------------------------------------------------------------- Unique


def test_unique_keeps_the_order_of_first_appearance(run_op):
    y, idx = run_op("Unique", np.array([4, 2, 4, 1, 2, 7], np.int32), T=np.int32)
    np.testing.assert_array_equal(y, [4, 2, 1, 7])
    np.testing.assert_array_equal(idx, [0, 1, 0, 2, 1, 3])
    assert idx.dtype == np.int32


def test_unique_out_idx_int64_and_strings(run_op):
    y, idx = run_op("Unique", np.array([b"b", b"a", b"b"], dtype=object), T=object, out_idx=np.int64)
    assert y.tolist() == [b"b", b"a"]
    assert idx.dtype == np.int64
    assert idx.tolist() == [0, 1, 0]


def test_unique_with_counts(run_op):
    y, idx, count = run_op("UniqueWithCounts", np.array([4, 2, 4, 1, 2, 7], np.int64), T=np.int64)
    assert y.tolist() == [4, 2, 1, 7]
    assert idx.tolist() == [0, 1, 0, 2, 1, 3]
    assert count.tolist() == [2, 2, 1, 1]


def test_unique_v2_along_an_axis(run_op):
    x = np.array([[1, 0], [2, 2], [1, 0], [0, 3]], np.int32)
    y, idx = run_op("UniqueV2", x, np.array([0], np.int64), T=np.int32, Taxis=np.int64)
    assert y.tolist() == [[1, 0], [2, 2], [0, 3]]
    assert idx.tolist() == [0, 1, 0, 2]
    y, idx = run_op("UniqueV2", x.T.copy(), np.array([-1], np.int64), T=np.int32, Taxis=np.int64)
    assert y.tolist() == [[1, 2, 0], [0, 2, 3]]
    assert idx.tolist() == [0, 1, 0, 2]
    y, idx = run_op(
        "UniqueV2", np.array([3, 3, 1], np.int32), np.array([], np.int64), T=np.int32, Taxis=np.int64
    )
    assert (y.tolist(), idx.tolist()) == ([3, 1], [0, 0, 1])


def test_unique_of_an_empty_vector(run_op):
    y, idx = run_op("Unique", np.array([], F32), T=F32)
    assert y.shape == (0,)
    assert idx.shape == (0,)


def test_unique_refuses_a_matrix(run_op):
    with pytest.raises(errors.InvalidArgumentError, match=r"unique expects a 1D vector\."):
        run_op("Unique", np.zeros((2, 2), np.int32), T=np.int32)


# --------------------------------------------------------------------------- segment reductions

DATA = np.arange(12, dtype=F32).reshape(6, 2) - 5  # rows [-5,-4] [-3,-2] [-1,0] [1,2] [3,4] [5,6]
SEGMENTS = np.array([0, 2, -1, 0, 2, 2], np.int32)  # -1: dropped


def _segment(run_op, op, data=DATA, ids=SEGMENTS, num=4, **attrs):
    attrs.setdefault("T", data.dtype.type)
    return run_op(op, data, ids, np.int32(num), Tindices=ids.dtype.type, Tnumsegments=np.int32, **attrs)[0]


def test_unsorted_segment_sum(run_op):
    out = _segment(run_op, "UnsortedSegmentSum")
    np.testing.assert_array_equal(out, [[-4, -2], [0, 0], [5, 8], [0, 0]])
    assert out.dtype == F32


@pytest.mark.parametrize(
    ("op", "expected", "empty"),
    [
        ("UnsortedSegmentMax", [[1, 2], [5, 6]], np.finfo(F32).min),
        ("UnsortedSegmentMin", [[-5, -4], [-3, -2]], np.finfo(F32).max),
        ("UnsortedSegmentProd", [[-5, -8], [-45, -48]], 1),
    ],
)
def test_unsorted_segment_reductions_fill_empty_segments_with_the_identity(run_op, op, expected, empty):
    out = _segment(run_op, op)
    np.testing.assert_array_equal(out[[0, 2]], expected)
    np.testing.assert_array_equal(out[[1, 3]], np.full((2, 2), empty, F32))


def test_unsorted_segment_max_on_integers_uses_the_lowest_value(run_op):
    out = _segment(run_op, "UnsortedSegmentMax", data=DATA.astype(np.int32))
    assert out[1].tolist() == [np.iinfo(np.int32).min] * 2
    assert out[2].tolist() == [5, 6]


def test_unsorted_segment_sum_with_matrix_ids_and_int64(run_op):
    data = np.arange(8, dtype=np.float64).reshape(2, 2, 2)
    ids = np.array([[1, 0], [1, 1]], np.int64)
    out = _segment(run_op, "UnsortedSegmentSum", data=data, ids=ids, num=2)
    np.testing.assert_array_equal(out, [[2, 3], [0 + 4 + 6, 1 + 5 + 7]])


@pytest.mark.parametrize("op", ["UnsortedSegmentSum", "UnsortedSegmentProd", "UnsortedSegmentMax"])
@pytest.mark.parametrize(
    "distinct", [2, 150, 5000], ids=["ufunc-at", "few-passes", "first-occurrences-then-repeats"]
)
def test_unsorted_segment_reductions_give_the_bits_of_walking_the_rows_in_order(run_op, op, distinct):
    # Float sums depend on the order: every segment must see its rows in input order,
    # as TF's kernel (and ufunc.at) walk them: by ufunc.at (an id named more than
    # `_MAX_PASSES` times), by passes (more repeats than `_MAX_REPEATS_AT`), or the
    # first occurrences in one pass and then the repeats by ufunc.at.
    rng = np.random.default_rng(3)
    ids = rng.integers(-1, distinct, 600).astype(np.int32)  # -1: dropped
    data = (rng.normal(size=(600, 7)) * 10.0 ** rng.integers(-4, 5, size=(600, 1))).astype(F32)
    kept = ids[ids >= 0]
    assert (np.bincount(kept).max() > sparse._MAX_PASSES) == (distinct == 2)
    assert (kept.size - np.unique(kept).size > sparse._MAX_REPEATS_AT) == (distinct < 5000)
    out = _segment(run_op, op, data=data, ids=ids, num=distinct + 1)
    expected = np.full(
        (distinct + 1, 7), {"UnsortedSegmentSum": 0, "UnsortedSegmentProd": 1}.get(op, np.finfo(F32).min), F32
    )
    ufunc = {
        "UnsortedSegmentSum": np.add,
        "UnsortedSegmentProd": np.multiply,
        "UnsortedSegmentMax": np.maximum,
    }[op]
    with np.errstate(all="ignore"):
        ufunc.at(expected, ids[ids >= 0], data[ids >= 0])
    np.testing.assert_array_equal(out.view(np.uint32), expected.view(np.uint32))


@pytest.mark.parametrize("op", ["UnsortedSegmentSum", "UnsortedSegmentMin"])
def test_unsorted_segment_reduction_by_uniques_ids_is_in_place_and_gives_the_same_bits(run_op, op):
    # `Unique`'s idx names segments 0, 1, ... at their first occurrences: the first
    # pass reduces into the output's leading rows in place. Zeros of either sign, as
    # adding to the identity gives (-0.0 + 0 = +0.0).
    rng = np.random.default_rng(5)
    _, idx = run_op("Unique", rng.integers(0, 700, 1000), T=np.int64, out_idx=np.int32)
    data = rng.normal(size=(1000, 5)).astype(F32)
    data[rng.random((1000, 5)) < 0.3] = -0.0
    first = sparse.first_positions(idx)
    assert first is not None
    assert np.array_equal(idx[first == np.arange(idx.size)], np.arange(idx.max() + 1))
    out = _segment(run_op, op, data=data, ids=idx, num=int(idx.max()) + 3)
    expected = np.full(out.shape, 0 if op == "UnsortedSegmentSum" else np.finfo(F32).max, F32)
    (np.add if op == "UnsortedSegmentSum" else np.minimum).at(expected, idx, data)
    np.testing.assert_array_equal(out.view(np.uint32), expected.view(np.uint32))


def test_first_positions_by_table_or_none_for_a_wide_range():
    rng = np.random.default_rng(6)
    for values in (
        rng.integers(-128, 128, 300).astype(np.int8),  # the whole range of a small type
        rng.integers(10**12, 10**12 + 50, 100),  # far from zero
        np.array([7]),
    ):
        first = sparse.first_positions(values)
        assert first is not None
        expected = [values.tolist().index(v) for v in values.tolist()]
        np.testing.assert_array_equal(first, expected)
    assert sparse.first_positions(np.array([0, 10**9])) is None  # range >> values: sort instead
    assert sparse.first_positions(np.array([1, 2], np.uint64)) is None


def test_unsorted_segment_sum_errors(run_op):
    with pytest.raises(errors.InvalidArgumentError, match=r"segment_ids\[2\] = 5 is out of range \[0, 4\)"):
        _segment(run_op, "UnsortedSegmentSum", ids=np.array([0, 1, 5, 0, 0, 0], np.int32))
    with pytest.raises(
        errors.InvalidArgumentError,
        match=r"data.shape = \[6,2\] does not start with segment_ids.shape = \[2\]",
    ):
        _segment(run_op, "UnsortedSegmentSum", ids=np.array([0, 1], np.int32))
    with pytest.raises(errors.InvalidArgumentError, match="must be non-negative"):
        _segment(run_op, "UnsortedSegmentSum", num=-1)


# --------------------------------------------------------------------------- DynamicPartition


def test_dynamic_partition_keeps_rows_in_order(run_op):
    parts = run_op("DynamicPartition", DATA, np.array([0, 1, 2, 0, 1, 0], np.int32), T=F32, num_partitions=3)
    assert [p.tolist() for p in parts] == [
        [[-5, -4], [1, 2], [5, 6]],
        [[-3, -2], [3, 4]],
        [[-1, 0]],
    ]


def test_dynamic_partition_of_ids_with_an_empty_partition(run_op):
    ids = np.array([5, 8, 1], np.int64)
    parts = run_op("DynamicPartition", ids, (ids % 3).astype(np.int32), T=np.int64, num_partitions=3)
    assert [p.tolist() for p in parts] == [[], [1], [5, 8]]
    assert parts[0].dtype == np.int64


def test_dynamic_partition_then_stitch_restores_the_order(run_op):
    ids = np.array([7, 2, 9, 4, 2], np.int64)
    partitions = (ids % 2).astype(np.int32)
    positions = run_op(
        "DynamicPartition", np.arange(5, dtype=np.int32), partitions, T=np.int32, num_partitions=2
    )
    values = run_op("DynamicPartition", ids * 10, partitions, T=np.int64, num_partitions=2)
    (stitched,) = run_op("DynamicStitch", *positions, *values, N=2, T=np.int64)
    assert stitched.tolist() == (ids * 10).tolist()
    (parallel,) = run_op("ParallelDynamicStitch", *positions, *values, N=2, T=np.int64)
    assert parallel.tolist() == (ids * 10).tolist()


def test_dynamic_partition_errors(run_op):
    with pytest.raises(errors.InvalidArgumentError, match=r"partitions\[5\] = 3 is not in \[0, 3\)"):
        run_op("DynamicPartition", DATA, np.array([0, 1, 2, 0, 1, 3], np.int32), T=F32, num_partitions=3)
    with pytest.raises(errors.InvalidArgumentError, match=r"data\.shape must start with partitions\.shape"):
        run_op("DynamicPartition", DATA, np.array([0, 1], np.int32), T=F32, num_partitions=3)


# --------------------------------------------------------------------------- ConcatOffset


def test_concat_offset(run_op):
    shapes = [np.array(s, np.int32) for s in ([2, 3, 5], [2, 7, 5], [2, 1, 5])]
    offsets = run_op("ConcatOffset", np.int32(-2), *shapes, N=3)
    assert [o.tolist() for o in offsets] == [[0, 0, 0], [0, 3, 0], [0, 10, 0]]
    assert offsets[0].dtype == np.int32
    wide = run_op(
        "ConcatOffset", np.int32(0), np.array([2, 3], np.int64), np.array([4, 3], np.int64),
        N=2, shape_type=np.int64,
    )  # fmt: skip
    assert [o.tolist() for o in wide] == [[0, 0], [2, 0]]
    assert wide[1].dtype == np.int64


def test_concat_offset_errors(run_op):
    a, b = np.array([2, 3, 5], np.int32), np.array([2, 7, 6], np.int32)
    with pytest.raises(
        errors.InvalidArgumentError,
        match=r"All dimensions except 1 must match\. Input 1 has shape \[2 7 6\] and doesn't match "
        r"input 0 with shape \[2 3 5\]\.",
    ):
        run_op("ConcatOffset", np.int32(1), a, b, N=2)
    with pytest.raises(errors.InvalidArgumentError, match=r"Concat dim is out of range: 3 vs\. 3"):
        run_op("ConcatOffset", np.int32(3), a, a, N=2)
    with pytest.raises(errors.InvalidArgumentError, match="input 1 should contain 3 elements, but got 2"):
        run_op("ConcatOffset", np.int32(0), a, np.array([1, 2], np.int32), N=2)


# --------------------------------------------------------------------------- sparse optimizers


def test_sparse_rows_passes_split_duplicates_in_order():
    passes = sparse_rows_passes(np.array([3, 1, 3, 0, 3, 1]))
    assert [p.tolist() for p in passes] == [[3, 1, 0], [5, 2], [4]]
    assert sparse_rows_passes(np.array([], np.int64)) == []


class Vars:
    """Resource variables (or TF 1.x reference variables) holding float32 arrays."""

    def __init__(self, ctx, make_node, legacy=False):
        self.ctx, self.make_node, self.legacy = ctx, make_node, legacy
        self.handles = {}

    def add(self, name, value):
        value = np.asarray(value, F32)
        if self.legacy:
            ref = create_kernel(
                self.make_node("VariableV2", name=name, dtype=F32, shape=value.shape)
            ).compute(self.ctx, [])[0]
            create_kernel(self.make_node("Assign", ["r", "v"], name=f"assign_{name}", T=F32)).compute(
                self.ctx, [ref, value]
            )
            self.handles[name] = ref
        else:
            handle = create_kernel(
                self.make_node("VarHandleOp", name=name, dtype=F32, shape=value.shape)
            ).compute(self.ctx, [])[0]
            create_kernel(self.make_node("AssignVariableOp", name=f"assign_{name}", dtype=F32)).compute(
                self.ctx, [handle, value]
            )
            self.handles[name] = handle
        return self.handles[name]

    def value(self, name):
        handle = self.handles[name]
        if self.legacy:
            return handle.variable.value
        return create_kernel(self.make_node("ReadVariableOp", dtype=F32)).compute(self.ctx, [handle])[0]

    def run(self, op, slots, inputs, **attrs):
        op = op if self.legacy else f"Resource{op}"
        values = [self.handles[s] for s in slots] + [np.asarray(x) for x in inputs]
        attrs.setdefault("Tindices", np.int64)
        node = self.make_node(op, [f"in_{i}" for i in range(len(values))], name=op.lower(), T=F32, **attrs)
        return create_kernel(node).compute(self.ctx, values)


@pytest.fixture(params=["resource", "ref"])
def variables(request, new_context, make_node):
    return Vars(new_context(), make_node, legacy=request.param == "ref")


VAR = np.array([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0], [7.0, 8.0]], F32)
ACCUM = np.full((4, 2), 0.5, F32)
GRAD = np.array([[0.1, -0.2], [0.3, 0.4], [-0.5, 0.6]], F32)
IDX = np.array([2, 0, 2], np.int64)  # row 2 twice: two updates, in order


def _expect_rows(var, rows_fn, grad=GRAD, idx=IDX):
    """Walk `idx` in order applying `rows_fn(state_rows, grad_row)` like TF's kernels."""
    state = {k: np.array(v, np.float64) for k, v in var.items()}
    for g, i in zip(grad.astype(np.float64), idx, strict=True):
        new = rows_fn({k: v[i] for k, v in state.items()}, g)
        for k, v in new.items():
            state[k][i] = v
    return state


def test_sparse_apply_adagrad(variables):
    variables.add("var", VAR)
    variables.add("accum", ACCUM)
    out = variables.run("SparseApplyAdagrad", ["var", "accum"], [F32(0.1), GRAD, IDX])
    assert (out == [variables.handles["var"]]) if variables.legacy else out == []

    def step(s, g):
        accum = s["accum"] + g * g
        return {"accum": accum, "var": s["var"] - 0.1 * g / np.sqrt(accum)}

    expected = _expect_rows({"var": VAR, "accum": ACCUM}, step)
    np.testing.assert_allclose(variables.value("var"), expected["var"], rtol=1e-6)
    np.testing.assert_allclose(variables.value("accum"), expected["accum"], rtol=1e-6)
    # row 2 saw both gradients: 0.5 + 0.01 + 0.04 + 0.25 + 0.36
    np.testing.assert_allclose(variables.value("accum")[2], [0.76, 0.9], rtol=1e-6)
    np.testing.assert_array_equal(variables.value("var")[[1, 3]], VAR[[1, 3]])  # untouched rows


def test_sparse_apply_adagrad_without_slot_updates_and_v2(variables):
    variables.add("var", VAR)
    variables.add("accum", ACCUM)
    variables.run("SparseApplyAdagrad", ["var", "accum"], [F32(0.1), GRAD[:1], IDX[:1]], update_slots=False)
    np.testing.assert_array_equal(variables.value("accum"), ACCUM)
    np.testing.assert_allclose(variables.value("var")[2], VAR[2] - 0.1 * GRAD[0] / np.sqrt(0.5), rtol=1e-6)
    variables.run("SparseApplyAdagradV2", ["var", "accum"], [F32(0.1), F32(0.5), GRAD[1:2], IDX[1:2]])
    accum = 0.5 + GRAD[1] ** 2
    np.testing.assert_allclose(variables.value("accum")[0], accum, rtol=1e-6)
    np.testing.assert_allclose(
        variables.value("var")[0], VAR[0] - 0.1 * GRAD[1] / (np.sqrt(accum) + 0.5), rtol=1e-6
    )


@pytest.mark.parametrize("nesterov", [False, True])
def test_sparse_apply_momentum(variables, nesterov):
    variables.add("var", VAR)
    variables.add("accum", ACCUM)
    variables.run(
        "SparseApplyMomentum", ["var", "accum"], [F32(0.1), GRAD, IDX, F32(0.9)], use_nesterov=nesterov
    )

    def step(s, g):
        accum = s["accum"] * 0.9 + g
        delta = 0.1 * g + 0.1 * 0.9 * accum if nesterov else 0.1 * accum
        return {"accum": accum, "var": s["var"] - delta}

    expected = _expect_rows({"var": VAR, "accum": ACCUM}, step)
    np.testing.assert_allclose(variables.value("var"), expected["var"], rtol=1e-6)
    np.testing.assert_allclose(variables.value("accum"), expected["accum"], rtol=1e-6)


def test_sparse_apply_rmsprop(variables):
    variables.add("var", VAR)
    variables.add("ms", ACCUM)
    variables.add("mom", np.full((4, 2), 0.1, F32))
    variables.run(
        "SparseApplyRMSProp", ["var", "ms", "mom"], [F32(0.01), F32(0.9), F32(0.5), F32(1e-3), GRAD, IDX]
    )

    def step(s, g):
        ms = s["ms"] * 0.9 + g * g * 0.1
        mom = s["mom"] * 0.5 + 0.01 * g / np.sqrt(ms + 1e-3)
        return {"ms": ms, "mom": mom, "var": s["var"] - mom}

    expected = _expect_rows({"var": VAR, "ms": ACCUM, "mom": np.full((4, 2), 0.1)}, step)
    for name in ("var", "ms", "mom"):
        np.testing.assert_allclose(variables.value(name), expected[name], rtol=1e-5)


def test_sparse_apply_centered_rmsprop(variables):
    for name, value in (("var", VAR), ("mg", np.full((4, 2), 0.1)), ("ms", ACCUM), ("mom", np.zeros((4, 2)))):
        variables.add(name, value)
    variables.run(
        "SparseApplyCenteredRMSProp",
        ["var", "mg", "ms", "mom"],
        [F32(0.01), F32(0.9), F32(0.5), F32(1e-3), GRAD, IDX],
    )

    def step(s, g):
        ms = s["ms"] * 0.9 + g * g * 0.1
        mg = s["mg"] * 0.9 + g * 0.1
        mom = s["mom"] * 0.5 + 0.01 * g / np.sqrt(ms + 1e-3 - mg * mg)
        return {"ms": ms, "mg": mg, "mom": mom, "var": s["var"] - mom}

    start = {"var": VAR, "mg": np.full((4, 2), 0.1), "ms": ACCUM, "mom": np.zeros((4, 2))}
    expected = _expect_rows(start, step)
    for name in start:
        np.testing.assert_allclose(variables.value(name), expected[name], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("l1", [0.0, 0.05])
def test_sparse_apply_proximal_adagrad(variables, l1):
    variables.add("var", VAR * 0.1)
    variables.add("accum", ACCUM)
    variables.run("SparseApplyProximalAdagrad", ["var", "accum"], [F32(0.1), F32(l1), F32(0.02), GRAD, IDX])

    def step(s, g):
        accum = s["accum"] + g * g
        rate = 0.1 / np.sqrt(accum)
        prox = s["var"] - g * rate
        var = np.sign(prox) * np.maximum(np.abs(prox) - rate * l1, 0) / (1 + 0.02 * rate)
        return {"accum": accum, "var": var}

    expected = _expect_rows({"var": VAR * 0.1, "accum": ACCUM}, step)
    np.testing.assert_allclose(variables.value("var"), expected["var"], rtol=1e-5)
    np.testing.assert_allclose(variables.value("accum"), expected["accum"], rtol=1e-6)


def _ftrl_step(l1, l2, lr, lr_power, shrinkage=0.0, by_lr=False):
    def step(s, g):
        shrunk = g + 2 * shrinkage * s["var"]
        new_accum = s["accum"] + g * g
        sigma = new_accum ** (-lr_power) - s["accum"] ** (-lr_power)
        if by_lr:
            linear = s["linear"] + shrunk * lr - sigma * s["var"]
            limit, quadratic = l1 * lr, new_accum ** (-lr_power) + 2 * l2 * lr
        else:
            linear = s["linear"] + shrunk - sigma / lr * s["var"]
            limit, quadratic = l1, new_accum ** (-lr_power) / lr + 2 * l2
        var = np.where(np.abs(linear) > limit, (np.sign(linear) * limit - linear) / quadratic, 0.0)
        return {"accum": new_accum, "linear": linear, "var": var}

    return step


LINEAR = np.array([[0.2, -0.01], [0.5, 0.0], [-0.3, 0.02], [1.0, 1.0]], F32)


@pytest.mark.parametrize(
    ("lr_power", "by_lr"), [(-0.5, False), (-0.3, False), (-0.5, True)], ids=["sqrt", "pow", "by_lr"]
)
def test_sparse_apply_ftrl(variables, lr_power, by_lr):
    variables.add("var", VAR * 0.1)
    variables.add("accum", ACCUM)
    variables.add("linear", LINEAR)
    variables.run(
        "SparseApplyFtrl",
        ["var", "accum", "linear"],
        [GRAD, IDX, F32(0.1), F32(0.05), F32(0.02), F32(lr_power)],
        multiply_linear_by_lr=by_lr,
    )
    start = {"var": VAR * 0.1, "accum": ACCUM, "linear": LINEAR}
    expected = _expect_rows(start, _ftrl_step(0.05, 0.02, 0.1, lr_power, by_lr=by_lr))
    for name in start:
        np.testing.assert_allclose(variables.value(name), expected[name], rtol=1e-5, atol=1e-7)


def test_sparse_apply_ftrl_v2_shrinks(variables):
    variables.add("var", VAR * 0.1)
    variables.add("accum", ACCUM)
    variables.add("linear", LINEAR)
    variables.run(
        "SparseApplyFtrlV2",
        ["var", "accum", "linear"],
        [GRAD, IDX, F32(0.1), F32(0.05), F32(0.02), F32(0.1), F32(-0.5)],
    )
    start = {"var": VAR * 0.1, "accum": ACCUM, "linear": LINEAR}
    expected = _expect_rows(start, _ftrl_step(0.05, 0.02, 0.1, -0.5, shrinkage=0.1))
    for name in start:
        np.testing.assert_allclose(variables.value(name), expected[name], rtol=1e-5, atol=1e-7)


def test_sparse_apply_on_a_vector_variable_with_int32_indices(variables):
    variables.add("var", np.array([1.0, 2.0, 3.0], F32))
    variables.add("accum", np.array([1.0, 1.0, 1.0], F32))
    variables.run(
        "SparseApplyAdagrad",
        ["var", "accum"],
        [F32(1.0), np.array([3.0, 4.0], F32), np.array([1, 1], np.int32)],
        Tindices=np.int32,
    )
    # row 1: accum 1 + 9 = 10, var 2 - 3/sqrt(10); then accum 26, var -= 4/sqrt(26)
    np.testing.assert_allclose(variables.value("accum"), [1, 26, 1])
    expected = [1, 2 - 3 / np.sqrt(10) - 4 / np.sqrt(26), 3]
    np.testing.assert_allclose(variables.value("var"), expected, rtol=1e-6)


def test_sparse_apply_with_no_indices_changes_nothing(variables):
    variables.add("var", VAR)
    variables.add("accum", ACCUM)
    variables.run(
        "SparseApplyMomentum",
        ["var", "accum"],
        [F32(0.1), np.zeros((0, 2), F32), np.zeros(0, np.int64), F32(0.9)],
    )
    np.testing.assert_array_equal(variables.value("var"), VAR)


def test_sparse_apply_out_of_range_index_changes_nothing(variables):
    variables.add("var", VAR)
    variables.add("accum", ACCUM)
    with pytest.raises(errors.InvalidArgumentError) as info:
        variables.run("SparseApplyAdagrad", ["var", "accum"], [F32(0.1), GRAD, np.array([1, 7, -1])])
    assert info.value.message.startswith("Index 7 at offset 1 in indices is out of range")
    assert info.value.node_name is not None
    np.testing.assert_array_equal(variables.value("var"), VAR)
    np.testing.assert_array_equal(variables.value("accum"), ACCUM)


@pytest.mark.parametrize(
    ("inputs", "message"),
    [
        ([F32(0.1), GRAD[:2], IDX], "grad must be the same size as indices in the first dimension."),
        ([F32(0.1), np.zeros((3, 3), F32), IDX], "var and grad must match in dimension 1"),
        ([F32(0.1), GRAD, IDX.reshape(3, 1)], "indices must be one-dimensional"),
        ([np.array([0.1, 0.2], F32), GRAD, IDX], r"lr is not a scalar: \[2\]"),
    ],
)
def test_sparse_apply_shape_errors(variables, inputs, message):
    variables.add("var", VAR)
    variables.add("accum", ACCUM)
    with pytest.raises(errors.InvalidArgumentError, match=message):
        variables.run("SparseApplyAdagrad", ["var", "accum"], inputs)


def test_sparse_apply_checks_slot_shapes_and_ftrl_scalars(variables):
    variables.add("var", VAR)
    variables.add("accum", np.ones((4, 3), F32))
    variables.add("linear", LINEAR)
    with pytest.raises(
        errors.InvalidArgumentError, match=r"var and accum do not have the same shape\[4,2\] \[4,3\]"
    ):
        variables.run("SparseApplyAdagrad", ["var", "accum"], [F32(0.1), GRAD, IDX])
    with pytest.raises(errors.InvalidArgumentError, match=r"lr is not a positive scalar: \[\]"):
        variables.run(
            "SparseApplyFtrl", ["var", "linear", "linear"], [GRAD, IDX, F32(0), F32(0), F32(0), F32(-0.5)]
        )
    with pytest.raises(errors.InvalidArgumentError, match="lr_power is not a non-positive scalar"):
        variables.run(
            "SparseApplyFtrl", ["var", "linear", "linear"], [GRAD, IDX, F32(1), F32(0), F32(0), F32(0.5)]
        )


def test_sparse_apply_on_an_uninitialized_variable(new_context, make_node):
    ctx = new_context()
    ref = create_kernel(make_node("VariableV2", name="emb", dtype=F32, shape=(4, 2))).compute(ctx, [])[0]
    accum = create_kernel(make_node("VariableV2", name="acc", dtype=F32, shape=(4, 2))).compute(ctx, [])[0]
    node = make_node("SparseApplyAdagrad", ["emb", "acc", "lr", "g", "i"], T=F32, Tindices=np.int64)
    with pytest.raises(errors.FailedPreconditionError, match="use uninitialized variables: emb"):
        create_kernel(node).compute(ctx, [ref, accum, F32(0.1), GRAD, IDX])
    missing = make_node("VarHandleOp", name="missing", dtype=F32, shape=(4, 2))
    handle = create_kernel(missing).compute(ctx, [])[0]
    node = make_node("ResourceSparseApplyAdagrad", ["a", "b", "lr", "g", "i"], T=F32, Tindices=np.int64)
    with pytest.raises(errors.NotFoundError, match="localhost/missing/N10tensorflow3VarE does not exist"):
        create_kernel(node).compute(ctx, [handle, handle, F32(0.1), GRAD, IDX])


def test_sparse_apply_refuses_unsupported_types(make_node):
    with pytest.raises(errors.InvalidArgumentError, match="No OpKernel was registered"):
        create_kernel(make_node("SparseApplyAdagrad", T=np.int32, Tindices=np.int64))
    with pytest.raises(errors.InvalidArgumentError, match="No OpKernel was registered"):
        create_kernel(make_node("ResourceSparseApplyFtrl", T=np.complex64, Tindices=np.int64))
    with pytest.raises(errors.InvalidArgumentError, match="No OpKernel was registered"):
        create_kernel(make_node("SparseApplyMomentum", T=F32, Tindices=np.int16))


def test_sparse_apply_ref_kernels_are_stateful_and_take_references(make_node):
    kernel = create_kernel(make_node("SparseApplyFtrlV2", T=F32, Tindices=np.int32))
    assert kernel.is_stateful
    assert kernel.ref_inputs == frozenset({0, 1, 2})
    assert create_kernel(make_node("ResourceSparseApplyRMSProp", T=F32, Tindices=np.int32)).ref_inputs == (
        frozenset()
    )


# --------------------------------------------------------------------------- dense twins


def test_dense_ftrl_and_ftrl_v2(variables):
    grad = np.array([[0.1, -0.2], [0.3, 0.4], [-0.5, 0.6], [0.0, 1.0]], F32)
    start = {"var": VAR * 0.1, "accum": ACCUM, "linear": LINEAR}
    for name, value in start.items():
        variables.add(name, value)
    variables.run("ApplyFtrl", list(start), [grad, F32(0.1), F32(0.05), F32(0.02), F32(-0.5)])
    expected = _expect_rows(start, _ftrl_step(0.05, 0.02, 0.1, -0.5), grad=grad, idx=np.arange(4))
    for name in start:
        np.testing.assert_allclose(variables.value(name), expected[name], rtol=1e-5, atol=1e-7)
    variables.run(
        "ApplyFtrlV2", list(start), [grad, F32(0.1), F32(0.05), F32(0.02), F32(0.1), F32(-0.5)],
        multiply_linear_by_lr=True,
    )  # fmt: skip
    expected = _expect_rows(
        expected, _ftrl_step(0.05, 0.02, 0.1, -0.5, shrinkage=0.1, by_lr=True), grad=grad, idx=np.arange(4)
    )
    for name in start:
        np.testing.assert_allclose(variables.value(name), expected[name], rtol=1e-5, atol=1e-7)


def test_dense_proximal_adagrad_and_centered_rmsprop(variables):
    grad = np.array([[0.1, -0.2], [0.3, 0.4], [-0.5, 0.6], [0.0, 1.0]], F32)
    variables.add("var", VAR)
    variables.add("accum", ACCUM)
    variables.run("ApplyProximalAdagrad", ["var", "accum"], [F32(0.1), F32(0.0), F32(0.02), grad])
    accum = ACCUM + grad * grad
    rate = 0.1 / np.sqrt(accum)
    np.testing.assert_allclose(variables.value("var"), (VAR - grad * rate) / (1 + 0.02 * rate), rtol=1e-6)
    variables.add("mg", np.zeros((4, 2)))
    variables.add("ms", ACCUM)
    variables.add("mom", np.zeros((4, 2)))
    var = variables.value("var").astype(np.float64)
    variables.run(
        "ApplyCenteredRMSProp", ["var", "mg", "ms", "mom"], [F32(0.01), F32(0.9), F32(0.0), F32(1e-3), grad]
    )
    ms = ACCUM + (grad * grad - ACCUM) * 0.1
    mg = grad * 0.1
    np.testing.assert_allclose(
        variables.value("var"), var - 0.01 * grad / np.sqrt(ms - mg * mg + 1e-3), rtol=1e-5
    )


@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.uint8])
@pytest.mark.parametrize("distinct", [1, 3, 200, 100_000])
def test_unique_of_integers_matches_the_first_appearance_definition(run_op, dtype, distinct):
    # Integer vectors take their own path (`_first_occurrence_unique_ints`); check it
    # against the definition, walked in Python.
    rng = np.random.default_rng(distinct)
    x = rng.integers(0, min(distinct, np.iinfo(dtype).max + 1), 500).astype(dtype)
    y, idx, count = run_op("UniqueWithCounts", x, T=dtype, out_idx=np.int64)
    first: dict[int, int] = {}
    for value in x.tolist():
        first.setdefault(value, len(first))
    np.testing.assert_array_equal(y, np.array(list(first), dtype))
    np.testing.assert_array_equal(idx, [first[v] for v in x.tolist()])
    np.testing.assert_array_equal(count, [x.tolist().count(v) for v in first])
    assert y.dtype == dtype
