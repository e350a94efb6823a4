"""Resource variables and optimizer kernels, and the ResourceManager behind them."""

from __future__ import annotations

import sys
import threading

import numpy as np
import pytest

from distserver import errors
from distserver.kernels import create_kernel
from distserver.kernels.resources import DEFAULT_CONTAINER, ResourceManager, VariableResource
from distserver.tensors import ResourceHandle


@pytest.fixture
def variable(make_node, ctx):
    """Run VarHandleOp for a float32 variable `v` and return its handle value."""

    def make(name="v", dtype=np.float32, shape=(2,), **attrs):
        kernel = create_kernel(make_node("VarHandleOp", name=name, dtype=dtype, shape=shape, **attrs))
        return kernel.compute(ctx, [])[0]

    return make


def _assign(run_op, ctx, handle, value, op="AssignVariableOp", **attrs):
    value = np.asarray(value)
    return run_op(op, handle, value, ctx=ctx, dtype=value.dtype, name=op.lower(), **attrs)


def _read(run_op, ctx, handle, dtype=np.float32):
    return run_op("ReadVariableOp", handle, ctx=ctx, dtype=dtype, name="read")[0]


# --------------------------------------------------------------------------- handles


def test_var_handle_op_names_the_variable(variable, ctx):
    handle = variable(name="weights/kernel", shape=(None, 3))
    assert handle.shape == ()
    assert handle.dtype == object
    resource = handle[()]
    assert resource == ResourceHandle(
        ctx.device, DEFAULT_CONTAINER, "weights/kernel", np.dtype(np.float32), (None, 3)
    )
    shared = variable(name="node", shared_name="shared", container="box")[()]
    assert (shared.container, shared.name) == ("box", "shared")


def test_var_handle_op_is_stateful(make_node):
    assert create_kernel(make_node("VarHandleOp", dtype=np.float32, shape=())).is_stateful


# --------------------------------------------------------------------------- read / assign


def test_read_before_assign_is_failed_precondition(run_op, ctx, variable):
    handle = variable()
    with pytest.raises(errors.FailedPreconditionError) as info:
        _read(run_op, ctx, handle)
    assert info.value.message.startswith(
        "Could not find variable v. This could mean that the variable has been deleted. In TF1, it can "
        "also mean the variable is uninitialized. Debug info: container=localhost, status error message="
        "Resource localhost/v/N10tensorflow3VarE does not exist."
    )
    assert info.value.node_name == "read"


def test_assign_then_read(run_op, ctx, variable):
    handle = variable()
    value = np.array([1.0, 2.0], np.float32)
    assert _assign(run_op, ctx, handle, value) == []
    np.testing.assert_array_equal(_read(run_op, ctx, handle), value)
    assert run_op("VarIsInitializedOp", handle, ctx=ctx)[0].item() is True


def test_assign_keeps_its_own_copy_and_reads_do_not_copy(run_op, ctx, variable):
    handle = variable()
    value = np.array([1.0, 2.0], np.float32)
    _assign(run_op, ctx, handle, value)
    value[0] = 100  # the caller's array changes later ...
    first = _read(run_op, ctx, handle)
    assert first[0] == 1.0  # ... the variable does not
    assert _read(run_op, ctx, handle) is first  # reads share the stored array
    assert not first.flags.writeable  # nobody may write into it
    _assign(run_op, ctx, handle, np.array([5.0, 5.0], np.float32), op="AssignAddVariableOp")
    np.testing.assert_array_equal(first, [1.0, 2.0])  # an earlier read never changes
    np.testing.assert_array_equal(_read(run_op, ctx, handle), [6.0, 7.0])


def test_assign_may_change_shape_unless_validated(run_op, ctx, variable):
    handle = variable()
    _assign(run_op, ctx, handle, np.zeros(2, np.float32))
    _assign(run_op, ctx, handle, np.ones((3, 3), np.float32))
    assert _read(run_op, ctx, handle).shape == (3, 3)
    with pytest.raises(errors.InvalidArgumentError, match=r"wrong shape. Expected \[3,3\] got \[2\]"):
        _assign(run_op, ctx, handle, np.zeros(2, np.float32), validate_shape=True)


