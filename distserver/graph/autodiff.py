"""Automatic differentiation: `gradients` builds the gradient graph of ys with respect to xs.

This follows `tf.compat.v1.gradients`: starting from `grad_ys` (ones by default), the
operations between xs and ys are visited from the outputs back (each once all its
consumers on the way have been visited), and each one's registered gradient function
adds the nodes computing the gradients of its inputs, in the name scope
``gradients/<op name>_grad``. A tensor reached along several paths gets the sum of
its gradients (``AddN``). The functions (`distserver.graph.gradient_functions`)
emit the ops TensorFlow's registered gradients emit, so the graphs also run on
TensorFlow.

Sparse gradients (of gathers) are `IndexedSlices`; optimizers apply them with
sparse updates, other consumers turn them into dense tensors (``UnsortedSegmentSum``).
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Final, TypeAlias

import numpy as np

from distserver import tensors
from distserver.graph import ops
from distserver.graph.graph import (
    Graph,
    Operation,
    Shape,
    Tensor,
    _graph_of,
    _TensorLike,
    dtype_name,
    get_default_graph,
    name_scope,
)
from distserver.protos import types_pb2

__all__ = [
    "IndexedSlices",
    "NotDifferentiable",
    "RegisterGradient",
    "gradients",
]


class IndexedSlices:
    """A sparse gradient: rows `indices` of a tensor of shape `dense_shape` are `values`.

    What the gradient of a gather is: only the gathered rows have gradients. Indices
    may repeat (their values add up).

    Attributes:
        values: The rows, shape ``[len(indices), *dense_shape[1:]]``.
        indices: A 1-D int tensor: the row of each value.
        dense_shape: A 1-D int tensor: the shape of the dense tensor.
    """

    def __init__(self, values: Tensor, indices: Tensor, dense_shape: Tensor) -> None:
        self.values = values
        self.indices = indices
        self.dense_shape = dense_shape

    @property
    def dtype(self) -> np.dtype[Any]:
        """The dtype of the values."""
        return self.values.dtype

    @property
    def datatype(self) -> int:
        """The `DataType` enum value of the values."""
        return self.values.datatype

    @property
    def graph(self) -> Graph:
        """The graph of the values."""
        return self.values.graph

    @property
    def device(self) -> str:
        """The device of the values."""
        return self.values.device

    @property
    def op(self) -> Operation:
        """The operation producing the values."""
        return self.values.op

    @property
    def name(self) -> str:
        """The name of the values tensor."""
        return self.values.name

    def __repr__(self) -> str:
        return (
            f"IndexedSlices(indices={self.indices.name}, values={self.values.name}, "
            f"dense_shape={self.dense_shape.name})"
        )


Gradient: TypeAlias = Tensor | IndexedSlices
GradientFunction: TypeAlias = Callable[..., Sequence[Gradient | None]]

# op type -> gradient function; None marks an op TensorFlow declares not differentiable.
_REGISTRY: dict[str, GradientFunction | None] = {}
# Op types whose gradient functions take `IndexedSlices` as they are (others get them dense).
_TAKES_SPARSE: set[str] = set()


class RegisterGradient:
    """Decorator registering the gradient function of an op type (``tf.RegisterGradient``).

    The function takes the forward `Operation` and one gradient per output (a
    `Tensor`, or zeros for outputs nothing depends on) and returns one gradient
    (`Tensor`, `IndexedSlices` or `None`) per input. Sparse gradients arriving at
    the op are made dense first, unless ``takes_indexed_slices=True`` (for ops that
    pass them on unchanged, such as ``Identity``).

    Example::

        @RegisterGradient("MyCube")  # an op type without a gradient yet
        def _my_cube_grad(op, grad):
            return [grad * 3.0 * op.inputs[0] * op.inputs[0]]

    Raises:
        KeyError: When the op type already has a gradient.
    """

    def __init__(self, op_type: str, *, takes_indexed_slices: bool = False) -> None:
        if not isinstance(op_type, str):
            raise TypeError("op_type must be a string")
        self._op_type = op_type
        self._takes_sparse = takes_indexed_slices

    def __call__(self, function: GradientFunction) -> GradientFunction:
        if self._op_type in _REGISTRY:
            raise KeyError(f"Registering two gradient with name '{self._op_type}'!")
        _REGISTRY[self._op_type] = function
        if self._takes_sparse:
            _TAKES_SPARSE.add(self._op_type)
        return function


def NotDifferentiable(op_type: str) -> None:
    """Declare that ops of `op_type` pass no gradient to their inputs (``tf.no_gradient``)."""
    if op_type in _REGISTRY:
        raise KeyError(f"Registering two gradient with name '{op_type}'!")
    _REGISTRY[op_type] = None


def gradient_function(op: Operation) -> GradientFunction | None:
    """The registered gradient function of `op` (None: not differentiable).

    Raises:
        LookupError: When nothing is registered for the op's type.
    """
    try:
        return _REGISTRY[op.type]
    except KeyError:
        raise LookupError(
            f"No gradient defined for operation '{op.name}' (op type: {op.type}). Every operation on "
            "the path from xs to ys needs a registered gradient (distserver.RegisterGradient); wrap "
            "the tensor in stop_gradient() to treat it as a constant."
        ) from None


_TRAINABLE: Final = tensors.FLOAT_DATATYPES | tensors.COMPLEX_DATATYPES | {types_pb2.DT_RESOURCE}


def is_trainable(datatype: int) -> bool:
    """Whether gradients flow through values of this dtype (floats, complex, resources)."""
    return datatype in _TRAINABLE


def gradients(
    ys: Any,
    xs: Any,
    grad_ys: Any = None,
    name: str = "gradients",
    colocate_gradients_with_ops: bool = False,
    gate_gradients: bool = False,
    stop_gradients: Any = None,
) -> list[Gradient | None]:
    """Build the graph computing the derivatives of ``sum(ys)`` with respect to each of `xs`.

    Like `tf.compat.v1.gradients`.

    Args:
        ys: A tensor or a list of tensors to differentiate.
        xs: A tensor, a `Variable` (its handle: gradients flow through its reads) or a
            list of them.
        grad_ys: The gradients of `ys` (one per y; `None` entries, or `None` for all,
            mean ones shaped like y).
        name: The name scope of the gradient nodes.
        colocate_gradients_with_ops: Put each gradient op on the device of the op it
            differentiates.
        gate_gradients: Group the input gradients of each op with ``tuple``, so that
            none is used before all are computed (what optimizers do by default).
        stop_gradients: Tensors to treat as constants.

    Returns:
        One entry per x: a `Tensor`, an `IndexedSlices` (sparse: from gathers), or
        `None` when x does not affect ys.

    Raises:
        LookupError: When an op between xs and ys has no registered gradient.
        TypeError: For complex ys without grad_ys, or an x that is not a tensor.
        ValueError: When grad_ys does not match ys.
    """
    y_list = _as_list(ys)
    x_list = _as_list(xs)
    graph = _graph_of([*y_list, *x_list])
    with graph.as_default(), name_scope(name, "gradients"):
        y_tensors = [ops.convert_to_tensor(y, name="y") for y in y_list]
        x_tensors = [_x_tensor(graph, x) for x in x_list]
        stops = [graph.as_graph_element(t) for t in _as_list(stop_gradients)]
        return _Backprop(graph, colocate_gradients_with_ops, gate_gradients).run(
            y_tensors, x_tensors, _grad_ys(y_tensors, grad_ys, colocate_gradients_with_ops), stops
        )


def _as_list(value: Any) -> list[Any]:
    if value is None:
        return []
    return list(value) if isinstance(value, list | tuple) else [value]


def _x_tensor(graph: Graph, x: Any) -> Tensor:
    handle = getattr(x, "handle", None)
    if isinstance(x, _TensorLike) and isinstance(handle, Tensor):
        return handle  # a resource variable: its reads pass gradients to the handle
    element = graph.as_graph_element(x)
    if not isinstance(element, Tensor):
        raise TypeError(f"xs must be tensors or variables, got {x!r}")
    return element


def _grad_ys(ys: list[Tensor], grad_ys: Any, colocate: bool) -> list[Gradient]:
    given = _as_list(grad_ys) if grad_ys is not None else [None] * len(ys)
    if len(given) != len(ys):
        raise ValueError(f"Passed {len(given)} grad_ys for {len(ys)} ys")
    result: list[Gradient] = []
    for i, (y, grad_y) in enumerate(zip(ys, given, strict=True)):
        if grad_y is None:
            if y.datatype in tensors.COMPLEX_DATATYPES:
                raise TypeError(f"Gradients of complex tensors ({y}) must set grad_ys (y.dtype = {y.dtype})")
            with _maybe_colocate(y.op, colocate):
                shape = ops.shape(y)
                with name_scope(f"grad_ys_{i}") as scope:
                    one = ops.constant(np.array(1, dtype=y.dtype))
                    result.append(ops.fill(shape, one, name=scope))
            continue
        if isinstance(grad_y, IndexedSlices):
            result.append(grad_y)
            continue
        grad_tensor = ops.convert_to_tensor(grad_y, dtype=y.dtype, name=f"grad_ys_{i}")
        if grad_tensor.datatype != y.datatype:
            raise ValueError(
                f"grad_ys[{i}] has dtype {dtype_name(grad_tensor.datatype)}, y has {dtype_name(y.datatype)}"
            )
        result.append(grad_tensor)
    return result


def _maybe_colocate(op: Operation, colocate: bool) -> contextlib.AbstractContextManager[None]:
    return op.graph.colocate_with(op) if colocate else contextlib.nullcontext()


class _Backprop:
    """One `gradients` call: the walk from ys back to xs."""

    def __init__(self, graph: Graph, colocate: bool, gate: bool) -> None:
        self.graph = graph
        self.colocate = colocate
        self.gate = gate
        # Gradients received so far: op -> one list per output.
        self.grads: dict[Operation, list[list[Gradient]]] = {}

    def run(
        self, ys: list[Tensor], xs: list[Tensor], grad_ys: list[Gradient], stops: list[Tensor | Operation]
    ) -> list[Gradient | None]:
        from_ops = list(dict.fromkeys(x.op for x in xs))
        between = _between_ops(from_ops, [y.op for y in ys], _consumers(self.graph))
        # An op is ready once every op between that consumes it has been visited.
        pending: dict[Operation, int] = collections.defaultdict(int)
        for op in between:
            for t in op.inputs:
                if t.op in between:
                    pending[t.op] += 1

        for y, grad_y in zip(ys, grad_ys, strict=True):
            self._add(y, grad_y)
        stop_ops = {op for op in from_ops if all(pending[t.op] == 0 for t in op.inputs)}
        stop_ops.update(s.op if isinstance(s, Tensor) else s for s in stops)
        ready: collections.deque[Operation] = collections.deque()
        queued: set[Operation] = set()
        for y in ys:
            if pending[y.op] == 0 and y.op not in queued and y.op in between:
                queued.add(y.op)
                ready.append(y.op)
        while ready:
            op = ready.popleft()
            self._backprop_op(op, op in stop_ops)
            for t in op.inputs:
                pending[t.op] -= 1
                if pending[t.op] == 0 and t.op in between:
                    ready.append(t.op)
        return [self._final_grad(x) for x in xs]

    def _backprop_op(self, op: Operation, is_stop: bool) -> None:
        with _maybe_colocate(op, self.colocate):
            out_grads = self._aggregated(op)
            function: GradientFunction | None = None
            has_grads = any(g is not None for g in out_grads)
            if has_grads and not is_stop:
                function = gradient_function(op)
            in_grads: list[Gradient | None]
            if function is not None and has_grads:
                for i, grad in enumerate(out_grads):
                    if grad is None and is_trainable(op.outputs[i].datatype):
                        out_grads[i] = _zeros_like_output(op.outputs[i])
                    elif isinstance(grad, IndexedSlices) and op.type not in _TAKES_SPARSE:
                        out_grads[i] = to_dense(grad)
                with name_scope(op.name + "_grad"):
                    in_grads = list(function(op, *out_grads))
                    if len(in_grads) != len(op.inputs):
                        raise ValueError(
                            f"Num gradients {len(in_grads)} generated for op {op.node_def} do not match "
                            f"num inputs {len(op.inputs)}"
                        )
                    if self.gate and sum(g is not None for g in in_grads) > 1:
                        with self.graph.device(None), self.graph.colocate_with(None, ignore_existing=True):
                            in_grads = _tuple(in_grads)
            else:
                in_grads = [None] * len(op.inputs)
            for t_in, in_grad in zip(op.inputs, in_grads, strict=True):
                if in_grad is None:
                    continue
                if isinstance(in_grad, Tensor) and t_in.datatype != types_pb2.DT_RESOURCE:
                    try:
                        in_grad.set_shape(t_in.shape)
                    except ValueError:
                        raise ValueError(
                            f"Incompatible shapes between op input and calculated input gradient. Forward "
                            f"operation: {op.name}. Input: {t_in.name}. Input shape: {t_in.shape}. "
                            f"Gradient shape: {in_grad.shape}."
                        ) from None
                self._add(t_in, in_grad)

    def _add(self, t: Tensor, grad: Gradient) -> None:
        per_output = self.grads.setdefault(t.op, [[] for _ in t.op.outputs])
        per_output[t.value_index].append(grad)

    def _aggregated(self, op: Operation) -> list[Gradient | None]:
        """The sum of each output's gradients (stored back, so xs read the sums)."""
        per_output = self.grads.get(op, [[] for _ in op.outputs])
        result: list[Gradient | None] = []
        for grads in per_output:
            if not grads:
                result.append(None)
                continue
            if len(grads) > 1:
                total = _aggregate(grads)
                grads[:] = [total]
            result.append(grads[0])
        return result

    def _final_grad(self, x: Tensor) -> Gradient | None:
        per_output = self.grads.get(x.op)
        if not per_output or not per_output[x.value_index]:
            return None
        grads = per_output[x.value_index]
        if len(grads) > 1:
            grads[:] = [_aggregate(grads)]
        return grads[0]


