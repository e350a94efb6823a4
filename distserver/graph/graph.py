"""Graphs, operations and tensors: the client-side dataflow graph, shaped like TF 1.x.

A `Graph` holds `Operation`s in creation order; each operation has input `Tensor`s
(outputs of earlier operations), control inputs, a device string and attrs, and
serialises to a `NodeDef` with TensorFlow's op names and attrs. `Graph.as_graph_def`
gives the `GraphDef` a session sends to a master (all of it, or only the nodes added
since a `Graph.version`, for ``ExtendSession``).

Building state follows `tf.compat.v1`:

* a thread-local stack of default graphs (`Graph.as_default`, `get_default_graph`,
  `reset_default_graph`); the process-wide default graph is shared by all threads;
* per graph and per thread: the name scope (`name_scope`), device scopes (`device`,
  which also takes device functions such as `replica_device_setter`'s), control
  dependencies (`control_dependencies`) and colocation (`colocate_with`).

Nothing here runs a graph, and nothing does I/O.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Final, NoReturn, TypeAlias, cast

import numpy as np

from distserver import devices, tensors
from distserver.protos import types_pb2
from distserver.protos.attr_value_pb2 import AttrValue
from distserver.protos.graph_pb2 import GraphDef
from distserver.protos.node_def_pb2 import NodeDef
from distserver.protos.versions_pb2 import VersionDef

if TYPE_CHECKING:
    from numpy.typing import NDArray

__all__ = [
    "GRAPH_DEF_VERSION",
    "Graph",
    "GraphKeys",
    "Operation",
    "Tensor",
    "add_to_collection",
    "colocate_with",
    "control_dependencies",
    "device",
    "get_collection",
    "get_default_graph",
    "name_scope",
    "reset_default_graph",
]

GRAPH_DEF_VERSION: Final = 2474
"""`versions.producer` of the GraphDefs we emit: TensorFlow 2.21's TF_GRAPH_DEF_VERSION.

