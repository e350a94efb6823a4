"""Optimizer updates written into the variable's own array, and when they must not be.

An update may write in place only while nothing but the variable references the
stored array (`VariableResource.unshared`); otherwise it builds a new array, so a
reader's value never changes under it. Either way the bits are the same.
"""

from __future__ import annotations

import threading
import weakref

import numpy as np
import pytest

from distserver.kernels import create_kernel, state
from distserver.kernels.resources import VariableResource

from .conftest import Context

SHAPE = (6, 5)


def _variable(make_node, ctx, name, value):
    handle = create_kernel(make_node("VarHandleOp", name=name, dtype=value.dtype, shape=value.shape)).compute(
        ctx, []
    )[0]
    assign = create_kernel(make_node("AssignVariableOp", name=f"assign_{name}", dtype=value.dtype))
    assign.compute(ctx, [handle, value])
    resource = ctx.resources.lookup(handle[()].container, handle[()].name)
    assert isinstance(resource, VariableResource)
    return handle, resource


def _optimizer_inputs(op, handles, grad, dtype, rows):
    s = lambda x: np.array(x, dtype)  # noqa: E731
    if op == "ResourceApplyGradientDescent":
        return [handles[0], s(0.1), grad]
    if op == "ResourceApplyMomentum":
        return [*handles[:2], s(0.05), grad, s(0.9)]
    if op == "ResourceApplyAdam":
        return [*handles[:3], s(0.9**3), s(0.999**3), s(0.01), s(0.9), s(0.999), s(1e-7), grad]
    if op == "ResourceApplyAdagrad":
        return [*handles[:2], s(0.1), grad]
    if op == "ResourceApplyAdagradV2":
        return [*handles[:2], s(0.1), s(1e-7), grad]
    if op == "ResourceSparseApplyAdagrad":
        return [*handles[:2], s(0.1), grad[: len(rows)], rows]
    raise AssertionError(op)


SLOTS = {
    "ResourceApplyGradientDescent": 1,
    "ResourceApplyMomentum": 2,
    "ResourceApplyAdam": 3,
    "ResourceApplyAdagrad": 2,
    "ResourceApplyAdagradV2": 2,
    "ResourceSparseApplyAdagrad": 2,
}
CASES = [
    ("ResourceApplyGradientDescent", {}),
    ("ResourceApplyMomentum", {"use_nesterov": False}),
    ("ResourceApplyMomentum", {"use_nesterov": True}),
    ("ResourceApplyAdam", {"use_nesterov": False}),
    ("ResourceApplyAdam", {"use_nesterov": True}),
    ("ResourceApplyAdagrad", {}),
    ("ResourceApplyAdagrad", {"update_slots": False}),
    ("ResourceApplyAdagradV2", {}),
    ("ResourceSparseApplyAdagrad", {}),
]


def _train(make_node, op, attrs, dtype, *, hold_reads, shape=SHAPE):
    """Three updates of fresh variables; returns (final values, kept reads, in place each step)."""
    ctx = Context()
    rng = np.random.default_rng(7)
    slots = [
        _variable(make_node, ctx, f"v{i}", np.abs(rng.normal(size=shape)).astype(dtype))
        for i in range(SLOTS[op])
    ]
    handles = [h for h, _ in slots]
    extra = {"Tindices": np.int32} if "Sparse" in op else {}
    kernel = create_kernel(make_node(op, name="apply", T=dtype, **extra, **attrs))
    rows = np.array([4, 1, 4, 0], np.int32)  # a repeated row: the update walks them in order
    kept, in_place = [], []
    for _ in range(3):
        grad = rng.normal(size=shape).astype(dtype)
        if hold_reads:  # a reader (a fetch, a send waiting for its RecvTensor) holds the value
            kept.append([(resource.read(), resource.read().copy()) for _, resource in slots])
        # Weak references: the test must not be a reader itself.
        before = [weakref.ref(resource.value) for _, resource in slots]
        kernel.compute(ctx, _optimizer_inputs(op, handles, grad, dtype, rows))
        in_place.append(
            all(resource.value is old() for (_, resource), old in zip(slots, before, strict=True))
        )
    return [resource.value.copy() for _, resource in slots], kept, in_place


