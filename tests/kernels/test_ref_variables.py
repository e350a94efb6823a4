"""TF 1.x reference variables, the dereferencing of references, and the optimizer kernels."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from distserver import errors
from distserver.kernels import create_kernel
from distserver.kernels.resources import (
    DEFAULT_CONTAINER,
    LegacyVariable,
    VariableRef,
    legacy_variable_key,
)


@pytest.fixture
def variable(make_node, ctx):
    """Run VariableV2 and return its output (a VariableRef)."""

    def make(name="v", dtype=np.float32, shape=(2,), **attrs):
        kernel = create_kernel(make_node("VariableV2", name=name, dtype=dtype, shape=shape, **attrs))
        return kernel.compute(ctx, [])[0]

    return make


def _run(make_node, ctx, op, inputs, input_names=None, **attrs):
    names = input_names or [f"input_{i}" for i in range(len(inputs))]
    kernel = create_kernel(make_node(op, names, name=op.lower(), **attrs))
    return kernel.compute(ctx, list(inputs))


# --------------------------------------------------------------------------- VariableV2


def test_variable_v2_outputs_a_reference_to_an_uninitialized_variable(variable, ctx):
    ref = variable(name="weights")
    assert isinstance(ref, VariableRef)
    assert ref.name == "weights"
    stored = ctx.resources.lookup(DEFAULT_CONTAINER, legacy_variable_key("weights"))
    assert stored is ref.variable
    assert isinstance(stored, LegacyVariable)
    assert not stored.is_initialized


def test_every_variable_v2_of_a_name_shares_the_variable(variable):
    assert variable(name="a").variable is variable(name="a").variable
    assert variable(name="n1", shared_name="s").variable is variable(name="n2", shared_name="s").variable
    assert variable(name="a", container="box").variable is not variable(name="a").variable


def test_reference_and_resource_variables_of_one_name_do_not_collide(variable, ctx, run_op, make_node):
    ref = variable(name="v")
    kernel = create_kernel(make_node("VarHandleOp", name="v", dtype=np.float32, shape=(2,)))
    handle = kernel.compute(ctx, [])[0]
    run_op("AssignVariableOp", handle, np.ones(2, np.float32), ctx=ctx, dtype=np.float32)
    assert not ref.variable.is_initialized


def test_variable_v2_dtype_must_match_the_existing_variable(variable):
    variable(name="v", dtype=np.float32)
    with pytest.raises(errors.InvalidArgumentError, match="created with dtype float32"):
        variable(name="v", dtype=np.int32)


# --------------------------------------------------------------------------- Assign / AssignAdd / AssignSub


def test_assign_stores_a_copy_and_outputs_the_reference(make_node, ctx, variable):
    ref = variable()
    value = np.array([1.0, 2.0], np.float32)
    (out,) = _run(make_node, ctx, "Assign", [ref, value], T=np.float32)
    assert out is ref
    value[0] = 99.0
    np.testing.assert_array_equal(ref.variable.value, [1.0, 2.0])


def test_assign_validates_shapes_against_the_declared_and_the_current_shape(make_node, ctx, variable):
    ref = variable(shape=(2,))
    with pytest.raises(errors.InvalidArgumentError, match=r"lhs shape= \[2\] rhs shape= \[3\]"):
        _run(make_node, ctx, "Assign", [ref, np.ones(3, np.float32)], T=np.float32)
    _run(make_node, ctx, "Assign", [ref, np.ones(3, np.float32)], T=np.float32, validate_shape=False)
    assert ref.variable.value.shape == (3,)
    with pytest.raises(errors.InvalidArgumentError, match=r"lhs shape= \[3\] rhs shape= \[2\]"):
        _run(make_node, ctx, "Assign", [ref, np.ones(2, np.float32)], T=np.float32)


def test_assign_of_a_variable_with_unknown_shape(make_node, ctx, variable):
    ref = variable(shape=(None, 2))
    _run(make_node, ctx, "Assign", [ref, np.ones((5, 2), np.float32)], T=np.float32)
    assert ref.variable.value.shape == (5, 2)


def test_assign_needs_a_reference(make_node, ctx):
    with pytest.raises(errors.InvalidArgumentError, match=r"must be a reference to a variable"):
        _run(make_node, ctx, "Assign", [np.ones(2, np.float32), np.ones(2, np.float32)], T=np.float32)


@pytest.mark.parametrize(("op", "expected"), [("AssignAdd", [4.0, 7.0]), ("AssignSub", [-2.0, -3.0])])
def test_assign_add_and_sub(make_node, ctx, variable, op, expected):
    ref = variable()
    _run(make_node, ctx, "Assign", [ref, np.array([1.0, 2.0], np.float32)], T=np.float32)
    (out,) = _run(make_node, ctx, op, [ref, np.array([3.0, 5.0], np.float32)], T=np.float32)
    assert out is ref
    np.testing.assert_array_equal(ref.variable.value, expected)


def test_assign_add_of_an_uninitialized_variable(make_node, ctx, variable):
    ref = variable()
    with pytest.raises(errors.FailedPreconditionError, match="Attempting to use uninitialized parameters: w"):
        _run(make_node, ctx, "AssignAdd", [ref, np.ones(2, np.float32)], ["w", "one"], T=np.float32)


def test_assign_add_needs_the_same_shape(make_node, ctx, variable):
    ref = variable()
    _run(make_node, ctx, "Assign", [ref, np.ones(2, np.float32)], T=np.float32)
    with pytest.raises(errors.InvalidArgumentError, match=r"must be the same size: \[2\] vs \[3\]"):
        _run(make_node, ctx, "AssignAdd", [ref, np.ones(3, np.float32)], T=np.float32)


def test_is_variable_initialized(make_node, ctx, variable):
    ref = variable()
    (before,) = _run(make_node, ctx, "IsVariableInitialized", [ref], dtype=np.float32)
    _run(make_node, ctx, "Assign", [ref, np.ones(2, np.float32)], T=np.float32)
    (after,) = _run(make_node, ctx, "IsVariableInitialized", [ref], dtype=np.float32)
    assert (before.shape, bool(before), bool(after)) == ((), False, True)


# --------------------------------------------------------------------------- dereferencing


def test_other_kernels_see_the_value_at_the_time_they_run(make_node, ctx, variable):
    ref = variable()
    read = create_kernel(make_node("Identity", ["v"], name="v/read", T=np.float32))
    _run(make_node, ctx, "Assign", [ref, np.array([1.0, 2.0], np.float32)], T=np.float32)
    (first,) = read.compute(ctx, [ref])
    _run(make_node, ctx, "AssignAdd", [ref, np.array([1.0, 1.0], np.float32)], T=np.float32)
    (second,) = read.compute(ctx, [ref])
    np.testing.assert_array_equal(first, [1.0, 2.0])
    np.testing.assert_array_equal(second, [2.0, 3.0])
    (total,) = _run(make_node, ctx, "AddV2", [ref, np.float32(1.0)], T=np.float32)
    np.testing.assert_array_equal(total, [3.0, 4.0])


def test_reading_an_uninitialized_reference_names_the_input_and_node(make_node, ctx, variable):
    ref = variable()
    read = create_kernel(make_node("Identity", ["^init", "w1"], name="w1/read", T=np.float32))
    with pytest.raises(errors.FailedPreconditionError) as info:
        read.compute(ctx, [ref])
    assert info.value.message.startswith("Attempting to use uninitialized value w1")
    assert info.value.node_name == "w1/read"


def test_async_kernels_see_values_too(make_node, ctx, variable):
    ref = variable()
    _run(make_node, ctx, "Assign", [ref, np.array([5.0, 6.0], np.float32)], T=np.float32)
    sent = {}

    class Rendezvous:
        def send(self, key, value, is_dead=False):
            sent[key] = value

    ctx.rendezvous = Rendezvous()
    send = create_kernel(
        make_node(
            "_Send",
            ["v"],
            tensor_name="v:0",
            send_device=ctx.device,
            recv_device=ctx.device,
            send_device_incarnation=1,
            client_terminated=True,
        )
    )
    asyncio.run(send.compute_async(ctx, [ref]))
    (value,) = sent.values()
    np.testing.assert_array_equal(value, [5.0, 6.0])


# --------------------------------------------------------------------------- optimizers on references


def _initialized(variable, make_node, ctx, name, value):
    ref = variable(name=name, shape=np.shape(value))
    _run(make_node, ctx, "Assign", [ref, np.asarray(value, np.float32)], T=np.float32)
    return ref


def test_apply_gradient_descent_updates_the_variable_and_outputs_the_reference(make_node, ctx, variable):
    ref = _initialized(variable, make_node, ctx, "w", [1.0, 2.0])
    (out,) = _run(
        make_node,
        ctx,
        "ApplyGradientDescent",
        [ref, np.float32(0.5), np.array([2.0, 4.0], np.float32)],
        T=np.float32,
    )
    assert out is ref
    np.testing.assert_allclose(ref.variable.value, [0.0, 0.0])


def test_apply_adam_on_references_matches_the_formula(make_node, ctx, variable):
    var = _initialized(variable, make_node, ctx, "w", [1.0, -1.0])
    m = _initialized(variable, make_node, ctx, "w/Adam", [0.1, 0.2])
    v = _initialized(variable, make_node, ctx, "w/Adam_1", [0.3, 0.4])
    grad = np.array([0.5, -0.5], np.float32)
    b1p, b2p, lr, b1, b2, eps = 0.9, 0.999, 0.01, 0.9, 0.999, 1e-8
    scalars = [np.float32(s) for s in (b1p, b2p, lr, b1, b2, eps)]
    _run(make_node, ctx, "ApplyAdam", [var, m, v, *scalars, grad], T=np.float32)
    m_new = np.array([0.1, 0.2]) + (grad - [0.1, 0.2]) * (1 - b1)
    v_new = np.array([0.3, 0.4]) + (grad**2 - [0.3, 0.4]) * (1 - b2)
    alpha = lr * np.sqrt(1 - b2p) / (1 - b1p)
    np.testing.assert_allclose(m.variable.value, m_new, rtol=1e-6)
    np.testing.assert_allclose(v.variable.value, v_new, rtol=1e-6)
    var_new = np.array([1.0, -1.0]) - alpha * m_new / (np.sqrt(v_new) + eps)
    np.testing.assert_allclose(var.variable.value, var_new, rtol=1e-6)


def test_apply_on_an_uninitialized_reference(make_node, ctx, variable):
    ref = variable()
    with pytest.raises(errors.FailedPreconditionError, match="Attempting to use uninitialized variables: w1"):
        _run(
            make_node,
            ctx,
            "ApplyGradientDescent",
            [ref, np.float32(0.1), np.ones(2, np.float32)],
            ["w1", "lr", "grad"],
            T=np.float32,
        )


# --------------------------------------------------------------------------- Adagrad and RMSProp


@pytest.fixture
def handle_of(make_node, ctx, run_op):
    """An initialized resource variable's handle."""

    def make(name, value):
        kernel = create_kernel(make_node("VarHandleOp", name=name, dtype=np.float64, shape=()))
        handle = kernel.compute(ctx, [])[0]
        run_op("AssignVariableOp", handle, np.asarray(value, np.float64), ctx=ctx, dtype=np.float64)
        return handle

    return make


