"""An optimizer's sparse update of rows named more than once as one node
(`kernels.sparse.DeduplicatedSparseUpdateKernel`): the bits, the errors and the
variables' values of its five parts run one by one, by its compiled loop and without
it; malformed nodes refused."""

from __future__ import annotations

import numpy as np
import pytest

from distserver import errors
from distserver.kernels import _compiled, create_kernel
from distserver.kernels.math import FUSED_NODES_ATTR
from distserver.kernels.sparse import DEDUPLICATED_SPARSE_UPDATE_OP

from .conftest import Context, make_node
from .test_in_place_updates import _variable

I32, I64 = np.int32, np.int64


def _parts(dtype, index_type, update_slots=True):
    """Unique, Shape, StridedSlice (shape[0]), UnsortedSegmentSum, ResourceSparseApplyAdagrad,
    wired as TF's `_deduplicate_indexed_slices` wires them."""
    return [
        make_node("Unique", ["indices"], name="u/Unique", T=index_type, out_idx=I32),
        make_node("Shape", ["u/Unique"], name="u/Shape", T=index_type, out_type=I32),
        make_node(
            "StridedSlice",
            ["u/Shape", "begin", "end", "strides"],
            name="u/strided_slice",
            T=I32,
            Index=I32,
            shrink_axis_mask=1,
            begin_mask=0,
            end_mask=0,
            ellipsis_mask=0,
            new_axis_mask=0,
        ),
        make_node(
            "UnsortedSegmentSum",
            ["values", "u/Unique:1", "u/strided_slice"],
            name="u/UnsortedSegmentSum",
            T=dtype,
            Tindices=I32,
            Tnumsegments=I32,
        ),
        make_node(
            "ResourceSparseApplyAdagrad",
            ["var", "accum", "lr", "u/UnsortedSegmentSum", "u/Unique"],
            name="u/update",
            T=dtype,
            Tindices=index_type,
            update_slots=update_slots,
        ),
    ]


def _fused(parts):
    node = make_node(
        DEDUPLICATED_SPARSE_UPDATE_OP, ["i", "v", "var", "accum", "lr", "b", "e", "s"], name="u/update"
    )
    node.attr[FUSED_NODES_ATTR].list.s.extend(part.SerializeToString() for part in parts)
    return create_kernel(node)


def _run(kernel, start, indices, values, *, lr=0.1, slice_=(0, 1, 1), hold=False):
    """The variables after one update from `start`, and what `kernel` raised (or None)."""
    ctx = Context()
    handles = [_variable(make_node, ctx, f"v{i}", value.copy())[0] for i, value in enumerate(start)]
    resources = [ctx.resources.lookup(h[()].container, h[()].name) for h in handles]
    held = [r.value for r in resources] if hold else []  # (a reader holding the values)
    held_before = [value.copy() for value in held]
    constants = [np.array([c], I32) for c in slice_]
    raised = None
    try:
        kernel.compute(ctx, [indices, values, *handles, np.array(lr, values.dtype), *constants])
    except errors.OpError as exc:
        raised = exc.message
    for value, before in zip(held, held_before, strict=True):
        np.testing.assert_array_equal(value, before)  # (never written in place under a reader)
    return [r.value.copy() for r in resources], raised


def _unfused(parts, start, indices, values, **kwargs):
    """The same update by the parts' own kernels, one after the other."""
    unique, shape, count, total, update = (create_kernel(part) for part in parts)

    class Chain:
        def compute(self, ctx, inputs):
            i, v, var, accum, lr, b, e, s = inputs
            u, position = unique.compute(ctx, [i])
            (n,) = count.compute(ctx, [shape.compute(ctx, [u])[0], b, e, s])
            (summed,) = total.compute(ctx, [v, position, n])
            return update.compute(ctx, [var, accum, lr, summed, u])

    return _run(Chain(), start, indices, values, **kwargs)


def _assert_same(got, expected):
    assert got[1] == expected[1]
    for a, b in zip(got[0], expected[0], strict=True):
        np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))


