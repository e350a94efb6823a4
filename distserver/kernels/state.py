"""Resource-variable kernels, as TensorFlow's graph mode builds them, and the optimizers.

A variable is a `VariableResource` in the task's `ResourceManager`, named by the
`ResourceHandle` that `VarHandleOp` outputs. `AssignVariableOp` creates it when it is
absent (TF's LookupOrCreate); reading one that does not exist (or was destroyed) is
TF's FailedPrecondition "Could not find variable ...".

Concurrency: every read-modify-write (AssignAdd/Sub, the optimizer updates) runs
under the variables' locks, taken in a fixed order, so concurrent steps never lose an
update and never deadlock. An update writes into the stored array only when nothing
else references it (`VariableResource.unshared`, TensorFlow's forwarding of a buffer
whose reference count is one); otherwise it replaces the array, so a value handed to
a reader stays unchanged while later steps update the variable (copy-on-write). A
group of like updates of small variables keeps them side by side and updates them
at once under the same rule, counted for the whole arena (`_VariableArena`).

The optimizer kernels (`ResourceApplyGradientDescent`, `...Momentum`, `...Adam`,
`...Adagrad`, `...AdagradV2`, `...RMSProp`, `...CenteredRMSProp`, `...ProximalAdagrad`,
`...Ftrl`, `...FtrlV2`) also run their TF 1.x twins without the
`Resource` prefix (`ApplyAdam`, ...), which update reference variables (see
`kernels.ref_variables`).
"""

from __future__ import annotations

import operator
import sys
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, TypeVar

import numpy as np

from distserver import errors
from distserver.kernels import _compiled
from distserver.kernels._common import (
    ALL_TYPES,
    COMPLEX,
    FLOATS,
    INDEX_TYPES,
    NUMBER,
    array,
    attr_shape,
    attr_type_in,
    check_input_dtype,
    handle_input,
    handle_output,
    kernel_error,
    quiet,
    scatter,
    shape_str,
    type_name,
)
from distserver.kernels.array import GatherKernel
from distserver.kernels.math import fused_parts
from distserver.kernels.ref_variables import count_up_to, ref_input, requested_input
from distserver.kernels.registry import (
    KernelContext,
    OpKernel,
    compute_without_dereference,
    create_kernel,
    register_kernel,
)
from distserver.kernels.resources import DEFAULT_CONTAINER, ResourceManager, VariableResource
from distserver.protos.node_def_pb2 import NodeDef
from distserver.tensors import ResourceHandle

# TensorFlow names resources by their C++ type in lookup errors; keep its text.
_VAR_TYPE_NAME = "N10tensorflow3VarE"


def _missing_text(handle: ResourceHandle) -> str:
    return f"Resource {handle.container or DEFAULT_CONTAINER}/{handle.name}/{_VAR_TYPE_NAME} does not exist."


# Handle inputs a kernel remembers having looked up (more come only from handles that
# are new arrays every step, such as ones received from another task).
_FOUND_KEPT = 8


class _VariableKernel(OpKernel):
    """Shared handle checks and lookups for the kernels that take a variable handle."""

    def __init__(self, node: NodeDef) -> None:
        super().__init__(node)
        # id(handle input) -> (that input, the ResourceManager, its generation then, the
        # device, the variable found, weakly). A VarHandleOp's output is the same array
        # every step: its variable is found again by identity, without a lookup.
        self._found: dict[int, tuple[Any, ResourceManager, int, str, weakref.ref[VariableResource]]] = {}

    def _handle(self, ctx: KernelContext, value: Any) -> ResourceHandle:
        handle = handle_input(self, value)
        if handle.device and ctx.device and handle.device != ctx.device:
            raise kernel_error(
                self,
                f"Trying to access resource {handle.name} located in device {handle.device} "
                f"from device {ctx.device}",
            )
        return handle

    def _find(self, ctx: KernelContext, handle: ResourceHandle) -> VariableResource | None:
        """The initialized variable `handle` names, or None."""
        resource = ctx.resources.find(handle.container, handle.name)
        if isinstance(resource, VariableResource) and resource.value is not None:
            return resource
        return None

    def _find_input(self, ctx: KernelContext, value: Any) -> VariableResource | None:
        """`_find(ctx, _handle(ctx, value))` for the usual case, inline (read and updated by
        every step): a handle of this device naming an initialized variable. None for any
        other case, which the caller then takes through `_handle` and `_find` for its error."""
        resources = ctx.resources
        found = self._found.get(id(value))
        if (
            found is not None
            and found[0] is value
            and found[1] is resources
            and found[2] == resources.generation
            and found[3] == ctx.device
        ):
            variable = found[4]()
            if variable is not None and variable.value is not None:
                return variable
        handle = value[()] if type(value) is np.ndarray and not value.ndim else value
        if type(handle) is ResourceHandle and (not handle.device or handle.device == ctx.device):
            generation = resources.generation  # read first: a removal after it shows
            variable = resources.find(handle.container, handle.name)
            if isinstance(variable, VariableResource) and variable.value is not None:
                if len(self._found) >= _FOUND_KEPT:
                    self._found.clear()
                self._found[id(value)] = (value, resources, generation, ctx.device, weakref.ref(variable))
                return variable
        return None

    def _lookup(self, ctx: KernelContext, handle: ResourceHandle) -> VariableResource:
        """The variable `handle` names; TF's NotFound text when there is none."""
        variable = self._find(ctx, handle)
        if variable is None:
            raise kernel_error(self, _missing_text(handle), errors.NotFoundError)
        return variable

    def _current(self, variable: VariableResource, handle: ResourceHandle) -> np.ndarray:
        """The value of a variable whose lock is held (it may have been destroyed meanwhile)."""
        value = variable.value
        if value is None:
            raise kernel_error(self, _missing_text(handle), errors.NotFoundError)
        return value


@register_kernel("VarHandleOp")
class VarHandleOpKernel(OpKernel):
    """Outputs the handle of variable `shared_name` (or the node's name) on this device."""

    is_stateful = True
    outputs_fixed = True

    def __init__(self, node: NodeDef) -> None:
        super().__init__(node)
        self.container = self.attr_str("container", "") or DEFAULT_CONTAINER
        self.var_name = self.attr_str("shared_name", "") or self.name
        self.dtype = self.attr_type("dtype")
        self.shape = attr_shape(self, "shape") if self.has_attr("shape") else None

    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        return [
            handle_output(ResourceHandle(ctx.device, self.container, self.var_name, self.dtype, self.shape))
        ]


@register_kernel("ReadVariableOp")
class ReadVariableOpKernel(_VariableKernel):
    """The variable's current value: the stored array itself (an update that finds it
    still referenced by this output's holders replaces it instead of writing into it)."""

    runs_on_loop = True  # no work: its input, a handle, never made it large enough for a thread

    def __init__(self, node: NodeDef) -> None:
        super().__init__(node)
        self.dtype = self.attr_type("dtype")

    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        variable = self._find_input(ctx, inputs[0])
        value = None if variable is None else variable.read()
        if value is not None and value.dtype == self.dtype:
            return [value]
        handle = self._handle(ctx, inputs[0])
        variable = self._find(ctx, handle)
        value = None if variable is None else variable.read()
        if value is None:
            raise kernel_error(
                self,
                f"Could not find variable {handle.name}. This could mean that the variable has been "
                "deleted. In TF1, it can also mean the variable is uninitialized. Debug info: "
                f"container={handle.container or DEFAULT_CONTAINER}, "
                f"status error message={_missing_text(handle)}",
                errors.FailedPreconditionError,
            )
        if value.dtype != self.dtype:
            raise kernel_error(
                self,
                f"Trying to read variable with wrong dtype. Expected {type_name(self.dtype)} "
                f"got {type_name(value.dtype)}",
            )
        return [value]


