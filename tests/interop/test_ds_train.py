"""`ds.gradients` + `ds.train` against TensorFlow.

One model (an embedding gathered by id, so its gradient is sparse, concatenated with
dense features, a dense softmax layer) is trained for a few steps:

* with `ds.train` on a distserver cluster (1 ps + 1 worker, one OS process each,
  variables and slots on the ps by `replica_device_setter`);
* with `tf.compat.v1.train` in TensorFlow alone, from the same initial values and
  batches (tests/interop/clients/ds_train.py);
* and the GraphDef distserver ran is run by a TensorFlow cluster of the same shape
  (1 ps + 1 worker `tf.distribute.Server`s).

All three must end with the same variables (float32 rounding). A second graph with
the gradients of many ops (StridedSliceGrad, InvertPermutation, DynamicStitch, ...)
runs on TensorFlow's server and must give distserver's values.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import distserver as ds
from distserver.graph import ops as graph_ops
from distserver.protos.attr_value_pb2 import AttrValue
from distserver.testing import LocalCluster

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300, func_only=True)]

OPTIMIZERS: dict[str, tuple[str, dict[str, Any]]] = {
    "gd": ("GradientDescentOptimizer", {"learning_rate": 0.5}),
    "momentum": ("MomentumOptimizer", {"learning_rate": 0.1, "momentum": 0.9}),
    "nesterov": ("MomentumOptimizer", {"learning_rate": 0.1, "momentum": 0.9, "use_nesterov": True}),
    "adam": ("AdamOptimizer", {"learning_rate": 0.05}),
    "adagrad": ("AdagradOptimizer", {"learning_rate": 0.3}),
    "rmsprop": ("RMSPropOptimizer", {"learning_rate": 0.05}),
    "rmsprop_centered": ("RMSPropOptimizer", {"learning_rate": 0.03, "momentum": 0.5, "centered": True}),
}
STEPS = 8
# Sums in another order (numpy vs Eigen) differ in the last float32 bits; over 8 steps
# of Adam/RMSProp (which divide by running norms) that stays below this.
TOLERANCE = 2e-5

_rng = np.random.default_rng(3)
INITIAL = {
    "emb": _rng.normal(size=(6, 4)).astype(np.float32),
    "w": (_rng.normal(size=(7, 3)) * 0.5).astype(np.float32),
    "b": np.zeros(3, np.float32),
}
BATCHES = [
    {
        "ids": _rng.integers(0, 6, size=5).astype(np.int32),  # repeated ids: duplicate indices
        "x": _rng.normal(size=(5, 3)).astype(np.float32),
        "labels": _rng.integers(0, 3, size=5).astype(np.int32),
    }
    for _ in range(STEPS)
]
OPS_FEED = _rng.uniform(-2, 2, size=(3, 4)).astype(np.float32)


def build_model(class_name: str, kwargs: dict[str, Any], device_fn: Any) -> tuple[ds.Graph, dict[str, Any]]:
    graph = ds.Graph()
    with graph.as_default(), ds.device(device_fn):
        ids = ds.placeholder(ds.int32, [None], name="ids")
        x = ds.placeholder(ds.float32, [None, 3], name="x")
        labels = ds.placeholder(ds.int32, [None], name="labels")
        variables = {name: ds.Variable(value, name=name) for name, value in INITIAL.items()}
        hidden = ds.tanh(ds.concat([ds.gather(variables["emb"], ids), x], 1))
        logits = ds.matmul(hidden, variables["w"]) + variables["b"]
        loss = ds.reduce_mean(ds.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits))
        step = ds.train.get_or_create_global_step()
        optimizer = getattr(ds.train, class_name)(**kwargs)
        train_op = optimizer.minimize(loss, global_step=step)
        names = sorted(variables)
        grads = ds.gradients(loss, [variables[n] for n in names], name="check_gradients")
        init = ds.global_variables_initializer()
    model = {
        "feeds": {"ids": ids, "x": x, "labels": labels},
        "variables": variables,
        "loss": loss,
        "train": train_op,
        "step": step,
        "init": init,
        "optimizer": optimizer,
        "grads": dict(zip(names, grads, strict=True)),
    }
    return graph, model


def build_ops_graph() -> tuple[ds.Graph, ds.Tensor, ds.Tensor]:
    """A loss over many ops of a [None, 4] input, and its gradient."""
    graph = ds.Graph()
    with graph.as_default():
        x = ds.placeholder(ds.float32, [None, 4], name="x")
        parts = [
            x[:, 1:3] * 2.0,
            ds.transpose(x) * ds.constant(np.arange(1.0, 4.0, dtype=np.float32)),
            ds.reduce_max(x, 1),
            ds.reduce_prod(ds.abs(x) + 0.5, 0),
            ds.reduce_sum(x * x, 1),
            ds.reduce_mean(ds.exp(x * 0.3), 0, keepdims=True),
            ds.where(x > 0.0, x, 0.5 * x),
            ds.maximum(x, 0.1) + ds.minimum(x, -0.2),
            ds.pow(ds.abs(x) + 1.0, 1.5),
            ds.concat([x, x * 2.0], 1),
            ds.stack([x, ds.square(x)], 1),
            ds.tile(x, [1, 2]),
            ds.gather(x, [0, 0, 3], axis=1),
            ds.softmax(x),
            ds.log_softmax(x),
            ds.sigmoid(x) + ds.tanh(x) + ds.relu(x),
            ds.sqrt(ds.abs(x) + 1.0) + ds.log(ds.abs(x) + 1.0),
            ds.bias_add(x, ds.constant(np.ones(4, np.float32))),
            ds.matmul(x, ds.constant(np.ones((4, 2), np.float32))),
            ds.reshape(ds.expand_dims(x, 0), [-1]),
            # Kernels without a graph-API constructor, built raw.
            _raw("Relu6", [x * 4.0]),
            _raw("Elu", [x]),
            _raw("Softplus", [x]),
            ds.reshape(_raw("L2Loss", [x]), [1]),
            _raw("SquaredDifference", [x, ds.constant(np.full(4, 0.3, np.float32))]),
            _raw("Slice", [x, _i32([1, 1]), _i32([-1, 2])], Index=ds.int32),
            _raw("Pad", [x, _i32([[1, 0], [0, 2]])], Tpaddings=ds.int32),
            _raw("ReverseV2", [x, _i32([1])], Tidx=ds.int32) * x,
            _raw("Cumsum", [x, _i32(1)], Tidx=ds.int32),
            _raw("Split", [_i32(1), x], outputs=2, T=ds.float32, num_split=2)[1] * 3.0,
            _raw("BroadcastTo", [ds.reduce_sum(x, 0, keepdims=True), _i32([2, 3, 4])], Tidx=ds.int32),
            _raw(
                "UnsortedSegmentSum",
                [ds.transpose(x), _i32([1, -1, 0, 1]), _i32(2)],
                Tindices=ds.int32,
                Tnumsegments=ds.int32,
            ),
        ]
        loss = ds.add_n([ds.reduce_sum(p * p) for p in parts])
        (grad,) = ds.gradients(loss, x)
    return graph, x, grad


def _i32(values: Any) -> np.ndarray:
    return np.array(values, dtype=np.int32)


def _raw(op_type: str, inputs: list[Any], outputs: int = 1, **attrs: Any) -> Any:
    # An op of a kernel we ship that the graph API has no constructor for.
    graph = ds.get_default_graph()
    tensors = [graph_ops.convert_to_tensor(v) for v in inputs]
    values = {"T": graph_ops._type_attr(tensors[0].datatype)}
    for key, value in attrs.items():
        if isinstance(value, int):
            values[key] = AttrValue(i=value)
        else:
            values[key] = graph_ops._type_attr(graph_ops.as_datatype(value))
    out_type = attrs.get("T", tensors[0].dtype)
    op = graph.create_op(op_type, tensors, [out_type] * outputs, attrs=values)
    return op.outputs[0] if outputs == 1 else op.outputs


def _dense(value: Any, shape: tuple[int, ...]) -> np.ndarray:
    if isinstance(value, tuple):
        values, indices, _ = value
        result = np.zeros(shape, np.float32)
        np.add.at(result, indices, values)
        return result
    return np.asarray(value)


def _train_on_distserver(target: str, model: dict[str, Any], graph: ds.Graph) -> dict[str, Any]:
    losses = []
    with ds.Session(target, graph=graph) as session:
        session.run(model["init"])
        feeds = {model["feeds"][k]: v for k, v in BATCHES[0].items()}
        fetches = {
            name: (g.values, g.indices, g.dense_shape) if isinstance(g, ds.IndexedSlices) else g
            for name, g in model["grads"].items()
        }
        gradients = {
            name: _dense(value, INITIAL[name].shape) for name, value in session.run(fetches, feeds).items()
        }
        all_batches = [{model["feeds"][k]: v for k, v in batch.items()} for batch in BATCHES]
        mean_loss_before = np.mean([session.run(model["loss"], feeds) for feeds in all_batches])
        for feeds in all_batches:
            losses.append(float(session.run(model["loss"], feeds)))
            session.run(model["train"], feeds)
        mean_loss_after = np.mean([session.run(model["loss"], feeds) for feeds in all_batches])
        final = {name: session.run(v) for name, v in model["variables"].items()}
        slot_devices = {v.name: v.device for v in model["optimizer"].variables()}
        return {
            "losses": losses,
            "mean_loss": (mean_loss_before, mean_loss_after),
            "final": final,
            "global_step": int(session.run(model["step"])),
            "gradients": gradients,
            "slot_devices": slot_devices,
        }


@pytest.fixture(scope="module")
def results(tf_client, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ds_train")
    ours: dict[str, Any] = {}
    graphs: dict[str, Any] = {}
    with LocalCluster({"ps": 1, "worker": 1}) as cluster:
        for key, (class_name, kwargs) in OPTIMIZERS.items():
            graph, model = build_model(class_name, kwargs, ds.replica_device_setter(cluster=cluster.cluster))
            ours[key] = _train_on_distserver(cluster.target("worker"), model, graph)
            # The same GraphDef then runs on a TensorFlow cluster of the same shape.
            path = tmp / f"{key}.pb"
            path.write_bytes(graph.as_graph_def().SerializeToString())
            names = {
                "init": model["init"].name,
                "train": model["train"].name,
                "loss": model["loss"].name,
                "global_step": model["step"]._as_graph_element().name,
                "feeds": {k: t.name for k, t in model["feeds"].items()},
                "variables": {k: v._as_graph_element().name for k, v in model["variables"].items()},
            }
            graphs[key] = {"path": str(path), "names": names}
        ops_graph, x, grad = build_ops_graph()
        with ds.Session(cluster.target("worker"), graph=ops_graph) as session:
            ours["ops_graph"] = session.run(grad, {x: OPS_FEED})
    ops_path = tmp / "ops.pb"
    ops_path.write_bytes(ops_graph.as_graph_def().SerializeToString())
    arguments = {
        "initial": {k: v.tolist() for k, v in INITIAL.items()},
        "batches": [{k: v.tolist() for k, v in b.items()} for b in BATCHES],
        "optimizers": {k: [c, kw] for k, (c, kw) in OPTIMIZERS.items()},
        "graphs": graphs,
        "ops_graph": {"path": str(ops_path), "feed": OPS_FEED.tolist(), "x": x.name, "fetch": grad.name},
    }
    return ours, tf_client.run("ds_train.py", arguments)


def _assert_same_training(ours: dict[str, Any], theirs: dict[str, Any]) -> None:
    np.testing.assert_allclose(ours["losses"], theirs["losses"], rtol=TOLERANCE, atol=TOLERANCE)
    for name, value in ours["final"].items():
        np.testing.assert_allclose(value, theirs["final"][name], rtol=TOLERANCE, atol=TOLERANCE, err_msg=name)
    assert ours["global_step"] == theirs["global_step"] == STEPS


@pytest.mark.parametrize("key", list(OPTIMIZERS))
def test_ds_train_matches_tensorflow(results, check, key):
    ours, tf_results = results
    mine = ours[key]
    before, after = mine["mean_loss"]
    assert after < before, mine["mean_loss"]
    # The embedding's gradient is sparse: only the gathered rows moved.
    untouched = sorted(set(range(6)) - {int(i) for b in BATCHES for i in b["ids"]})
    np.testing.assert_array_equal(mine["final"]["emb"][untouched], INITIAL["emb"][untouched])
    _assert_same_training(mine, check(tf_results, f"tf/{key}"))


@pytest.mark.parametrize("key", list(OPTIMIZERS))
def test_our_training_graph_runs_on_a_tensorflow_cluster(results, check, key):
    ours, tf_results = results
    _assert_same_training(ours[key], check(tf_results, f"ours_in_tf/{key}"))


def test_gradients_match_tensorflows(results, check):
    ours, tf_results = results
    theirs = check(tf_results, "tf_gradients")
    for name, value in ours["gd"]["gradients"].items():
        np.testing.assert_allclose(value, theirs[name], rtol=1e-5, atol=1e-6, err_msg=name)


def test_gradients_of_many_ops_run_on_a_tensorflow_server(results, check):
    ours, tf_results = results
    np.testing.assert_allclose(ours["ops_graph"], check(tf_results, "ops_graph"), rtol=1e-5, atol=1e-4)


def test_slots_live_with_their_variables_on_the_ps(results):
    ours, _ = results
    devices = ours["adam"]["slot_devices"]
    assert set(devices) == {
        "beta1_power:0",
        "beta2_power:0",
        "b/Adam:0",
        "b/Adam_1:0",
        "emb/Adam:0",
        "emb/Adam_1:0",
        "w/Adam:0",
        "w/Adam_1:0",
    }
    assert set(devices.values()) == {"/job:ps/task:0"}
