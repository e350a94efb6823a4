"""Optimizers and the global step, as `tf.compat.v1.train` builds them (``ds.train``).

`GradientDescentOptimizer`, `MomentumOptimizer`, `AdamOptimizer`, `AdagradOptimizer`
and `RMSPropOptimizer` build the nodes TensorFlow's v1 optimizers build for resource
variables: the gradients (`distserver.graph.autodiff`), slot variables created next
to their variable (same device, ``_class: loc:@<var>``), and one ``ResourceApply*``
kernel per variable (``ResourceSparseApply*``/``ResourceScatterAdd`` when the gradient
is sparse, from a gather), so training gives TensorFlow's numbers and the graph runs on
TensorFlow's servers too.

Example::

    import distserver as ds

    with ds.Graph().as_default():
        w = ds.Variable([[0.5], [-0.5]], name="w")
        x = ds.placeholder(ds.float32, [None, 2])
        y = ds.placeholder(ds.float32, [None, 1])
        loss = ds.reduce_mean(ds.square(ds.matmul(x, w) - y))
        step = ds.train.get_or_create_global_step()
        train_op = ds.train.AdamOptimizer(0.01).minimize(loss, global_step=step)
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Final

import numpy as np

from distserver.graph import ops
from distserver.graph.autodiff import Gradient, IndexedSlices, _tuple, gradients, unsorted_segment_sum
from distserver.graph.graph import (
    Graph,
    GraphKeys,
    Operation,
    Tensor,
    _graph_of,
    dtype_name,
    get_default_graph,
    name_scope,
)
from distserver.graph.variables import Variable
from distserver.protos import types_pb2
from distserver.protos.attr_value_pb2 import AttrValue

__all__ = [
    "AdagradOptimizer",
    "AdamOptimizer",
    "GradientDescentOptimizer",
    "MomentumOptimizer",
    "Optimizer",
    "RMSPropOptimizer",
    "create_global_step",
    "get_global_step",
    "get_or_create_global_step",
]

_VALID_DTYPES: Final = frozenset(
    {types_pb2.DT_HALF, types_pb2.DT_BFLOAT16, types_pb2.DT_FLOAT, types_pb2.DT_DOUBLE}
)


# --------------------------------------------------------------------------- global step


def get_global_step(graph: Graph | None = None) -> Variable | None:
    """The graph's global step variable (collection ``global_step``), or `None`.

    Raises:
        TypeError: When the collection holds more than one variable.
    """
    graph = graph or get_default_graph()
    found = graph.get_collection(GraphKeys.GLOBAL_STEP)
    if len(found) > 1:
        raise TypeError("Multiple tensors in global_step collection.")
    return found[0] if found else None


def create_global_step(graph: Graph | None = None) -> Variable:
    """Create the global step: an int64 scalar variable ``global_step`` starting at 0.

    It is not trainable and belongs to the ``variables`` and ``global_step``
    collections; device scopes (e.g. `replica_device_setter`) place it.

    Raises:
        ValueError: When the graph has a global step already.
    """
    graph = graph or get_default_graph()
    if get_global_step(graph) is not None:
        raise ValueError('"global_step" already exists.')
    with graph.as_default(), graph.name_scope(None):
        return Variable(
            lambda: ops.zeros([], np.int64, name="zeros"),
            name=GraphKeys.GLOBAL_STEP,
            trainable=False,
            collections=[GraphKeys.GLOBAL_VARIABLES, GraphKeys.GLOBAL_STEP],
        )


def get_or_create_global_step(graph: Graph | None = None) -> Variable:
    """The graph's global step, created (see `create_global_step`) the first time."""
    graph = graph or get_default_graph()
    step = get_global_step(graph)
    return create_global_step(graph) if step is None else step


# --------------------------------------------------------------------------- optimizer base


def _apply_op(
    op_type: str, inputs: Sequence[Tensor], attrs: dict[str, AttrValue], name: str | None = None
) -> Operation:
    return get_default_graph().create_op(op_type, list(inputs), [], name=name or op_type, attrs=attrs)


def _type(datatype: int) -> AttrValue:
    return ops._type_attr(datatype)


