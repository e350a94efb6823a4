"""Adadelta, FTRL, centered RMSProp and the proximal optimizers: one step each against the formulas.

Each update runs on resource variables (`ResourceApplyX`) and on reference variables
(`ApplyX`), in float64, and is compared with TensorFlow's documented update written
out by hand below.
"""

from __future__ import annotations

import numpy as np
import pytest

from distserver import errors
from distserver.kernels import create_kernel
from distserver.kernels.ref_variables import REF_OUTPUT_OPS

RNG = np.random.default_rng(5)
SHAPE = (2, 3)


@pytest.fixture(params=["resource", "ref"])
def flavour(request):
    return request.param


@pytest.fixture
def step(make_node, ctx, flavour):
    """`step(op, slots, scalars..., **attrs)`: run one update; returns the slots' new values.

    `slots` maps each variable input's name to its initial value, in the op's order
    (every op here takes its variables first); the other inputs (gradients,
    hyperparameters) follow as positional arguments, in the op's order.
    """

    def run(op, slots, *values, **attrs):
        variables = {}
        for name, value in slots.items():
            value = np.asarray(value, np.float64)
            if flavour == "resource":
                kernel = create_kernel(
                    make_node("VarHandleOp", name=name, dtype=np.float64, shape=value.shape)
                )
                handle = kernel.compute(ctx, [])[0]
                create_kernel(
                    make_node("AssignVariableOp", ["h", "v"], name=f"{name}/init", dtype=np.float64)
                ).compute(ctx, [handle, value])
                variables[name] = handle
            else:
                ref = create_kernel(
                    make_node("VariableV2", name=name, dtype=np.float64, shape=value.shape)
                ).compute(ctx, [])[0]
                create_kernel(make_node("Assign", ["r", "v"], name=f"{name}/init", T=np.float64)).compute(
                    ctx, [ref, value]
                )
                variables[name] = ref
        args = [*variables.values(), *(np.asarray(value) for value in values)]
        name = op if flavour == "ref" else f"Resource{op}"
        node = make_node(name, [f"in_{i}" for i in range(len(args))], name="update", T=np.float64, **attrs)
        outputs = create_kernel(node).compute(ctx, args)
        if flavour == "ref":
            assert outputs == [variables["var"]]  # the reference to var
            return {name: ref.variable.value for name, ref in variables.items()}
        assert outputs == []
        return {
            name: ctx.resources.lookup(h[()].container, h[()].name).value for name, h in variables.items()
        }

    return run


def _rand(low=-1.0, high=1.0):
    return RNG.uniform(low, high, size=SHAPE)


def _close(got, expected):
    for name, value in expected.items():
        np.testing.assert_allclose(got[name], value, rtol=1e-12, atol=1e-14, err_msg=name)


def test_adadelta(step):
    var, accum, accum_update, grad = _rand(), _rand(0, 1), _rand(0, 1), _rand()
    lr, rho, eps = 0.5, 0.95, 1e-6
    got = step(
        "ApplyAdadelta", {"var": var, "accum": accum, "accum_update": accum_update}, lr, rho, eps, grad
    )
    accum = rho * accum + (1 - rho) * grad**2
    update = np.sqrt(accum_update + eps) / np.sqrt(accum + eps) * grad
    accum_update = rho * accum_update + (1 - rho) * update**2
    _close(got, {"var": var - lr * update, "accum": accum, "accum_update": accum_update})


def _ftrl(var, accum, linear, grad, lr, l1, l2, lr_power, shrinkage=0.0, multiply_linear_by_lr=False):
    shrunk = grad + 2 * shrinkage * var
    accum_new = accum + grad**2
    sigma = accum_new ** (-lr_power) - accum ** (-lr_power)
    if multiply_linear_by_lr:
        linear = linear + shrunk * lr - sigma * var
        quadratic = accum_new ** (-lr_power) + 2 * l2 * lr
        var = np.where(np.abs(linear) > l1 * lr, (np.sign(linear) * l1 * lr - linear) / quadratic, 0.0)
    else:
        linear = linear + shrunk - sigma / lr * var
        quadratic = 1.0 / (accum_new**lr_power * lr) + 2 * l2
        var = np.where(np.abs(linear) > l1, (np.sign(linear) * l1 - linear) / quadratic, 0.0)
    return {"var": var, "accum": accum_new, "linear": linear}


def _ftrl_inputs(lr, l1, l2, lr_power, shrinkage=0.0, multiply_linear_by_lr=False):
    """var, accum, linear, grad such that the new `linear` spans [-2 * l1', 2 * l1'] (l1' the threshold).

    Half the entries then fall under the L1 threshold and become 0, the others do not.
    """
    var, accum, grad = _rand(), _rand(0.1, 1), _rand()
    increment = _ftrl(
        var, accum, np.zeros(SHAPE), grad, lr, l1, l2, lr_power, shrinkage, multiply_linear_by_lr
    )
    threshold = l1 * lr if multiply_linear_by_lr else l1
    target = np.array([[-1.9, -1.3, -0.4], [0.3, 0.8, 1.7]]) * threshold
    return var, accum, target - increment["linear"], grad


