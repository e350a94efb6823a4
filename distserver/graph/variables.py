"""Resource variables, their initializers, and `replica_device_setter`.

A `Variable` builds the nodes TensorFlow 2.x's `tf.compat.v1.Variable` builds in graph
mode (a resource variable)::

    v/Initializer/initial_value   Const              (_class: loc:@v, no device)
    v                             VarHandleOp        (container, shared_name "v", dtype, shape, ...)
    v/IsInitialized/VarIsInitializedOp
    v/Assign                      AssignVariableOp   (validate_shape false): the initializer
    v/Read/ReadVariableOp         ReadVariableOp     (the value a session fetches for `v`)

Using a variable as a tensor reads it (a new ``ReadVariableOp``); `Variable.assign`,
`assign_add` and `assign_sub` build ``AssignVariableOp``/``AssignAddVariableOp``/
``AssignSubVariableOp`` followed by a ``ReadVariableOp`` with a control input on them.

One deliberate difference: every op we build that takes the variable's handle runs
on the handle's device explicitly (TensorFlow leaves some, such as ``IsInitialized``
and plain reads, to its placer's resource colocation).
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, Final, Literal, overload

import numpy as np

from distserver import devices, tensors
from distserver.graph import ops
from distserver.graph.graph import (
    Graph,
    GraphKeys,
    Operation,
    Shape,
    Tensor,
    _merge_shapes,
    _TensorLike,
    as_shape,
    dtype_name,
    get_default_graph,
    name_scope,
    shape_text,
)
from distserver.protos import types_pb2
from distserver.protos.attr_value_pb2 import AttrValue

__all__ = [
    "STANDARD_PS_OPS",
    "Variable",
    "global_variables",
    "global_variables_initializer",
    "replica_device_setter",
    "trainable_variables",
    "variables_initializer",
]


class Variable(_TensorLike):
    """A resource variable: a value kept on a device across steps (TF 1.x graph mode).

    Args:
        initial_value: The initial value: a tensor, a Python or numpy value, or a
            callable returning one (called inside the ``<name>/Initializer`` scope).
        name: The variable name (default ``"Variable"``), made unique.
        dtype: The dtype; the initial value is converted to it.
        trainable: Also add the variable to the ``trainable_variables`` collection.
        shape: The variable's static shape (default: that of the initial value); may
            be less specific, e.g. ``[None, 3]``.
        collections: The collections to add the variable to (default:
            ``["variables"]``, plus ``"trainable_variables"`` when trainable).

    Raises:
        ValueError: When `shape` is incompatible with the initial value's shape.
    """

    def __init__(
        self,
        initial_value: Any,
        *,
        name: str | None = None,
        dtype: Any = None,
        trainable: bool = True,
        shape: Any = None,
        collections: Iterable[str] | None = None,
    ) -> None:
        if initial_value is None:
            raise ValueError("initial_value must be specified.")
        graph = get_default_graph()
        # Variables ignore enclosing control dependencies (TensorFlow's init_scope).
        with graph.control_dependencies(None), name_scope(name, "Variable") as scope:
            handle_name = scope[:-1]
            colocation = AttrValue(list=AttrValue.ListValue(s=[f"loc:@{handle_name}".encode()]))
            with graph._attr_scope({"_class": colocation}):
                with name_scope("Initializer"), graph.device(None):
                    value = initial_value() if callable(initial_value) else initial_value
                    initial = ops.convert_to_tensor(value, dtype=dtype, name="initial_value")
                static_shape = initial.shape if shape is None else as_shape(shape)
                try:
                    _merge_shapes(initial.shape, static_shape)
                except ValueError:
                    raise ValueError(
                        f"The initial value's shape ({shape_text(initial.shape)}) is not compatible with "
                        f"the explicitly supplied `shape` argument ({shape_text(static_shape)})."
                    ) from None
                self._handle = self._handle_op(graph, scope, initial.datatype, static_shape)
            self._graph = graph
            self._datatype = initial.datatype
            self._shape = static_shape
            self._initial_value = initial
            self._trainable = trainable
            with name_scope("IsInitialized"), self._on_handle_device():
                self._is_initialized = graph.create_op(
                    "VarIsInitializedOp", [self._handle], [types_pb2.DT_BOOL], shapes=[()]
                ).outputs[0]
            with name_scope("Assign") as assign_scope, self._on_handle_device():
                self._initializer = self._assign_op(
                    "AssignVariableOp", initial, assign_scope, validate_shape=False
                )
            with name_scope("Read"):
                self._graph_element = self._read()
        if collections is None:
            collections = [GraphKeys.GLOBAL_VARIABLES]
            if trainable:
                collections.append(GraphKeys.TRAINABLE_VARIABLES)
        graph.add_to_collections(collections, self)

    @staticmethod
    def _handle_op(graph: Graph, scope: str, datatype: int, shape: Shape) -> Tensor:
        attrs = {
            "container": AttrValue(s=b""),
            "shared_name": AttrValue(s=scope[:-1].encode()),
            "debug_name": AttrValue(s=scope.encode()),
            "dtype": ops._type_attr(datatype),
            "shape": AttrValue(shape=tensors.shape_to_proto(shape)),
            "allowed_devices": AttrValue(list=AttrValue.ListValue()),
        }
        op = graph.create_op("VarHandleOp", [], [types_pb2.DT_RESOURCE], name=scope, attrs=attrs, shapes=[()])
        return op.outputs[0]

    @contextlib.contextmanager
    def _on_handle_device(self) -> Iterator[None]:
        # Exactly the handle's device: outer device and colocation scopes do not apply.
        with self._graph.colocate_with(None, ignore_existing=True), self._graph.device(self._handle.device):
            yield

    def _assign_op(
        self, op_type: str, value: Tensor, name: str | None, validate_shape: bool | None = None
    ) -> Operation:
        attrs = {"dtype": ops._type_attr(self._datatype)}
        if validate_shape is not None:
            attrs["validate_shape"] = AttrValue(b=validate_shape)
        return self._graph.create_op(op_type, [self._handle, value], [], name=name, attrs=attrs)

    def _read(self) -> Tensor:
        with self._on_handle_device():
            op = self._graph.create_op(
                "ReadVariableOp",
                [self._handle],
                [self._datatype],
                attrs={"dtype": ops._type_attr(self._datatype)},
                shapes=[self._shape],
            )
        return op.outputs[0]

    # ----------------------------------------------------------------- properties

    @property
    def name(self) -> str:
        """``"<handle op name>:0"``, e.g. ``"v:0"``."""
        return self._handle.name

    @property
    def op(self) -> Operation:
        """The ``VarHandleOp``."""
        return self._handle.op

    @property
    def handle(self) -> Tensor:
        """The DT_RESOURCE tensor naming the variable."""
        return self._handle

    @property
    def graph(self) -> Graph:
        """The graph holding the variable."""
        return self._graph

    @property
    def device(self) -> str:
        """The device of the variable (that of its handle)."""
        return self._handle.device

    @property
    def datatype(self) -> int:
        """The `DataType` enum value of the variable's values."""
        return self._datatype

    @property
    def dtype(self) -> np.dtype[Any]:
        """The numpy dtype of the variable's values."""
        return tensors.as_numpy_dtype(self._datatype)

    @property
    def shape(self) -> Shape:
        """The static shape of the variable."""
        return self._shape

    def get_shape(self) -> Shape:
        """Alias of `shape`."""
        return self._shape

    @property
    def initializer(self) -> Operation:
        """The ``<name>/Assign`` op that sets the initial value."""
        return self._initializer

    @property
    def initial_value(self) -> Tensor:
        """The tensor of the initial value."""
        return self._initial_value

    @property
    def trainable(self) -> bool:
        """Whether the variable is in the ``trainable_variables`` collection by default."""
        return self._trainable

    # ----------------------------------------------------------------- reading

    def value(self) -> Tensor:
        """A new ``ReadVariableOp`` of the variable (what using it as a tensor does)."""
        return self._read()

    def read_value(self) -> Tensor:
        """``Read/ReadVariableOp`` followed by an ``Identity``, as TensorFlow builds it."""
        with name_scope("Read"):
            value = self._read()
        return ops.identity(value)

    def sparse_read(self, indices: Any, name: str | None = None) -> Tensor:
        """``ResourceGather``: the rows `indices` of the variable (what `gather` of it builds).

        Its gradient is sparse (`IndexedSlices`), so optimizers update only those rows.
        """
        with name_scope(name, "Gather", [indices]) as scope:
            (index,) = ops._convert_inputs(
                "ResourceGather", [("indices", indices)], default_dtype=np.int32, allowed=ops._INDEX
            )
            out_shape: Shape = None
            if self._shape is not None and index.shape is not None:
                out_shape = (*index.shape, *self._shape[1:])
            attrs = {
                "batch_dims": AttrValue(i=0),
                "validate_indices": AttrValue(b=True),
                "dtype": ops._type_attr(self._datatype),
                "Tindices": ops._type_attr(index.datatype),
            }
            with self._on_handle_device():
                op = self._graph.create_op(
                    "ResourceGather",
                    [self._handle, index],
                    [self._datatype],
                    name=scope,
                    attrs=attrs,
                    shapes=[out_shape],
                )
        return op.outputs[0]

    def is_initialized(self, name: str | None = None) -> Tensor:
        """A ``VarIsInitializedOp``: a bool scalar, true once the variable has a value."""
        with self._on_handle_device():
            op = self._graph.create_op(
                "VarIsInitializedOp", [self._handle], [types_pb2.DT_BOOL], name=name, shapes=[()]
            )
        return op.outputs[0]

    def _as_graph_element(self) -> Tensor:
        # What fetching the variable in a session returns: ``<name>/Read/ReadVariableOp:0``.
        return self._graph_element

    def _as_operand(self) -> Tensor:
        return self.value()

    def _as_tensor(self, datatype: int | None, name: str | None) -> Tensor:
        if datatype is not None and datatype != self._datatype:
            raise ValueError(
                f"Incompatible type conversion requested to type '{dtype_name(datatype)}' for variable "
                f"of type '{dtype_name(self._datatype)}'"
            )
        return self.value()

    # ----------------------------------------------------------------- updating

    @overload
    def assign(self, value: Any, name: str | None = ..., read_value: Literal[True] = ...) -> Tensor: ...

    @overload
    def assign(self, value: Any, name: str | None = ..., *, read_value: Literal[False]) -> Operation: ...

    def assign(self, value: Any, name: str | None = None, read_value: bool = True) -> Tensor | Operation:
        """Set the variable to `value` (``AssignVariableOp``, validate_shape true).

        Args:
            value: The new value; Python values are converted to the variable's dtype.
            name: The op name (default ``"AssignVariableOp"``).
            read_value: Return a ``ReadVariableOp`` of the new value (running after the
                assignment) instead of the assign op.

        Raises:
            ValueError: When `value`'s static shape is incompatible with the variable's.
        """
        tensor = ops.convert_to_tensor(value, dtype=self._datatype)
        try:
            _merge_shapes(self._shape, tensor.shape)
        except ValueError:
            raise ValueError(
                f"Cannot assign value to variable ' {self.name}': Shape mismatch. The variable shape "
                f"{shape_text(self._shape)}, and the assigned value shape {shape_text(tensor.shape)} are "
                "incompatible."
            ) from None
        return self._update("AssignVariableOp", tensor, name, read_value, validate_shape=True)

    @overload
    def assign_add(self, delta: Any, name: str | None = ..., read_value: Literal[True] = ...) -> Tensor: ...

    @overload
    def assign_add(self, delta: Any, name: str | None = ..., *, read_value: Literal[False]) -> Operation: ...

    def assign_add(self, delta: Any, name: str | None = None, read_value: bool = True) -> Tensor | Operation:
        """Add `delta` to the variable (``AssignAddVariableOp``); see `assign` for the arguments."""
        return self._update(
            "AssignAddVariableOp", ops.convert_to_tensor(delta, dtype=self._datatype), name, read_value
        )

    @overload
    def assign_sub(self, delta: Any, name: str | None = ..., read_value: Literal[True] = ...) -> Tensor: ...

    @overload
    def assign_sub(self, delta: Any, name: str | None = ..., *, read_value: Literal[False]) -> Operation: ...

    def assign_sub(self, delta: Any, name: str | None = None, read_value: bool = True) -> Tensor | Operation:
        """Subtract `delta` from the variable (``AssignSubVariableOp``); see `assign`."""
        return self._update(
            "AssignSubVariableOp", ops.convert_to_tensor(delta, dtype=self._datatype), name, read_value
        )

    def _update(
        self,
        op_type: str,
        value: Tensor,
        name: str | None,
        read_value: bool,
        validate_shape: bool | None = None,
    ) -> Tensor | Operation:
        with self._on_handle_device():
            op = self._assign_op(op_type, value, name, validate_shape)
        if not read_value:
            return op
        with self._graph.control_dependencies([op]):
            return self._read()

    def __repr__(self) -> str:
        shape = "<unknown>" if self._shape is None else repr(self._shape)
        return f"<distserver.graph.Variable '{self.name}' shape={shape} dtype={dtype_name(self._datatype)}>"