class Optimizer:
    """The base of the optimizers: `minimize` = `compute_gradients` + `apply_gradients`.

    Subclasses create their slots (`_create_slots`), turn hyper-parameters into
    tensors (`_prepare`) and build one update per variable (`_apply_dense`,
    `_apply_sparse`), as TensorFlow's `tf.compat.v1.train.Optimizer` does.

    Attributes:
        GATE_NONE: Apply each gradient as soon as it is computed.
        GATE_OP: Compute all gradients of an op's inputs before using any (default).
        GATE_GRAPH: Compute all gradients before applying any.
    """

    GATE_NONE: Final = 0
    GATE_OP: Final = 1
    GATE_GRAPH: Final = 2

    def __init__(self, use_locking: bool, name: str) -> None:
        if not name:
            raise ValueError("Must specify the optimizer name")
        self._use_locking = use_locking
        self._name = name
        self._slots: dict[str, dict[Variable, Variable]] = {}
        self._non_slots: dict[tuple[str, Graph], Variable] = {}

    def get_name(self) -> str:
        """The optimizer's name (the name scope of its update ops)."""
        return self._name

    # ----------------------------------------------------------------- the API

    def minimize(
        self,
        loss: Tensor,
        global_step: Variable | None = None,
        var_list: Iterable[Variable] | None = None,
        gate_gradients: int = GATE_OP,
        colocate_gradients_with_ops: bool = False,
        name: str | None = None,
        grad_loss: Tensor | None = None,
    ) -> Operation:
        """Add ops minimizing `loss` by updating `var_list`; returns the training op.

        Args:
            loss: A scalar tensor to minimize.
            global_step: A variable to increment by one after the updates.
            var_list: The variables to update (default: the graph's trainable variables).
            gate_gradients: `GATE_NONE`, `GATE_OP` or `GATE_GRAPH`.
            colocate_gradients_with_ops: Put each gradient op on its forward op's device.
            name: The name of the returned op (default: the optimizer's name).
            grad_loss: The gradient of `loss` (default: ones).

        Raises:
            ValueError: When no variable receives a gradient.
        """
        grads_and_vars = self.compute_gradients(
            loss,
            var_list=var_list,
            gate_gradients=gate_gradients,
            colocate_gradients_with_ops=colocate_gradients_with_ops,
            grad_loss=grad_loss,
        )
        with_grads = [v for g, v in grads_and_vars if g is not None]
        if not with_grads:
            raise ValueError(
                f"No gradients provided for any variable, check your graph for ops that do not support "
                f"gradients, between variables {[str(v) for _, v in grads_and_vars]} and loss {loss}."
            )
        return self.apply_gradients(grads_and_vars, global_step=global_step, name=name)

    def compute_gradients(
        self,
        loss: Tensor,
        var_list: Iterable[Variable] | None = None,
        gate_gradients: int = GATE_OP,
        colocate_gradients_with_ops: bool = False,
        grad_loss: Tensor | None = None,
    ) -> list[tuple[Gradient | None, Variable]]:
        """The gradients of `loss` for the variables in `var_list`, as (gradient, variable) pairs.

        A gradient is a `Tensor`, an `IndexedSlices` (sparse: the variable was
        gathered) or `None` (the loss does not depend on the variable).

        Raises:
            ValueError: For an empty `var_list`, or an invalid `gate_gradients`.
            TypeError: For a loss or variable that cannot be differentiated.
        """
        if gate_gradients not in (self.GATE_NONE, self.GATE_OP, self.GATE_GRAPH):
            raise ValueError(
                f"gate_gradients must be one of: Optimizer.GATE_NONE, Optimizer.GATE_OP, "
                f"Optimizer.GATE_GRAPH. Not {gate_gradients}"
            )
        if not isinstance(loss, Tensor):
            raise TypeError(f"loss must be a Tensor, got {loss!r}")
        self._assert_valid_dtypes([loss])
        graph = loss.graph
        variables = (
            list(var_list)
            if var_list is not None
            else list(graph.get_collection(GraphKeys.TRAINABLE_VARIABLES))
        )
        if not variables:
            raise ValueError("No variables to optimize.")
        for var in variables:
            if not isinstance(var, Variable):
                raise TypeError(f"var_list holds {var!r}, which is not a distserver Variable")
        grads = gradients(
            loss,
            variables,
            grad_ys=grad_loss,
            gate_gradients=gate_gradients == self.GATE_OP,
            colocate_gradients_with_ops=colocate_gradients_with_ops,
        )
        if gate_gradients == self.GATE_GRAPH:
            with graph.as_default(), name_scope(None, "gradients"):
                grads = _tuple(grads)
        pairs = list(zip(grads, variables, strict=True))
        self._assert_valid_dtypes([v for g, v in pairs if g is not None])
        return pairs

    def apply_gradients(
        self,
        grads_and_vars: Iterable[tuple[Any, Variable]],
        global_step: Variable | None = None,
        name: str | None = None,
    ) -> Operation:
        """Add the updates applying the gradients; returns the training op.

        Args:
            grads_and_vars: (gradient, variable) pairs, as `compute_gradients` returns
                (gradients may be processed in between, e.g. clipped).
            global_step: A variable to increment by one after the updates.
            name: The name of the returned op (default: the optimizer's name).

        Raises:
            TypeError: For a pair that is not (gradient, Variable).
            ValueError: When no pair has a gradient, or a variable appears twice.
        """
        pairs = list(grads_and_vars)
        if not pairs:
            raise ValueError("No variables provided.")
        converted: list[tuple[Gradient | None, Variable]] = []
        seen: set[Variable] = set()
        for grad, var in pairs:
            if not isinstance(var, Variable):
                raise TypeError(f"Expected a distserver Variable, got {var!r}")
            if var in seen:
                raise ValueError(f"Variable {var.name} appears twice in grads_and_vars")
            seen.add(var)
            if grad is not None and not isinstance(grad, Tensor | IndexedSlices):
                grad = ops.convert_to_tensor(grad, dtype=var.dtype)
            converted.append((grad, var))
        var_list = [v for g, v in converted if g is not None]
        if not var_list:
            raise ValueError(f"No gradients provided for any variable: {[str(v) for _, v in converted]}.")
        graph = _graph_of([v for _, v in converted])
        with graph.as_default():
            with graph.control_dependencies(None):
                self._create_slots(var_list)
            update_ops: list[Operation] = []
            with name_scope(name, self._name) as scope:
                self._prepare()
                for grad, var in converted:
                    if grad is None:
                        continue
                    with name_scope("update_" + var.op.name), graph.colocate_with(var.op):
                        if isinstance(grad, IndexedSlices):
                            update_ops.append(self._apply_sparse_duplicate_indices(grad, var))
                        else:
                            update_ops.append(self._apply_dense(grad, var))
                if global_step is None:
                    train_op = self._finish(update_ops, scope)
                else:
                    finished = self._finish(update_ops, "update")
                    with graph.control_dependencies([finished]), graph.colocate_with(global_step.op):
                        one = ops.constant(np.array(1, dtype=global_step.dtype))
                        train_op = global_step.assign_add(one, name=scope, read_value=False)
            train_ops = graph.get_collection_ref(GraphKeys.TRAIN_OP)
            if train_op not in train_ops:
                train_ops.append(train_op)
        return train_op

    def get_slot(self, var: Variable, name: str) -> Variable | None:
        """The slot `name` (e.g. ``"m"``) of `var`, or `None`."""
        return self._slots.get(name, {}).get(var)

    def get_slot_names(self) -> list[str]:
        """The names of the slots this optimizer creates, sorted."""
        return sorted(self._slots)

    def variables(self) -> list[Variable]:
        """The variables this optimizer created (slots and accumulators), by name."""
        made = [v for slots in self._slots.values() for v in slots.values()]
        made.extend(self._non_slots.values())
        return sorted(made, key=lambda v: v.name)

    # ----------------------------------------------------------------- helpers for subclasses

    def _assert_valid_dtypes(self, values: Iterable[Tensor | Variable]) -> None:
        for value in values:
            if value.datatype not in _VALID_DTYPES:
                raise ValueError(
                    f"Invalid type {dtype_name(value.datatype)} for {value.name}, expected: "
                    f"{sorted(dtype_name(d) for d in _VALID_DTYPES)}."
                )

    def _slot(
        self, var: Variable, slot_name: str, initial: Callable[[], Any], op_name: str | None = None
    ) -> Variable:
        """The slot variable `slot_name` of `var`: ``<var>/<op_name>``, on `var`'s device."""
        slots = self._slots.setdefault(slot_name, {})
        if var not in slots:
            graph = var.graph
            with graph.name_scope(None), graph.colocate_with(var.op):
                slots[var] = Variable(
                    initial,
                    name=f"{var.op.name}/{op_name or self._name}",
                    dtype=var.dtype,
                    trainable=False,
                    shape=var.shape,
                )
        return slots[var]

    def _zeros_slot(self, var: Variable, slot_name: str, op_name: str | None = None) -> Variable:
        return self._slot(var, slot_name, functools.partial(_filled_like, var, 0, "zeros"), op_name)

    def _non_slot(self, name: str, initial_value: Any, colocate_with: Variable) -> Variable:
        """A variable the optimizer keeps once per graph (Adam's ``beta1_power``)."""
        key = (name, colocate_with.graph)
        if key not in self._non_slots:
            graph = colocate_with.graph
            with graph.name_scope(None), graph.colocate_with(colocate_with.op):
                self._non_slots[key] = Variable(initial_value, name=name, trainable=False)
        return self._non_slots[key]

    @staticmethod
    def _hyper(value: Any, name: str) -> Tensor:
        value = value() if callable(value) else value
        return ops.convert_to_tensor(value, name=name)

    @staticmethod
    def _cast(value: Tensor | Variable, like: Tensor | Variable) -> Tensor:
        return ops.cast(value, like.dtype)

    def _apply_sparse_duplicate_indices(self, grad: IndexedSlices, var: Variable) -> Operation:
        values, indices = _deduplicate(grad)
        return self._apply_sparse(values, var, indices)

    # ----------------------------------------------------------------- subclass hooks

    def _create_slots(self, var_list: list[Variable]) -> None:
        """Create the slot variables of each variable (called outside control dependencies)."""

    def _prepare(self) -> None:
        """Turn the hyper-parameters into tensors (in the optimizer's name scope)."""

    def _apply_dense(self, grad: Tensor, var: Variable) -> Operation:
        raise NotImplementedError

    def _apply_sparse(self, values: Tensor, var: Variable, indices: Tensor) -> Operation:
        """Apply a gradient with unique `indices` (rows of `var`) and their `values`."""
        raise NotImplementedError

    def _finish(self, update_ops: list[Operation], name: str) -> Operation:
        return ops.group(*update_ops, name=name)

    def __repr__(self) -> str:
        return f"<distserver.train.{type(self).__name__} '{self._name}'>"