@pytest.mark.parametrize("lr_power", [-0.5, -0.7, 0.0])
@pytest.mark.parametrize("multiply_linear_by_lr", [False, True])
def test_ftrl(step, lr_power, multiply_linear_by_lr):
    lr, l1, l2 = 0.1, 0.3, 0.2
    var, accum, linear, grad = _ftrl_inputs(lr, l1, l2, lr_power, multiply_linear_by_lr=multiply_linear_by_lr)
    slots = {"var": var, "accum": accum, "linear": linear}
    got = step("ApplyFtrl", slots, grad, lr, l1, l2, lr_power, multiply_linear_by_lr=multiply_linear_by_lr)
    expected = _ftrl(
        var, accum, linear, grad, lr, l1, l2, lr_power, multiply_linear_by_lr=multiply_linear_by_lr
    )
    _close(got, expected)
    assert np.count_nonzero(got["var"] == 0) == 3  # under the L1 threshold


@pytest.mark.parametrize("multiply_linear_by_lr", [False, True])
def test_ftrl_v2(step, multiply_linear_by_lr):
    lr, l1, l2, shrinkage, lr_power = 0.1, 0.05, 0.2, 0.3, -0.5
    var, accum, linear, grad = _ftrl_inputs(lr, l1, l2, lr_power, shrinkage, multiply_linear_by_lr)
    slots = {"var": var, "accum": accum, "linear": linear}
    got = step(
        "ApplyFtrlV2",
        slots,
        grad,
        lr,
        l1,
        l2,
        shrinkage,
        lr_power,
        multiply_linear_by_lr=multiply_linear_by_lr,
    )
    expected = _ftrl(var, accum, linear, grad, lr, l1, l2, lr_power, shrinkage, multiply_linear_by_lr)
    _close(got, expected)
    assert np.count_nonzero(got["var"] == 0) == 3


def test_centered_rms_prop(step):
    var, mg, ms, mom, grad = _rand(), _rand(-0.1, 0.1), _rand(0.5, 1), _rand(), _rand()
    lr, rho, momentum, eps = 0.01, 0.9, 0.5, 1e-3
    got = step(
        "ApplyCenteredRMSProp", {"var": var, "mg": mg, "ms": ms, "mom": mom}, lr, rho, momentum, eps, grad
    )
    mg = rho * mg + (1 - rho) * grad
    ms = rho * ms + (1 - rho) * grad**2
    mom = momentum * mom + lr * grad / np.sqrt(ms - mg**2 + eps)
    _close(got, {"var": var - mom, "mg": mg, "ms": ms, "mom": mom})


@pytest.mark.parametrize("l1", [0.0, 0.2])
def test_proximal_adagrad(step, l1):
    var, accum, grad = _rand(), _rand(0.1, 1), _rand()
    lr, l2 = 0.3, 0.1
    got = step("ApplyProximalAdagrad", {"var": var, "accum": accum}, lr, l1, l2, grad)
    accum = accum + grad**2
    rate = lr / np.sqrt(accum)  # TensorFlow's kernel uses the adapted rate for l1 and l2 too
    prox = var - rate * grad
    expected = np.sign(prox) * np.maximum(np.abs(prox) - rate * l1, 0) / (1 + rate * l2)
    _close(got, {"var": expected, "accum": accum})


@pytest.mark.parametrize("l1", [0.0, 0.2])
def test_proximal_gradient_descent(step, l1):
    var, delta = _rand(), _rand()
    alpha, l2 = 0.3, 0.1
    got = step("ApplyProximalGradientDescent", {"var": var}, alpha, l1, l2, delta)
    prox = var - alpha * delta
    expected = np.sign(prox) * np.maximum(np.abs(prox) - alpha * l1, 0) / (1 + alpha * l2)
    _close(got, {"var": expected})
    if l1:
        assert np.count_nonzero(got["var"] == 0) > 0


@pytest.mark.parametrize(
    ("scalars", "text"),
    [
        ((0.0, 0.0, 0.0), r"lr is not a positive scalar: \[\]"),
        ((0.1, -1.0, 0.0), r"l1 regularization strength is not a non-negative scalar: \[\]"),
        ((0.1, 0.0, -1.0), r"l2 regularization strength is not a non-negative scalar: \[\]"),
    ],
)
def test_proximal_adagrad_checks_its_hyperparameters(step, scalars, text):
    with pytest.raises(errors.InvalidArgumentError, match=text):
        step("ApplyProximalAdagrad", {"var": _rand(), "accum": _rand(0.1, 1)}, *scalars, _rand())


def test_shape_and_scalar_errors(step):
    with pytest.raises(errors.InvalidArgumentError, match=r"lr is not a scalar: \[2\]"):
        step("ApplyAdadelta", {"var": _rand(), "accum": _rand(), "accum_update": _rand()},
             [0.1, 0.2], 0.9, 1e-6, _rand())  # fmt: skip
    with pytest.raises(errors.InvalidArgumentError, match="var and grad do not have the same shape"):
        step("ApplyCenteredRMSProp", {"var": _rand(), "mg": _rand(), "ms": _rand(), "mom": _rand()},
             0.1, 0.9, 0.0, 1e-6, np.ones(3))  # fmt: skip


@pytest.mark.parametrize(
    "op", ["ApplyFtrl", "ApplyFtrlV2", "ApplyProximalAdagrad", "ResourceApplyProximalGradientDescent"]
)
def test_complex_types_are_refused_where_tensorflow_has_no_kernel(make_node, op):
    with pytest.raises(errors.InvalidArgumentError, match="No OpKernel was registered"):
        create_kernel(make_node(op, T=np.complex64))


def test_reference_flavours_output_a_reference():
    for op in ("ApplyAdadelta", "ApplyFtrl", "ApplyFtrlV2", "ApplyCenteredRMSProp", "ApplyProximalAdagrad",
               "ApplyProximalGradientDescent"):  # fmt: skip
        assert op in REF_OUTPUT_OPS