@register_kernel("VariableShape")
class VariableShapeKernel(_VariableKernel):
    """The shape of the variable's current value, as `out_type` (int32 by default)."""

    runs_on_loop = True

    def __init__(self, node: NodeDef) -> None:
        super().__init__(node)
        self.out_type = self.attr_type("out_type", np.dtype(np.int32))

    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        handle = self._handle(ctx, inputs[0])
        variable = self._lookup(ctx, handle)
        return [np.array(self._current(variable, handle).shape, dtype=self.out_type)]


@register_kernel("AssignVariableOp")
class AssignVariableOpKernel(_VariableKernel):
    """Stores a copy of `value`, creating the variable when absent; shapes may change.

    With `validate_shape=True` (newer TF) the new value must keep the current shape.
    """

    is_stateful = True

    def __init__(self, node: NodeDef) -> None:
        super().__init__(node)
        self.dtype = attr_type_in(self, "dtype", ALL_TYPES)
        self.validate_shape = self.attr_bool("validate_shape", False)

    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        handle = self._handle(ctx, inputs[0])
        value = inputs[1]
        if value.dtype != self.dtype:
            raise kernel_error(
                self,
                f"Variable and value dtypes don't match; respectively, {type_name(self.dtype)} "
                f"and {type_name(value.dtype)}",
            )
        variable = ctx.resources.lookup_or_create(
            handle.container, handle.name, lambda: VariableResource(self.dtype, handle.shape)
        )
        if not isinstance(variable, VariableResource):
            raise kernel_error(
                self, f"Resource {handle.container}/{handle.name} exists and is not a variable"
            )
        with variable.lock:
            if variable.dtype != self.dtype:
                raise kernel_error(
                    self,
                    f"Trying to assign variable with wrong dtype. Expected {type_name(variable.dtype)} "
                    f"got {type_name(self.dtype)}",
                )
            current = variable.value
            if self.validate_shape and current is not None and current.shape != value.shape:
                raise kernel_error(
                    self,
                    "Trying to assign to variable with tensor with wrong shape. Expected "
                    f"{shape_str(current.shape)} got {shape_str(value.shape)}",
                )
            variable.assign(value)
        return []


@register_kernel("AssignAddVariableOp", "AssignSubVariableOp")
class AssignUpdateVariableOpKernel(_VariableKernel):
    """var += value / var -= value, atomically: concurrent updates all count."""

    is_stateful = True

    def __init__(self, node: NodeDef) -> None:
        super().__init__(node)
        self.dtype = attr_type_in(self, "dtype", NUMBER)
        self.fn = quiet(np.add if self.op == "AssignAddVariableOp" else np.subtract)

    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        # (a global step's increment, every step: the variable found again without a lookup)
        value = inputs[1]
        variable = self._find_input(ctx, inputs[0])
        if variable is None:
            handle = self._handle(ctx, inputs[0])
            check_input_dtype(self, 1, value, self.dtype)
            variable = self._lookup(ctx, handle)
        else:
            check_input_dtype(self, 1, value, self.dtype)
        with variable.lock:
            current = variable.value
            if current is None:  # (destroyed meanwhile)
                current = self._current(variable, self._handle(ctx, inputs[0]))
            if current.dtype != self.dtype:
                raise kernel_error(
                    self,
                    f"Variable and value dtypes don't match; respectively, {type_name(current.dtype)} "
                    f"and {type_name(self.dtype)}",
                )
            if current.shape != value.shape:
                raise kernel_error(
                    self,
                    f"Cannot update variable with shape {shape_str(current.shape)} using a Tensor with "
                    f"shape {shape_str(value.shape)}, shapes must be equal.",
                )
            variable.replace(array(self.fn(current, value), self.dtype))
        return []


@register_kernel("ResourceCountUpTo")
class ResourceCountUpToKernel(_VariableKernel):
    """CountUpTo on a resource variable (see `ref_variables.count_up_to`)."""

    is_stateful = True

    def __init__(self, node: NodeDef) -> None:
        super().__init__(node)
        self.limit = self.attr_int("limit")

    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        handle = self._handle(ctx, inputs[0])
        variable = self._lookup(ctx, handle)
        with variable.lock:
            return [count_up_to(self, self._current(variable, handle), self.limit, variable.replace)]


@register_kernel("VarIsInitializedOp")
class VarIsInitializedOpKernel(_VariableKernel):
    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        handle = self._handle(ctx, inputs[0])
        return [np.array(self._find(ctx, handle) is not None)]


@register_kernel("DisableCopyOnRead")
class DisableCopyOnReadKernel(_VariableKernel):
    """Turns off TensorFlow's copy-on-read mode of a variable (the Saver runs it before reading
    a partitioned resource variable). distserver writes into a variable's array only while no
    reader holds it (see `VariableResource`), so a value read never changes and there is no
    mode to turn off: this checks that the variable exists."""

    is_stateful = True

    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        handle = self._handle(ctx, inputs[0])
        try:
            resource = ctx.resources.lookup(handle.container, handle.name)
        except errors.NotFoundError:
            resource = None
        if not isinstance(resource, VariableResource):
            raise kernel_error(self, _missing_text(handle), errors.NotFoundError)
        return []


@register_kernel("DestroyResourceOp")
class DestroyResourceOpKernel(_VariableKernel):
    """Deletes the resource a handle names (any resource type)."""

    is_stateful = True

    def __init__(self, node: NodeDef) -> None:
        super().__init__(node)
        self.ignore_lookup_error = self.attr_bool("ignore_lookup_error", True)

    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        handle = self._handle(ctx, inputs[0])
        try:
            ctx.resources.delete(handle.container, handle.name)
        except errors.NotFoundError as exc:
            if not self.ignore_lookup_error:
                raise kernel_error(self, exc.message, errors.NotFoundError) from None
        return []


@register_kernel("ResourceGather")
class ResourceGatherKernel(GatherKernel):
    """The variable's rows `indices` (`tf.gather` or an embedding lookup on a resource variable)."""

    params_type_attr = "dtype"

    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        handle = handle_input(self, inputs[0])
        if handle.device and ctx.device and handle.device != ctx.device:
            raise kernel_error(
                self,
                f"Trying to access resource {handle.name} located in device {handle.device} "
                f"from device {ctx.device}",
            )
        try:
            variable = ctx.resources.lookup(handle.container, handle.name)
        except errors.NotFoundError:
            variable = None
        value = variable.read() if isinstance(variable, VariableResource) else None
        if value is None:
            raise kernel_error(self, _missing_text(handle), errors.NotFoundError)
        check_input_dtype(self, 0, value, self.dtype)
        return [self.gather(value, inputs[1], 0)]


@register_kernel("ResourceScatterAdd", "ResourceScatterSub", "ResourceScatterUpdate")
class ResourceScatterKernel(_VariableKernel):
    """var[indices] += / -= / = updates, atomically (sparse updates of a resource variable)."""

    is_stateful = True

    def __init__(self, node: NodeDef) -> None:
        super().__init__(node)
        self.mode = self.op.removeprefix("ResourceScatter")
        self.dtype = attr_type_in(self, "dtype", ALL_TYPES if self.mode == "Update" else NUMBER)
        self.index_type = attr_type_in(self, "Tindices", INDEX_TYPES)

    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        handle = self._handle(ctx, inputs[0])
        indices, updates = inputs[1], inputs[2]
        check_input_dtype(self, 1, indices, self.index_type)
        check_input_dtype(self, 2, updates, self.dtype)
        variable = self._lookup(ctx, handle)
        with variable.lock:
            current = self._current(variable, handle)
            check_input_dtype(self, 0, current, self.dtype)
            variable.replace(scatter(self, current, indices, updates, self.mode))
        return []


# --------------------------------------------------------------------------- optimizers