# --------------------------------------------------------------------------- collections


def global_variables(scope: str | None = None) -> list[Variable]:
    """The variables of the default graph's ``variables`` collection (matching `scope`)."""
    return get_default_graph().get_collection(GraphKeys.GLOBAL_VARIABLES, scope)


def trainable_variables(scope: str | None = None) -> list[Variable]:
    """The variables of the default graph's ``trainable_variables`` collection."""
    return get_default_graph().get_collection(GraphKeys.TRAINABLE_VARIABLES, scope)


def variables_initializer(var_list: Iterable[Variable], name: str = "init") -> Operation:
    """An op running the initializers of `var_list` (a ``NoOp`` when it is empty)."""
    initializers = [v.initializer for v in var_list]
    if not initializers:
        return ops.no_op(name=name)
    return ops.group(*initializers, name=name)


def global_variables_initializer() -> Operation:
    """``init``: an op running the initializers of all global variables."""
    return variables_initializer(global_variables(), name="init")


# --------------------------------------------------------------------------- placement

STANDARD_PS_OPS: Final = frozenset(
    {
        "Variable",
        "VariableV2",
        "AutoReloadVariable",
        "MutableHashTable",
        "MutableHashTableV2",
        "MutableHashTableOfTensors",
        "MutableHashTableOfTensorsV2",
        "MutableDenseHashTable",
        "MutableDenseHashTableV2",
        "VarHandleOp",
        "BoostedTreesEnsembleResourceHandleOp",
        "BoostedTreesQuantileStreamResourceHandleOp",
        "ResourceConditionalAccumulator",
        "DecisionTree",
        "TreeEnsembleVariable",
    }
)
"""Op types `replica_device_setter` places on parameter servers by default (TensorFlow's list)."""