def _consumers(graph: Graph) -> dict[Tensor, list[Operation]]:
    result: dict[Tensor, list[Operation]] = collections.defaultdict(list)
    for op in graph.get_operations():
        for t in op.inputs:
            result[t].append(op)
    return result


def _between_ops(
    from_ops: list[Operation], to_ops: list[Operation], consumers: dict[Tensor, list[Operation]]
) -> dict[Operation, None]:
    """The ops on a path from `from_ops` to `to_ops` (an ordered set)."""
    reached = _reached_ops(from_ops, consumers)
    between: dict[Operation, None] = {}
    queue = collections.deque(to_ops)
    while queue:
        op = queue.popleft()
        if op in reached:
            between[op] = None
            reached.discard(op)
            queue.extend(t.op for t in op.inputs)
    return between


def _reached_ops(from_ops: Iterable[Operation], consumers: dict[Tensor, list[Operation]]) -> set[Operation]:
    reached: set[Operation] = set()
    queue = collections.deque(from_ops)
    while queue:
        op = queue.popleft()
        if op in reached:
            continue
        reached.add(op)
        for output in op.outputs:
            if is_trainable(output.datatype):
                queue.extend(consumers.get(output, ()))
    return reached


def _zeros_like_output(t: Tensor) -> Tensor:
    # An output nothing depends on: its gradient is zero (an explicit ZerosLike, as TF builds).
    return ops._make(
        get_default_graph().unique_name("zeros_like") + "/",
        "ZerosLike",
        [t],
        {"T": ops._type_attr(t.datatype)},
        t.datatype,
        t.shape,
    )