@pytest.mark.parametrize(("op", "attrs"), CASES, ids=[f"{op}-{attrs}" for op, attrs in CASES])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_in_place_updates_give_the_same_bits_and_never_touch_a_held_value(make_node, op, attrs, dtype, loops):
    in_place_result, _, in_place = _train(make_node, op, attrs, dtype, hold_reads=False)
    copied_result, kept, copied_in_place = _train(make_node, op, attrs, dtype, hold_reads=True)
    assert in_place == [True, True, True]
    assert copied_in_place == [False, False, False]
    for got, expected in zip(in_place_result, copied_result, strict=True):
        np.testing.assert_array_equal(got.view(np.uint8), expected.view(np.uint8))
    for step in kept:
        for held, snapshot in step:
            np.testing.assert_array_equal(held, snapshot)  # what a reader got never changed
            assert not held.flags.writeable


DENSE_CASES = [case for case in CASES if "Sparse" not in case[0]]


@pytest.mark.parametrize(("op", "attrs"), DENSE_CASES, ids=[f"{op}-{attrs}" for op, attrs in DENSE_CASES])
def test_a_large_variable_updated_in_place_gets_the_bits_of_one_whole_update(make_node, op, attrs, loops):
    # 300 x 1001 float32 (1.2 MB) is written piece by piece (`state._PIECE_BYTES`, and
    # a last piece of another size) or by a compiled loop; the copying path computes it
    # whole with numpy.
    shape = (300, 1001)
    assert np.prod(shape) * 4 > 4 * state._PIECE_BYTES
    assert np.prod(shape) * 4 % state._PIECE_BYTES
    in_place_result, _, in_place = _train(make_node, op, attrs, np.float32, hold_reads=False, shape=shape)
    copied_result, _, copied_in_place = _train(make_node, op, attrs, np.float32, hold_reads=True, shape=shape)
    assert in_place == [True, True, True]
    assert copied_in_place == [False, False, False]
    for got, expected in zip(in_place_result, copied_result, strict=True):
        np.testing.assert_array_equal(got.view(np.uint8), expected.view(np.uint8))