def _case(dtype, rows=40, width=6, ids=(5, 0, 17, 5, 3, 0, 5, 39), seed=3):
    rng = np.random.default_rng(seed)
    start = [
        rng.normal(size=(rows, width)).astype(dtype),
        np.abs(rng.normal(size=(rows, width))).astype(dtype) + 0.1,
    ]
    values = (rng.normal(size=(len(ids), width)) * 10.0 ** rng.integers(-3, 3, size=(len(ids), 1))).astype(
        dtype
    )
    values[1, :2] = -0.0  # (a row that sums from zero: +0.0, as the segment sum makes it)
    return start, values


@pytest.fixture
def compiled(monkeypatch):
    """Each test runs with the compiled loops (counted) and then without them."""
    assert _compiled.wait(300), "the compiled loops are not there: numba missing? (pip install -e '.[dev]')"
    real = _compiled.loops()
    calls = []

    def counted(*args):
        calls.append(args)
        return real.deduplicated_sparse_adagrad(*args)

    class Loops:
        def __getattr__(self, name):
            return counted if name == "deduplicated_sparse_adagrad" else getattr(real, name)

    monkeypatch.setattr(_compiled, "_loops", Loops())

    def without():
        monkeypatch.setattr(_compiled, "_loops", None)

    return calls, without


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("index_type", [I32, I64])
@pytest.mark.parametrize("update_slots", [True, False])
def test_the_fused_update_gives_the_parts_bits_both_ways(compiled, dtype, index_type, update_slots):
    calls, without = compiled
    parts = _parts(dtype, index_type, update_slots)
    start, values = _case(dtype)
    indices = np.array([5, 0, 17, 5, 3, 0, 5, 39], index_type)
    expected = _unfused(parts, start, indices, values)
    assert expected[1] is None
    got = _run(_fused(parts), start, indices, values)
    assert len(calls) == 1  # (the loop made it)
    _assert_same(got, expected)
    without()
    _assert_same(_run(_fused(parts), start, indices, values), expected)
    assert len(calls) == 1


@pytest.mark.parametrize(
    ("ids", "slice_", "hold"),
    [
        ([5, 0, 5], (0, 1, 1), True),  # a reader holds the variables' values
        ([0, 3000, 0], (0, 1, 1), False),  # ids over a range too wide for a table
        ([5, 0, 5], (0, 2, 1), False),  # the slice is not shape[0] (the count then differs)
    ],
    ids=["shared-variable", "wide-range", "other-slice"],
)
def test_what_the_loop_does_not_take_runs_the_parts(compiled, ids, slice_, hold):
    calls, _ = compiled
    parts = _parts(np.float32, I64)
    start, values = _case(np.float32, rows=3001, ids=ids)
    indices = np.array(ids, I64)
    expected = _unfused(parts, start, indices, values, slice_=slice_, hold=hold)
    got = _run(_fused(parts), start, indices, values, slice_=slice_, hold=hold)
    _assert_same(got, expected)
    # (the wide range reached the loop, which left it to the parts having changed nothing)
    assert len(calls) == (1 if ids[1] == 3000 else 0)


@pytest.mark.parametrize("bad", [-1, 40], ids=["negative", "past-the-end"])
def test_a_row_out_of_range_is_named_as_the_update_names_it_and_nothing_changes(compiled, bad):
    calls, without = compiled
    parts = _parts(np.float32, I64)
    start, values = _case(np.float32, ids=(5, 0, 5, bad, 7))
    indices = np.array([5, 0, 5, bad, 7], I64)
    expected = _unfused(parts, start, indices, values)
    assert expected[1] is not None
    assert f"Index {bad} at offset 2 in indices is out of range" in expected[1]
    got = _run(_fused(parts), start, indices, values)
    assert len(calls) == 1
    _assert_same(got, expected)
    for value, before in zip(got[0], start, strict=True):
        np.testing.assert_array_equal(value, before)
    without()
    _assert_same(_run(_fused(parts), start, indices, values), expected)


def test_a_malformed_node_is_refused():
    parts = _parts(np.float32, I64)
    for wrong in (
        parts[:4],
        [parts[1], parts[0], *parts[2:]],
        [*parts[:4], make_node("ResourceApplyAdagrad", name="x", T=np.float32)],
    ):
        with pytest.raises(errors.InvalidArgumentError, match=r"u/update.*expected \['Unique', 'Shape'"):
            _fused(wrong)
    kernel = _fused(parts)
    with pytest.raises(errors.InvalidArgumentError, match="expects 8 inputs, got 7"):
        kernel.compute(Context(), [np.zeros(1)] * 7)