def _value(ctx, handle):
    return ctx.resources.lookup(handle[()].container, handle[()].name).value


def test_resource_apply_adagrad(run_op, ctx, handle_of):
    var, accum = handle_of("var", [1.0, 2.0]), handle_of("accum", [0.1, 0.1])
    grad = np.array([0.5, -1.0])
    run_op("ResourceApplyAdagrad", var, accum, np.float64(0.1), grad, ctx=ctx, T=np.float64)
    accum_new = np.array([0.1, 0.1]) + grad**2
    np.testing.assert_allclose(_value(ctx, accum), accum_new)
    np.testing.assert_allclose(_value(ctx, var), [1.0, 2.0] - 0.1 * grad / np.sqrt(accum_new))


def test_resource_apply_adagrad_v2_and_update_slots(run_op, ctx, handle_of):
    var, accum = handle_of("var", [1.0]), handle_of("accum", [4.0])
    grad = np.array([2.0])
    run_op(
        "ResourceApplyAdagradV2",
        var,
        accum,
        np.float64(0.5),
        np.float64(1.0),
        grad,
        ctx=ctx,
        T=np.float64,
        update_slots=False,
    )
    np.testing.assert_allclose(_value(ctx, accum), [4.0])
    np.testing.assert_allclose(_value(ctx, var), [1.0 - 0.5 * 2.0 / (2.0 + 1.0)])