def _filled_like(var: Variable, value: float, name: str) -> Tensor:
    shape = var.shape
    if shape is not None and None not in shape:
        filled = ops.zeros if value == 0 else ops.ones
        return filled(list(shape), var.dtype, name=name)
    fill_like = ops.zeros_like if value == 0 else ops.ones_like
    return fill_like(var.initial_value, name=name)


def _deduplicate(grad: IndexedSlices) -> tuple[Tensor, Tensor]:
    """Sum the values of repeated indices: ``Unique`` + ``UnsortedSegmentSum``, as TF does."""
    graph = get_default_graph()
    with name_scope(None, "Unique") as scope:
        unique = graph.create_op(
            "Unique",
            [grad.indices],
            [grad.indices.datatype, types_pb2.DT_INT32],
            name=scope,
            attrs={"T": _type(grad.indices.datatype), "out_idx": _type(types_pb2.DT_INT32)},
            shapes=[(None,), grad.indices.shape],
        )
    unique_indices, positions = unique.outputs
    count = ops.shape(unique_indices)[0]
    summed = unsorted_segment_sum(grad.values, positions, count)
    return summed, unique_indices


def _sparse_attrs(var: Variable, indices: Tensor, use_locking: bool) -> dict[str, AttrValue]:
    return {
        "T": _type(var.datatype),
        "Tindices": _type(indices.datatype),
        "use_locking": AttrValue(b=use_locking),
    }


