"""One registry from TensorFlow op name to the kernel that runs it.

A kernel is built once per graph node, when a worker registers the graph
(`create_kernel(node_def)`): the constructor reads and checks the node's attrs, so
a malformed node fails at registration with an error that names it. Each step then
calls `compute` (or `compute_async` for kernels that wait, such as `_Recv`) with the
node's input values and gets its output values back.

Values are numpy arrays (0-d for scalars); DT_STRING tensors are object arrays of
`bytes`; DT_RESOURCE tensors are 0-d object arrays holding a `ResourceHandle`.
The same kernels run graphs built by `distserver.graph` and graphs sent by real
TensorFlow clients.
"""

from __future__ import annotations

import asyncio
import functools
import math
import operator
import threading
import types
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, TypeVar

import numpy as np

from distserver import errors
from distserver.kernels.resources import VariableRef
from distserver.tensors import as_numpy_dtype

if TYPE_CHECKING:
    from distserver.devices import RendezvousKey
    from distserver.kernels.resources import ResourceManager
    from distserver.protos.attr_value_pb2 import NameAttrList
    from distserver.protos.node_def_pb2 import NodeDef


class Rendezvous(Protocol):
    """Where `_Send` puts and `_Recv` takes the values that cross partitions in one step."""

    def send(self, key: RendezvousKey, value: Any, is_dead: bool = False) -> None:
        """Deliver `value` under `key`; each key is sent at most once per step."""

    async def recv(self, key: RendezvousKey) -> tuple[Any, bool]:
        """Wait for the value sent under `key`; returns `(value, is_dead)`.

        A key whose sender is another task is fetched from that task."""
        ...

    async def recv_local(self, key: RendezvousKey) -> tuple[Any, bool]:
        """Wait for a value delivered to this task's rendezvous, wherever it came from."""
        ...

    def recv_soon(self, key: RendezvousKey, together: bool = False) -> asyncio.Future[tuple[Any, bool]]:
        """`recv`, as a future the caller owns (cancelling it gives up this receive only);
        `together`: the caller goes on only once all its receives are in (see
        `runtime.rendezvous.StepRendezvous.recv_soon`)."""
        ...

    def recv_local_soon(self, key: RendezvousKey) -> asyncio.Future[tuple[Any, bool]]:
        """`recv_local`, as a future the caller owns."""
        ...


class KernelContext(Protocol):
    """What a kernel may use while it runs one step."""

    @property
    def step_id(self) -> int: ...

    @property
    def device(self) -> str:
        """Full name of the device the node runs on."""
        ...

    @property
    def device_incarnation(self) -> int: ...

    @property
    def rendezvous(self) -> Rendezvous: ...

    @property
    def resources(self) -> ResourceManager: ...

    @property
    def checkpoint_root(self) -> str | None:
        """The resolved directory checkpoint kernels may read and write under; None: none may."""
        ...

    @property
    def frame(self) -> FunctionFrame | None:
        """The arguments and results of the function call this step runs, if it runs one."""
        ...

    @property
    def frame_iter(self) -> tuple[int, int] | None:
        """(frame id, iteration) of the loop iteration a `_Send`/`_Recv` runs in; None outside loops."""
        ...

    async def call_function(self, function: NameAttrList, args: list[Any]) -> list[Any]:
        """Run graph function `function` (name and attrs) of the graph's library on `args`.

        What functional ops (`While`) use: the body runs on this device, in this step,
        and is cancelled with it. Raises `NotFoundError` when the graph has no library
        or no such function, and the body's errors.
        """
        ...


@dataclass
class FunctionFrame:
    """One call of a graph function: `_Arg` kernels read `args`, `_Retval` kernels fill `retvals`."""

    args: list[Any]
    retvals: list[Any]


class _Dead:
    """The value of a tensor on a branch that does not run (TensorFlow's dead tensors).

    `Switch` outputs its input on one port and `DEAD` on the other; a node with a dead
    input is not computed and its outputs are dead too (see `OpKernel.dead_inputs`);
    `Merge` outputs its one live input. `_Send` carries deadness to other tasks as
    RecvTensor's `is_dead`.
    """

    __slots__ = ()

    def __repr__(self) -> str:
        return "<dead>"


DEAD = _Dead()

# `OpKernel.dead_inputs` values.
SKIP_WHEN_DEAD = "skip"
SEES_DEAD_DATA = "merge"
CARRIES_DEADNESS = "transfer"


