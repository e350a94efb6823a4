"""TF 1.x summary ops on a distserver cluster and on TensorFlow alone, compared by the client.

Scalar, histogram and merged summaries must be TensorFlow's bytes; images and audio
must decode (with TensorFlow's decoders) to TensorFlow's pixels and samples.

Argument (JSON): {"cluster": {"ps": [a], "worker": [b]}}
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf
from _common import Checks, args, target_of

tf1 = tf.compat.v1
tf1.disable_v2_behavior()

cluster = args()["cluster"]
checks = Checks()
rng = np.random.default_rng(3)
VALUES = np.concatenate([rng.normal(size=500) * 3, np.zeros(20), [1e-13, -1e-13, 7e19, -2.5]]).astype(
    np.float32
)
FLOAT_IMAGES = rng.uniform(-1.0, 2.0, size=(2, 5, 4, 3)).astype(np.float32)
POSITIVE_IMAGES = rng.uniform(0.0, 3.0, size=(1, 3, 3, 1)).astype(np.float32)
BYTE_IMAGES = rng.integers(0, 256, size=(3, 4, 6, 4), dtype=np.uint8)
AUDIO = np.sin(np.linspace(0, 40, 800)).reshape(2, 400).astype(np.float32) * 0.8


def build(device: str | None):
    graph = tf.Graph()
    with graph.as_default(), tf1.device(device):
        values = tf.constant(VALUES)
        parts = {
            "scalar": tf1.summary.scalar("loss", tf.reduce_mean(values)),
            "histogram": tf1.summary.histogram("weights", values),
            "empty_histogram": tf1.summary.histogram("nothing", tf.zeros([0])),
            "float_images": tf1.summary.image("float", tf.constant(FLOAT_IMAGES), max_outputs=3),
            "positive_image": tf1.summary.image("positive", tf.constant(POSITIVE_IMAGES), max_outputs=1),
            "byte_images": tf1.summary.image("bytes", tf.constant(BYTE_IMAGES), max_outputs=2),
            "audio": tf1.summary.audio("sound", tf.constant(AUDIO), 8000, max_outputs=2),
        }
        parts["merged"] = tf1.summary.merge([parts["scalar"], parts["histogram"]])
        parts["duplicate"] = tf1.summary.merge([parts["scalar"], parts["scalar"]])
    return graph, parts


def fetch(target: str, device: str | None) -> dict:
    graph, parts = build(device)
    with tf1.Session(target, graph=graph) as sess:
        out = {}
        for name, op in parts.items():
            try:
                out[name] = sess.run(op)
            except tf.errors.OpError as exc:
                out[name] = exc
        return out


ours = fetch(target_of(cluster["worker"][0]), "/job:ps/task:0")
theirs = fetch("", None)


def same_bytes(name: str) -> bool:
    return ours[name] == theirs[name]


def images(summary_bytes: bytes) -> list:
    """(tag, height, width, colorspace, pixels) per image, decoded by TensorFlow."""
    out = []
    with tf1.Session(graph=tf.Graph()) as sess:
        for value in tf1.Summary.FromString(summary_bytes).value:
            pixels = sess.run(tf.io.decode_png(value.image.encoded_image_string, channels=0))
            out.append((value.tag, value.image.height, value.image.width, value.image.colorspace, pixels))
    return out


def clips(summary_bytes: bytes) -> list:
    """(tag, sample_rate, channels, frames, samples) per clip, decoded by TensorFlow."""
    out = []
    with tf1.Session(graph=tf.Graph()) as sess:
        for value in tf1.Summary.FromString(summary_bytes).value:
            samples, _ = sess.run(tf.audio.decode_wav(value.audio.encoded_audio_string))
            audio = value.audio
            out.append((value.tag, audio.sample_rate, audio.num_channels, audio.length_frames, samples))
    return out


def compare(decode, name: str) -> dict:
    """The metadata of both sides and the largest difference between their decoded data."""
    a, b = decode(ours[name]), decode(theirs[name])
    return {
        "ours": [list(x[:4]) for x in a],
        "theirs": [list(x[:4]) for x in b],
        "max_difference": max(
            float(np.max(np.abs(x[4].astype(np.float64) - y[4].astype(np.float64))))
            for x, y in zip(a, b, strict=True)
        ),
    }


for name in ("scalar", "histogram", "empty_histogram", "merged"):
    checks.run(f"{name}_bytes_equal", lambda name=name: same_bytes(name))
for name in ("float_images", "positive_image", "byte_images"):
    checks.run(f"{name}_pixels", lambda name=name: compare(images, name))
checks.run("audio_samples", lambda: compare(clips, "audio"))
checks.run("audio_bytes_equal", lambda: same_bytes("audio"))
checks.run("duplicate_tags", lambda: [type(ours["duplicate"]).__name__, ours["duplicate"].message])
checks.emit()