def _dense_attrs(var: Variable, use_locking: bool) -> dict[str, AttrValue]:
    return {"T": _type(var.datatype), "use_locking": AttrValue(b=use_locking)}


def _scatter_add(var: Variable, indices: Tensor, updates: Tensor) -> Operation:
    attrs = {"dtype": _type(var.datatype), "Tindices": _type(indices.datatype)}
    return _apply_op("ResourceScatterAdd", [var.handle, indices, updates], attrs)


# --------------------------------------------------------------------------- the optimizers


class GradientDescentOptimizer(Optimizer):
    """``var -= learning_rate * grad`` (``ResourceApplyGradientDescent``; sparse:
    ``ResourceScatterAdd`` of ``-learning_rate * values``).

    Args:
        learning_rate: A float, a scalar tensor, or a callable returning one.
        use_locking: Lock the variable during the update.
        name: The name scope of the update ops.
    """

    def __init__(self, learning_rate: Any, use_locking: bool = False, name: str = "GradientDescent") -> None:
        super().__init__(use_locking, name)
        self._learning_rate = learning_rate
        self._learning_rate_tensor: Tensor | None = None

    def _prepare(self) -> None:
        self._learning_rate_tensor = self._hyper(self._learning_rate, "learning_rate")

    def _lr(self, like: Tensor | Variable) -> Tensor:
        assert self._learning_rate_tensor is not None
        return self._cast(self._learning_rate_tensor, like)

    def _apply_dense(self, grad: Tensor, var: Variable) -> Operation:
        return _apply_op(
            "ResourceApplyGradientDescent",
            [var.handle, self._lr(grad), grad],
            _dense_attrs(var, self._use_locking),
        )

    def _apply_sparse_duplicate_indices(self, grad: IndexedSlices, var: Variable) -> Operation:
        # Repeated indices add up in ResourceScatterAdd: no deduplication needed.
        delta = ops.multiply(ops.negative(grad.values), self._lr(grad.values))
        return _scatter_add(var, grad.indices, delta)


