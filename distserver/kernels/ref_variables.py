"""TF 1.x reference variables: `VariableV2`, `Assign`, `AssignAdd`/`Sub`, `Scatter*`, `IsVariableInitialized`.

`tf.compat.v1` programs (with `disable_v2_behavior()`, or `use_resource=False`)
build these instead of resource variables. `VariableV2` outputs a reference to the
variable (a `VariableRef`, TF's `float_ref` tensor); the kernels here take that
reference at input 0 and change the variable itself, and output the reference
again. Any other kernel that consumes a reference gets the variable's value, read
when that kernel runs (see `OpKernel.ref_inputs`). The optimizers' `Apply*` kernels
for reference variables live in `kernels.state`, next to their `ResourceApply*`
twins, and share their formulas.

The variable lives in the task's `ResourceManager` under its `shared_name` (or the
node's name), in its `container` (default "localhost"), so every session and every
graph that names it uses the same variable, as on a TensorFlow parameter server;
`Session.reset(target)` drops it. Updates replace the stored array under the
variable's lock (no in-place writes), so readers never see a torn value.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from distserver import errors
from distserver.kernels._common import (
    ALL_TYPES,
    INDEX_TYPES,
    NUMBER,
    array,
    attr_shape,
    attr_type_in,
    check_input_dtype,
    kernel_error,
    scatter,
    shape_str,
)
from distserver.kernels.registry import KernelContext, OpKernel, register_kernel
from distserver.kernels.resources import (
    DEFAULT_CONTAINER,
    LegacyVariable,
    VariableRef,
    legacy_variable_key,
)

if TYPE_CHECKING:
    from distserver.protos.node_def_pb2 import NodeDef


# Ops whose output 0 is a reference to a variable (a `T_ref` tensor).
REF_OUTPUT_OPS = frozenset(
    {"VariableV2", "Variable", "Assign", "AssignAdd", "AssignSub", "ScatterAdd", "ScatterSub",
     "ScatterUpdate", "ApplyGradientDescent", "ApplyMomentum", "ApplyAdam", "ApplyAdagrad",
     "ApplyAdagradV2", "ApplyRMSProp", "ApplyCenteredRMSProp", "ApplyProximalAdagrad", "ApplyFtrl",
     "ApplyFtrlV2", "ApplyAdadelta", "ApplyProximalGradientDescent", "SparseApplyAdagrad",
     "SparseApplyAdagradV2", "SparseApplyProximalAdagrad", "SparseApplyMomentum", "SparseApplyRMSProp",
     "SparseApplyCenteredRMSProp", "SparseApplyFtrl", "SparseApplyFtrlV2"}
)  # fmt: skip


def requested_input(kernel: OpKernel, index: int) -> str:
    """The input string of data input `index` of the kernel's node (TF's `requested_input`)."""
    data_inputs = [t for t in kernel.node.input if not t.startswith("^")]
    return data_inputs[index] if index < len(data_inputs) else f"input {index}"


def ref_input(kernel: OpKernel, value: Any, index: int) -> VariableRef:
    """`value`, input `index` of `kernel`, as a variable reference; an error for a plain value."""
    if type(value) is not VariableRef:
        raise kernel_error(
            kernel,
            f"{kernel.op} input {index} ({requested_input(kernel, index)}) must be a reference to a "
            "variable (a VariableV2 output), got a value",
        )
    return value


@register_kernel("VariableV2", "Variable")
class VariableV2Kernel(OpKernel):
    """Outputs a reference to the variable `container/shared_name` (node name by default).

    The variable is created, uninitialized, the first time any node names it.
    """

    is_stateful = True
    makes_refs = True

    def __init__(self, node: NodeDef) -> None:
        super().__init__(node)
        self.dtype = attr_type_in(self, "dtype", ALL_TYPES)
        self.shape = attr_shape(self, "shape") if self.has_attr("shape") else None
        self.container = self.attr_str("container", "") or DEFAULT_CONTAINER
        self.var_name = self.attr_str("shared_name", "") or self.name

    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        variable = ctx.resources.lookup_or_create(
            self.container,
            legacy_variable_key(self.var_name),
            lambda: LegacyVariable(self.dtype, self.shape),
        )
        if not isinstance(variable, LegacyVariable):  # pragma: no cover - the key is ours alone
            raise kernel_error(self, f"Resource {self.container}/{self.var_name} is not a variable")
        if variable.dtype != self.dtype:
            raise kernel_error(
                self,
                f"Variable {self.var_name} was created with dtype {variable.dtype} and is now "
                f"requested with dtype {self.dtype}",
            )
        return [VariableRef(variable, self.var_name)]


@register_kernel("Assign")
class AssignKernel(OpKernel):
    """ref = value; outputs the reference.

    `validate_shape` (default true) requires `value` to have the variable's shape: its
    current value's when initialized, else the shape the `VariableV2` declared (when
    fully known). With `validate_shape=False` the variable takes any shape.
    """

    is_stateful = True
    ref_inputs = frozenset({0})

    def __init__(self, node: NodeDef) -> None:
        super().__init__(node)
        self.dtype = attr_type_in(self, "T", ALL_TYPES)
        self.validate_shape = self.attr_bool("validate_shape", True)

    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        ref = ref_input(self, inputs[0], 0)
        value = inputs[1]
        check_input_dtype(self, 1, value, self.dtype)
        variable = ref.variable
        with variable.lock:
            if self.validate_shape:
                current = variable.value
                expected = current.shape if current is not None else _declared_shape(variable)
                if expected is not None and expected != value.shape:
                    raise kernel_error(
                        self,
                        f"Assign requires shapes of both tensors to match. lhs shape= {shape_str(expected)} "
                        f"rhs shape= {shape_str(value.shape)}",
                    )
            variable.assign(value)
        return [ref]


def _declared_shape(variable: LegacyVariable) -> tuple[int, ...] | None:
    """The shape `VariableV2` declared, when every dimension is known."""
    if variable.shape is None:
        return None
    dims = [d for d in variable.shape if d is not None]
    return tuple(dims) if len(dims) == len(variable.shape) else None


@register_kernel("AssignAdd", "AssignSub")
class AssignUpdateKernel(OpKernel):
    """ref += value / ref -= value, atomically; outputs the reference."""

    is_stateful = True
    ref_inputs = frozenset({0})

    def __init__(self, node: NodeDef) -> None:
        super().__init__(node)
        self.dtype = attr_type_in(self, "T", NUMBER)
        self.fn = np.add if self.op == "AssignAdd" else np.subtract

    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        ref = ref_input(self, inputs[0], 0)
        value = inputs[1]
        check_input_dtype(self, 1, value, self.dtype)
        variable = ref.variable
        with variable.lock:
            current = _initialized_value(self, variable.value)
            if current.shape != value.shape:
                raise kernel_error(
                    self,
                    f"Parameters and update must be the same size: {shape_str(current.shape)} vs "
                    f"{shape_str(value.shape)}",
                )
            with np.errstate(all="ignore"):
                variable.replace(array(self.fn(current, value), self.dtype))
        return [ref]


def _initialized_value(kernel: OpKernel, value: np.ndarray | None) -> np.ndarray:
    """The variable's value, or TF's error for updating an uninitialized one."""
    if value is None:
        raise kernel_error(
            kernel,
            f"Attempting to use uninitialized parameters: {requested_input(kernel, 0)}",
            errors.FailedPreconditionError,
        )
    return value


@register_kernel("ScatterAdd", "ScatterSub", "ScatterUpdate")
class ScatterKernel(OpKernel):
    """ref[indices] += / -= / = updates, atomically; outputs the reference.

    What the optimizers emit for sparse gradients (embedding lookups).
    """

    is_stateful = True
    ref_inputs = frozenset({0})

    def __init__(self, node: NodeDef) -> None:
        super().__init__(node)
        self.mode = self.op.removeprefix("Scatter")
        self.dtype = attr_type_in(self, "T", ALL_TYPES if self.mode == "Update" else NUMBER)
        self.index_type = attr_type_in(self, "Tindices", INDEX_TYPES)

    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        ref = ref_input(self, inputs[0], 0)
        indices, updates = inputs[1], inputs[2]
        check_input_dtype(self, 1, indices, self.index_type)
        check_input_dtype(self, 2, updates, self.dtype)
        variable = ref.variable
        with variable.lock:
            current = _initialized_value(self, variable.value)
            variable.replace(scatter(self, current, indices, updates, self.mode))
        return [ref]


@register_kernel("IsVariableInitialized")
class IsVariableInitializedKernel(OpKernel):
    """Whether the referenced variable has a value (a bool scalar)."""

    ref_inputs = frozenset({0})

    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        return [np.array(ref_input(self, inputs[0], 0).variable.is_initialized)]


__all__ = [
    "REF_OUTPUT_OPS",
    "AssignKernel",
    "AssignUpdateKernel",
    "IsVariableInitializedKernel",
    "ScatterKernel",
    "VariableV2Kernel",
    "ref_input",
    "requested_input",
]


@register_kernel("CountUpTo")
class CountUpToKernel(OpKernel):
    """Increments an integer variable and outputs its value before the increment;
    `OutOfRangeError` once it has reached `limit` (what input producers stop on)."""

    is_stateful = True
    ref_inputs = frozenset({0})

    def __init__(self, node: NodeDef) -> None:
        super().__init__(node)
        self.dtype = attr_type_in(self, "T", INDEX_TYPES)
        self.limit = self.attr_int("limit")

    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        variable = ref_input(self, inputs[0], 0).variable
        with variable.lock:
            return [count_up_to(self, _initialized_value(self, variable.value), self.limit, variable.replace)]


def count_up_to(kernel: OpKernel, current: np.ndarray, limit: int, store: Any) -> np.ndarray:
    """CountUpTo's step, for both kinds of variables: `store(current + 1)`, return `current`."""
    if current.shape != ():
        raise kernel_error(kernel, f"input is not a scalar: {shape_str(current.shape)}")
    if int(current) >= limit:
        raise kernel_error(kernel, f"Reached limit of {limit}", errors.OutOfRangeError)
    before = current.copy()
    store(array(current + 1, current.dtype))
    return before