def replica_device_setter(
    ps_tasks: int = 0,
    ps_device: str = "/job:ps",
    worker_device: str = "/job:worker",
    merge_devices: bool = True,
    cluster: Any = None,
    ps_ops: Iterable[str] | None = None,
    ps_strategy: Callable[[Operation], int] | None = None,
) -> Callable[[Operation], str] | None:
    """A device function placing variables on parameter servers, as TensorFlow's.

    Use it with `device`: ``with device(replica_device_setter(ps_tasks=2)): ...``.
    Ops whose type is in `ps_ops` go to ``<ps_device>/task:<i>`` with `i` chosen
    round-robin (one task per variable, in creation order); all other ops go to
    `worker_device`. Devices set by scopes inside take precedence field by field.

    Args:
        ps_tasks: Number of parameter-server tasks (taken from `cluster` when given).
        ps_device: The parameter-server job (or device).
        worker_device: The device of every other op.
        merge_devices: Merge with devices set by inner scopes (else keep them as set).
        cluster: A `ClusterSpec` (anything with ``as_dict()``) or a dict from job name
            to its task addresses; its ``ps`` job gives `ps_tasks`.
        ps_ops: Op types to place on parameter servers (default `STANDARD_PS_OPS`).
        ps_strategy: A function from op to ps task index (default: round robin).

    Returns:
        The device function, or `None` when there are no parameter servers (`device`
        then clears enclosing device scopes, as in TensorFlow).
    """
    if cluster is not None:
        jobs: Mapping[str, Any] = cluster.as_dict() if hasattr(cluster, "as_dict") else dict(cluster)
        ps_job = devices.DeviceSpec.from_string(ps_device).job
        if ps_job is None or ps_job not in jobs or not jobs[ps_job]:
            return None
        ps_tasks = len(jobs[ps_job])
    if ps_tasks == 0:
        return None
    ps_types = STANDARD_PS_OPS if ps_ops is None else frozenset(ps_ops)
    if ps_strategy is None:
        counter = itertools.count()

        def round_robin(op: Operation) -> int:
            return next(counter) % ps_tasks

        ps_strategy = round_robin
    ps_spec = devices.DeviceSpec.from_string(ps_device)
    worker_spec = devices.DeviceSpec.from_string(worker_device or "")

    def device_function(op: Operation) -> str:
        if not merge_devices and op.device:
            return op.device
        current = devices.DeviceSpec.from_string(op.device)
        if op.type in ps_types:
            spec = ps_spec
            if spec.job and current.job in (None, spec.job):
                spec = spec.make_merged_spec(devices.DeviceSpec(task=ps_strategy(op)))
            return spec.make_merged_spec(current).to_string()
        return worker_spec.make_merged_spec(current).to_string()

    return device_function