class MomentumOptimizer(Optimizer):
    """``accum = momentum * accum + grad; var -= learning_rate * accum``
    (``ResourceApplyMomentum``; Nesterov's variant with ``use_nesterov``).

    The slot ``"momentum"`` (``<var>/Momentum``) holds ``accum``.
    """

    def __init__(
        self,
        learning_rate: Any,
        momentum: Any,
        use_locking: bool = False,
        name: str = "Momentum",
        use_nesterov: bool = False,
    ) -> None:
        super().__init__(use_locking, name)
        self._learning_rate = learning_rate
        self._momentum = momentum
        self._use_nesterov = use_nesterov
        self._tensors: dict[str, Tensor] = {}

    def _create_slots(self, var_list: list[Variable]) -> None:
        for var in var_list:
            self._zeros_slot(var, "momentum")

    def _prepare(self) -> None:
        self._tensors = {
            "learning_rate": self._hyper(self._learning_rate, "learning_rate"),
            "momentum": self._hyper(self._momentum, "momentum"),
        }

    def _attrs(self, attrs: dict[str, AttrValue]) -> dict[str, AttrValue]:
        return {**attrs, "use_nesterov": AttrValue(b=self._use_nesterov)}

    def _apply_dense(self, grad: Tensor, var: Variable) -> Operation:
        accum = self._slots["momentum"][var]
        lr = self._cast(self._tensors["learning_rate"], grad)
        momentum = self._cast(self._tensors["momentum"], grad)
        return _apply_op(
            "ResourceApplyMomentum",
            [var.handle, accum.handle, lr, grad, momentum],
            self._attrs(_dense_attrs(var, self._use_locking)),
        )

    def _apply_sparse(self, values: Tensor, var: Variable, indices: Tensor) -> Operation:
        accum = self._slots["momentum"][var]
        lr = self._cast(self._tensors["learning_rate"], values)
        momentum = self._cast(self._tensors["momentum"], values)
        return _apply_op(
            "ResourceSparseApplyMomentum",
            [var.handle, accum.handle, lr, values, indices, momentum],
            self._attrs(_sparse_attrs(var, indices, self._use_locking)),
        )