def test_assign_dtype_errors(run_op, ctx, variable):
    handle = variable()
    with pytest.raises(
        errors.InvalidArgumentError,
        match="Variable and value dtypes don't match; respectively, float and int32",
    ):
        run_op("AssignVariableOp", handle, np.zeros(2, np.int32), ctx=ctx, dtype=np.float32)
    _assign(run_op, ctx, handle, np.zeros(2, np.float32))
    with pytest.raises(
        errors.InvalidArgumentError,
        match=r"Trying to assign variable with wrong dtype. Expected float got int32",
    ):
        _assign(run_op, ctx, handle, np.zeros(2, np.int32))
    with pytest.raises(
        errors.InvalidArgumentError,
        match=r"Trying to read variable with wrong dtype. Expected int32 got float",
    ):
        _read(run_op, ctx, handle, dtype=np.int32)


@pytest.mark.parametrize(
    ("op", "expected"), [("AssignAddVariableOp", [4.0, 7.0]), ("AssignSubVariableOp", [-2.0, -3.0])]
)
def test_assign_add_and_sub(run_op, ctx, variable, op, expected):
    handle = variable()
    _assign(run_op, ctx, handle, np.array([1.0, 2.0], np.float32))
    assert _assign(run_op, ctx, handle, np.array([3.0, 5.0], np.float32), op=op) == []
    np.testing.assert_array_equal(_read(run_op, ctx, handle), expected)


def test_assign_add_errors(run_op, ctx, variable):
    handle = variable()
    with pytest.raises(
        errors.NotFoundError, match=r"Resource localhost/v/N10tensorflow3VarE does not exist."
    ):
        _assign(run_op, ctx, handle, np.zeros(2, np.float32), op="AssignAddVariableOp")
    _assign(run_op, ctx, handle, np.zeros(2, np.float32))
    with pytest.raises(
        errors.InvalidArgumentError,
        match=r"Cannot update variable with shape \[2\] using a Tensor with shape \[3\], "
        r"shapes must be equal\.",
    ):
        _assign(run_op, ctx, handle, np.zeros(3, np.float32), op="AssignAddVariableOp")


