"""Grouped updates over their variables side by side (`state._VariableArena`).

A group whose parts all make the same element-wise update keeps its variables'
values in one flat array per slot and updates them all at once. The bits must be
those of the parts run one by one, and the arena must never be written while
anything but the variables references it: a reader's value, or a view made from
it, never changes.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from distserver.kernels import create_kernel
from distserver.kernels.math import FUSED_NODES_ATTR
from distserver.kernels.state import ARENA_MAX_VARIABLE_BYTES, GROUPED_UPDATES_OP, OPTIMIZER_UPDATES
from distserver.protos.node_def_pb2 import NodeDef

from .conftest import Context, make_node
from .test_in_place_updates import CASES, SLOTS, _optimizer_inputs, _variable

SHAPES = [(3, 4), (7,), (2, 2, 2), (1,), (5, 3), ()]  # (a scalar variable too)
DENSE_CASES = [case for case in CASES if "Sparse" not in case[0]]


def _group_node(op: str, dtype: type, attrs: dict, count: int) -> NodeDef:
    parts = [make_node(op, name=f"apply_{p}", T=dtype, **attrs) for p in range(count)]
    arity = len(_optimizer_inputs(op, [None] * 3, None, dtype, []))
    for part in parts:
        part.input.extend(f"{part.name}_in_{i}" for i in range(arity))
    node = NodeDef(name="group", op=GROUPED_UPDATES_OP)
    node.attr["N"].i = arity * count
    node.attr[FUSED_NODES_ATTR].list.s.extend(part.SerializeToString() for part in parts)
    return node


class Model:
    """Variables of `SHAPES` (each with the op's slots) in a fresh context, and the
    gradients of every step, the same for every model made with the same seed."""

    def __init__(self, op: str, dtype: type, seed: int = 3, shapes: list[tuple[int, ...]] = SHAPES) -> None:
        self.op, self.dtype, self.shapes = op, dtype, shapes
        self.ctx = Context()
        rng = np.random.default_rng(seed)
        self.parts = [
            [
                _variable(make_node, self.ctx, f"v{p}_{s}", np.abs(rng.normal(size=shape)).astype(dtype))
                for s in range(SLOTS[op])
            ]
            for p, shape in enumerate(shapes)
        ]
        self.grads = [[rng.normal(size=shape).astype(dtype) for shape in shapes] for _ in range(4)]

    def inputs(self, step: int, part: int) -> list:
        handles = [handle for handle, _ in self.parts[part]]
        return _optimizer_inputs(self.op, handles, self.grads[step][part], self.dtype, [])

    def group_inputs(self, step: int) -> list:
        return [value for part in range(len(self.shapes)) for value in self.inputs(step, part)]

    def resources(self) -> list:
        return [resource for slots in self.parts for _, resource in slots]

    def values(self) -> list[np.ndarray]:
        return [resource.value.copy() for resource in self.resources()]


def _one_by_one(op: str, dtype: type, attrs: dict, steps: int, shapes: list = SHAPES) -> list[np.ndarray]:
    """The values after `steps` steps of the parts run on their own."""
    model = Model(op, dtype, shapes=shapes)
    kernel = create_kernel(make_node(op, name="apply", T=dtype, **attrs))
    for step in range(steps):
        for part in range(len(shapes)):
            kernel.compute(model.ctx, model.inputs(step, part))
    return model.values()


def _assert_same_bits(got: list[np.ndarray], expected: list[np.ndarray]) -> None:
    for a, b in zip(got, expected, strict=True):
        np.testing.assert_array_equal(a.reshape(-1).view(np.uint8), b.reshape(-1).view(np.uint8))


def _in_arena(kernel, model: Model, parts: list[int] | None = None) -> bool:
    """Whether the variables of `parts` (every part's by default) are in the kernel's arena."""
    arena = kernel._arena
    slots = model.parts if parts is None else [model.parts[part] for part in parts]
    return arena is not None and all(
        any(np.shares_memory(resource.value, flat) for flat in arena.arrays)
        for slot in slots
        for _, resource in slot
    )


@pytest.mark.parametrize(("op", "attrs"), DENSE_CASES, ids=[f"{op}-{attrs}" for op, attrs in DENSE_CASES])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_like_updates_run_over_an_arena_with_the_bits_of_the_parts_one_by_one(op, attrs, dtype):
    model = Model(op, dtype)
    kernel = create_kernel(_group_node(op, dtype, attrs, len(SHAPES)))
    for step in range(3):
        before = OPTIMIZER_UPDATES.in_place
        kernel.compute(model.ctx, model.group_inputs(step))
        assert OPTIMIZER_UPDATES.in_place - before == len(SHAPES)
        assert _in_arena(kernel, model)
    _assert_same_bits(model.values(), _one_by_one(op, dtype, attrs, 3))
    for resource in model.resources():
        assert not resource.value.flags.writeable
        assert not resource.unshared()  # (a view: every other kernel copies instead of writing)


# Part 1's variable is beyond `ARENA_MAX_VARIABLE_BYTES` (120 KiB of float32).
MIXED_SHAPES = [(3, 4), (240, 128), (7,), ()]


@pytest.mark.parametrize(("op", "attrs"), DENSE_CASES, ids=[f"{op}-{attrs}" for op, attrs in DENSE_CASES])
def test_the_small_variables_of_a_group_with_a_large_one_update_over_an_arena(op, attrs):
    assert np.prod(MIXED_SHAPES[1]) * 4 > ARENA_MAX_VARIABLE_BYTES
    model = Model(op, np.float32, shapes=MIXED_SHAPES)
    kernel = create_kernel(_group_node(op, np.float32, attrs, len(MIXED_SHAPES)))
    for step in range(3):
        before = OPTIMIZER_UPDATES.in_place
        kernel.compute(model.ctx, model.group_inputs(step))
        assert OPTIMIZER_UPDATES.in_place - before == len(MIXED_SHAPES)  # the large one in place on its own
        assert _in_arena(kernel, model, [0, 2, 3])
        assert not any(
            np.shares_memory(r.value, flat) for _, r in model.parts[1] for flat in kernel._arena.arrays
        )
    _assert_same_bits(model.values(), _one_by_one(op, np.float32, attrs, 3, MIXED_SHAPES))
    # A group with one small variable and a large one runs its parts one by one.
    pair = Model(op, np.float32, shapes=MIXED_SHAPES[:2])
    kernel = create_kernel(_group_node(op, np.float32, attrs, 2))
    kernel.compute(pair.ctx, pair.group_inputs(0))
    assert kernel._arena is None
    _assert_same_bits(pair.values(), _one_by_one(op, np.float32, attrs, 1, MIXED_SHAPES[:2]))


def test_a_held_value_is_never_written_and_the_arena_comes_back_when_it_is_let_go():
    op, attrs = "ResourceApplyMomentum", {"use_nesterov": False}
    model = Model(op, np.float32)
    kernel = create_kernel(_group_node(op, np.float32, attrs, len(SHAPES)))
    kernel.compute(model.ctx, model.group_inputs(0))
    assert _in_arena(kernel, model)
    held = model.parts[2][1][1].read()  # a reader keeps part 2's accumulator
    snapshot = held.copy()
    before = OPTIMIZER_UPDATES.copied
    kernel.compute(model.ctx, model.group_inputs(1))
    np.testing.assert_array_equal(held, snapshot)
    assert OPTIMIZER_UPDATES.copied - before == len(SHAPES)  # the parts copied, one by one
    assert not _in_arena(kernel, model)
    del held
    kernel.compute(model.ctx, model.group_inputs(2))
    assert _in_arena(kernel, model)  # lined up again
    kernel.compute(model.ctx, model.group_inputs(3))
    _assert_same_bits(model.values(), _one_by_one(op, np.float32, attrs, 4))


@pytest.mark.parametrize("make_view", [lambda v: v[1:], lambda v: v.reshape(-1), lambda v: memoryview(v)])
def test_anything_made_from_a_value_counts_as_a_reader(make_view):
    op = "ResourceApplyGradientDescent"
    model = Model(op, np.float32)
    kernel = create_kernel(_group_node(op, np.float32, {}, len(SHAPES)))
    kernel.compute(model.ctx, model.group_inputs(0))
    assert _in_arena(kernel, model)
    derived = make_view(model.parts[4][0][1].read())  # the value itself is let go
    snapshot = np.array(derived, copy=True)
    kernel.compute(model.ctx, model.group_inputs(1))
    np.testing.assert_array_equal(np.asarray(derived), snapshot)
    kernel.compute(model.ctx, model.group_inputs(2))
    _assert_same_bits(model.values(), _one_by_one(op, np.float32, {}, 3))


def test_a_value_assigned_by_another_kernel_leaves_the_arena_and_is_updated_from():
    op = "ResourceApplyGradientDescent"
    model = Model(op, np.float32)
    reference = Model(op, np.float32)
    kernel = create_kernel(_group_node(op, np.float32, {}, len(SHAPES)))
    single = create_kernel(make_node(op, name="apply", T=np.float32))
    assign = create_kernel(make_node("AssignVariableOp", name="assign", dtype=np.float32))
    fresh = np.arange(7, dtype=np.float32)
    for step in range(3):
        if step == 1:
            assign.compute(model.ctx, [model.parts[1][0][0], fresh])
            assign.compute(reference.ctx, [reference.parts[1][0][0], fresh])
        kernel.compute(model.ctx, model.group_inputs(step))
        for part in range(len(SHAPES)):
            single.compute(reference.ctx, reference.inputs(step, part))
    _assert_same_bits(model.values(), reference.values())
    assert _in_arena(kernel, model)


def test_parts_that_differ_run_one_by_one():
    op = "ResourceApplyGradientDescent"
    model = Model(op, np.float32)
    kernel = create_kernel(_group_node(op, np.float32, {}, len(SHAPES)))
    inputs = model.group_inputs(0)
    inputs[1] = np.array(0.2, np.float32)  # part 0's learning rate is another
    kernel.compute(model.ctx, inputs)
    assert kernel._arena is None
    reference = Model(op, np.float32)
    single = create_kernel(make_node(op, name="apply", T=np.float32))
    for part in range(len(SHAPES)):
        part_inputs = reference.inputs(0, part)
        if part == 0:
            part_inputs[1] = np.array(0.2, np.float32)
        single.compute(reference.ctx, part_inputs)
    _assert_same_bits(model.values(), reference.values())
    # Parts of other ops (or other attributes) never line up at all.
    mixed = _group_node(op, np.float32, {}, 2)
    other = make_node(op, ["v", "lr", "g"], name="apply_other", T=np.float32, use_locking=True)
    mixed.attr[FUSED_NODES_ATTR].list.s[1] = other.SerializeToString()
    assert create_kernel(mixed)._same_update is None


def test_a_gradient_of_another_shape_fails_naming_its_part():
    op = "ResourceApplyGradientDescent"
    model = Model(op, np.float32)
    kernel = create_kernel(_group_node(op, np.float32, {}, len(SHAPES)))
    kernel.compute(model.ctx, model.group_inputs(0))
    inputs = model.group_inputs(1)
    inputs[3 * 2 + 2] = np.ones((2, 4, 1), np.float32)  # part 2's gradient
    with pytest.raises(Exception, match="var and delta do not have the same shape"):
        kernel.compute(model.ctx, inputs)


def test_concurrent_readers_never_see_a_value_change():
    # Gradient descent with a gradient of ones from zeros: after k updates every element
    # of every variable is -k * 0.5. A reader keeps what it read for a moment, letting
    # the updates run (sleep), then checks it still holds one value, the one it read.
    count, size, steps = 40, 4096, 300
    ctx = Context()
    slots = [_variable(make_node, ctx, f"v{p}", np.zeros(size, np.float32)) for p in range(count)]
    kernel = create_kernel(_group_node("ResourceApplyGradientDescent", np.float32, {}, count))
    inputs = []
    for handle, _ in slots:
        inputs += [handle, np.array(0.5, np.float32), np.ones(size, np.float32)]
    stop = threading.Event()
    changed: list[str] = []

    def read(start: int) -> None:
        for _ in range(10_000):
            for _, resource in slots[start::5]:
                if stop.is_set():
                    return
                value = resource.read()
                first = float(value[0])
                time.sleep(0.0002)  # (the updates run meanwhile)
                if value.min() != first or value.max() != first:
                    changed.append(f"read {first}, now {value.min()}..{value.max()}")

    readers = [threading.Thread(target=read, args=(i,)) for i in range(2)]
    for reader in readers:
        reader.start()
    try:
        for _ in range(steps):
            kernel.compute(ctx, inputs)
            time.sleep(0)
    finally:
        stop.set()
        for reader in readers:
            reader.join(timeout=30)
    assert not changed
    for _, resource in slots:
        np.testing.assert_array_equal(resource.value, np.full(size, -0.5 * steps, np.float32))
