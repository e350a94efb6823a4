"""Dense optimizer updates beyond those in `state`: Adadelta and ProximalGradientDescent.

Each kernel runs both flavours of its op, `ResourceApplyX` (resource variables) and
`ApplyX` (TF 1.x reference variables, outputting the reference to `var`), through
`state._ApplyKernel`, which owns the variable plumbing: handles and references,
locks, shape and dtype checks. Only the formulas live here; they are TensorFlow's
documented updates, written the way its CPU kernels evaluate them, so that float32
results agree to the last bits or nearly:

* `ApplyAdadelta` (`tf.compat.v1.train.AdadeltaOptimizer`)
* `ApplyProximalGradientDescent` (`ProximalGradientDescentOptimizer`)

Ftrl, centered RMSProp and ProximalAdagrad, dense and sparse, are in `state` and
`sparse`, which share their formulas.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from distserver.kernels._common import FLOATS, attr_type_in
from distserver.kernels.registry import register_kernel
from distserver.kernels.state import _ApplyKernel, proximal_step

if TYPE_CHECKING:
    from distserver.protos.node_def_pb2 import NodeDef


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
        return {"var": proximal_step(x["var"] - x["delta"] * alpha, alpha, x["l1"], x["l2"], self.dtype)}


__all__ = ["ApplyAdadeltaKernel", "ApplyProximalGradientDescentKernel"]