def test_resource_apply_rms_prop(run_op, ctx, handle_of):
    var, ms, mom = handle_of("var", [1.0, 2.0]), handle_of("ms", [0.5, 0.5]), handle_of("mom", [0.1, 0.0])
    grad = np.array([1.0, -2.0])
    lr, rho, momentum, eps = 0.01, 0.9, 0.5, 1e-10
    run_op(
        "ResourceApplyRMSProp",
        var,
        ms,
        mom,
        *[np.float64(s) for s in (lr, rho, momentum, eps)],
        grad,
        ctx=ctx,
        T=np.float64,
    )
    ms_new = np.array([0.5, 0.5]) + (grad**2 - 0.5) * (1 - rho)
    mom_new = np.array([0.1, 0.0]) * momentum + lr * grad / np.sqrt(ms_new + eps)
    np.testing.assert_allclose(_value(ctx, ms), ms_new)
    np.testing.assert_allclose(_value(ctx, mom), mom_new)
    np.testing.assert_allclose(_value(ctx, var), [1.0, 2.0] - mom_new)


# --------------------------------------------------------------------------- sparse reads and updates


def test_resource_gather(run_op, ctx, make_node):
    handle = create_kernel(make_node("VarHandleOp", name="emb", dtype=np.float32, shape=(4, 2))).compute(
        ctx, []
    )[0]
    table = np.arange(8, dtype=np.float32).reshape(4, 2)
    run_op("AssignVariableOp", handle, table, ctx=ctx, dtype=np.float32)
    indices = np.array([[3, 0], [1, 1]], np.int64)
    (rows,) = run_op("ResourceGather", handle, indices, ctx=ctx, dtype=np.float32, Tindices=np.int64)
    np.testing.assert_array_equal(rows, table[indices])
    with pytest.raises(errors.InvalidArgumentError, match=r"indices\[1\] = 4 is not in \[0, 4\)"):
        run_op(
            "ResourceGather", handle, np.array([0, 4], np.int32), ctx=ctx, dtype=np.float32, Tindices=np.int32
        )