def _aggregate(grads: list[Gradient]) -> Gradient:
    """Sum gradients: AddN of dense ones; concatenated slices when all are sparse."""
    if all(isinstance(g, IndexedSlices) for g in grads):
        slices = [g for g in grads if isinstance(g, IndexedSlices)]
        return IndexedSlices(
            ops.concat([s.values for s in slices], 0),
            ops.concat([ops.cast(s.indices, np.int64) for s in slices], 0)
            if len({s.indices.datatype for s in slices}) > 1
            else ops.concat([s.indices for s in slices], 0),
            slices[0].dense_shape,
        )
    dense = [to_dense(g) for g in grads]
    # TF colocates the sum with the first gradient.
    with dense[0].graph.colocate_with(dense[0].op, ignore_existing=True):
        return ops.add_n(dense)


def to_dense(grad: Gradient) -> Tensor:
    """A dense tensor of a gradient: `IndexedSlices` are summed into rows (UnsortedSegmentSum)."""
    if isinstance(grad, Tensor):
        return grad
    rows = ops.slice_helper(grad.dense_shape, 0)
    with name_scope(None, "UnsortedSegmentSum"):
        return unsorted_segment_sum(grad.values, grad.indices, rows, _static_dense_shape(grad))


def _static_dense_shape(grad: IndexedSlices) -> Shape:
    known = ops._static_ints(grad.dense_shape)
    return None if known is None else tuple(known)