class OptimizerUpdates:
    """How many optimizer updates (dense and sparse) this process wrote into the
    variables' own arrays, and how many built new arrays because something held the
    old ones (`AsyncServer.statistics`, the `distserver_optimizer_updates_total` metric)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.in_place = 0
        self.copied = 0

    def count(self, in_place: bool, updates: int = 1) -> None:
        with self._lock:
            if in_place:
                self.in_place += updates
            else:
                self.copied += updates


OPTIMIZER_UPDATES = OptimizerUpdates()


class _locked:  # a context manager, named like one written as a function
    """Hold the locks of `variables` (a context manager): one fixed order (by identity)
    for every kernel, so two updates never deadlock; a variable passed twice is locked
    once. A class, not a generator: it is entered by every optimizer update."""

    __slots__ = ("_locks", "_taken")

    def __init__(self, variables: list[VariableResource]) -> None:
        if len(variables) == 1:
            self._locks = [variables[0].lock]
        elif len(variables) == 2:
            a, b = variables
            self._locks = [a.lock] if a is b else [a.lock, b.lock] if id(a) < id(b) else [b.lock, a.lock]
        else:
            self._locks = _locked.lock_order(variables)
        self._taken = 0

    @staticmethod
    def lock_order(variables: list[VariableResource]) -> list[threading.Lock]:
        """The locks of `variables`, each once, in the order they are taken."""
        return [v.lock for v in sorted({id(v): v for v in variables}.values(), key=id)]

    @classmethod
    def in_order(cls, locks: list[threading.Lock]) -> _locked:
        """Hold `locks`, which `lock_order` gave (for a caller that keeps that list)."""
        held = cls.__new__(cls)
        held._locks = locks
        held._taken = 0
        return held

    def __enter__(self) -> None:
        try:
            for lock in self._locks:
                lock.acquire()
                self._taken += 1
        except BaseException:
            self._release()
            raise

    def __exit__(self, *exc_info: object) -> None:
        self._release()

    def _release(self) -> None:
        for lock in reversed(self._locks[: self._taken]):
            lock.release()
        self._taken = 0


_R = TypeVar("_R")

# What `update_pair_in_place` returns when it did not update.
NOT_IN_PLACE: Any = object()


def update_pair_in_place(
    var: VariableResource,
    slot: VariableResource,
    fits: Callable[[np.ndarray, np.ndarray], bool],
    update: Callable[[np.ndarray, np.ndarray], _R],
) -> _R:
    """The short path of an optimizer's update of a variable and its slot (two
    distinct variables with values): with both locks held (in `_locked`'s order), when
    neither's value is shared (checked before this holds the arrays) and the values
    `fits`, `update(value, slot_value)` with both arrays writeable, and its result;
    else `NOT_IN_PLACE`, having changed nothing."""
    first, second = (var, slot) if id(var) < id(slot) else (slot, var)
    with first.lock, second.lock:
        if not (var.unshared() and slot.unshared()):
            return NOT_IN_PLACE  # type: ignore[no-any-return]
        value, slot_value = var.value, slot.value
        assert value is not None  # (unshared: both have values)
        assert slot_value is not None
        if not fits(value, slot_value):
            return NOT_IN_PLACE  # type: ignore[no-any-return]
        value.setflags(write=True)  # (setflags: 0.27 us, `flags.writeable =` 0.40)
        slot_value.setflags(write=True)
        try:
            return update(value, slot_value)
        finally:
            value.setflags(write=False)
            slot_value.setflags(write=False)


# The dtypes whose updates may be written into the variables' arrays (`update_in_place`):
# numpy computes them natively, so in place and out of place give the same bits.
_IN_PLACE_TYPES = frozenset({np.dtype(np.float32), np.dtype(np.float64)})


# A dense update of a larger variable is written piece by piece, each piece this many
# bytes of the variable: every pass of the update (Adam makes a dozen) then runs over
# data in the CPU's cache instead of streaming the whole arrays through memory each
# time (784x512 float32 Adam: 1.4 -> 0.7 ms here). The updates are element-wise, so
# the pieces give the same bits as one whole update.
_PIECE_BYTES = 256 * 1024


def _pieces(
    values: dict[str, np.ndarray], signature: tuple[tuple[str, str], ...]
) -> list[dict[str, np.ndarray]]:
    """`values` (an `_ApplyKernel`'s inputs, by name) cut into pieces of `_PIECE_BYTES`
    of the variable: flat views of every array input, the scalars as they are. One
    piece, `values` itself, when the variable is small or an array is not contiguous."""
    var = values["var"]
    if var.nbytes < 2 * _PIECE_BYTES:
        return [values]
    arrays = [name for name, kind in signature if kind != "scalar"]
    if not all(values[name].flags.c_contiguous for name in arrays):
        return [values]
    flat = {name: values[name].reshape(-1) for name in arrays}
    step = max(1, _PIECE_BYTES // var.itemsize)
    pieces = []
    for start in range(0, var.size, step):
        piece = dict(values)
        for name, whole in flat.items():
            piece[name] = whole[start : start + step]
        pieces.append(piece)
    return pieces


class _ApplyKernel(_VariableKernel):
    """A dense optimizer update of one or more variables, per TF's formulas.

    One class serves both flavours of an optimizer op: `ResourceApplyX` takes
    variable handles, `ApplyX` (TF 1.x reference variables) takes references and
    outputs the reference to `var`. `signature` lists the inputs in TF's order as
    (name, kind): "var" inputs are the variables updated, "scalar" inputs must be
    scalars (TF's legacy scalars: [] or [1]) and "tensor" inputs must have the shape
    of `var`. Every update happens under the locks of all the variables involved,
    whatever `use_locking` says: taking an uncontended lock is cheap, lost updates
    are not.

    A class that defines `update_in_place` has its update written into the
    variables' own arrays when every one of them is unshared
    (`VariableResource.unshared`: no reader holds it) and of a dtype numpy computes
    natively; otherwise, and for every other class, `update` builds new arrays.
    """

    is_stateful = True
    # A dense update streams its variables and gradient once (Adam of a 1.6 MiB
    # gradient: ~0.3 ms, as long as a large grpc+verbs write holds the loop), where a
    # hop to the pool and back costs 0.1-0.2 ms inside a step (traced: a ps's update
    # of an mlp's first layer). Up to a 2 MiB gradient it runs on the loop.
    offload_bytes: ClassVar[int | None] = 2 << 20
    signature: ClassVar[tuple[tuple[str, str], ...]]
    types: ClassVar[frozenset[np.dtype[Any]]] = FLOATS | COMPLEX  # the `T` TF has kernels for

    def __init__(self, node: NodeDef) -> None:
        super().__init__(node)
        self.dtype = attr_type_in(self, "T", self.types)
        self.use_locking = self.attr_bool("use_locking", False)
        self.use_nesterov = self.attr_bool("use_nesterov", False)
        self.on_refs = not self.op.startswith("Resource")
        if self.on_refs:
            self.ref_inputs = frozenset(i for i, (_, kind) in enumerate(self.signature) if kind == "var")
        self.may_update_in_place = (
            type(self).update_in_place is not _ApplyKernel.update_in_place and self.dtype in _IN_PLACE_TYPES
        )
        # The inputs' names; the indices and names of the "var" inputs; (input index, name,
        # is a scalar) of the rest; the names of the inputs that must have var's shape.
        self._names = [name for name, _ in self.signature]
        self._var_indices = [i for i, (_, kind) in enumerate(self.signature) if kind == "var"]
        self._var_names = [self._names[i] for i in self._var_indices]
        self._shaped_names = [name for name, kind in self.signature[1:] if kind != "scalar"]
        self._other_slots = [
            (i, name, kind == "scalar") for i, (name, kind) in enumerate(self.signature) if kind != "var"
        ]
        self._quiet_update_in_place = quiet(self.update_in_place)

    def _no_value(self, ctx: KernelContext, index: int, value: Any) -> errors.OpError:
        """The error for variable input `index` (`value`), found without a value."""
        if self.on_refs:
            return kernel_error(
                self,
                f"Attempting to use uninitialized variables: {requested_input(self, index)}",
                errors.FailedPreconditionError,
            )
        return kernel_error(self, _missing_text(self._handle(ctx, value)), errors.NotFoundError)

    # A kernel with a short path for its usual inputs sets `_may_go_fast` and defines
    # `_update_fast` (update in place and return True, or change nothing and return False).
    _may_go_fast = False

    def _update_fast(self, ctx: KernelContext, inputs: list[Any]) -> bool:
        return False

    def _took_short_path(self, ctx: KernelContext, inputs: list[Any]) -> bool:
        """Whether the short path (`_update_fast`) made this update."""
        if self._may_go_fast and len(inputs) == len(self.signature) and self._update_fast(ctx, inputs):
            OPTIMIZER_UPDATES.count(True)
            return True
        return False

    def _resource(self, ctx: KernelContext, index: int, value: Any) -> VariableResource:
        """The variable input `index` (`value`) names."""
        if self.on_refs:
            return ref_input(self, value, index).variable
        return self._find_input(ctx, value) or self._lookup(ctx, self._handle(ctx, value))

    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        # Run by every optimizer update of every step (a model of 60 variables: 60 a
        # step), so the checks are plain comparisons, with the error paths out of line.
        if len(inputs) != len(self.signature):
            raise kernel_error(self, f"expects {len(self.signature)} inputs, got {len(inputs)}")
        targets = [self._resource(ctx, i, inputs[i]) for i in self._var_indices]
        values = dict(zip(self._names, inputs, strict=True))
        dtype = self.dtype
        for i, name, scalar in self._other_slots:
            value = inputs[i]
            if value.dtype != dtype:
                check_input_dtype(self, i, value, dtype)
            if scalar and value.ndim:
                if value.size != 1 or value.ndim > 1:
                    raise kernel_error(self, f"{name} is not a scalar: {shape_str(value.shape)}")
                values[name] = value.reshape(())
        with _locked(targets):
            # Decided before this kernel takes references to the arrays itself. Scalars
            # are not worth it (numpy's temporaries of 0-d arrays are not arrays).
            in_place = self.may_update_in_place and (
                len(targets) == 1 or len({id(v) for v in targets}) == len(targets)
            )
            for variable in targets:
                in_place = in_place and variable.unshared() and variable.value.ndim > 0  # type: ignore[union-attr]
            for i, name, variable in zip(self._var_indices, self._var_names, targets, strict=True):
                current = variable.value
                if current is None:
                    raise self._no_value(ctx, i, inputs[i])
                if current.dtype != dtype:
                    check_input_dtype(self, 0, current, dtype)
                values[name] = current
            shape = values["var"].shape
            for name in self._shaped_names:
                if values[name].shape != shape:
                    raise kernel_error(
                        self,
                        f"var and {name} do not have the same shape"
                        f"{shape_str(shape)} {shape_str(values[name].shape)}",
                    )
            if in_place:
                self._update_in_place(values)
            else:
                with np.errstate(all="ignore"):
                    updated = self.update(**values)
                for name, new_value in updated.items():
                    targets[self._var_names.index(name)].replace(array(new_value, self.dtype))
            OPTIMIZER_UPDATES.count(in_place)
        return [inputs[0]] if self.on_refs else []

    def _update_in_place(self, values: dict[str, np.ndarray]) -> None:
        for name in self._var_names:
            values[name].flags.writeable = True
        try:
            if self.compiled_update(values):
                return
            if values["var"].nbytes < 2 * _PIECE_BYTES:  # one piece: `_pieces` would give `values`
                self._quiet_update_in_place(**values)
            else:
                for piece in _pieces(values, self.signature):
                    self._quiet_update_in_place(**piece)
        finally:
            for name in self._var_names:
                values[name].flags.writeable = False

    def compiled_update(self, values: dict[str, np.ndarray]) -> bool:
        """`update_in_place` of `values` by a compiled loop (`_compiled`), and True; or
        False, having changed nothing, for numpy's calls to make it."""
        return False

    def update(self, **x: np.ndarray) -> dict[str, Any]:
        """New values of the "var" inputs, from every input's current value."""
        raise NotImplementedError

    def update_in_place(self, **x: np.ndarray) -> None:
        """`update`, written into the "var" arrays (the same operations in the same
        order, so the same bits), with as few temporaries as it can."""
        raise NotImplementedError


@register_kernel("ResourceApplyGradientDescent", "ApplyGradientDescent")
class ApplyGradientDescentKernel(_ApplyKernel):
    """var -= alpha * delta"""

    signature = (("var", "var"), ("alpha", "scalar"), ("delta", "tensor"))

    def update(self, **x: np.ndarray) -> dict[str, Any]:
        return {"var": x["var"] - x["alpha"] * x["delta"]}

    def update_in_place(self, **x: np.ndarray) -> None:
        np.subtract(x["var"], x["alpha"] * x["delta"], out=x["var"])


@register_kernel("ResourceApplyMomentum", "ApplyMomentum")
class ApplyMomentumKernel(_ApplyKernel):
    """accum = accum * momentum + grad; var -= lr * accum (Nesterov: lr * (grad + momentum * accum))."""

    signature = (
        ("var", "var"),
        ("accum", "var"),
        ("lr", "scalar"),
        ("grad", "tensor"),
        ("momentum", "scalar"),
    )

    def __init__(self, node: NodeDef) -> None:
        super().__init__(node)
        self._may_go_fast = self.may_update_in_place and not self.on_refs and not self.use_nesterov
        self._quiet_step = quiet(_momentum_step)
        if self.may_update_in_place and not self.use_nesterov:
            _compiled.prepare()

    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        # A model's variables are most often updated by this kernel (60 calls a step for
        # `small`), nearly always the same way: two unshared float variables, scalar
        # hyperparameters, a gradient of the variable's shape. That case runs here
        # with the same checks, locks and arithmetic as `_ApplyKernel.compute` (10.7 -> 5.8
        # us a call); anything else, errors included, goes the general way.
        return [] if self._took_short_path(ctx, inputs) else super().compute(ctx, inputs)

    def _update_fast(self, ctx: KernelContext, inputs: list[Any]) -> bool:
        """Update in place and return True, or return False having changed nothing."""
        var_input, accum_input, lr, grad, momentum = inputs
        dtype = self.dtype
        if lr.dtype != dtype or grad.dtype != dtype or momentum.dtype != dtype or lr.ndim or momentum.ndim:
            return False
        var = self._find_input(ctx, var_input)
        accum = self._find_input(ctx, accum_input)
        if var is None or accum is None or var is accum:
            return False

        def fits(value: np.ndarray, slot: np.ndarray) -> bool:
            return (
                value.dtype == dtype
                and slot.dtype == dtype
                and value.ndim > 0
                and value.shape == grad.shape
                and slot.shape == grad.shape
            )

        def step(value: np.ndarray, slot: np.ndarray) -> None:
            if not self._compiled_step(value, slot, lr, grad, momentum):
                self._quiet_step(value, slot, lr, grad, momentum)

        return update_pair_in_place(var, accum, fits, step) is not NOT_IN_PLACE

    def compiled_update(self, values: dict[str, np.ndarray]) -> bool:
        if self.use_nesterov:
            return False
        return self._compiled_step(
            values["var"], values["accum"], values["lr"], values["grad"], values["momentum"]
        )

    def _compiled_step(
        self, var: np.ndarray, accum: np.ndarray, lr: Any, grad: np.ndarray, momentum: Any
    ) -> bool:
        """`_momentum_step` by the compiled loop, and True; or False, having changed nothing."""
        loops = _compiled.loops()
        if loops is None or not _compiled.contiguous(var, accum, grad):
            return False
        loops.momentum(
            var.reshape(-1), accum.reshape(-1), lr[()], _compiled.read_only(grad, -1), momentum[()]
        )
        return True

    def update(self, **x: np.ndarray) -> dict[str, Any]:
        accum = x["accum"] * x["momentum"] + x["grad"]
        if self.use_nesterov:
            var = x["var"] - (x["grad"] * x["lr"] + accum * x["momentum"] * x["lr"])
        else:
            var = x["var"] - x["lr"] * accum
        return {"var": var, "accum": accum}

    def update_in_place(self, **x: np.ndarray) -> None:
        var, accum, grad, lr, momentum = x["var"], x["accum"], x["grad"], x["lr"], x["momentum"]
        if not self.use_nesterov:
            _momentum_step(var, accum, lr, grad, momentum)
            return
        accum *= momentum  # the augmented operators: the same ufuncs as `update`, called faster
        accum += grad
        step = grad * lr
        scaled = accum * momentum
        scaled *= lr
        step += scaled
        var -= step


def _momentum_step(var: np.ndarray, accum: np.ndarray, lr: Any, grad: np.ndarray, momentum: Any) -> None:
    """`ApplyMomentumKernel.update_in_place` without Nesterov: the same operations."""
    accum *= momentum
    accum += grad
    var -= lr * accum


@register_kernel("ResourceApplyAdam", "ApplyAdam")
class ApplyAdamKernel(_ApplyKernel):
    """TF's ApplyAdam:

    lr_t = lr * sqrt(1 - beta2_power) / (1 - beta1_power)
    m += (grad - m) * (1 - beta1);  v += (grad^2 - v) * (1 - beta2)
    var -= lr_t * m / (sqrt(v) + epsilon)
        (Nesterov: lr_t * (grad * (1 - beta1) + beta1 * m) / (sqrt(v) + epsilon))
    """

    signature = (
        ("var", "var"),
        ("m", "var"),
        ("v", "var"),
        ("beta1_power", "scalar"),
        ("beta2_power", "scalar"),
        ("lr", "scalar"),
        ("beta1", "scalar"),
        ("beta2", "scalar"),
        ("epsilon", "scalar"),
        ("grad", "tensor"),
    )

    def __init__(self, node: NodeDef) -> None:
        super().__init__(node)
        if self.may_update_in_place and not self.use_nesterov:
            _compiled.prepare()

    def compiled_update(self, values: dict[str, np.ndarray]) -> bool:
        loops = _compiled.loops()
        if loops is None or self.use_nesterov:
            return False
        var, m, v, grad = values["var"], values["m"], values["v"], values["grad"]
        if not _compiled.contiguous(var, m, v, grad):
            return False
        one = np.ones((), dtype=self.dtype)  # (the scalars as `update_in_place` makes them)
        alpha = values["lr"] * np.sqrt(one - values["beta2_power"]) / (one - values["beta1_power"])
        loops.adam(
            var.reshape(-1),
            m.reshape(-1),
            v.reshape(-1),
            _compiled.read_only(grad, -1),
            alpha[()],
            (one - values["beta1"])[()],
            (one - values["beta2"])[()],
            values["epsilon"][()],
        )
        return True

    def update(self, **x: np.ndarray) -> dict[str, Any]:
        one = np.ones((), dtype=self.dtype)
        grad, beta1, beta2 = x["grad"], x["beta1"], x["beta2"]
        alpha = x["lr"] * np.sqrt(one - x["beta2_power"]) / (one - x["beta1_power"])
        m = x["m"] + (grad - x["m"]) * (one - beta1)
        v = x["v"] + (grad * grad - x["v"]) * (one - beta2)
        step = grad * (one - beta1) + beta1 * m if self.use_nesterov else m
        var = x["var"] - step * alpha / (np.sqrt(v) + x["epsilon"])
        return {"var": var, "m": m, "v": v}

    def update_in_place(self, **x: np.ndarray) -> None:
        one = np.ones((), dtype=self.dtype)
        var, m, v, grad, beta1 = x["var"], x["m"], x["v"], x["grad"], x["beta1"]
        alpha = x["lr"] * np.sqrt(one - x["beta2_power"]) / (one - x["beta1_power"])
        work = np.subtract(grad, m)
        np.multiply(work, one - beta1, out=work)
        np.add(m, work, out=m)
        np.multiply(grad, grad, out=work)
        np.subtract(work, v, out=work)
        np.multiply(work, one - x["beta2"], out=work)
        np.add(v, work, out=v)
        if self.use_nesterov:
            np.multiply(grad, one - beta1, out=work)
            denominator = np.multiply(beta1, m)
            np.add(work, denominator, out=work)
            np.multiply(work, alpha, out=work)
        else:
            np.multiply(m, alpha, out=work)
            denominator = np.empty_like(work)
        np.sqrt(v, out=denominator)
        np.add(denominator, x["epsilon"], out=denominator)
        np.divide(work, denominator, out=work)
        np.subtract(var, work, out=var)


@register_kernel("ResourceApplyAdagrad", "ApplyAdagrad")
class ApplyAdagradKernel(_ApplyKernel):
    """accum += grad^2 (unless `update_slots` is false); var -= lr * grad / sqrt(accum)."""

    signature: ClassVar[tuple[tuple[str, str], ...]] = (
        ("var", "var"),
        ("accum", "var"),
        ("lr", "scalar"),
        ("grad", "tensor"),
    )

    def __init__(self, node: NodeDef) -> None:
        super().__init__(node)
        self.update_slots = self.attr_bool("update_slots", True)
        if self.may_update_in_place:
            _compiled.prepare()

    def compiled_update(self, values: dict[str, np.ndarray]) -> bool:
        # (AdagradV2 too: its epsilon added to the square root)
        loops = _compiled.loops()
        var, accum, grad = values["var"], values["accum"], values["grad"]
        if loops is None or not _compiled.contiguous(var, accum, grad):
            return False
        epsilon = values.get("epsilon")
        loops.adagrad(
            var.reshape(-1),
            accum.reshape(-1),
            values["lr"][()],
            _compiled.read_only(grad, -1),
            self.update_slots,
            epsilon is not None,
            var.dtype.type(0) if epsilon is None else epsilon[()],
        )
        return True

    def update(self, **x: np.ndarray) -> dict[str, Any]:
        grad = x["grad"]
        accum = x["accum"] + grad * grad if self.update_slots else x["accum"]
        return {"var": x["var"] - x["lr"] * grad / np.sqrt(accum), "accum": accum}

    def update_in_place(self, **x: np.ndarray) -> None:
        work = self._add_squares(x["accum"], x["grad"])
        np.multiply(x["lr"], x["grad"], out=work)
        denominator = np.sqrt(x["accum"])
        np.divide(work, denominator, out=work)
        np.subtract(x["var"], work, out=x["var"])

    def _add_squares(self, accum: np.ndarray, grad: np.ndarray) -> np.ndarray:
        """accum += grad^2 (when `update_slots`); returns a scratch array of accum's shape."""
        work: np.ndarray = np.multiply(grad, grad)
        if self.update_slots:
            np.add(accum, work, out=accum)
        return work


@register_kernel("ResourceApplyAdagradV2", "ApplyAdagradV2")
class ApplyAdagradV2Kernel(ApplyAdagradKernel):
    """Adagrad with epsilon: var -= lr * grad / (sqrt(accum) + epsilon)."""

    signature = (
        ("var", "var"),
        ("accum", "var"),
        ("lr", "scalar"),
        ("epsilon", "scalar"),
        ("grad", "tensor"),
    )

    def update(self, **x: np.ndarray) -> dict[str, Any]:
        grad = x["grad"]
        accum = x["accum"] + grad * grad if self.update_slots else x["accum"]
        return {"var": x["var"] - x["lr"] * grad / (np.sqrt(accum) + x["epsilon"]), "accum": accum}

    def update_in_place(self, **x: np.ndarray) -> None:
        work = self._add_squares(x["accum"], x["grad"])
        np.multiply(x["lr"], x["grad"], out=work)
        denominator = np.sqrt(x["accum"])
        np.add(denominator, x["epsilon"], out=denominator)
        np.divide(work, denominator, out=work)
        np.subtract(x["var"], work, out=x["var"])


@register_kernel("ResourceApplyRMSProp", "ApplyRMSProp")
class ApplyRMSPropKernel(_ApplyKernel):
    """TF's ApplyRMSProp:

    ms += (grad^2 - ms) * (1 - rho)
    mom = mom * momentum + lr * grad / sqrt(ms + epsilon)
    var -= mom
    """

    signature = (
        ("var", "var"),
        ("ms", "var"),
        ("mom", "var"),
        ("lr", "scalar"),
        ("rho", "scalar"),
        ("momentum", "scalar"),
        ("epsilon", "scalar"),
        ("grad", "tensor"),
    )

    def update(self, **x: np.ndarray) -> dict[str, Any]:
        one = np.ones((), dtype=self.dtype)
        grad = x["grad"]
        ms = x["ms"] + (grad * grad - x["ms"]) * (one - x["rho"])
        mom = x["mom"] * x["momentum"] + x["lr"] * grad / np.sqrt(ms + x["epsilon"])
        return {"var": x["var"] - mom, "ms": ms, "mom": mom}


@register_kernel("ResourceApplyCenteredRMSProp", "ApplyCenteredRMSProp")
class ApplyCenteredRMSPropKernel(_ApplyKernel):
    """RMSProp normalised by the centred second moment (TF's ApplyCenteredRMSProp):

    ms += (grad^2 - ms) * (1 - rho); mg += (grad - mg) * (1 - rho)
    mom = mom * momentum + lr * grad / sqrt(ms - mg^2 + epsilon); var -= mom
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
        one = np.ones((), dtype=self.dtype)
        grad = x["grad"]
        ms = x["ms"] + (grad * grad - x["ms"]) * (one - x["rho"])
        mg = x["mg"] + (grad - x["mg"]) * (one - x["rho"])
        denom = (ms - mg * mg) + x["epsilon"]
        mom = x["mom"] * x["momentum"] + grad * x["lr"] / np.sqrt(denom)
        return {"var": x["var"] - mom, "mg": mg, "ms": ms, "mom": mom}


@register_kernel("ResourceApplyProximalAdagrad", "ApplyProximalAdagrad")
class ApplyProximalAdagradKernel(_ApplyKernel):
    """FOBOS with Adagrad's rate: accum += grad^2; rate = lr / sqrt(accum); v = var - rate * grad;
    var = sign(v) * max(|v| - rate * l1, 0) / (1 + rate * l2) (just v / (1 + rate * l2) when l1 = 0)."""

    types = frozenset({np.dtype(np.float32), np.dtype(np.float64)})
    signature = (
        ("var", "var"),
        ("accum", "var"),
        ("lr", "scalar"),
        ("l1", "scalar"),
        ("l2", "scalar"),
        ("grad", "tensor"),
    )

    def update(self, **x: np.ndarray) -> dict[str, Any]:
        lr, l1, l2 = x["lr"], x["l1"], x["l2"]
        for value, valid, what in (
            (lr, lr > 0, "lr is not a positive scalar"),
            (l1, l1 >= 0, "l1 regularization strength is not a non-negative scalar"),
            (l2, l2 >= 0, "l2 regularization strength is not a non-negative scalar"),
        ):
            if not valid:
                raise kernel_error(self, f"{what}: {shape_str(value.shape)}")
        one = np.ones((), dtype=self.dtype)
        grad = x["grad"]
        accum = x["accum"] + grad * grad
        rate = lr * (one / np.sqrt(accum))
        return {"var": proximal_step(x["var"] - grad * rate, rate, l1, l2, self.dtype), "accum": accum}


def proximal_step(prox: Any, rate: Any, l1: np.ndarray, l2: np.ndarray, dtype: np.dtype[Any]) -> Any:
    """FOBOS's proximal step: sign(prox) * max(|prox| - rate * l1, 0) / (1 + rate * l2)."""
    one = np.ones((), dtype)
    if float(l1) > 0:
        return np.sign(prox) * np.maximum(np.abs(prox) - rate * l1, 0) / (one + l2 * rate)
    return prox / (one + l2 * rate)


def ftrl_update(
    x: dict[str, np.ndarray], dtype: np.dtype[Any], multiply_linear_by_lr: bool
) -> dict[str, Any]:
    """TF's FTRL-proximal step, shared by the dense and the sparse kernels.

    new_accum = accum + grad^2
    linear += g - (new_accum^-lr_power - accum^-lr_power) / lr * var
              (g = grad + 2 * l2_shrinkage * var when `x` has l2_shrinkage, else grad)
    var = (clip(linear, -l1, l1) - linear) / (new_accum^-lr_power / lr + 2 * l2)
    With `multiply_linear_by_lr` the linear term is kept multiplied by lr (g * lr, l1 * lr,
    and the quadratic term new_accum^-lr_power + 2 * l2 * lr). lr_power = -0.5 uses sqrt.
    """
    two = np.asarray(2, dtype=dtype)
    grad, var, accum, lr = x["grad"], x["var"], x["accum"], x["lr"]
    l1, l2, lr_power = x["l1"], x["l2"], x["lr_power"]
    shrunk = grad + two * x["l2_shrinkage"] * var if "l2_shrinkage" in x else grad
    new_accum = accum + grad * grad
    if lr_power == -0.5:
        new_power, old_power = np.sqrt(new_accum), np.sqrt(accum)
    else:
        new_power, old_power = new_accum ** (-lr_power), accum ** (-lr_power)
    if multiply_linear_by_lr:
        linear = x["linear"] + (shrunk * lr - (new_power - old_power) * var)
        limit = l1 * lr
        quadratic = new_power + two * l2 * lr
    else:
        linear = x["linear"] + (shrunk - (new_power - old_power) / lr * var)
        limit = l1
        quadratic = new_power / lr + two * l2
    new_var = (np.clip(linear, -limit, limit) - linear) / quadratic
    return {"var": new_var, "accum": new_accum, "linear": linear}


@register_kernel("ResourceApplyFtrl", "ApplyFtrl")
class ApplyFtrlKernel(_ApplyKernel):
    """FTRL-proximal (see `ftrl_update`)."""

    types = FLOATS
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
        self.multiply_linear_by_lr = self.attr_bool("multiply_linear_by_lr", False)

    def update(self, **x: np.ndarray) -> dict[str, Any]:
        return ftrl_update(x, self.dtype, self.multiply_linear_by_lr)


@register_kernel("ResourceApplyFtrlV2", "ApplyFtrlV2")
class ApplyFtrlV2Kernel(ApplyFtrlKernel):
    """FTRL with L2 shrinkage: the linear term sees grad + 2 * l2_shrinkage * var."""

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


# --------------------------------------------------------------------------- grouped reads

GROUPED_READS_OP = "_DistserverGroupedReads"


@register_kernel(GROUPED_READS_OP)
class GroupedReadsKernel(OpKernel):
    """Reads of resource variables as one node (`runtime.fusion.group_variable_reads`):
    its parts' ReadVariableOp NodeDefs in attr `FUSED_NODES_ATTR`, input p part p's
    handle, output p its value. Each value is the variable's stored array, taken under
    the variable's lock as `ReadVariableOpKernel` takes it. When a part would fail (a
    variable uninitialized or destroyed, another dtype), the parts' kernels run one by
    one instead, so the error is the part's and names it."""

    runs_on_loop = True  # no work, as for its parts

    def __init__(self, node: NodeDef) -> None:
        super().__init__(node)
        parts = fused_parts(self)
        if not parts or any(part.op != "ReadVariableOp" for part in parts):
            raise errors.InvalidArgumentError(
                f"Node '{self.name}' ({GROUPED_READS_OP}) groups {[part.op for part in parts]}: "
                "expected ReadVariableOps",
                node_name=self.name,
            )
        if len(parts) != self.attr_int("N"):
            raise errors.InvalidArgumentError(
                f"Node '{self.name}' ({GROUPED_READS_OP}) has N = {self.attr_int('N')} inputs, "
                f"but {len(parts)} parts",
                node_name=self.name,
            )
        self._kernels: list[ReadVariableOpKernel] = [ReadVariableOpKernel(part) for part in parts]
        self._dtypes = [kernel.dtype for kernel in self._kernels]
        # The variables the handles named last time, and what made them valid
        # (`_still_resolved`).
        self._resolved: tuple[Any, ...] | None = None

    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        variables = self._variables(ctx, inputs)
        if variables is not None:
            values = [variable.read() for variable in variables]
            if list(map(_dtype_or_none, values)) == self._dtypes:
                return values
        return [
            kernel.compute(ctx, [handle])[0] for kernel, handle in zip(self._kernels, inputs, strict=True)
        ]

    def _variables(self, ctx: KernelContext, handles: list[Any]) -> list[VariableResource] | None:
        """The initialized variables `handles` name, or None when one does not."""
        last = self._resolved
        if last is not None and _still_resolved(last, ctx, handles):
            found: list[VariableResource] = last[4]
            return found
        generation = ctx.resources.generation  # (read first: a removal after it shows)
        variables = []
        for kernel, handle in zip(self._kernels, handles, strict=True):
            variable = kernel._find_input(ctx, handle)
            if variable is None:
                return None
            variables.append(variable)
        self._resolved = (ctx.resources, generation, ctx.device, list(handles), variables)
        return variables


def _dtype_or_none(value: np.ndarray | None) -> np.dtype[Any] | None:
    return None if value is None else value.dtype


# --------------------------------------------------------------------------- grouped updates

GROUPED_UPDATES_OP = "_DistserverGroupedUpdates"
# The dense updates of resource variables a `GROUPED_UPDATES_OP` node may group (they
# have no outputs).
GROUPABLE_UPDATE_OPS = frozenset(
    {
        "ResourceApplyGradientDescent",
        "ResourceApplyProximalGradientDescent",
        "ResourceApplyMomentum",
        "ResourceApplyAdam",
        "ResourceApplyAdagrad",
        "ResourceApplyAdagradV2",
        "ResourceApplyProximalAdagrad",
        "ResourceApplyAdadelta",
        "ResourceApplyRMSProp",
        "ResourceApplyCenteredRMSProp",
        "ResourceApplyFtrl",
        "ResourceApplyFtrlV2",
    }
)


@register_kernel(GROUPED_UPDATES_OP)
class GroupedUpdatesKernel(OpKernel):
    """Independent dense variable updates as one node (`runtime.fusion.group_variable_updates`):
    its parts' NodeDefs in attr `FUSED_NODES_ATTR`, its inputs theirs one after the
    other (`N` in all). Each part's kernel runs in turn, with its own locks and checks,
    so its errors name the part."""

    is_stateful = True

    def __init__(self, node: NodeDef) -> None:
        super().__init__(node)
        parts = fused_parts(self)
        arities = [sum(1 for text in part.input if not text.startswith("^")) for part in parts]
        if not parts or any(part.op not in GROUPABLE_UPDATE_OPS for part in parts):
            raise errors.InvalidArgumentError(
                f"Node '{self.name}' ({GROUPED_UPDATES_OP}) groups {[part.op for part in parts]}: "
                f"expected dense updates of resource variables ({', '.join(sorted(GROUPABLE_UPDATE_OPS))})",
                node_name=self.name,
            )
        if sum(arities) != self.attr_int("N"):
            raise errors.InvalidArgumentError(
                f"Node '{self.name}' ({GROUPED_UPDATES_OP}) has N = {self.attr_int('N')} inputs, "
                f"but its parts take {sum(arities)}",
                node_name=self.name,
            )
        # The parts' computes without their check for `VariableRef` inputs: the group's
        # inputs never hold one (the executor passes none to a graph without reference
        # variables, and this kernel's own `compute` dereferences them in one with).
        kernels = [create_kernel(part) for part in parts]
        computes = [compute_without_dereference(kernel) for kernel in kernels]
        starts = [sum(arities[:part]) for part in range(len(parts))]
        # (each part's compute, and where its inputs are among the group's)
        self._parts = [
            (compute, slice(start, start + arity))
            for compute, start, arity in zip(computes, starts, arities, strict=True)
        ]
        # Parts that all make the same element-wise update (one op, the same attributes
        # but for internal ones such as `_class`) may run as one over their variables
        # side by side (`_VariableArena`).
        first = kernels[0]
        self._same_update: _ApplyKernel | None = (
            first
            if len(parts) > 1
            and isinstance(first, _ApplyKernel)
            and first.may_update_in_place
            and [kind for _, kind in first.signature].count("tensor") == 1
            and all(part.op == parts[0].op and _own_attrs(part) == _own_attrs(parts[0]) for part in parts)
            else None
        )
        # The gradient's input name (the one "tensor" input of `_same_update`'s signature).
        self._grad_name = ""
        self._grad_column = 0  # (the gradient's place among a part's inputs)
        if self._same_update is not None:
            kinds = [kind for _, kind in self._same_update.signature]
            self._grad_column = kinds.index("tensor")
            self._grad_name = self._same_update.signature[self._grad_column][0]
        self._kernels = kernels
        self._arena: _VariableArena | None = None
        # The variables the parts' handles named last time, and what made them valid
        # (`_resources`).
        self._resolved: tuple[Any, ...] | None = None

    def work_nbytes(self, inputs: list[Any]) -> int:
        # Its gradients' bytes, asked every step: the rest of its inputs are handles and
        # scalars, which `OpKernel.work_nbytes` would walk too (three times the inputs).
        if self._same_update is not None:
            try:
                grads = inputs[self._grad_column :: len(self._same_update.signature)]
                nbytes: int = sum(map(_nbytes_of, grads))
                return nbytes
            except AttributeError:
                pass
        return super().work_nbytes(inputs)

    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        parts = self._parts
        left = range(len(parts)) if self._same_update is None else self._update_side_by_side(ctx, inputs)
        for part in left:  # (each with its own kernel, which raises what it raises)
            compute, span = parts[part]
            compute(ctx, inputs[span])
        return []

    def _update_side_by_side(self, ctx: KernelContext, inputs: list[Any]) -> Sequence[int]:
        """The updates of the parts whose variables fit an arena (`_fits_an_arena`) as
        one, over those variables' arena (`_VariableArena`, made here when they may go
        into one); return the parts left to run one by one: the others, or all of
        them, having changed no value, when fewer than two fit (one update over an
        arena would not pay), their inputs are not alike or they may not line up."""
        kernel = self._same_update
        assert kernel is not None
        signature = kernel.signature
        dtype = kernel.dtype
        every = range(len(self._parts))
        # columns[i]: input i of every part (the parts' inputs follow one another)
        columns = [inputs[i :: len(signature)] for i in range(len(signature))]
        values: dict[str, Any] = {}
        grads: list[Any] = []
        for (name, kind), column in zip(signature, columns, strict=True):
            if kind == "scalar":
                first = column[0]
                if type(first) is not np.ndarray or first.dtype != dtype or first.ndim:
                    return every
                # (all parts read one tensor, most often: the same array; `count` is
                # identity first)
                if column.count(first) != len(column) and not all(_same_scalar(v, first) for v in column):
                    return every
                values[name] = first
            elif kind == "tensor":  # (the one: see `_same_update`)
                grads = column
        count = len(grads)
        if (
            list(map(type, grads)).count(np.ndarray) != count
            or list(map(_dtype_of, grads)).count(dtype) != count
        ):
            return every
        # (a variable has its gradient's shape; most often every one fits, seen in one pass)
        if max(map(_nbytes_of, grads)) <= ARENA_MAX_VARIABLE_BYTES:
            fitting: Sequence[int] = every
            rest: list[int] = []
        else:
            fits = list(map(_fits_an_arena, grads))
            fitting = [part for part in every if fits[part]]
            rest = [part for part in every if not fits[part]]
        if len(fitting) < 2:
            return every
        resolved = self._resources(ctx, [columns[i] for i in kernel._var_indices])
        if resolved is None:
            return every
        resources, locks = resolved
        if rest:
            grads = [grads[part] for part in fitting]
            resources = [[column[part] for part in fitting] for column in resources]
        with _locked.in_order(locks):
            arena = self._arena
            if arena is None or not arena.holds(resources):
                self._arena = arena = None
                if not _may_line_up(resources, grads, dtype):
                    return every
                arena = self._arena = _VariableArena(resources)
            if list(map(_shape_of, grads)) != arena.shapes:
                return every
            values[self._grad_name] = np.concatenate(grads, axis=None)
            values.update(zip(kernel._var_names, arena.arrays, strict=True))
            kernel._update_in_place(values)
        OPTIMIZER_UPDATES.count(True, len(fitting))
        return rest

    def _resources(
        self, ctx: KernelContext, handles: list[list[Any]]
    ) -> tuple[list[list[VariableResource]], list[threading.Lock]] | None:
        """The variables `handles` name (`handles[k][p]`: part p's k-th variable input)
        and their locks in `_locked`'s order; None when one is not an initialized
        variable of this device. Found again without a lookup while the handles are
        the same arrays (a VarHandleOp's output is) and no resource was removed."""
        manager = ctx.resources
        flat = [handle for column in handles for handle in column]
        last = self._resolved
        if last is not None and _still_resolved(last, ctx, flat):
            found: tuple[list[list[VariableResource]], list[threading.Lock]] = last[4]
            return found
        generation = manager.generation  # (read first: a removal after it shows)
        resources = []
        for column in handles:
            variables = []
            for kernel, handle in zip(self._kernels, column, strict=True):
                variable = kernel._find_input(ctx, handle)  # type: ignore[attr-defined]
                if variable is None:
                    return None
                variables.append(variable)
            resources.append(variables)
        found = (resources, _locked.lock_order([v for column in resources for v in column]))
        self._resolved = (manager, generation, ctx.device, flat, found)
        return found


def _still_resolved(last: tuple[Any, ...], ctx: KernelContext, handles: list[Any]) -> bool:
    """Whether the variables found for a grouped node's handles (`last`: the resource
    manager, its generation, the device, the handles, what was found) still hold: the
    same manager with no resource removed since, the same device, the same handle
    arrays (a VarHandleOp's output is one array for every step)."""
    manager = ctx.resources
    return (
        last[0] is manager
        and last[1] == manager.generation
        and last[2] == ctx.device
        and len(last[3]) == len(handles)
        and all(map(operator.is_, handles, last[3]))
    )


def _own_attrs(node: NodeDef) -> dict[str, Any]:
    """The attributes of `node` that its op defines (not the internal `_`-prefixed ones)."""
    return {name: value for name, value in node.attr.items() if not name.startswith("_")}


# A variable goes into an arena when it is at most this large: beyond it, the update's
# own work dwarfs what a part costs on its own, and the copy of its gradient into the
# arena's would not pay.
ARENA_MAX_VARIABLE_BYTES = 64 * 1024


def _fits_an_arena(value: np.ndarray) -> bool:
    # (a scalar too: its view is one element of the flat array, reshaped to ())
    return value.nbytes <= ARENA_MAX_VARIABLE_BYTES


def _same_scalar(value: Any, first: np.ndarray) -> bool:
    """Whether `value` is a scalar of `first`'s dtype and bits (0.0 is not -0.0 here)."""
    same_kind = type(value) is np.ndarray and value.dtype == first.dtype and not value.ndim
    return same_kind and value.tobytes() == first.tobytes()


def _may_line_up(
    resources: list[list[VariableResource]], grads: list[np.ndarray], dtype: np.dtype[Any]
) -> bool:
    """With the variables' locks held: whether they may go into an arena. They must be
    distinct, unshared (nothing else holds their arrays, which the arena replaces),
    of `dtype`, and each part's variables of its gradient's shape (which
    `_fits_an_arena`)."""
    seen = set()
    for column in resources:
        for resource, grad in zip(column, grads, strict=True):
            if id(resource) in seen or not resource.unshared():  # (before holding the array here)
                return False
            seen.add(id(resource))
            value = resource.value
            assert value is not None  # (unshared: it has one)
            if value.dtype != dtype or value.shape != grad.shape:
                return False
    return True


class _VariableArena:
    """The values of a grouped update's variables side by side: for each variable
    input of the parts (`var`, `accum`, ...), one flat array (`arrays`) holding that
    variable of every part in turn, each variable's value a view of it (`views`).
    The updates are element-wise, so one update over the flat arrays, with the parts'
    gradients side by side too, gives every part's update bit for bit: a few numpy
    calls a step instead of a few per part.

    Only the group's kernel writes into the flat arrays, and only while `holds` finds
    that nothing but the variables references them: each view has no reference but
    its variable's and the arena's, and each flat array none but its views' and the
    arena's. A reader that keeps a value, or anything made from it (a view, a
    memoryview being sent), counts on the one or the other; the parts then run one
    by one instead. Every other kernel finds a view not `unshared` (it does not own
    its memory) and replaces the variable's value instead of writing into it, which
    takes that variable out of the arena.
    """

    __slots__ = ("_counts", "arrays", "resources", "shapes", "views")

    def __init__(self, resources: list[list[VariableResource]]) -> None:
        """Move the variables' values (see `_may_line_up`) into new flat arrays, with
        their locks held."""
        self.resources = resources
        self.arrays, self.views = zip(*[_line_up(column) for column in resources], strict=True)
        self.shapes = list(map(_shape_of, self.views[0]))  # every part's variables' shape
        # The reference counts `holds` sees while nothing else holds a view or an array.
        self._counts = self._reference_counts()

    def holds(self, resources: list[list[VariableResource]]) -> bool:
        """With the variables' locks held: whether `resources` are this arena's
        variables, still with their values here, and nothing else references those."""
        return (
            resources == self.resources
            and self._reference_counts() == self._counts
            and all(
                all(map(operator.is_, map(_value_of, column), views))
                for column, views in zip(resources, self.views, strict=True)
            )
        )

    def _reference_counts(self) -> list[list[int]]:
        # (counted the same way every time: what the counting itself holds cancels out)
        return [list(map(sys.getrefcount, self.arrays))] + [list(map(sys.getrefcount, v)) for v in self.views]


def _line_up(column: list[VariableResource]) -> tuple[np.ndarray, list[np.ndarray]]:
    """One flat array of `column`'s values, and each variable's value replaced by its view."""
    flat = np.concatenate([variable.value.reshape(-1) for variable in column])  # type: ignore[union-attr]
    views = []
    start = 0
    for variable in column:
        value = variable.value
        assert value is not None
        view = flat[start : start + value.size].reshape(value.shape)
        start += value.size
        variable.replace(view)
        views.append(view)
    flat.flags.writeable = False
    return flat, views


_value_of = operator.attrgetter("value")
_dtype_of = operator.attrgetter("dtype")
_shape_of = operator.attrgetter("shape")
_nbytes_of = operator.attrgetter("nbytes")


__all__ = [
    "ARENA_MAX_VARIABLE_BYTES",
    "GROUPABLE_UPDATE_OPS",
    "GROUPED_READS_OP",
    "GROUPED_UPDATES_OP",
    "ApplyAdagradKernel",
    "ApplyAdagradV2Kernel",
    "ApplyAdamKernel",
    "ApplyCenteredRMSPropKernel",
    "ApplyFtrlKernel",
    "ApplyFtrlV2Kernel",
    "ApplyGradientDescentKernel",
    "ApplyMomentumKernel",
    "ApplyProximalAdagradKernel",
    "ApplyRMSPropKernel",
    "AssignUpdateVariableOpKernel",
    "AssignVariableOpKernel",
    "DestroyResourceOpKernel",
    "GroupedReadsKernel",
    "GroupedUpdatesKernel",
    "ReadVariableOpKernel",
    "ResourceGatherKernel",
    "ResourceScatterKernel",
    "VarHandleOpKernel",
    "VarIsInitializedOpKernel",
    "ftrl_update",
]
