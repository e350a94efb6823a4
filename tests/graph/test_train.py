"""`ds.train`: optimizer updates against numpy formulas, graph shapes, the global step.

(tests/interop/test_ds_train.py compares whole training runs with TensorFlow's.)
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

import distserver as ds

W0 = np.array([[0.5, -1.0], [2.0, 0.25], [-0.75, 1.5], [1.0, 1.0]])
COEFFS = np.array([[1.0, -2.0], [0.5, 3.0], [-1.5, 0.25], [2.0, 1.0]])
IDS = np.array([2, 0, 2])  # a repeated row: its gradients add up
ROW_COEFFS = np.array([[1.0, 2.0], [-0.5, 0.5], [3.0, -1.0]])


@pytest.fixture(scope="module")
def server() -> Iterator[ds.Server]:
    with ds.Server.create_local_server() as server:
        yield server


def _dense_gradient(sparse: bool) -> np.ndarray:
    if not sparse:
        return COEFFS
    gradient = np.zeros_like(W0)
    np.add.at(gradient, IDS, ROW_COEFFS)
    return gradient


def _f32(*values: float) -> list[float]:
    # Python hyper-parameters become float32 constants (then cast), as in TensorFlow.
    return [float(np.float32(v)) for v in values]


# Reference updates: (state, w, gradient, rows) -> new w; `rows` are the rows a sparse
# update touches (all rows for dense gradients), state holds the slots.
def _gd(lr: float) -> Callable[..., np.ndarray]:
    (lr,) = _f32(lr)

    def update(state: dict[str, Any], w: np.ndarray, g: np.ndarray, rows: np.ndarray) -> np.ndarray:
        return w - lr * g

    return update


def _momentum(lr: float, momentum: float, nesterov: bool = False) -> Callable[..., np.ndarray]:
    lr, momentum = _f32(lr, momentum)

    def update(state: dict[str, Any], w: np.ndarray, g: np.ndarray, rows: np.ndarray) -> np.ndarray:
        accum = state.setdefault("accum", np.zeros_like(w))
        w = w.copy()
        accum[rows] = momentum * accum[rows] + g[rows]
        step = g[rows] + momentum * accum[rows] if nesterov else accum[rows]
        w[rows] -= lr * step
        return w

    return update


def _adam(lr: float, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8) -> Callable[..., np.ndarray]:
    lr, beta1, beta2, eps = _f32(lr, b1, b2, eps)

    def update(state: dict[str, Any], w: np.ndarray, g: np.ndarray, rows: np.ndarray) -> np.ndarray:
        # Sparse or not, m and v decay everywhere (TF's sparse Adam does the same).
        m = state.setdefault("m", np.zeros_like(w))
        v = state.setdefault("v", np.zeros_like(w))
        # beta1_power and beta2_power are float32 variables, multiplied in float32.
        power1, power2 = state.get("powers", (np.float32(b1), np.float32(b2)))
        m[:] = beta1 * m + (1 - beta1) * g
        v[:] = beta2 * v + (1 - beta2) * g * g
        lr_t = lr * np.sqrt(1 - float(power2)) / (1 - float(power1))
        state["powers"] = (power1 * np.float32(b1), power2 * np.float32(b2))
        return w - lr_t * m / (np.sqrt(v) + eps)

    return update


def _adagrad(lr: float, initial: float = 0.1) -> Callable[..., np.ndarray]:
    (lr,) = _f32(lr)

    def update(state: dict[str, Any], w: np.ndarray, g: np.ndarray, rows: np.ndarray) -> np.ndarray:
        acc = state.setdefault("acc", np.full_like(w, initial))
        w = w.copy()
        acc[rows] += g[rows] ** 2
        w[rows] -= lr * g[rows] / np.sqrt(acc[rows])
        return w

    return update


def _rmsprop(
    lr: float, decay: float = 0.9, momentum: float = 0.0, eps: float = 1e-10, centered: bool = False
) -> Callable[..., np.ndarray]:
    lr, decay, momentum, eps = _f32(lr, decay, momentum, eps)

    def update(state: dict[str, Any], w: np.ndarray, g: np.ndarray, rows: np.ndarray) -> np.ndarray:
        ms = state.setdefault("ms", np.ones_like(w))
        mg = state.setdefault("mg", np.zeros_like(w))
        mom = state.setdefault("mom", np.zeros_like(w))
        w = w.copy()
        ms[rows] = decay * ms[rows] + (1 - decay) * g[rows] ** 2
        denominator = ms[rows] + eps
        if centered:
            mg[rows] = decay * mg[rows] + (1 - decay) * g[rows]
            denominator = denominator - mg[rows] ** 2
        mom[rows] = momentum * mom[rows] + lr * g[rows] / np.sqrt(denominator)
        w[rows] -= mom[rows]
        return w

    return update


OPTIMIZERS: dict[str, tuple[Callable[[], Any], Callable[..., np.ndarray]]] = {
    "gd": (lambda: ds.train.GradientDescentOptimizer(0.1), _gd(0.1)),
    "momentum": (lambda: ds.train.MomentumOptimizer(0.1, 0.9), _momentum(0.1, 0.9)),
    "nesterov": (lambda: ds.train.MomentumOptimizer(0.1, 0.9, use_nesterov=True), _momentum(0.1, 0.9, True)),
    "adam": (lambda: ds.train.AdamOptimizer(0.1), _adam(0.1)),
    "adagrad": (lambda: ds.train.AdagradOptimizer(0.5, initial_accumulator_value=0.2), _adagrad(0.5, 0.2)),
    "rmsprop": (lambda: ds.train.RMSPropOptimizer(0.05, momentum=0.5), _rmsprop(0.05, momentum=0.5)),
    "rmsprop centered": (
        lambda: ds.train.RMSPropOptimizer(0.05, decay=0.8, centered=True),
        _rmsprop(0.05, decay=0.8, centered=True),
    ),
}


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_updates_match_the_formulas(server, name, sparse):
    make_optimizer, reference = OPTIMIZERS[name]
    graph = ds.Graph()
    with graph.as_default():
        w = ds.Variable(W0, name="w")
        loss = ds.reduce_sum(ds.gather(w, IDS) * ROW_COEFFS) if sparse else ds.reduce_sum(w * COEFFS)
        step = ds.train.get_or_create_global_step()
        train_op = make_optimizer().minimize(loss, global_step=step)
        init = ds.global_variables_initializer()
    gradient = _dense_gradient(sparse)
    rows = np.unique(IDS) if sparse else np.arange(len(W0))
    expected, state = W0, {}
    with ds.Session(server.target, graph=graph) as session:
        session.run(init)
        for _ in range(3):
            session.run(train_op)
            expected = reference(state, expected, gradient, rows)
            np.testing.assert_allclose(session.run(w), expected, rtol=1e-12, atol=1e-12)
        assert session.run(step) == 3


def _ops(graph: ds.Graph) -> dict[str, ds.Operation]:
    return {op.name: op for op in graph.get_operations()}


def test_adam_graph_on_parameter_servers():
    graph = ds.Graph()
    with graph.as_default(), ds.device(ds.replica_device_setter(ps_tasks=2)):
        x = ds.placeholder(ds.float32, [None, 3], name="x")
        w = ds.Variable(np.ones((3, 2), np.float32), name="w")  # ps task 0
        b = ds.Variable(np.zeros(2, np.float32), name="b")  # ps task 1
        loss = ds.reduce_sum(ds.matmul(x, w) + b)
        step = ds.train.get_or_create_global_step()  # ps task 0
        optimizer = ds.train.AdamOptimizer(0.1)
        train_op = optimizer.minimize(loss, global_step=step)
    ops = _ops(graph)
    assert (w.device, b.device) == ("/job:ps/task:0", "/job:ps/task:1")
    # Slots sit with their variable; the beta accumulators with the first variable by name (b).
    assert optimizer.get_slot(w, "m").name == "w/Adam:0"
    assert optimizer.get_slot(w, "v").name == "w/Adam_1:0"
    for slot in ("m", "v"):
        assert optimizer.get_slot(w, slot).device == w.device
        assert optimizer.get_slot(b, slot).device == b.device
        assert ops[optimizer.get_slot(w, slot).op.name].get_attr("_class") == [b"loc:@w"]
    assert ops["beta1_power"].device == b.device
    assert ops["beta1_power"].get_attr("_class") == [b"loc:@b"]
    apply_w = ops["Adam/update_w/ResourceApplyAdam"]
    assert apply_w.type == "ResourceApplyAdam"
    assert apply_w.device == w.device
    assert apply_w.get_attr("_class") == [b"loc:@w"]
    assert [t.op.name for t in apply_w.inputs[:3]] == ["w", "w/Adam", "w/Adam_1"]
    assert train_op.name == "Adam"
    assert train_op.type == "AssignAddVariableOp"
    assert train_op.device == step.device
    (one,) = [t.op for t in train_op.inputs[1:]]
    assert [op.name for op in one.control_inputs] == ["Adam/update"]
    assert graph.get_collection("train_op") == [train_op]
    # Gradients are gated per op, as TF's optimizers do by default.
    assert "gradients/MatMul_grad/tuple/control_dependency_1" in ops
    assert sorted(optimizer.get_slot_names()) == ["m", "v"]
    assert [v.name for v in optimizer.variables()] == [
        "b/Adam:0",
        "b/Adam_1:0",
        "beta1_power:0",
        "beta2_power:0",
        "w/Adam:0",
        "w/Adam_1:0",
    ]


@pytest.mark.parametrize(
    ("make_optimizer", "dense_type", "sparse_types"),
    [
        (
            lambda: ds.train.GradientDescentOptimizer(0.1),
            "ResourceApplyGradientDescent",
            {"ResourceScatterAdd"},
        ),
        (
            lambda: ds.train.MomentumOptimizer(0.1, 0.9),
            "ResourceApplyMomentum",
            {"ResourceSparseApplyMomentum"},
        ),
        (lambda: ds.train.AdagradOptimizer(0.1), "ResourceApplyAdagrad", {"ResourceSparseApplyAdagrad"}),
        (lambda: ds.train.RMSPropOptimizer(0.1), "ResourceApplyRMSProp", {"ResourceSparseApplyRMSProp"}),
        (
            lambda: ds.train.RMSPropOptimizer(0.1, centered=True),
            "ResourceApplyCenteredRMSProp",
            {"ResourceSparseApplyCenteredRMSProp"},
        ),
        (
            lambda: ds.train.AdamOptimizer(0.1),
            "ResourceApplyAdam",
            {"ResourceScatterAdd", "AssignSubVariableOp"},
        ),
    ],
)
def test_kernels_of_dense_and_sparse_updates(make_optimizer, dense_type, sparse_types):
    graph = ds.Graph()
    with graph.as_default():
        dense = ds.Variable(np.ones((3, 2)), name="dense")
        table = ds.Variable(np.ones((5, 2)), name="table")
        loss = ds.reduce_sum(dense * 2.0) + ds.reduce_sum(ds.gather(table, [1, 1, 4]))
        make_optimizer().minimize(loss)
    update_types = {
        op.type
        for op in graph.get_operations()
        if "/update_table/" in op.name and op.type.startswith(("Resource", "Assign"))
    }
    assert sparse_types <= update_types
    assert dense_type not in update_types
    dense_updates = [op for op in graph.get_operations() if op.type == dense_type]
    assert [op.name.split("/")[1] for op in dense_updates] == ["update_dense"]


def test_compute_and_apply_processed_gradients(server):
    graph = ds.Graph()
    with graph.as_default():
        a = ds.Variable([1.0, 2.0], name="a")
        b = ds.Variable([3.0], name="b")
        unused = ds.Variable([0.0], name="unused")
        loss = ds.reduce_sum(a * a) + ds.reduce_sum(b)
        optimizer = ds.train.GradientDescentOptimizer(0.5)
        pairs = optimizer.compute_gradients(loss, gate_gradients=ds.train.Optimizer.GATE_GRAPH)
        assert [v for _, v in pairs] == [a, b, unused]
        assert pairs[2][0] is None
        clipped = [(None if g is None else ds.minimum(g, 1.0), v) for g, v in pairs]
        train_op = optimizer.apply_gradients(clipped, name="clipped_step")
        only_b = optimizer.minimize(loss, var_list=[b])
        init = ds.global_variables_initializer()
    assert train_op.name == "clipped_step"
    with ds.Session(server.target, graph=graph) as session:
        session.run(init)
        session.run(train_op)
        np.testing.assert_allclose(session.run(a), [1.0 - 0.5 * 1.0, 2.0 - 0.5 * 1.0])
        np.testing.assert_allclose(session.run(b), [3.0 - 0.5])
        session.run(only_b)
        np.testing.assert_allclose(session.run(a), [0.5, 1.5])
        np.testing.assert_allclose(session.run(b), [2.0])


def test_global_step():
    with ds.Graph().as_default() as graph:
        assert ds.train.get_global_step() is None
        with ds.name_scope("scope"), ds.control_dependencies([ds.no_op()]):
            step = ds.train.get_or_create_global_step()
        assert ds.train.get_or_create_global_step() is step
        assert ds.train.get_global_step(graph) is step
        assert (step.name, step.dtype, step.shape, step.trainable) == ("global_step:0", np.int64, (), False)
        assert ds.global_variables() == [step]
        assert ds.trainable_variables() == []
        assert graph.get_operation_by_name("global_step/Initializer/zeros").type == "Const"
        with pytest.raises(ValueError, match='"global_step" already exists'):
            ds.train.create_global_step()


def test_errors():
    with ds.Graph().as_default():
        x = ds.placeholder(ds.float32, [2], name="x")
        with pytest.raises(ValueError, match="No variables to optimize"):
            ds.train.GradientDescentOptimizer(0.1).minimize(ds.reduce_sum(x))
        v = ds.Variable([1.0, 2.0], name="v")
        other = ds.Variable([1.0], name="other")
        with pytest.raises(ValueError, match="No gradients provided for any variable"):
            ds.train.GradientDescentOptimizer(0.1).minimize(ds.reduce_sum(other), var_list=[v])
        with pytest.raises(ValueError, match="Invalid type int32"):
            ds.train.GradientDescentOptimizer(0.1).minimize(ds.reduce_sum(ds.cast(v, ds.int32)))
        with pytest.raises(ValueError, match="gate_gradients must be one of"):
            ds.train.GradientDescentOptimizer(0.1).minimize(ds.reduce_sum(v), gate_gradients=7)
        with pytest.raises(ValueError, match="No variables provided"):
            ds.train.GradientDescentOptimizer(0.1).apply_gradients([])
        with pytest.raises(TypeError, match="Expected a distserver Variable"):
            ds.train.GradientDescentOptimizer(0.1).apply_gradients([(x, x)])
        with pytest.raises(ValueError, match="appears twice"):
            ds.train.GradientDescentOptimizer(0.1).apply_gradients([(x, v), (x, v)])
        with pytest.raises(ValueError, match="initial_accumulator_value must be positive"):
            ds.train.AdagradOptimizer(0.1, initial_accumulator_value=0.0)