def test_resource_gather_of_a_missing_variable(run_op, ctx, make_node):
    handle = create_kernel(make_node("VarHandleOp", name="nope", dtype=np.float32, shape=(2,))).compute(
        ctx, []
    )[0]
    with pytest.raises(errors.NotFoundError, match="nope"):
        run_op(
            "ResourceGather", handle, np.array([0], np.int32), ctx=ctx, dtype=np.float32, Tindices=np.int32
        )


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("Add", [[0.0, 1.0], [11.0, 12.0], [4.0, 5.0]]),
        ("Sub", [[0.0, 1.0], [-7.0, -6.0], [4.0, 5.0]]),
        ("Update", [[0.0, 1.0], [5.0, 5.0], [4.0, 5.0]]),
    ],
)
def test_resource_scatter_counts_repeated_indices(run_op, ctx, make_node, mode, expected):
    handle = create_kernel(make_node("VarHandleOp", name="t", dtype=np.float32, shape=(3, 2))).compute(
        ctx, []
    )[0]
    run_op(
        "AssignVariableOp", handle, np.arange(6, dtype=np.float32).reshape(3, 2), ctx=ctx, dtype=np.float32
    )
    updates = np.array([[4.0, 4.0], [5.0, 5.0]], np.float32)
    run_op(
        f"ResourceScatter{mode}",
        handle,
        np.array([1, 1], np.int32),
        updates,
        ctx=ctx,
        dtype=np.float32,
        Tindices=np.int32,
    )
    np.testing.assert_array_equal(ctx.resources.lookup("", "t").value, expected)


def test_scatter_on_references(make_node, ctx, variable):
    ref = _initialized(variable, make_node, ctx, "emb", [[1.0, 1.0], [2.0, 2.0]])
    (out,) = _run(
        make_node,
        ctx,
        "ScatterSub",
        [ref, np.array([1], np.int64), np.array([[0.5, 1.0]], np.float32)],
        T=np.float32,
        Tindices=np.int64,
    )
    assert out is ref
    np.testing.assert_array_equal(ref.variable.value, [[1.0, 1.0], [1.5, 1.0]])
    _run(
        make_node,
        ctx,
        "ScatterUpdate",
        [ref, np.array([0], np.int32), np.float32(7.0)],
        T=np.float32,
        Tindices=np.int32,
    )
    np.testing.assert_array_equal(ref.variable.value, [[7.0, 7.0], [1.5, 1.0]])


def test_scatter_checks_indices_and_shapes(make_node, ctx, variable):
    ref = _initialized(variable, make_node, ctx, "emb", [[1.0, 1.0], [2.0, 2.0]])
    with pytest.raises(errors.InvalidArgumentError, match=r"indices\[0\] = 2 is not in \[0, 2\)"):
        _run(
            make_node, ctx, "ScatterAdd", [ref, np.array([2], np.int32), np.ones((1, 2), np.float32)],
            T=np.float32, Tindices=np.int32,
        )  # fmt: skip
    with pytest.raises(errors.InvalidArgumentError, match="updates must have shape"):
        _run(
            make_node, ctx, "ScatterAdd", [ref, np.array([0], np.int32), np.ones((1, 3), np.float32)],
            T=np.float32, Tindices=np.int32,
        )  # fmt: skip
    fresh = variable(name="fresh")
    with pytest.raises(errors.FailedPreconditionError, match="uninitialized parameters"):
        _run(
            make_node, ctx, "ScatterAdd", [fresh, np.array([0], np.int32), np.float32(1.0)],
            T=np.float32, Tindices=np.int32,
        )  # fmt: skip