def test_concurrent_assign_add_loses_no_update(make_node, ctx, variable):
    handle = variable(dtype=np.int64, shape=())
    create_kernel(make_node("AssignVariableOp", ["v", "x"], dtype=np.int64)).compute(
        ctx, [handle, np.array(0)]
    )
    add = create_kernel(make_node("AssignAddVariableOp", ["v", "one"], dtype=np.int64))
    one = np.array(1, np.int64)
    threads_count, adds = 8, 1000
    barrier = threading.Barrier(threads_count)

    def worker():
        barrier.wait()  # start together to maximise contention
        for _ in range(adds):
            add.compute(ctx, [handle, one])

    threads = [threading.Thread(target=worker) for _ in range(threads_count)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads often, so an unlocked update would be lost
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(interval)
    read = create_kernel(make_node("ReadVariableOp", ["v"], dtype=np.int64))
    assert read.compute(ctx, [handle])[0] == threads_count * adds


def test_var_is_initialized_and_destroy(run_op, ctx, variable):
    handle = variable()
    assert run_op("VarIsInitializedOp", handle, ctx=ctx)[0].item() is False
    _assign(run_op, ctx, handle, np.zeros(2, np.float32))
    assert run_op("VarIsInitializedOp", handle, ctx=ctx)[0].item() is True
    assert run_op("DestroyResourceOp", handle, ctx=ctx) == []
    assert run_op("VarIsInitializedOp", handle, ctx=ctx)[0].item() is False
    with pytest.raises(errors.FailedPreconditionError, match="Could not find variable v"):
        _read(run_op, ctx, handle)
    run_op("DestroyResourceOp", handle, ctx=ctx)  # ignore_lookup_error defaults to True
    with pytest.raises(errors.NotFoundError, match=r"Resource localhost/v does not exist."):
        run_op("DestroyResourceOp", handle, ctx=ctx, ignore_lookup_error=False)


def test_handle_from_another_device_is_refused(run_op, ctx, variable):
    # A variable of that name exists on this device: the handle's device still decides
    # (the kernels' inline lookup must not skip the check).
    _assign(run_op, ctx, variable(name="v"), np.zeros(3, np.float32))
    handle = np.empty((), dtype=object)
    handle[()] = ResourceHandle("/job:ps/replica:0/task:0/device:CPU:0", "localhost", "v")
    refused = pytest.raises(
        errors.InvalidArgumentError, match="Trying to access resource v located in device /job:ps"
    )
    with refused:
        _read(run_op, ctx, handle)
    with refused:
        run_op(
            "ResourceApplyGradientDescent",
            handle,
            np.float32(0.1),
            np.ones(3, np.float32),
            ctx=ctx,
            T=np.float32,
        )


def test_non_handle_input_is_refused(run_op, ctx):
    with pytest.raises(errors.InvalidArgumentError, match="expects a resource handle"):
        _read(run_op, ctx, np.zeros(()))


# --------------------------------------------------------------------------- optimizers


def _init(run_op, ctx, variable, name, value):
    handle = variable(name=name, dtype=value.dtype, shape=value.shape)
    _assign(run_op, ctx, handle, value)
    return handle


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_apply_gradient_descent(run_op, ctx, variable, dtype):
    var0 = np.array([1.0, 2.0, 3.0], dtype)
    delta = np.array([0.5, -1.0, 2.0], dtype)
    handle = _init(run_op, ctx, variable, "var", var0)
    assert run_op("ResourceApplyGradientDescent", handle, dtype(0.1), delta, ctx=ctx, T=dtype) == []
    np.testing.assert_allclose(_read(run_op, ctx, handle, dtype), var0 - dtype(0.1) * delta, rtol=1e-6)


@pytest.mark.parametrize("use_nesterov", [False, True])
def test_apply_momentum(run_op, ctx, variable, use_nesterov):
    rng = np.random.default_rng(3)
    var, accum = rng.normal(size=(2, 3)), rng.normal(size=(2, 3))
    var_h = _init(run_op, ctx, variable, "var", var)
    accum_h = _init(run_op, ctx, variable, "accum", accum)
    lr, momentum = 0.05, 0.9
    for _ in range(3):
        grad = rng.normal(size=(2, 3))
        run_op(
            "ResourceApplyMomentum", var_h, accum_h, np.float64(lr), grad, np.float64(momentum),
            ctx=ctx, T=np.float64, use_nesterov=use_nesterov,
        )  # fmt: skip
        accum = accum * momentum + grad
        var = var - (grad * lr + accum * momentum * lr) if use_nesterov else var - lr * accum
    np.testing.assert_allclose(_read(run_op, ctx, var_h, np.float64), var)
    np.testing.assert_allclose(_read(run_op, ctx, accum_h, np.float64), accum)


@pytest.mark.parametrize("use_nesterov", [False, True])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_apply_adam(run_op, ctx, variable, use_nesterov, dtype):
    rng = np.random.default_rng(4)
    var = rng.normal(size=(4,)).astype(dtype)
    m, v = np.zeros(4, dtype), np.zeros(4, dtype)
    handles = [
        _init(run_op, ctx, variable, name, value) for name, value in (("var", var), ("m", m), ("v", v))
    ]
    lr, beta1, beta2, epsilon = 0.01, 0.9, 0.999, 1e-7
    for t in range(1, 4):
        grad = rng.normal(size=(4,)).astype(dtype)
        scalars = [beta1**t, beta2**t, lr, beta1, beta2, epsilon]
        run_op(
            "ResourceApplyAdam", *handles, *[np.array(s, dtype) for s in scalars], grad,
            ctx=ctx, T=dtype, use_nesterov=use_nesterov,
        )  # fmt: skip
        # TF's documented update (training_ops.cc ApplyAdamNonCuda), in float64.
        alpha = lr * np.sqrt(1 - beta2**t) / (1 - beta1**t)
        m = m + (grad - m) * (1 - beta1)
        v = v + (grad * grad - v) * (1 - beta2)
        step = grad * (1 - beta1) + beta1 * m if use_nesterov else m
        var = var - step * alpha / (np.sqrt(v) + epsilon)
    rtol = 1e-5 if dtype == np.float32 else 1e-12
    for handle, expected in zip(handles, (var, m, v), strict=True):
        got = _read(run_op, ctx, handle, dtype)
        assert got.dtype == np.dtype(dtype)
        np.testing.assert_allclose(got, expected, rtol=rtol, atol=1e-7)


def test_optimizer_errors(run_op, ctx, variable):
    handle = _init(run_op, ctx, variable, "var", np.zeros(3, np.float32))
    with pytest.raises(errors.InvalidArgumentError, match=r"alpha is not a scalar: \[2\]"):
        run_op(
            "ResourceApplyGradientDescent",
            handle,
            np.ones(2, np.float32),
            np.ones(3, np.float32),
            ctx=ctx,
            T=np.float32,
        )
    with pytest.raises(
        errors.InvalidArgumentError, match=r"var and delta do not have the same shape\[3\] \[2\]"
    ):
        run_op(
            "ResourceApplyGradientDescent",
            handle,
            np.float32(1),
            np.ones(2, np.float32),
            ctx=ctx,
            T=np.float32,
        )
    missing = variable(name="missing")
    with pytest.raises(
        errors.NotFoundError, match=r"Resource localhost/missing/N10tensorflow3VarE does not exist."
    ):
        run_op(
            "ResourceApplyGradientDescent",
            missing,
            np.float32(1),
            np.ones(2, np.float32),
            ctx=ctx,
            T=np.float32,
        )


# --------------------------------------------------------------------------- ResourceManager


def test_resource_manager_basics():
    manager = ResourceManager()
    with pytest.raises(errors.NotFoundError, match="Container localhost does not exist"):
        manager.lookup("", "x")
    manager.create("", "x", 1)
    assert manager.lookup("localhost", "x") == 1  # "" is the default container
    with pytest.raises(errors.AlreadyExistsError, match=r"Resource localhost/x already exists."):
        manager.create("localhost", "x", 2)
    with pytest.raises(errors.NotFoundError, match=r"Resource localhost/y does not exist."):
        manager.lookup("", "y")
    manager.create("other", "y", 3)
    assert manager.containers() == ["localhost", "other"]
    manager.delete("other", "y")
    assert manager.containers() == ["localhost"]
    with pytest.raises(errors.NotFoundError):
        manager.delete("other", "y")


def test_resource_manager_clear():
    manager = ResourceManager()
    for container in ("", "a", "b"):
        manager.create(container, "x", container)
    manager.clear([])  # the default container
    assert manager.containers() == ["a", "b"]
    manager.clear(["a", "unknown"])
    assert manager.containers() == ["b"]


def test_lookup_or_create_creates_once_under_contention():
    manager = ResourceManager()
    created = []
    barrier = threading.Barrier(8)
    results = []

    def factory():
        created.append(1)
        return VariableResource(np.dtype(np.float32))

    def worker():
        barrier.wait()
        results.append(manager.lookup_or_create("", "v", factory))

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(created) == 1
    assert all(r is results[0] for r in results)


def test_disable_copy_on_read_needs_the_variable_and_changes_nothing(run_op, new_context):
    ctx = new_context()
    handle = np.array(ResourceHandle(ctx.device, "", "v"), dtype=object)
    with pytest.raises(errors.NotFoundError, match=r"Resource localhost/v/.* does not exist"):
        run_op("DisableCopyOnRead", handle, ctx=ctx)
    ctx.resources.create("", "v", VariableResource(np.float32))
    assert run_op("DisableCopyOnRead", handle, ctx=ctx) == []


# --------------------------------------------------------------------------- remembered lookups


def test_kernels_use_the_variable_a_handle_names_now_not_the_one_they_found_before(
    make_node, new_context, ctx, variable
):
    # Kernels remember the variable a handle input named (the same handle array every
    # step): destroying it, clearing the container or running on another ResourceManager
    # must not leave them updating or reading the old one.
    handle = variable(name="v")
    read = create_kernel(make_node("ReadVariableOp", ["h"], dtype=np.float32))
    step = create_kernel(make_node("ResourceApplyGradientDescent", ["h", "a", "d"], T=np.float32))
    alpha, delta = np.float32(1.0), np.ones(3, np.float32)

    def apply(context):
        step.compute(context, [handle, np.asarray(alpha), delta])

    def value(context):
        return read.compute(context, [handle])[0].tolist()

    create_kernel(make_node("AssignVariableOp", ["h", "v"], dtype=np.float32)).compute(
        ctx, [handle, np.array([1, 2, 3], np.float32)]
    )
    apply(ctx)
    assert value(ctx) == [0, 1, 2]
    create_kernel(make_node("DestroyResourceOp", ["h"])).compute(ctx, [handle])
    with pytest.raises(errors.NotFoundError, match="does not exist"):
        apply(ctx)
    with pytest.raises(errors.FailedPreconditionError, match="Could not find variable v"):
        value(ctx)
    for start in ([10, 20, 30], [7, 7, 7]):  # a new variable of the same name, twice
        create_kernel(make_node("AssignVariableOp", ["h", "v"], dtype=np.float32)).compute(
            ctx, [handle, np.array(start, np.float32)]
        )
        apply(ctx)
        assert value(ctx) == [x - 1 for x in start]
        held = ctx.resources.find(DEFAULT_CONTAINER, "v")  # alive, with its value, after the clear
        ctx.resources.clear([])
        assert held.value is not None
    other = new_context()  # same handle array, another task's variables
    create_kernel(make_node("AssignVariableOp", ["h", "v"], dtype=np.float32)).compute(
        other, [handle, np.array([5, 5, 5], np.float32)]
    )
    apply(other)
    assert value(other) == [4, 4, 4]
    with pytest.raises(errors.FailedPreconditionError, match="Could not find variable v"):
        value(ctx)
