"""TensorFlow imports a GraphDef built with distserver's graph API and runs it (TF 2.21).

Our graph API emits TF's node shapes (ops, attrs, control inputs); this checks that
real TensorFlow accepts a whole training-style graph and computes what numpy does.
"""

from __future__ import annotations

import json
import subprocess

import numpy as np
import pytest

import distserver.graph as tf


@pytest.fixture(autouse=True)
def graph():
    with tf.Graph().as_default() as g:
        yield g


_RUN_IN_TENSORFLOW = """
import json, os, sys
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
import numpy as np
import tensorflow as tf
graph_def = tf.compat.v1.GraphDef.FromString(open(sys.argv[1], "rb").read())
request = json.load(open(sys.argv[2]))
with tf.Graph().as_default() as graph:
    tf.import_graph_def(graph_def, name="")
with tf.compat.v1.Session(graph=graph) as session:
    session.run(request["init"])
    feeds = {name: np.array(value, dtype=dtype) for name, (value, dtype) in request["feeds"].items()}
    results = [session.run(request["fetches"], feeds) for _ in range(2)]
print(json.dumps([{k: np.asarray(v).tolist() for k, v in r.items()} for r in results]))
"""


@pytest.mark.slow
def test_tensorflow_imports_and_runs_our_graph(graph, tf_client, tmp_path):
    x = tf.placeholder(tf.float32, shape=[None, 4], name="x")
    k = tf.placeholder(tf.int32, shape=[3], name="k")
    with tf.device(
        tf.replica_device_setter(ps_tasks=1, ps_device="/job:localhost", worker_device="/job:localhost")
    ):
        w = tf.Variable(np.arange(8, dtype=np.float32).reshape(4, 2), name="w")
        steps = tf.Variable(0, name="steps")
    fetches = {
        "y": tf.matmul(x, w) + 1.0,
        "mean": tf.reduce_mean(x, 1, keepdims=True),
        "slice": x[1:, ::-1][..., None, 0],
        "div": k / 2,
        "reshape": tf.reshape(x, [tf.shape(x)[0], -1, 2]),
        "select": tf.where(x > 2, x, -x),
        "one_hot": tf.one_hot(k, 4),
        "concat": tf.concat([x, 2 * x], -1),
        "softmax_sum": tf.reduce_sum(tf.softmax(x), 1),
        "steps": steps.assign_add(1),
    }
    x_value = np.arange(12, dtype=np.float32).reshape(3, 4)
    k_value = np.array([1, 2, 3], np.int32)
    init = tf.global_variables_initializer()
    (tmp_path / "graph.pb").write_bytes(graph.as_graph_def().SerializeToString())
    request = {
        "init": init.name,
        "feeds": {"x:0": [x_value.tolist(), "float32"], "k:0": [k_value.tolist(), "int32"]},
        "fetches": {key: t.name for key, t in fetches.items()},
    }
    (tmp_path / "request.json").write_text(json.dumps(request))
    script = tmp_path / "run.py"
    script.write_text(_RUN_IN_TENSORFLOW)
    done = subprocess.run(
        [tf_client.python, str(script), str(tmp_path / "graph.pb"), str(tmp_path / "request.json")],
        capture_output=True,
        text=True,
        timeout=100,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    first, second = json.loads(done.stdout.splitlines()[-1])
    np.testing.assert_allclose(first["y"], x_value @ np.arange(8).reshape(4, 2) + 1)
    np.testing.assert_allclose(first["mean"], x_value.mean(1, keepdims=True))
    np.testing.assert_allclose(first["slice"], x_value[1:, ::-1][..., None, 0])
    np.testing.assert_allclose(first["div"], k_value / 2)
    np.testing.assert_allclose(first["reshape"], x_value.reshape(3, -1, 2))
    np.testing.assert_allclose(first["select"], np.where(x_value > 2, x_value, -x_value))
    np.testing.assert_allclose(first["one_hot"], np.eye(4)[k_value])
    np.testing.assert_allclose(first["concat"], np.concatenate([x_value, 2 * x_value], -1))
    np.testing.assert_allclose(first["softmax_sum"], np.ones(3), rtol=1e-6)
    assert (first["steps"], second["steps"]) == (1, 2)
