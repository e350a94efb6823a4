"""tf.compat.v1.train.Saver against a distserver cluster: V2 checkpoints both ways.

Argument (JSON): {"cluster": {job: [addresses]}} with 2 ps and 1 worker task started
with `--checkpoint-root <root>`, "root" (that directory) and "outside" (a directory
outside it).
"""

from __future__ import annotations

import os

import numpy as np
import tensorflow as tf
from _common import Checks, args, target_of

tf1 = tf.compat.v1
tf1.disable_v2_behavior()

arguments = args()
worker = target_of(arguments["cluster"]["worker"][0])
root = arguments["root"]
outside = arguments["outside"]
checks = Checks()

# name -> (dtype, value written by distserver's side, value written by TensorFlow's side)
VALUES = {
    "f32": (tf.float32, np.arange(6, dtype=np.float32).reshape(2, 3), np.full((2, 3), -1.5, np.float32)),
    "f64": (tf.float64, np.array([1e-300, 2.5]), np.array([7.0, 8.0])),
    "f16": (tf.float16, np.array([0.5, -2.0], np.float16), np.array([3.0, 4.0], np.float16)),
    "bf16": (tf.bfloat16, np.array([1.5, 256.0]), np.array([-8.0, 0.25])),
    "i32": (tf.int32, np.array([1, -2, 3], np.int32), np.array([9, 9, 9], np.int32)),
    "i64": (tf.int64, np.array([2**40], np.int64), np.array([-(2**50)], np.int64)),
    "flag": (tf.bool, np.array([True, False]), np.array([False, True])),
    "text": (
        tf.string,
        np.array([b"alpha", b"", b"\xff\x00"], dtype=object),
        np.array([b"tf", b"b", b"c"], dtype=object),
    ),
}
NAMES = sorted(VALUES)


def build(distributed: bool, sharded: bool) -> dict:
    """Variables over two ps tasks (resource on ps 0, reference on ps 1), a Saver,
    and assign ops for both sets of values. Without `distributed`: no device names."""
    nodes: dict = {"vars": {}, "set_ours": [], "set_tfs": []}
    for i, name in enumerate(NAMES):
        dtype, ours, theirs = VALUES[name]
        device = f"/job:ps/task:{i % 2}" if distributed else None
        with tf1.device(device):
            var = tf1.get_variable(
                name,
                initializer=tf.zeros_like(tf.constant(ours, dtype))
                if dtype != tf.string
                else tf.constant(ours),
                use_resource=i % 2 == 0,
            )
        nodes["vars"][name] = var
        nodes["set_ours"].append(var.assign(tf.constant(ours, dtype)))
        nodes["set_tfs"].append(var.assign(tf.constant(theirs, dtype)))
    nodes["init"] = tf1.global_variables_initializer()
    nodes["saver"] = tf1.train.Saver(sharded=sharded, max_to_keep=2)
    return nodes


def read(sess, nodes) -> dict:
    values = sess.run(nodes["vars"])
    # bfloat16 and half as floats, for JSON; their values are exact in float64.
    return {
        name: values[name].astype(np.float64) if name in ("bf16", "f16") else values[name] for name in NAMES
    }


def exercise(sharded: bool) -> None:
    label = "sharded" if sharded else "plain"
    directory = os.path.join(root, label)
    os.makedirs(directory, exist_ok=True)

    # (a) distserver writes, TensorFlow alone restores.
    graph = tf.Graph()
    with graph.as_default():
        nodes = build(distributed=True, sharded=sharded)
        with tf1.Session(worker) as sess:
            sess.run(nodes["init"])
            sess.run(nodes["set_ours"])
            paths = []
            for step in (1, 2, 3):
                paths.append(nodes["saver"].save(sess, os.path.join(directory, "model"), global_step=step))
            checks.run(f"{label}_saved_paths", lambda: paths)
            checks.run(f"{label}_files", lambda: sorted(os.listdir(directory)))
    checks.run(f"{label}_latest", lambda: tf1.train.latest_checkpoint(directory))
    state = tf1.train.get_checkpoint_state(directory)
    checks.run(
        f"{label}_state",
        lambda: [state.model_checkpoint_path, list(state.all_model_checkpoint_paths)],
    )
    graph = tf.Graph()
    with graph.as_default():
        nodes = build(distributed=False, sharded=sharded)
        with tf1.Session() as sess:
            nodes["saver"].restore(sess, tf1.train.latest_checkpoint(directory))
            checks.run(f"{label}_restored_by_tf", lambda: read(sess, nodes))
            # (b) TensorFlow alone writes, distserver restores.
            sess.run(nodes["set_tfs"])
            os.makedirs(os.path.join(root, f"tf_{label}"), exist_ok=True)  # Saver wants the parent
            tf_path = nodes["saver"].save(sess, os.path.join(root, f"tf_{label}", "model"))
    reader = tf.train.load_checkpoint(paths[-1])
    checks.run(f"{label}_tf_reader_keys", lambda: sorted(reader.get_variable_to_shape_map()))
    graph = tf.Graph()
    with graph.as_default():
        nodes = build(distributed=True, sharded=sharded)
        with tf1.Session(worker) as sess:
            sess.run(nodes["init"])
            nodes["saver"].restore(sess, tf_path)
            checks.run(f"{label}_restored_by_distserver", lambda: read(sess, nodes))
            # (d) paths outside the root are refused.
            checks.run(
                f"{label}_save_outside",
                lambda: nodes["saver"].save(sess, os.path.join(outside, "model")),
            )
            checks.run(
                f"{label}_save_dotdot",
                lambda: nodes["saver"].save(sess, os.path.join(root, "..", os.path.basename(outside), "m2")),
            )
    checks.run(f"{label}_outside_files", lambda: sorted(os.listdir(outside)))


exercise(sharded=False)
exercise(sharded=True)

# (d) restoring a checkpoint that lives outside the root (written by TensorFlow alone).
graph = tf.Graph()
with graph.as_default():
    nodes = build(distributed=False, sharded=False)
    with tf1.Session() as sess:
        sess.run(nodes["init"])
        os.makedirs(os.path.join(outside, "tf_written"))
        outside_path = nodes["saver"].save(sess, os.path.join(outside, "tf_written", "model"))
graph = tf.Graph()
with graph.as_default():
    nodes = build(distributed=True, sharded=False)
    with tf1.Session(worker) as sess:
        checks.run("restore_outside", lambda: nodes["saver"].restore(sess, outside_path))

checks.emit(values={name: [v[1], v[2]] for name, v in VALUES.items()})
