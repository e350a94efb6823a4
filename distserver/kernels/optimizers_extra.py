"""The remaining dense optimizer updates: Adadelta, FTRL, centered RMSProp and the proximal ones.

Each kernel runs both flavours of its op, `ResourceApplyX` (resource variables) and
`ApplyX` (TF 1.x reference variables, outputting the reference to `var`), through
`state._ApplyKernel`, which owns the variable plumbing: handles and references,
locks, shape and dtype checks. Only the formulas live here; they are TensorFlow's
documented updates (`tf.raw_ops.ApplyFtrl`, ...), written the way its CPU kernels
evaluate them, so that float32 results agree to the last bits or nearly:

* `ApplyAdadelta` (`tf.compat.v1.train.AdadeltaOptimizer`)
* `ApplyFtrl`, `ApplyFtrlV2` (`FtrlOptimizer`, V2 when `l2_shrinkage_regularization_strength` is set)
* `ApplyCenteredRMSProp` (`RMSPropOptimizer(centered=True)`)
* `ApplyProximalAdagrad` (`ProximalAdagradOptimizer`)
* `ApplyProximalGradientDescent` (`ProximalGradientDescentOptimizer`)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from distserver.kernels._common import FLOATS, attr_type_in, kernel_error, shape_str
from distserver.kernels.registry import register_kernel
from distserver.kernels.state import _ApplyKernel

if TYPE_CHECKING:
    from distserver.protos.node_def_pb2 import NodeDef


def _proximal(kernel: _ApplyKernel, prox: Any, rate: Any, l1: np.ndarray, l2: np.ndarray) -> Any:
    """The proximal step: sign(prox) * max(|prox| - rate * l1, 0) / (1 + rate * l2)."""
    one = np.ones((), kernel.dtype)
    if float(l1) > 0:
        return np.sign(prox) * np.maximum(np.abs(prox) - rate * l1, 0) / (rate * l2 + one)
    return prox / (rate * l2 + one)


def _require(kernel: _ApplyKernel, value: np.ndarray, condition: bool, what: str) -> None:
    """TensorFlow's check of a proximal optimizer's scalar hyperparameter."""
    if not condition:
        raise kernel_error(kernel, f"{what}: {shape_str(value.shape)}")


@register_kernel("ResourceApplyAdadelta", "ApplyAdadelta")
class ApplyAdadeltaKernel(_ApplyKernel):
    """TF's ApplyAdadelta:

    accum = rho * accum + (1 - rho) * grad^2
    update = sqrt(accum_update + epsilon) / sqrt(accum + epsilon) * grad
    var -= lr * update
    accum_update = rho * accum_update + (1 - rho) * update^2
    """

    signature = (
        ("var", "var"),
        ("accum", "var"),
        ("accum_update", "var"),
        ("lr", "scalar"),
        ("rho", "scalar"),
        ("epsilon", "scalar"),
        ("grad", "tensor"),
    )

    def update(self, **x: np.ndarray) -> dict[str, Any]:
        one = np.ones((), self.dtype)
        grad, rho, epsilon = x["grad"], x["rho"], x["epsilon"]
        accum = x["accum"] * rho + grad * grad * (one - rho)
        step = np.sqrt(x["accum_update"] + epsilon) / np.sqrt(accum + epsilon) * grad
        accum_update = x["accum_update"] * rho + step * step * (one - rho)
        return {"var": x["var"] - step * x["lr"], "accum": accum, "accum_update": accum_update}


@register_kernel("ResourceApplyFtrl", "ApplyFtrl")
class ApplyFtrlKernel(_ApplyKernel):
    """TF's ApplyFtrl (FTRL-proximal), with p = lr_power:

    accum_new = accum + grad^2
    linear += grad - (accum_new^-p - accum^-p) / lr * var
    var = (sign(linear) * l1 - linear) / (accum_new^-p / lr + 2 * l2) if |linear| > l1 else 0
    accum = accum_new

    With `multiply_linear_by_lr`, `linear` holds lr times that: linear += grad * lr -
    (accum_new^-p - accum^-p) * var, and var = (sign(linear) * l1 * lr - linear) /
    (accum_new^-p + 2 * l2 * lr) where |linear| > l1 * lr. ApplyFtrlV2 adds
    2 * l2_shrinkage * var to the gradient that enters `linear` (not `accum`).
    """

    signature: ClassVar[tuple[tuple[str, str], ...]] = (
        ("var", "var"),
        ("accum", "var"),
        ("linear", "var"),
        ("grad", "tensor"),
        ("lr", "scalar"),
        ("l1", "scalar"),
        ("l2", "scalar"),
        ("lr_power", "scalar"),
    )

    def __init__(self, node: NodeDef) -> None:
        super().__init__(node)
        self.dtype = attr_type_in(self, "T", FLOATS)
        self.multiply_linear_by_lr = self.attr_bool("multiply_linear_by_lr", False)

    def update(self, **x: np.ndarray) -> dict[str, Any]:
        var, accum, grad, lr, l1, l2 = x["var"], x["accum"], x["grad"], x["lr"], x["l1"], x["l2"]
        two = np.array(2, self.dtype)
        shrunk = grad + two * x["l2_shrinkage"] * var if "l2_shrinkage" in x else grad
        accum_new = accum + grad * grad
        if float(x["lr_power"]) == -0.5:  # TensorFlow's special case: square roots, not powers
            power_new, power_old = np.sqrt(accum_new), np.sqrt(accum)
        else:
            power_new, power_old = np.power(accum_new, -x["lr_power"]), np.power(accum, -x["lr_power"])
        if self.multiply_linear_by_lr:
            linear = x["linear"] + shrunk * lr - (power_new - power_old) * var
            threshold = l1 * lr
            quadratic = power_new + two * l2 * lr
        else:
            linear = x["linear"] + shrunk - (power_new - power_old) / lr * var
            threshold = l1
            quadratic = power_new / lr + two * l2
        new_var = np.where(np.abs(linear) > threshold, (np.sign(linear) * threshold - linear) / quadratic, 0)
        return {"var": new_var, "accum": accum_new, "linear": linear}


@register_kernel("ResourceApplyFtrlV2", "ApplyFtrlV2")
class ApplyFtrlV2Kernel(ApplyFtrlKernel):
    """FTRL with an L2 shrinkage term (see ApplyFtrlKernel)."""

    signature = (
        ("var", "var"),
        ("accum", "var"),
        ("linear", "var"),
        ("grad", "tensor"),
        ("lr", "scalar"),
        ("l1", "scalar"),
        ("l2", "scalar"),
        ("l2_shrinkage", "scalar"),
        ("lr_power", "scalar"),
    )


@register_kernel("ResourceApplyCenteredRMSProp", "ApplyCenteredRMSProp")
class ApplyCenteredRMSPropKernel(_ApplyKernel):
    """TF's ApplyCenteredRMSProp: RMSProp normalised by an estimate of the variance.

    mg += (grad - mg) * (1 - rho);  ms += (grad^2 - ms) * (1 - rho)
    mom = mom * momentum + lr * grad / sqrt(ms - mg^2 + epsilon)
    var -= mom
    """

    signature = (
        ("var", "var"),
        ("mg", "var"),
        ("ms", "var"),
        ("mom", "var"),
        ("lr", "scalar"),
        ("rho", "scalar"),
        ("momentum", "scalar"),
        ("epsilon", "scalar"),
        ("grad", "tensor"),
    )

    def update(self, **x: np.ndarray) -> dict[str, Any]:
        one = np.ones((), self.dtype)
        grad, rho = x["grad"], x["rho"]
        ms = x["ms"] + (grad * grad - x["ms"]) * (one - rho)
        mg = x["mg"] + (grad - x["mg"]) * (one - rho)
        mom = x["mom"] * x["momentum"] + grad * x["lr"] / np.sqrt(ms - mg * mg + x["epsilon"])
        return {"var": x["var"] - mom, "mg": mg, "ms": ms, "mom": mom}


@register_kernel("ResourceApplyProximalAdagrad", "ApplyProximalAdagrad")
class ApplyProximalAdagradKernel(_ApplyKernel):
    """TF's ApplyProximalAdagrad, with the per-element rate r = lr / sqrt(accum):

    accum += grad^2
    prox = var - r * grad
    var = sign(prox) * max(|prox| - r * l1, 0) / (1 + r * l2)
    """

    signature = (
        ("var", "var"),
        ("accum", "var"),
        ("lr", "scalar"),
        ("l1", "scalar"),
        ("l2", "scalar"),
        ("grad", "tensor"),
    )

    def __init__(self, node: NodeDef) -> None:
        super().__init__(node)
        self.dtype = attr_type_in(self, "T", FLOATS)

    def update(self, **x: np.ndarray) -> dict[str, Any]:
        lr, l1, l2 = x["lr"], x["l1"], x["l2"]
        _require(self, lr, float(lr) > 0, "lr is not a positive scalar")
        _require(self, l1, float(l1) >= 0, "l1 regularization strength is not a non-negative scalar")
        _require(self, l2, float(l2) >= 0, "l2 regularization strength is not a non-negative scalar")
        grad = x["grad"]
        accum = x["accum"] + grad * grad
        rate = lr / np.sqrt(accum)
        return {"var": _proximal(self, x["var"] - grad * rate, rate, l1, l2), "accum": accum}


@register_kernel("ResourceApplyProximalGradientDescent", "ApplyProximalGradientDescent")
class ApplyProximalGradientDescentKernel(_ApplyKernel):
    """TF's ApplyProximalGradientDescent:

    prox = var - alpha * delta
    var = sign(prox) * max(|prox| - alpha * l1, 0) / (1 + alpha * l2)
    """

    signature = (
        ("var", "var"),
        ("alpha", "scalar"),
        ("l1", "scalar"),
        ("l2", "scalar"),
        ("delta", "tensor"),
    )

    def __init__(self, node: NodeDef) -> None:
        super().__init__(node)
        self.dtype = attr_type_in(self, "T", FLOATS)

    def update(self, **x: np.ndarray) -> dict[str, Any]:
        alpha = x["alpha"]
        return {"var": _proximal(self, x["var"] - x["delta"] * alpha, alpha, x["l1"], x["l2"])}


__all__ = [
    "ApplyAdadeltaKernel",
    "ApplyCenteredRMSPropKernel",
    "ApplyFtrlKernel",
    "ApplyFtrlV2Kernel",
    "ApplyProximalAdagradKernel",
    "ApplyProximalGradientDescentKernel",
]