class AdamOptimizer(Optimizer):
    """Adam (Kingma & Ba), as TensorFlow's v1 `AdamOptimizer` (``ResourceApplyAdam``).

    Slots ``"m"`` and ``"v"`` (``<var>/Adam``, ``<var>/Adam_1``); the accumulators
    ``beta1_power`` and ``beta2_power`` live next to the first variable (by name) and
    are updated once per step, after all variables. Sparse gradients update ``m`` and
    ``v`` everywhere (decay) and the gathered rows (``ResourceScatterAdd``), as in TF.
    """

    def __init__(
        self,
        learning_rate: Any = 0.001,
        beta1: Any = 0.9,
        beta2: Any = 0.999,
        epsilon: Any = 1e-8,
        use_locking: bool = False,
        name: str = "Adam",
    ) -> None:
        super().__init__(use_locking, name)
        self._hypers = {"learning_rate": learning_rate, "beta1": beta1, "beta2": beta2, "epsilon": epsilon}
        self._tensors: dict[str, Tensor] = {}
        self._first_var: Variable | None = None

    def _beta_powers(self) -> tuple[Variable, Variable]:
        assert self._first_var is not None
        graph = self._first_var.graph
        return self._non_slots[("beta1_power", graph)], self._non_slots[("beta2_power", graph)]

    def _create_slots(self, var_list: list[Variable]) -> None:
        first = min(var_list, key=lambda v: v.name)
        beta1, beta2 = self._hypers["beta1"], self._hypers["beta2"]
        self._non_slot("beta1_power", beta1() if callable(beta1) else beta1, first)
        self._non_slot("beta2_power", beta2() if callable(beta2) else beta2, first)
        if self._first_var is None or self._first_var.graph is not first.graph:
            self._first_var = first
        for var in var_list:
            self._zeros_slot(var, "m")
            self._zeros_slot(var, "v")

    def _prepare(self) -> None:
        self._tensors = {name: self._hyper(value, name) for name, value in self._hypers.items()}

    def _apply_dense(self, grad: Tensor, var: Variable) -> Operation:
        m, v = self._slots["m"][var], self._slots["v"][var]
        beta1_power, beta2_power = self._beta_powers()
        scalars = [self._cast(t, grad) for t in (beta1_power, beta2_power)]
        scalars += [
            self._cast(self._tensors[n], grad) for n in ("learning_rate", "beta1", "beta2", "epsilon")
        ]
        attrs = {**_dense_attrs(var, self._use_locking), "use_nesterov": AttrValue(b=False)}
        return _apply_op("ResourceApplyAdam", [var.handle, m.handle, v.handle, *scalars, grad], attrs)

    def _apply_sparse(self, values: Tensor, var: Variable, indices: Tensor) -> Operation:
        graph = get_default_graph()
        beta1_power, beta2_power = (self._cast(t, var) for t in self._beta_powers())
        lr, beta1, beta2, epsilon = (
            self._cast(self._tensors[n], var) for n in ("learning_rate", "beta1", "beta2", "epsilon")
        )
        one = ops.constant(np.array(1, dtype=var.dtype))
        lr = ops.truediv(
            ops.multiply(lr, ops.sqrt(ops.subtract(one, beta2_power))), ops.subtract(one, beta1_power)
        )
        m = self._slots["m"][var]
        m_scaled = ops.multiply(values, ops.subtract(one, beta1))
        m_t = m.assign(ops.multiply(m, beta1))
        with graph.control_dependencies([m_t]):
            m_t = _read_after(m, _scatter_add(m, indices, m_scaled))
        v = self._slots["v"][var]
        v_scaled = ops.multiply(ops.multiply(values, values), ops.subtract(one, beta2))
        v_t = v.assign(ops.multiply(v, beta2))
        with graph.control_dependencies([v_t]):
            v_t = _read_after(v, _scatter_add(v, indices, v_scaled))
        v_sqrt = ops.sqrt(v_t)
        var_update = var.assign_sub(ops.truediv(ops.multiply(lr, m_t), ops.add(v_sqrt, epsilon)))
        return ops.group(var_update, m_t, v_t)

    def _finish(self, update_ops: list[Operation], name: str) -> Operation:
        graph = get_default_graph()
        beta1_power, beta2_power = self._beta_powers()
        with graph.control_dependencies(update_ops), graph.colocate_with(beta1_power.op):
            update_beta1 = beta1_power.assign(ops.multiply(beta1_power, self._tensors["beta1"]))
            update_beta2 = beta2_power.assign(ops.multiply(beta2_power, self._tensors["beta2"]))
        return ops.group(*update_ops, update_beta1, update_beta2, name=name)


def _read_after(var: Variable, op: Operation) -> Tensor:
    with var.graph.control_dependencies([op]):
        return var.value()