class OpKernel:
    """Runs one node. Subclasses read attrs in `__init__` and implement `compute`.

    Contract:
        * `__init__(node)` raises `InvalidArgumentError` for missing/invalid attrs.
        * `compute(ctx, inputs)` returns one value per output of the node and raises
          `OpError` subclasses (usually `InvalidArgumentError`) for bad inputs; the
          executor adds the node name to the error.
        * `compute` must not keep references to `inputs` after it returns, except
          where the op's semantics say so (variables store their value).
        * Kernels with `is_async = True` implement `compute_async` instead; they run
          on the event loop and may wait (rendezvous, queues).
        * `is_stateful = True` marks kernels with side effects (never pruned as dead
          code, never cached).
        * Inputs that are references to TF 1.x variables (`VariableRef`, the value of
          a `T_ref` tensor) are replaced by the variable's current value before
          `compute`/`compute_async` sees them, as TensorFlow's executor does, except
          at the positions in `ref_inputs` (the op's `Ref(T)` inputs: `Assign`'s
          input 0, ...). Reading an uninitialized variable that way is TF's
          `FailedPreconditionError("Attempting to use uninitialized value <input>")`.
        * Dead inputs (`DEAD`, from a Switch's untaken port), by `dead_inputs`:
          `SKIP_WHEN_DEAD` (almost every kernel): a dead data or control input makes
          the node dead without computing it (every output `DEAD`); `SEES_DEAD_DATA`
          (Merge, ControlTrigger): computed with `DEAD` among the data inputs, control
          inputs' deadness ignored; `CARRIES_DEADNESS` (`_Send`): computed, with every
          data input `DEAD` when any input is dead.
    """

    is_async: ClassVar[bool] = False
    dead_inputs: ClassVar[str] = SKIP_WHEN_DEAD
    # Kernels that may output `DEAD` from live inputs (Switch, a `_Recv` of a dead
    # value): the executor looks for dead values only once one of them has run.
    may_output_dead: ClassVar[bool] = False
    is_stateful: ClassVar[bool] = False
    # Synchronous kernels the executor runs inline on the event loop even when their
    # inputs are large: those that touch loop-bound state (the rendezvous), and those
    # whose cost does not grow with their inputs (a view, a shape), for which a
    # thread hop would cost more than the work.
    runs_on_loop: ClassVar[bool] = False
    # Kernels that touch state only the event loop's thread may touch (the rendezvous,
    # a stack, a tensor array): never run in a thread. Every other synchronous kernel
    # may be (`runs_on_loop` ones too, when the executor moves a run of nodes there).
    loop_bound: ClassVar[bool] = False
    # Kernels that read or write files: the executor always runs them in the thread
    # pool (when it has one), whatever the size of their inputs.
    does_io: ClassVar[bool] = False
    # The weight of a call (`work_nbytes`) from which the executor runs the kernel in
    # its thread pool rather than on the event loop; None: `executor.OFFLOAD_BYTES`.
    offload_bytes: ClassVar[int | None] = None
    # Kernels whose outputs depend only on their NodeDef and the step's device (Const,
    # VarHandleOp): the executor computes such a node without inputs once per device
    # and hands its outputs to every later step, instead of running it every step.
    outputs_fixed: ClassVar[bool] = False
    # Kernels that output a `VariableRef` (VariableV2): only graphs holding one need the
    # dereferencing check on every kernel's inputs (`compute_without_dereference`).
    makes_refs: ClassVar[bool] = False
    # Pure kernels of one output whose work is at most a pass over their inputs'
    # elements (element-wise arithmetic, comparisons, casts, selects, views and shapes):
    # the executor may run a connected group of such nodes as one
    # (`kernels.regions.FusedRegionKernel`). Set on a class, never inherited by a
    # subclass that differs.
    fusable: ClassVar[bool] = False
    # Kernels that output their one data input unchanged (Identity) or nothing (NoOp):
    # the executor may leave such a node out of its steps, its consumers taking the
    # value from its input and waiting for its control inputs themselves.
    passes_through: ClassVar[bool] = False
    ref_inputs: frozenset[int] = frozenset()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # Wrap the compute methods a subclass defines so that they never see a
        # VariableRef where the op takes a value. The check is one type test per
        # input; only graphs with legacy variables ever pay for a dereference.
        compute = cls.__dict__.get("compute")
        if compute is not None and not hasattr(compute, "__wrapped__"):
            setattr(cls, "compute", _dereferencing(compute))  # noqa: B010
        compute_async = cls.__dict__.get("compute_async")
        if compute_async is not None and not hasattr(compute_async, "__wrapped__"):
            setattr(cls, "compute_async", _dereferencing_async(compute_async))  # noqa: B010

    def __init__(self, node: NodeDef) -> None:
        self.node = node
        self.name = node.name
        self.op = node.op

    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        raise NotImplementedError

    def output_nbytes(self, inputs: list[Any]) -> int:
        """Bytes this kernel will write for `inputs`, or its work counted in such bytes,
        where that does not follow from their size.

        Kernels whose output can dwarf their inputs (Fill, Tile, Range, random
        tensors, ...) or whose work does (a matrix product's multiply-adds, a
        convolution's patches) say so, and the executor sends them to the thread pool
        like a kernel with large inputs. A cheap estimate; 0 when unknown or malformed
        (the kernel reports bad inputs when it runs).
        """
        return 0

    def work_nbytes(self, inputs: list[Any]) -> int:
        """What a call on `inputs` weighs, in bytes: the executor runs a call that weighs
        `offload_bytes` (or `executor.OFFLOAD_BYTES`) or more in its thread pool.

        Its inputs' bytes plus `output_nbytes`. Kernels asked before every call of a
        step (a dense layer's) may count the same in fewer Python calls: asked before
        each of a step's 60 small dense layer nodes, this count came to 3-6% of it.
        """
        try:  # (inputs are arrays but for rare values)
            nbytes: int = sum(map(_nbytes_of, inputs))
        except AttributeError:
            nbytes = sum(value.nbytes for value in inputs if isinstance(value, np.ndarray))
        return nbytes + self.output_nbytes(inputs)

    async def compute_async(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        return self.compute(ctx, inputs)

    # Attr helpers: each raises InvalidArgumentError naming the node and the attr.

    def _attr(self, name: str) -> Any:
        try:
            return self.node.attr[name]
        except KeyError:
            raise errors.InvalidArgumentError(
                f"NodeDef missing attr '{name}' from Op<name={self.op}>; NodeDef: {self.name} = {self.op}",
                node_name=self.name,
            ) from None

    def has_attr(self, name: str) -> bool:
        return name in self.node.attr

    def attr_type(self, name: str, default: np.dtype[Any] | None = None) -> np.dtype[Any]:
        if default is not None and name not in self.node.attr:
            return default
        return as_numpy_dtype(self._attr(name).type)

    def attr_int(self, name: str, default: int | None = None, *, at_least: int | None = None) -> int:
        """An int attr; with `at_least`, its op's minimum (TensorFlow's error when below)."""
        value = default if default is not None and name not in self.node.attr else int(self._attr(name).i)
        if at_least is not None and value < at_least:
            raise errors.InvalidArgumentError(
                f"Value for attr '{name}' of {value} must be at least minimum {at_least}", node_name=self.name
            )
        return value

    def attr_float(self, name: str, default: float | None = None) -> float:
        if default is not None and name not in self.node.attr:
            return default
        return float(self._attr(name).f)

    def attr_bool(self, name: str, default: bool | None = None) -> bool:
        if default is not None and name not in self.node.attr:
            return default
        return bool(self._attr(name).b)

    def attr_str(self, name: str, default: str | None = None) -> str:
        if default is not None and name not in self.node.attr:
            return default
        return str(self._attr(name).s.decode())

    def attr_ints(self, name: str, default: list[int] | None = None) -> list[int]:
        if default is not None and name not in self.node.attr:
            return default
        return list(self._attr(name).list.i)


def product_of(value: Any) -> int:
    """The product of a shape-like tensor's values (negative sizes count as 0); 0 if it has none."""
    try:
        sizes = np.asarray(value).reshape(-1).tolist()
        return math.prod(max(int(size), 0) for size in sizes)
    except (TypeError, ValueError, OverflowError):
        return 0


def _dereference(kernel: OpKernel, inputs: list[Any]) -> list[Any]:
    """`inputs` with every VariableRef outside `kernel.ref_inputs` replaced by its value."""
    values = list(inputs)
    for i, value in enumerate(values):
        if type(value) is VariableRef and i not in kernel.ref_inputs:
            current = value.variable.read()
            if current is None:
                data_inputs = [t for t in kernel.node.input if not t.startswith("^")]
                requested = data_inputs[i] if i < len(data_inputs) else value.name
                raise errors.FailedPreconditionError(
                    f"Attempting to use uninitialized value {requested}\n\t [[{{{{node {kernel.name}}}}}]]",
                    node_name=kernel.name,
                )
            values[i] = current
    return values


_nbytes_of = operator.attrgetter("nbytes")

_Compute = Callable[[Any, KernelContext, list[Any]], list[Any]]
_ComputeAsync = Callable[[Any, KernelContext, list[Any]], Coroutine[Any, Any, list[Any]]]


def _dereferencing(method: _Compute) -> _Compute:
    @functools.wraps(method)
    def compute(self: OpKernel, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        for value in inputs:
            if type(value) is VariableRef:
                inputs = _dereference(self, inputs)
                break
        return method(self, ctx, inputs)

    compute.without_dereference = method  # type: ignore[attr-defined]
    return compute


def compute_without_dereference(kernel: OpKernel) -> Callable[[KernelContext, list[Any]], list[Any]]:
    """`kernel.compute` without the check for `VariableRef` inputs, for a caller that
    knows none can reach it (a graph without `VariableV2`, the only kernel making
    them: the executor)."""
    method = getattr(type(kernel).compute, "without_dereference", None)
    if method is None:
        return kernel.compute
    return types.MethodType(method, kernel)


def _dereferencing_async(method: _ComputeAsync) -> _ComputeAsync:
    @functools.wraps(method)
    async def compute_async(self: OpKernel, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        for value in inputs:
            if type(value) is VariableRef:
                inputs = _dereference(self, inputs)
                break
        return await method(self, ctx, inputs)

    return compute_async


_KERNELS: dict[str, type[OpKernel]] = {}

K = TypeVar("K", bound=type[OpKernel])


def register_kernel(*op_names: str) -> Callable[[K], K]:
    """Class decorator: run nodes whose op is one of `op_names` with this kernel."""

    def decorate(cls: K) -> K:
        for op_name in op_names:
            if op_name in _KERNELS:
                raise ValueError(f"a kernel for op {op_name!r} is already registered")
            _KERNELS[op_name] = cls
        return cls

    return decorate


def has_kernel(op_name: str) -> bool:
    _load_builtin_kernels()
    return op_name in _KERNELS


def fusable_op(op_name: str) -> bool:
    """Whether `op_name`'s kernel is `OpKernel.fusable` (asked before building one)."""
    _load_builtin_kernels()
    cls = _KERNELS.get(op_name)
    return cls is not None and cls.fusable


def registered_ops() -> list[str]:
    """Sorted names of every op with a kernel."""
    _load_builtin_kernels()
    return sorted(_KERNELS)


def create_kernel(node: NodeDef) -> OpKernel:
    """Build the kernel for `node`.

    Raises:
        NotFoundError: no kernel is registered for `node.op` (the message names the op
            and the node).
        InvalidArgumentError: the node's attrs are missing or invalid.
    """
    _load_builtin_kernels()
    cls = _KERNELS.get(node.op)
    if cls is None:
        raise errors.NotFoundError(
            f"Op type not registered '{node.op}' in binary running on this distserver task "
            f"(node '{node.name}'). distserver supports these ops: see docs/tf-compat.md "
            f"or distserver.kernels.registered_ops().",
            node_name=node.name,
        )
    return cls(node)


_loaded = False
# Graphs are checked in threads (the master imports them off the event loop): the first
# callers must all wait until every kernel module has registered, not see a half-filled
# registry.
_loading = threading.RLock()


def _load_builtin_kernels() -> None:
    global _loaded
    if _loaded:
        return
    with _loading:
        if _loaded:
            return
        import distserver.kernels.accumulators
        import distserver.kernels.array
        import distserver.kernels.checkpoint
        import distserver.kernels.control_flow
        import distserver.kernels.conv
        import distserver.kernels.datasets
        import distserver.kernels.functional
        import distserver.kernels.lookup
        import distserver.kernels.math
        import distserver.kernels.nn
        import distserver.kernels.optimizers_extra
        import distserver.kernels.optionals
        import distserver.kernels.queue
        import distserver.kernels.random
        import distserver.kernels.ref_variables
        import distserver.kernels.regions
        import distserver.kernels.sendrecv
        import distserver.kernels.sparse
        import distserver.kernels.stacks
        import distserver.kernels.state
        import distserver.kernels.stateless_random
        import distserver.kernels.strings
        import distserver.kernels.summary
        import distserver.kernels.tensor_arrays
        import distserver.kernels.tensor_lists  # noqa: F401

        _loaded = True


def check_dtype(kernel: OpKernel, value: np.ndarray, expected: np.dtype[Any], what: str = "input") -> None:
    """Raise InvalidArgumentError unless `value` has dtype `expected`."""
    if value.dtype != expected:
        raise errors.InvalidArgumentError(
            f"{kernel.op} {what} of node '{kernel.name}' has dtype {value.dtype}, expected {expected}",
            node_name=kernel.name,
        )