Our nodes carry the attrs TensorFlow 2.21 emits (e.g. MatMul's ``grad_a``/``grad_b``,
VarHandleOp's ``debug_name``), so we claim that producer version.
"""

Shape: TypeAlias = tuple[int | None, ...] | None
"""A static shape: a tuple of sizes (`None` for unknown ones), or `None` for unknown rank."""

DeviceFunction: TypeAlias = Callable[["Operation"], "str | devices.DeviceSpec | None"]
"""A device function: given an operation being created, return its device."""

_VALID_OP_NAME: Final = re.compile(r"^[A-Za-z0-9.][A-Za-z0-9_.\\/>-]*$")
_VALID_SCOPE_NAME: Final = re.compile(r"^[A-Za-z0-9_.\\/>-]*$")
_TENSOR_NAME_FORM: Final = 'Tensor names must be of the form "<op_name>:<output_index>".'

# Types without a numpy dtype of their own (they all map to numpy's object dtype).
_SPECIAL_DTYPE_NAMES: Final[dict[int, str]] = {
    types_pb2.DT_STRING: "string",
    types_pb2.DT_RESOURCE: "resource",
    types_pb2.DT_VARIANT: "variant",
}


# --------------------------------------------------------------------------- dtypes and shapes


def as_datatype(dtype: Any) -> int:
    """Return the `DataType` enum value for anything naming a dtype.

    Accepts what `distserver.tensors.as_datatype` accepts (numpy dtypes and types,
    names such as ``"float32"`` or ``"string"``, enum values); reference types map to
    their base type.
    """
    datatype = tensors.as_datatype(dtype)
    return datatype - 100 if datatype > 100 else datatype


def dtype_name(datatype: int) -> str:
    """TensorFlow's short name of a DataType, e.g. ``"float32"``, ``"string"``."""
    if datatype in _SPECIAL_DTYPE_NAMES:
        return _SPECIAL_DTYPE_NAMES[datatype]
    try:
        return tensors.as_numpy_dtype(datatype).name
    except Exception:
        return tensors.datatype_name(datatype)


def as_shape(shape: Any) -> Shape:
    """Normalise a shape-like value to a `Shape`.

    Args:
        shape: `None` (unknown rank), an int (a vector of that size), or a sequence of
            sizes where `None` or -1 marks an unknown dimension.

    Raises:
        TypeError: When a size is not an integer.
        ValueError: When a size is negative (other than -1).
    """
    if shape is None:
        return None
    if isinstance(shape, int | np.integer):
        shape = (shape,)
    dims: list[int | None] = []
    for size in shape:
        if size is None:
            dims.append(None)
            continue
        if isinstance(size, bool) or not isinstance(size, int | np.integer):
            raise TypeError(f"Dimension sizes must be integers or None, got {size!r} in {shape!r}")
        if size < -1:
            raise ValueError(f"Dimension sizes must be >= 0 (or None/-1 for unknown), got {size}")
        dims.append(None if size == -1 else int(size))
    return tuple(dims)


def shape_text(shape: Shape) -> str:
    """TensorFlow's text form of a static shape in error messages: ``[2,?]``, ``<unknown>``."""
    if shape is None:
        return "<unknown>"
    return "[" + ",".join("?" if size is None else str(size) for size in shape) + "]"


def _shape_repr(shape: Shape) -> str:
    return "<unknown>" if shape is None else repr(shape)


def _merge_shapes(current: Shape, new: Shape) -> Shape:
    """The most specific shape compatible with both, or `ValueError`."""
    if current is None:
        return new
    if new is None:
        return current
    if len(current) != len(new):
        raise ValueError("ranks differ")
    merged: list[int | None] = []
    for a, b in zip(current, new, strict=True):
        if a is not None and b is not None and a != b:
            raise ValueError(f"dimensions {a} and {b} differ")
        merged.append(a if a is not None else b)
    return tuple(merged)


# --------------------------------------------------------------------------- operations


class Operation:
    """A node of a `Graph`: an op type, inputs, attrs, a device, and output `Tensor`s.

    Operations are created by op constructors (`distserver.graph.add`, `constant`,
    ...) or `Graph.create_op`, never directly.
    """

    def __init__(
        self,
        graph: Graph,
        node_def: NodeDef,
        inputs: Sequence[Tensor],
        control_inputs: Sequence[Operation],
        output_types: Sequence[int],
        output_shapes: Sequence[Shape],
        op_id: int,
    ) -> None:
        self._graph = graph
        self._node_def = node_def
        self._inputs = tuple(inputs)
        self._control_inputs = tuple(control_inputs)
        self._id = op_id
        self._outputs = [
            Tensor(self, index, datatype, shape)
            for index, (datatype, shape) in enumerate(zip(output_types, output_shapes, strict=True))
        ]
        self._static_value: NDArray[Any] | None = None

    @property
    def name(self) -> str:
        """The operation's name, unique within its graph."""
        return self._node_def.name

    @property
    def type(self) -> str:
        """The TensorFlow op type, e.g. ``"MatMul"``."""
        return self._node_def.op

    @property
    def graph(self) -> Graph:
        """The graph holding this operation."""
        return self._graph

    @property
    def inputs(self) -> tuple[Tensor, ...]:
        """The data inputs, in order."""
        return self._inputs

    @property
    def control_inputs(self) -> tuple[Operation, ...]:
        """The operations that must run before this one (in the order they were added)."""
        return self._control_inputs

    @property
    def outputs(self) -> list[Tensor]:
        """The output tensors, in order."""
        return list(self._outputs)

    def values(self) -> tuple[Tensor, ...]:
        """The output tensors, as a tuple (TensorFlow's name for `outputs`)."""
        return tuple(self._outputs)

    @property
    def device(self) -> str:
        """The requested device (possibly partial, e.g. ``"/job:ps/task:0"``; ``""`` for any)."""
        return self._node_def.device

    @property
    def node_def(self) -> NodeDef:
        """A copy of this operation's `NodeDef`."""
        node = NodeDef()
        node.CopyFrom(self._node_def)
        return node

    def get_attr(self, name: str) -> Any:
        """Return the value of an attr as a Python value.

        Types come back as numpy dtypes (the `DataType` enum value for types numpy
        cannot hold), shapes as `Shape`s, tensors as numpy arrays, strings as bytes,
        lists as lists.

        Raises:
            ValueError: When the operation has no such attr.
        """
        if name not in self._node_def.attr:
            raise ValueError(f"Operation '{self.name}' has no attr named '{name}'.")
        return _attr_to_python(self._node_def.attr[name])

    def colocation_groups(self) -> list[bytes]:
        """The colocation groups (``b"loc:@<op>"``) this operation belongs to."""
        if "_class" in self._node_def.attr:
            groups = [g for g in self._node_def.attr["_class"].list.s if g.startswith(b"loc:@")]
            if groups:
                return groups
        return [f"loc:@{self.name}".encode()]

    def _set_device(self, device: str | devices.DeviceSpec | None) -> None:
        if isinstance(device, devices.DeviceSpec):
            device = device.to_string()
        with self._graph._lock:
            self._node_def.device = device or ""

    def _set_attr(self, name: str, value: AttrValue) -> None:
        # Changes after a session has sent this node are not sent again (as in TF); only
        # informational attrs (`_has_manual_control_dependencies`) change that late.
        with self._graph._lock:
            self._node_def.attr[name].CopyFrom(value)

    def __repr__(self) -> str:
        return f"<distserver.graph.Operation '{self.name}' type={self.type}>"

    __str__ = __repr__


def _attr_to_python(value: AttrValue) -> Any:
    kind = value.WhichOneof("value")
    if kind is None:
        return None
    if kind == "list":
        items = value.list
        for field in ("s", "i", "f", "b", "type", "shape", "tensor", "func"):
            values = getattr(items, field)
            if values:
                return [_attr_to_python(_single_attr(field, item)) for item in values]
        return []
    if kind == "type":
        try:
            return tensors.as_numpy_dtype(value.type)
        except Exception:
            return int(value.type)
    if kind == "shape":
        return tensors.shape_from_proto(value.shape)
    if kind == "tensor":
        return tensors.from_tensor_proto(value.tensor)
    return getattr(value, kind)


def _single_attr(field: str, item: Any) -> AttrValue:
    attr = AttrValue()
    if field in ("shape", "tensor", "func"):
        getattr(attr, field).CopyFrom(item)
    else:
        setattr(attr, field, item)
    return attr


# --------------------------------------------------------------------------- tensors


# Tensor operators build ops, and `ops` builds on this module: it registers the
# builders when it is imported (the `distserver.graph` package imports it), so this
# module never imports `ops`. Keys: "binary" (py_name, x, y), "negative", "abs",
# "logical_not" (x) and "slice" (x, key).
_OPERATOR_BUILDERS: dict[str, Callable[..., Tensor]] = {}


def register_operator_builders(builders: Mapping[str, Callable[..., Tensor]]) -> None:
    """Called by `ops` at import: the functions Python's operators on tensors call."""
    _OPERATOR_BUILDERS.update(builders)


def _operator(py_name: str, x: Any, y: Any) -> Tensor:
    return _OPERATOR_BUILDERS["binary"](py_name, x, y)


class _TensorLike:
    """Operators shared by `Tensor` and `Variable`: each builds ops on `_as_operand()`.

    Python numbers and numpy arrays on either side become `Const`s of the tensor's
    dtype, named after the operand (``add/y``), as in TensorFlow.
    """

    # Numpy hands binary operators with a tensor operand to our reflected methods.
    __array_ufunc__ = None
    __array_priority__ = 100

    @property
    def datatype(self) -> int:
        """The `DataType` enum value of the values."""
        raise NotImplementedError

    def _as_operand(self) -> Tensor:
        raise NotImplementedError

    def _as_tensor(self, datatype: int | None, name: str | None) -> Tensor:
        """Convert to a tensor of `datatype` (any when `None`); used by `convert_to_tensor`."""
        raise NotImplementedError

    def __add__(self, other: Any) -> Tensor:
        return _operator("add", self._as_operand(), other)

    def __radd__(self, other: Any) -> Tensor:
        return _operator("add", other, self._as_operand())

    def __sub__(self, other: Any) -> Tensor:
        return _operator("sub", self._as_operand(), other)

    def __rsub__(self, other: Any) -> Tensor:
        return _operator("sub", other, self._as_operand())

    def __mul__(self, other: Any) -> Tensor:
        return _operator("mul", self._as_operand(), other)

    def __rmul__(self, other: Any) -> Tensor:
        return _operator("mul", other, self._as_operand())

    def __truediv__(self, other: Any) -> Tensor:
        return _operator("truediv", self._as_operand(), other)

    def __rtruediv__(self, other: Any) -> Tensor:
        return _operator("truediv", other, self._as_operand())

    def __floordiv__(self, other: Any) -> Tensor:
        return _operator("floordiv", self._as_operand(), other)

    def __rfloordiv__(self, other: Any) -> Tensor:
        return _operator("floordiv", other, self._as_operand())

    def __mod__(self, other: Any) -> Tensor:
        return _operator("mod", self._as_operand(), other)

    def __rmod__(self, other: Any) -> Tensor:
        return _operator("mod", other, self._as_operand())

    def __pow__(self, other: Any) -> Tensor:
        return _operator("pow", self._as_operand(), other)

    def __rpow__(self, other: Any) -> Tensor:
        return _operator("pow", other, self._as_operand())

    def __matmul__(self, other: Any) -> Tensor:
        return _operator("matmul", self._as_operand(), other)

    def __rmatmul__(self, other: Any) -> Tensor:
        return _operator("matmul", other, self._as_operand())

    def __and__(self, other: Any) -> Tensor:
        return _operator("and", self._as_operand(), other)

    def __rand__(self, other: Any) -> Tensor:
        return _operator("and", other, self._as_operand())

    def __or__(self, other: Any) -> Tensor:
        return _operator("or", self._as_operand(), other)

    def __ror__(self, other: Any) -> Tensor:
        return _operator("or", other, self._as_operand())

    # Comparisons build ops too; == and != keep Python's identity semantics (tensors
    # stay hashable), as TensorFlow graph tensors do.
    def __lt__(self, other: Any) -> Tensor:
        return _operator("Less", self._as_operand(), other)

    def __le__(self, other: Any) -> Tensor:
        return _operator("LessEqual", self._as_operand(), other)

    def __gt__(self, other: Any) -> Tensor:
        return _operator("Greater", self._as_operand(), other)

    def __ge__(self, other: Any) -> Tensor:
        return _operator("GreaterEqual", self._as_operand(), other)

    def __neg__(self) -> Tensor:
        return _OPERATOR_BUILDERS["negative"](self._as_operand())

    def __abs__(self) -> Tensor:
        return _OPERATOR_BUILDERS["abs"](self._as_operand())

    def __invert__(self) -> Tensor:
        return _OPERATOR_BUILDERS["logical_not"](self._as_operand())

    def __getitem__(self, key: Any) -> Tensor:
        return _OPERATOR_BUILDERS["slice"](self._as_operand(), key)

    def __bool__(self) -> bool:
        raise TypeError(
            "Using a `tf.Tensor` as a Python `bool` is not allowed in Graph execution. "
            "Build the condition into the graph (e.g. with `where`) and run it in a session."
        )

    def __iter__(self) -> NoReturn:
        raise TypeError(
            "Iterating over a symbolic `tf.Tensor` is not allowed in Graph execution; "
            "index it (`t[i]`) or use `tf.unstack`-style ops instead."
        )

    def __array__(self, dtype: Any = None, copy: Any = None) -> NoReturn:
        raise NotImplementedError(
            f"Cannot convert a symbolic tf.Tensor ({getattr(self, 'name', '?')}) to a numpy array: "
            "its value exists only when a session runs the graph."
        )


class Tensor(_TensorLike):
    """One output of an `Operation`: a symbolic value with a static dtype and shape.

    Named ``"<op name>:<output index>"``. Supports Python operators (``+ - * / // % **
    @``, unary ``-``, ``abs``, ``< <= > >=``, ``& | ~`` on bools, and indexing, which
    builds a StridedSlice); ``==`` compares identity, as in TensorFlow graphs.
    """

    def __init__(self, op: Operation, value_index: int, datatype: int, shape: Shape) -> None:
        self._op = op
        self._value_index = value_index
        self._datatype = datatype
        self._shape = shape

    @property
    def op(self) -> Operation:
        """The operation that produces this tensor."""
        return self._op

    @property
    def value_index(self) -> int:
        """The index of this tensor among its operation's outputs."""
        return self._value_index

    @property
    def name(self) -> str:
        """``"<op name>:<value index>"``."""
        return f"{self._op.name}:{self._value_index}"

    @property
    def datatype(self) -> int:
        """The `DataType` enum value (tells DT_STRING, DT_RESOURCE and DT_VARIANT apart)."""
        return self._datatype

    @property
    def dtype(self) -> np.dtype[Any]:
        """The numpy dtype of the values (object for strings, resources and variants)."""
        return tensors.as_numpy_dtype(self._datatype)

    @property
    def shape(self) -> Shape:
        """The static shape: sizes with `None` for unknown ones, or `None` for unknown rank."""
        return self._shape

    def get_shape(self) -> Shape:
        """Alias of `shape`."""
        return self._shape

    def set_shape(self, shape: Any) -> None:
        """Refine the static shape with a compatible, more specific one.

        Raises:
            ValueError: When `shape` is incompatible with the current shape.
        """
        new = as_shape(shape)
        try:
            self._shape = _merge_shapes(self._shape, new)
        except ValueError:
            raise ValueError(
                f"Tensor's shape {_shape_repr(self._shape)} is not compatible with supplied shape "
                f"{_shape_repr(new)}."
            ) from None

    @property
    def graph(self) -> Graph:
        """The graph of this tensor's operation."""
        return self._op.graph

    @property
    def device(self) -> str:
        """The device of this tensor's operation."""
        return self._op.device

    def consumers(self) -> list[Operation]:
        """The operations that take this tensor as an input, in creation order."""
        return [op for op in self.graph.get_operations() if any(t is self for t in op.inputs)]

    def _as_operand(self) -> Tensor:
        return self

    def _as_tensor(self, datatype: int | None, name: str | None) -> Tensor:
        return self

    def _input_name(self) -> str:
        # NodeDef inputs name output 0 by the op name alone, as TensorFlow writes them.
        return self._op.name if self._value_index == 0 else self.name

    def __len__(self) -> int:
        raise TypeError(
            f"len is not well defined for a symbolic Tensor ({self.name}). "
            "Please call `x.shape` rather than `len(x)` for shape information."
        )

    def __repr__(self) -> str:
        return (
            f"<distserver.graph.Tensor '{self.name}' shape={_shape_repr(self._shape)} "
            f"dtype={dtype_name(self._datatype)}>"
        )

    def __str__(self) -> str:
        shape = "" if self._shape is None else f", shape={self._shape!r}"
        device = f", device={self.device}" if self.device else ""
        return f'Tensor("{self.name}"{shape}, dtype={dtype_name(self._datatype)}{device})'


# --------------------------------------------------------------------------- graph state


@dataclasses.dataclass
class _DeviceScope:
    """One `device()` scope: a spec to merge, a function to call, or a reset."""

    spec: devices.DeviceSpec | None = None
    function: DeviceFunction | None = None
    reset: bool = False  # device(None): ignore all outer scopes.

    def apply(self, op: Operation) -> None:
        if self.function is not None:
            op._set_device(self.function(op))
        elif self.spec is not None:
            # Fields already set by inner scopes win over this (outer) scope's.
            current = devices.DeviceSpec.from_string(op.device)
            op._set_device(self.spec.make_merged_spec(current).to_string())


@dataclasses.dataclass
class _ControlScope:
    """One `control_dependencies()` scope and the operations created inside it."""

    control_inputs: list[Operation]
    created: set[int] = dataclasses.field(default_factory=set)


@dataclasses.dataclass
class _ScopeState:
    """Per-graph, per-thread building state (TensorFlow keeps these thread-local too)."""

    name_stack: str = ""
    devices: list[_DeviceScope] = dataclasses.field(default_factory=list)
    controls: list[_ControlScope] = dataclasses.field(default_factory=list)
    colocation: list[Operation] = dataclasses.field(default_factory=list)
    attrs: dict[str, AttrValue] = dataclasses.field(default_factory=dict)


class GraphKeys:
    """Standard collection names, as in `tf.compat.v1.GraphKeys`."""

    GLOBAL_STEP: Final = "global_step"
    GLOBAL_VARIABLES: Final = "variables"
    LOCAL_VARIABLES: Final = "local_variables"
    TRAINABLE_VARIABLES: Final = "trainable_variables"
    TRAIN_OP: Final = "train_op"


class Graph:
    """A dataflow graph: operations in creation order, plus collections.

    Thread-safe for building from several threads; each thread has its own name,
    device, control-dependency and colocation scopes.

    Example::

        g = Graph()
        with g.as_default():
            x = placeholder(float32, shape=[None, 2], name="x")
            y = reduce_sum(x * 2.0)
        graph_def = g.as_graph_def()
    """

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._ops: list[Operation] = []
        self._ops_by_name: dict[str, Operation] = {}
        self._names_in_use: dict[str, int] = {}
        self._version = 0
        self._finalized = False
        self._collections: dict[str, list[Any]] = {}
        self._local = threading.local()

    # ----------------------------------------------------------------- default graph

    @contextlib.contextmanager
    def as_default(self) -> Iterator[Graph]:
        """Make this the default graph of the current thread within a ``with`` block."""
        stack = _default_graphs.stack
        stack.append(self)
        try:
            yield self
        finally:
            if not stack or stack[-1] is not self:
                raise AssertionError("Nesting violated for default graph.")
            stack.pop()

    # ----------------------------------------------------------------- contents

    @property
    def version(self) -> int:
        """A number that grows by one for every operation added (0 for an empty graph)."""
        return self._version

    @property
    def graph_def_versions(self) -> VersionDef:
        """The `VersionDef` of the GraphDefs this graph produces."""
        return VersionDef(producer=GRAPH_DEF_VERSION)

    @property
    def finalized(self) -> bool:
        """Whether `finalize()` was called."""
        return self._finalized

    def finalize(self) -> None:
        """Make the graph read-only: adding operations then raises `RuntimeError`."""
        self._finalized = True

    def _check_not_finalized(self) -> None:
        if self._finalized:
            raise RuntimeError("Graph is finalized and cannot be modified.")

    def as_graph_def(self, from_version: int | None = None, add_shapes: bool = False) -> GraphDef:
        """Return the `GraphDef` of this graph.

        Args:
            from_version: When given, only the operations added after the graph had
                this `version` (the delta a session sends with ExtendSession).
            add_shapes: Add each node's static output shapes as an ``_output_shapes``
                attr, as TensorFlow does.

        Returns:
            A new GraphDef with nodes in creation order and ``versions.producer`` set
            to `GRAPH_DEF_VERSION`. Nodes are never changed once added, except for
            TensorFlow's informational ``_has_manual_control_dependencies`` attr (set
            when an op is first used in `control_dependencies`), which a delta does
            not repeat.
        """
        graph_def = GraphDef()
        graph_def.versions.producer = GRAPH_DEF_VERSION
        with self._lock:
            for op in self._ops:
                if from_version is not None and op._id <= from_version:
                    continue
                node = graph_def.node.add()
                node.CopyFrom(op._node_def)
                if add_shapes and op.outputs:
                    shapes = node.attr["_output_shapes"].list.shape
                    for output in op.outputs:
                        shapes.add().CopyFrom(tensors.shape_to_proto(output.shape))
        return graph_def

    def get_operations(self) -> list[Operation]:
        """All operations, in creation order."""
        with self._lock:
            return list(self._ops)

    def get_operation_by_name(self, name: str) -> Operation:
        """Return the operation called `name`.

        Raises:
            KeyError: When there is none.
            ValueError: When `name` names a tensor (``"op:0"``).
            TypeError: When `name` is not a string.
        """
        if not isinstance(name, str):
            raise TypeError(f"Operation names are strings (or similar), not {type(name).__name__}.")
        return cast(Operation, self.as_graph_element(name, allow_tensor=False, allow_operation=True))

    def get_tensor_by_name(self, name: str) -> Tensor:
        """Return the tensor called `name` (``"<op name>:<output index>"``).

        Raises:
            KeyError: When the operation or the output does not exist.
            ValueError: When `name` is not a tensor name.
            TypeError: When `name` is not a string.
        """
        if not isinstance(name, str):
            raise TypeError(f"Tensor names are strings (or similar), not {type(name).__name__}.")
        return cast(Tensor, self.as_graph_element(name, allow_tensor=True, allow_operation=False))

    def as_graph_element(
        self, obj: Any, allow_tensor: bool = True, allow_operation: bool = True
    ) -> Tensor | Operation:
        """Return the tensor or operation `obj` names or is, checking it is in this graph.

        `obj` may be a `Tensor`, an `Operation`, a name (``"op"`` or ``"op:0"``), or an
        object with an ``_as_graph_element()`` method (a `Variable` gives its value).

        Raises:
            KeyError: For a name of nothing in the graph.
            ValueError: For an element of another graph, or a name of the wrong kind.
            TypeError: For any other object.
        """
        if hasattr(obj, "_as_graph_element") and not isinstance(obj, Tensor | Operation):
            obj = obj._as_graph_element()
        kinds = " or ".join(k for k, ok in (("Tensor", allow_tensor), ("Operation", allow_operation)) if ok)
        if isinstance(obj, str):
            return self._element_by_name(obj, allow_tensor, allow_operation)
        if isinstance(obj, Tensor) and allow_tensor:
            if obj.graph is not self:
                raise ValueError(f"Tensor {obj} is not an element of this graph.")
            return obj
        if isinstance(obj, Operation) and allow_operation:
            if obj.graph is not self:
                raise ValueError(f"Operation {obj} is not an element of this graph.")
            return obj
        raise TypeError(f"Can not convert a {type(obj).__name__} into a {kinds}.")

    def _element_by_name(self, name: str, allow_tensor: bool, allow_operation: bool) -> Tensor | Operation:
        with self._lock:
            if ":" in name and allow_tensor:
                op_name, _, index_text = name.partition(":")
                if not index_text.isdigit():
                    raise ValueError(
                        f"The name {name!r} looks a like a Tensor name, but is not a valid one. "
                        + _TENSOR_NAME_FORM
                    )
                index = int(index_text)
                op = self._ops_by_name.get(op_name)
                if op is None:
                    raise KeyError(
                        f"The name {name!r} refers to a Tensor which does not exist. The operation, "
                        f"{op_name!r}, does not exist in the graph."
                    )
                if index >= len(op.outputs):
                    raise KeyError(
                        f"The name {name!r} refers to a Tensor which does not exist. The operation, "
                        f"{op_name!r}, exists but only has {len(op.outputs)} outputs."
                    )
                return op.outputs[index]
            if ":" in name:
                raise ValueError(f"Name {name!r} appears to refer to a Tensor, not a Operation.")
            if not allow_operation:
                if name in self._ops_by_name:
                    raise ValueError(
                        f"The name {name!r} refers to an Operation, not a Tensor. " + _TENSOR_NAME_FORM
                    )
                raise ValueError(
                    f"The name {name!r} looks like an (invalid) Operation name, not a Tensor. "
                    + _TENSOR_NAME_FORM
                )
            op = self._ops_by_name.get(name)
            if op is None:
                raise KeyError(f"The name {name!r} refers to an Operation not in the graph.")
            return op

    # ----------------------------------------------------------------- names

    def _state(self) -> _ScopeState:
        state: _ScopeState | None = getattr(self._local, "state", None)
        if state is None:
            state = self._local.state = _ScopeState()
        return state

    def unique_name(self, name: str, mark_as_used: bool = True) -> str:
        """Return `name` prefixed by the current name scope and made unique.

        Uniqueness is case-insensitive and uses TensorFlow's scheme: ``name``,
        ``name_1``, ``name_2``, ...

        Args:
            name: The base name.
            mark_as_used: Reserve the returned name (else only report it).
        """
        stack = self._state().name_stack
        if stack:
            name = f"{stack}/{name}"
        with self._lock:
            key = name.lower()
            count = self._names_in_use.get(key, 0)
            if mark_as_used:
                self._names_in_use[key] = count + 1
            if count > 0:
                base = key
                while key in self._names_in_use:
                    key = f"{base}_{count}"
                    count += 1
                if mark_as_used:
                    self._names_in_use[key] = 1
                name = f"{name}_{count - 1}"
        return name

    def get_name_scope(self) -> str:
        """The current name scope, e.g. ``"outer/inner"`` (``""`` at the root)."""
        return self._state().name_stack

    @contextlib.contextmanager
    def name_scope(self, name: str | None) -> Iterator[str]:
        """Open a name scope: operations created inside are named ``"<scope>/<name>"``.

        A name already used gets a suffix (``"a_1"``); a name ending in ``/`` re-enters
        that exact (absolute) scope; `None` or ``""`` goes back to the root.

        Yields:
            The scope, with a trailing ``/`` (``""`` at the root); pass it as `name` to an
            op constructor to name the op exactly after the scope.

        Raises:
            ValueError: When `name` is not a valid scope name.
        """
        state = self._state()
        if name:
            pattern = _VALID_SCOPE_NAME if state.name_stack else _VALID_OP_NAME
            if not pattern.match(name):
                raise ValueError(
                    f"'{name}' is not a valid scope name. A scope name has to match the following "
                    f"pattern: {pattern.pattern}"
                )
        old_stack = state.name_stack
        if not name:
            new_stack, scope = "", ""
        elif name.endswith("/"):
            new_stack, scope = name[:-1], name
        else:
            new_stack = self.unique_name(name)
            scope = new_stack + "/"
        state.name_stack = new_stack
        try:
            yield scope
        finally:
            state.name_stack = old_stack

    # ----------------------------------------------------------------- scopes

    @contextlib.contextmanager
    def device(self, device_name_or_function: Any) -> Iterator[None]:
        """Request a device for the operations created inside.

        Args:
            device_name_or_function: A (partial) device name or `DeviceSpec`, merged
                with enclosing scopes field by field (inner fields win: ``"/job:ps"``
                around ``"/task:1"`` gives ``"/job:ps/task:1"``); a function from the
                `Operation` being created to its device (inner scopes have already set
                ``op.device`` when it is called; its result replaces it); ``""`` to
                change nothing; or `None` to ignore all enclosing scopes.
        """
        spec = device_name_or_function
        if spec is None:
            scope = _DeviceScope(reset=True)
        elif callable(spec) and not isinstance(spec, str | devices.DeviceSpec):
            scope = _DeviceScope(function=spec)
        elif isinstance(spec, devices.DeviceSpec):
            scope = _DeviceScope(spec=spec)
        elif isinstance(spec, str):
            scope = _DeviceScope(spec=devices.DeviceSpec.from_string(spec) if spec else None)
        else:
            raise TypeError(f"device() takes a device name, a DeviceSpec, a function or None, got {spec!r}")
        stack = self._state().devices
        stack.append(scope)
        try:
            yield
        finally:
            stack.pop()

    @contextlib.contextmanager
    def control_dependencies(self, control_inputs: Iterable[Any] | None) -> Iterator[None]:
        """Make the operations created inside run after `control_inputs`.

        Args:
            control_inputs: Operations or tensors (or variables: their handle op) to
                wait for; `None` clears all enclosing control dependencies.

        Raises:
            TypeError: For an element that is not an operation or tensor.
        """
        state = self._state()
        if control_inputs is None:
            saved = state.controls
            state.controls = []
            try:
                yield
            finally:
                state.controls = saved
            return
        current = {id(op) for scope in state.controls for op in scope.control_inputs}
        added: list[Operation] = []
        for item in control_inputs:
            op = self._control_input(item)
            if id(op) not in current:
                added.append(op)
                current.add(id(op))
                # TensorFlow marks every op used as a manual control dependency.
                op._set_attr("_has_manual_control_dependencies", AttrValue(b=True))
        state.controls.append(_ControlScope(added))
        try:
            yield
        finally:
            state.controls.pop()

    def _control_input(self, item: Any) -> Operation:
        if isinstance(item, _TensorLike) and not isinstance(item, Tensor):
            item = getattr(item, "op", item)  # a variable: depend on its handle, do not read it
        try:
            element = self.as_graph_element(item)
        except TypeError:
            raise TypeError(f"Control input must be Operation or Tensor: {item!r}") from None
        return element.op if isinstance(element, Tensor) else element

    @contextlib.contextmanager
    def colocate_with(self, op: Any, ignore_existing: bool = False) -> Iterator[None]:
        """Place the operations created inside with `op` (same device, ``_class`` attr).

        Device scopes opened outside are ignored inside, as in TensorFlow.

        Args:
            op: An operation, tensor or variable; `None` (with ``ignore_existing``) to
                clear colocation and device scopes.
            ignore_existing: Ignore enclosing `colocate_with` scopes.

        Raises:
            ValueError: When `op` is None without ``ignore_existing``.
        """
        if op is None and not ignore_existing:
            raise ValueError("Trying to reset colocation (op is None) but ignore_existing is not True")
        target = None if op is None else self._control_input(op)
        state = self._state()
        saved_devices, saved_colocation = state.devices, state.colocation
        state.devices = []
        if ignore_existing:
            state.colocation = []
        if target is not None:
            state.colocation = [*state.colocation, target]
        try:
            yield
        finally:
            state.devices, state.colocation = saved_devices, saved_colocation

    @contextlib.contextmanager
    def _attr_scope(self, attrs: Mapping[str, AttrValue]) -> Iterator[None]:
        # Extra attrs for every operation created inside (used for variables' `_class`).
        state = self._state()
        saved = state.attrs
        state.attrs = {**saved, **attrs}
        try:
            yield
        finally:
            state.attrs = saved

    # ----------------------------------------------------------------- op creation

    def create_op(
        self,
        op_type: str,
        inputs: Sequence[Tensor],
        dtypes: Sequence[Any] = (),
        name: str | None = None,
        attrs: Mapping[str, AttrValue] | None = None,
        shapes: Sequence[Any] | None = None,
    ) -> Operation:
        """Add an operation; op constructors call this after checking their arguments.

        Args:
            op_type: The TensorFlow op type.
            inputs: Data inputs, tensors of this graph.
            dtypes: One dtype per output.
            name: The name, made unique within the current name scope (default:
                `op_type`); a name ending in ``/`` (a scope) is used as is, without it.
            attrs: The node's attrs.
            shapes: One static shape per output (default: unknown).

        Returns:
            The new operation, with control inputs, device and colocation applied from
            the current scopes.

        Raises:
            RuntimeError: When the graph is finalized.
            ValueError: For an input of another graph or an invalid name.
        """
        for tensor in inputs:
            if not isinstance(tensor, Tensor):
                raise TypeError(f"Inputs of {op_type} must be Tensors, got {tensor!r}")
            if tensor.graph is not self:
                raise ValueError(
                    f"Tensor {tensor} must be from the same graph as the {op_type} being created."
                )
        datatypes = [as_datatype(d) for d in dtypes]
        out_shapes = [as_shape(s) for s in shapes] if shapes is not None else [None] * len(datatypes)
        state = self._state()
        with self._lock:
            self._check_not_finalized()
            # A scope name ("a/b/") names the op exactly; any other name is made unique.
            name = name[:-1] if name and name.endswith("/") else self.unique_name(name or op_type)
            if not _VALID_OP_NAME.match(name):
                raise ValueError(f"'{name}' is not a valid node name")
            if name in self._ops_by_name:
                raise ValueError(f"Duplicate node name in graph: '{name}'")
            control_inputs = self._control_inputs_for(state, [t.op for t in inputs])
            node = NodeDef(name=name, op=op_type)
            node.input.extend(t._input_name() for t in inputs)
            # TensorFlow serialises control inputs sorted by name.
            node.input.extend(sorted(f"^{c.name}" for c in control_inputs))
            for key, value in {**state.attrs, **(attrs or {})}.items():
                node.attr[key].CopyFrom(value)
            self._version += 1
            op = Operation(self, node, inputs, control_inputs, datatypes, out_shapes, self._version)
            self._place(op, state)
            self._ops.append(op)
            self._ops_by_name[name] = op
            for scope in state.controls:
                scope.created.add(op._id)
        return op

    @staticmethod
    def _control_inputs_for(state: _ScopeState, input_ops: Sequence[Operation]) -> list[Operation]:
        result: list[Operation] = []
        for scope in state.controls:
            # An op fed by an op created under this scope already runs after its inputs.
            if any(op._id in scope.created for op in input_ops):
                continue
            result.extend(c for c in scope.control_inputs if c not in input_ops and c not in result)
        return result

    @staticmethod
    def _place(op: Operation, state: _ScopeState) -> None:
        # Innermost scope first; each outer string scope only fills unset fields, an
        # outer device function gets the last word (TensorFlow's order).
        for scope in reversed(state.devices):
            if scope.reset:
                break
            scope.apply(op)
        if state.colocation:
            groups: set[bytes] = set()
            device_set = False
            for target in reversed(state.colocation):
                groups.update(target.colocation_groups())
                if target.device and not device_set:
                    op._set_device(target.device)
                    device_set = True
            op._set_attr("_class", AttrValue(list=AttrValue.ListValue(s=sorted(groups))))

    # ----------------------------------------------------------------- collections

    def add_to_collection(self, name: str, value: Any) -> None:
        """Append `value` to the collection `name`."""
        with self._lock:
            self._check_not_finalized()
            self._collections.setdefault(name, []).append(value)

    def add_to_collections(self, names: Iterable[str], value: Any) -> None:
        """Append `value` to each collection in `names` (once per distinct name)."""
        for name in dict.fromkeys(names):
            self.add_to_collection(name, value)

    def get_collection(self, name: str, scope: str | None = None) -> list[Any]:
        """Return a copy of the collection `name`.

        Args:
            name: The collection, e.g. ``GraphKeys.GLOBAL_VARIABLES``.
            scope: Keep only items whose ``name`` matches this regular expression at
                its start.
        """
        with self._lock:
            items = list(self._collections.get(name, []))
        if scope is None:
            return items
        pattern = re.compile(scope)
        return [
            item
            for item in items
            if isinstance(getattr(item, "name", None), str) and pattern.match(item.name)
        ]

    def get_collection_ref(self, name: str) -> list[Any]:
        """Return the collection `name` itself (created empty if missing)."""
        with self._lock:
            return self._collections.setdefault(name, [])

    def get_all_collection_keys(self) -> list[str]:
        """The names of all non-empty collections."""
        with self._lock:
            return [name for name, items in self._collections.items() if items]


# --------------------------------------------------------------------------- default graph


class _DefaultGraphStack(threading.local):
    def __init__(self) -> None:
        self.stack: list[Graph] = []


_default_graphs = _DefaultGraphStack()
_global_default_graph: Graph | None = None
_global_lock = threading.Lock()


def get_default_graph() -> Graph:
    """Return the current thread's default graph.

    That is the innermost `Graph.as_default()` graph of this thread, else the
    process-wide default graph (shared by all threads, created on first use).
    """
    stack = _default_graphs.stack
    if stack:
        return stack[-1]
    global _global_default_graph
    with _global_lock:
        if _global_default_graph is None:
            _global_default_graph = Graph()
        return _global_default_graph


def reset_default_graph() -> None:
    """Replace the process-wide default graph by a new, empty one.

    Raises:
        AssertionError: When called inside a `Graph.as_default()` block.
    """
    if _default_graphs.stack:
        raise AssertionError(
            "Do not use tf.reset_default_graph() to clear nested graphs. If you need a cleared "
            "graph, exit the nesting and create a new graph."
        )
    global _global_default_graph
    with _global_lock:
        _global_default_graph = None


def _graph_of(values: Iterable[Any]) -> Graph:
    # The graph of the tensors, operations and variables in `values` (nested lists
    # allowed), else the default graph.
    found: Graph | None = None
    pending = list(values)
    while pending:
        value = pending.pop()
        if isinstance(value, list | tuple):
            pending.extend(value)
            continue
        graph = getattr(value, "graph", None) if isinstance(value, Operation | _TensorLike) else None
        if graph is None:
            continue
        if found is not None and graph is not found:
            raise ValueError(f"{value} must be from the same graph as the other inputs.")
        found = graph
    return found if found is not None else get_default_graph()


@contextlib.contextmanager
def name_scope(
    name: str | None, default_name: str | None = None, values: Iterable[Any] = ()
) -> Iterator[str]:
    """Open a name scope in the graph of `values` (or the default graph).

    Like `tf.compat.v1.name_scope`: the scope is `name`, or `default_name` when `name`
    is `None`; the graph holding the tensors in `values` becomes the default graph
    inside. See `Graph.name_scope` for naming rules.

    Yields:
        The scope with a trailing ``/``, to pass on as an op's `name`.
    """
    graph = _graph_of(values)
    with graph.as_default(), graph.name_scope(name if name is not None else default_name) as scope:
        yield scope


def device(device_name_or_function: Any) -> contextlib.AbstractContextManager[None]:
    """`Graph.device` on the default graph."""
    return get_default_graph().device(device_name_or_function)


def control_dependencies(control_inputs: Iterable[Any] | None) -> contextlib.AbstractContextManager[None]:
    """`Graph.control_dependencies` on the default graph."""
    return get_default_graph().control_dependencies(control_inputs)


def colocate_with(op: Any, ignore_existing: bool = False) -> contextlib.AbstractContextManager[None]:
    """`Graph.colocate_with` on the default graph."""
    return get_default_graph().colocate_with(op, ignore_existing)


def get_collection(name: str, scope: str | None = None) -> list[Any]:
    """`Graph.get_collection` on the default graph."""
    return get_default_graph().get_collection(name, scope)


def add_to_collection(name: str, value: Any) -> None:
    """`Graph.add_to_collection` on the default graph."""
    get_default_graph().add_to_collection(name, value)