def unsorted_segment_sum(
    data: Tensor, segment_ids: Tensor, num_segments: Tensor, shape: Shape = None
) -> Tensor:
    """``UnsortedSegmentSum``: rows of `data` added into `num_segments` rows by id."""
    graph = get_default_graph()
    if shape is None and data.shape is not None and segment_ids.shape is not None:
        shape = (ops._static_int(num_segments), *data.shape[len(segment_ids.shape) :])
    attrs = {
        "T": ops._type_attr(data.datatype),
        "Tindices": ops._type_attr(segment_ids.datatype),
        "Tnumsegments": ops._type_attr(num_segments.datatype),
    }
    return ops._make(
        graph.unique_name("UnsortedSegmentSum") + "/",
        "UnsortedSegmentSum",
        [data, segment_ids, num_segments],
        attrs,
        data.datatype,
        shape,
    )


def _tuple(grads: list[Gradient | None]) -> list[Gradient | None]:
    """TensorFlow's ``tuple``: each gradient passes an Identity that waits for all of them."""
    graph = get_default_graph()
    with name_scope("tuple"):
        gate = ops.group(*[g.op for g in grads if g is not None])
        result: list[Gradient | None] = []
        for grad in grads:
            if grad is None:
                result.append(None)
                continue
            values = grad.values if isinstance(grad, IndexedSlices) else grad
            with (
                name_scope("control_dependency") as scope,
                graph.colocate_with(values.op),
                graph.control_dependencies([gate]),
            ):
                gated = ops.identity(values, name=scope)
            if isinstance(grad, IndexedSlices):
                result.append(IndexedSlices(gated, grad.indices, grad.dense_shape))
            else:
                result.append(gated)
        return result