class AdagradOptimizer(Optimizer):
    """Adagrad: ``accum += grad**2; var -= learning_rate * grad / sqrt(accum)``
    (``ResourceApplyAdagrad``); the slot ``"accumulator"`` starts at
    `initial_accumulator_value`.

    Raises:
        ValueError: When `initial_accumulator_value` is not positive.
    """

    def __init__(
        self,
        learning_rate: Any,
        initial_accumulator_value: float = 0.1,
        use_locking: bool = False,
        name: str = "Adagrad",
    ) -> None:
        if initial_accumulator_value <= 0.0:
            raise ValueError(f"initial_accumulator_value must be positive: {initial_accumulator_value}")
        super().__init__(use_locking, name)
        self._learning_rate = learning_rate
        self._initial_accumulator_value = initial_accumulator_value
        self._learning_rate_tensor: Tensor | None = None

    def _create_slots(self, var_list: list[Variable]) -> None:
        for var in var_list:
            initial = self._initial_accumulator_value

            def accumulator(var: Variable = var, initial: float = initial) -> Tensor:
                if var.shape is not None and None not in var.shape:
                    return ops.constant(initial, dtype=var.dtype, shape=list(var.shape), name="Const")
                return ops.multiply(ops.ones_like(var.initial_value), ops.constant(initial, dtype=var.dtype))

            self._slot(var, "accumulator", accumulator)

    def _prepare(self) -> None:
        self._learning_rate_tensor = self._hyper(self._learning_rate, "learning_rate")

    def _apply_dense(self, grad: Tensor, var: Variable) -> Operation:
        assert self._learning_rate_tensor is not None
        accumulator = self._slots["accumulator"][var]
        attrs = {**_dense_attrs(var, self._use_locking), "update_slots": AttrValue(b=True)}
        lr = self._cast(self._learning_rate_tensor, grad)
        return _apply_op("ResourceApplyAdagrad", [var.handle, accumulator.handle, lr, grad], attrs)

    def _apply_sparse(self, values: Tensor, var: Variable, indices: Tensor) -> Operation:
        assert self._learning_rate_tensor is not None
        accumulator = self._slots["accumulator"][var]
        attrs = {**_sparse_attrs(var, indices, self._use_locking), "update_slots": AttrValue(b=True)}
        lr = self._cast(self._learning_rate_tensor, values)
        return _apply_op(
            "ResourceSparseApplyAdagrad", [var.handle, accumulator.handle, lr, values, indices], attrs
        )


class RMSPropOptimizer(Optimizer):
    """RMSProp, as TensorFlow's v1 `RMSPropOptimizer` (``ResourceApplyRMSProp``, or
    ``ResourceApplyCenteredRMSProp`` with ``centered``).

    Slots: ``"rms"`` (starts at ones), ``"mg"`` (centered only) and ``"momentum"``.
    """

    def __init__(
        self,
        learning_rate: Any,
        decay: Any = 0.9,
        momentum: Any = 0.0,
        epsilon: Any = 1e-10,
        use_locking: bool = False,
        centered: bool = False,
        name: str = "RMSProp",
    ) -> None:
        super().__init__(use_locking, name)
        self._hypers = {
            "learning_rate": learning_rate,
            "decay": decay,
            "momentum": momentum,
            "epsilon": epsilon,
        }
        self._centered = centered
        self._tensors: dict[str, Tensor] = {}

    def _create_slots(self, var_list: list[Variable]) -> None:
        for var in var_list:
            self._slot(var, "rms", functools.partial(_filled_like, var, 1, "ones"))
            if self._centered:
                self._zeros_slot(var, "mg")
            self._zeros_slot(var, "momentum")

    def _prepare(self) -> None:
        self._tensors = {name: self._hyper(value, name) for name, value in self._hypers.items()}

    def _scalars(self, like: Tensor) -> list[Tensor]:
        return [self._cast(self._tensors[n], like) for n in ("learning_rate", "decay", "momentum", "epsilon")]

    def _slot_handles(self, var: Variable) -> list[Tensor]:
        handles = [self._slots["mg"][var].handle] if self._centered else []
        return [*handles, self._slots["rms"][var].handle, self._slots["momentum"][var].handle]

    def _apply_dense(self, grad: Tensor, var: Variable) -> Operation:
        op_type = "ResourceApplyCenteredRMSProp" if self._centered else "ResourceApplyRMSProp"
        inputs = [var.handle, *self._slot_handles(var), *self._scalars(grad), grad]
        return _apply_op(op_type, inputs, _dense_attrs(var, self._use_locking))

    def _apply_sparse(self, values: Tensor, var: Variable, indices: Tensor) -> Operation:
        op_type = "ResourceSparseApplyCenteredRMSProp" if self._centered else "ResourceSparseApplyRMSProp"
        inputs = [var.handle, *self._slot_handles(var), *self._scalars(values), values, indices]
        return _apply_op(op_type, inputs, _sparse_attrs(var, indices, self._use_locking))