def test_pieces_are_views_of_contiguous_arrays_and_whole_otherwise():
    var = np.zeros(3 * state._PIECE_BYTES // 4 + 5, np.float32)
    grad = np.ones_like(var)
    signature = (("var", "var"), ("alpha", "scalar"), ("delta", "tensor"))
    alpha = np.float32(0.5).reshape(())
    pieces = state._pieces({"var": var, "alpha": alpha, "delta": grad}, signature)
    assert [p["var"].size for p in pieces] == [65536, 65536, 65536, 5]
    assert all(np.shares_memory(p["var"], var) and p["alpha"] is alpha for p in pieces)
    strided = np.ones(2 * var.size, np.float32)[::2]  # not contiguous: no pieces
    whole = state._pieces({"var": var, "alpha": alpha, "delta": strided}, signature)
    assert len(whole) == 1
    assert whole[0]["delta"] is strided


@pytest.mark.parametrize("op", sorted(set(SLOTS) - {"ResourceSparseApplyAdagrad"}))
def test_scalar_variables_are_updated_out_of_place(make_node, op):
    ctx = Context()
    slots = [_variable(make_node, ctx, f"v{i}", np.array(0.5 + i, np.float32)) for i in range(SLOTS[op])]
    kernel = create_kernel(make_node(op, T=np.float32))
    before = weakref.ref(slots[0][1].value)
    kernel.compute(
        ctx, _optimizer_inputs(op, [h for h, _ in slots], np.array(0.25, np.float32), np.float32, [])
    )
    assert slots[0][1].value is not before()
    assert slots[0][1].value.shape == ()


def test_a_view_of_the_value_counts_as_a_reader(make_node):
    ctx = Context()
    handle, resource = _variable(make_node, ctx, "v", np.zeros(8, np.float32))
    view = resource.read()[2:4]
    assert not resource.unshared()
    kernel = create_kernel(make_node("ResourceApplyGradientDescent", T=np.float32))
    kernel.compute(ctx, [handle, np.float32(1.0), np.ones(8, np.float32)])
    np.testing.assert_array_equal(view, [0.0, 0.0])
    del view
    assert resource.unshared()


def test_an_array_that_does_not_own_its_memory_is_never_written(make_node):
    ctx = Context()
    _, resource = _variable(make_node, ctx, "v", np.zeros(8, np.float32))
    backing = np.zeros(16, np.float32)
    with resource.lock:
        resource.replace(backing[:8])  # e.g. a value in a transport's buffer
        assert not resource.unshared()


def torn_reads(make_node, ctx, handle, dtype, update):
    """Run `update()` while two threads read the variable of `handle` (of `dtype`) as
    fast as they can; the (min, max) of every read that was not uniform."""
    read = create_kernel(make_node("ReadVariableOp", dtype=dtype))
    torn, done = [], threading.Event()

    def reader():
        while not done.is_set():
            value = read.compute(ctx, [handle])[0]
            if value[0] != value[-1] or value.min() != value.max():
                torn.append((value.min(), value.max()))
            del value

    readers = [threading.Thread(target=reader) for _ in range(2)]
    for thread in readers:
        thread.start()
    try:
        update()
    finally:
        done.set()
        for thread in readers:
            thread.join()
    return torn


def test_concurrent_readers_never_see_a_torn_value(make_node):
    # GD with delta -1 adds 1 to every element: any read that is not uniform saw an
    # update half done. Large enough that numpy releases the GIL inside the update.
    ctx = Context()
    handle, resource = _variable(make_node, ctx, "v", np.zeros(1 << 18, np.float64))
    apply = create_kernel(make_node("ResourceApplyGradientDescent", T=np.float64))
    delta = -np.ones(1 << 18, np.float64)
    steps = 200

    def update():
        for _ in range(steps):
            apply.compute(ctx, [handle, np.float64(1.0), delta])

    assert torn_reads(make_node, ctx, handle, np.float64, update) == []
    np.testing.assert_array_equal(resource.value, np.full(1 << 18, float(steps)))
    before = weakref.ref(resource.value)
    apply.compute(ctx, [handle, np.float64(1.0), delta])  # no reader left: in place
    assert resource.value is before()


@pytest.mark.parametrize(
    "rows",
    [[5, 0, 17, 3, 9], [5, 0, 5, 3, 0, 5], list(range(40))],
    ids=["distinct-shuffled", "repeated", "every-row"],
)
def test_a_sparse_update_equals_walking_its_rows_one_by_one(make_node, rows, loops):
    # Distinct rows take one pass over all positions (`sparse._update_passes`), repeated
    # ones a pass per occurrence; either way the bits of TF's walk over the rows in order.
    rng = np.random.default_rng(11)
    start = [np.abs(rng.normal(size=(40, 3))).astype(np.float32) + 0.1 for _ in range(2)]
    rows = np.array(rows, np.int64)
    grad = rng.normal(size=(rows.size, 3)).astype(np.float32)
    lr = np.array(0.1, np.float32)
    results = []
    for one_by_one in (False, True):
        ctx = Context()
        handles = [_variable(make_node, ctx, f"v{i}", value.copy())[0] for i, value in enumerate(start)]
        kernel = create_kernel(make_node("ResourceSparseApplyAdagrad", T=np.float32, Tindices=np.int64))
        batches = [slice(k, k + 1) for k in range(rows.size)] if one_by_one else [slice(None)]
        for batch in batches:
            kernel.compute(ctx, [*handles, lr, grad[batch], rows[batch]])
        results.append([ctx.resources.lookup(h[()].container, h[()].name).value.copy() for h in handles])
    for batched, walked in zip(*results, strict=True):
        np.testing.assert_array_equal(batched.view(np.uint32), walked.view(np.uint32))
