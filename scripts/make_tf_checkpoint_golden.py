"""Write tests/data/tf_checkpoint/{model,sliced}.*: V2 checkpoints written by a real TensorFlow.

Run with the Python of a venv that has TensorFlow (not distserver's venv):

    .tfenv/bin/python scripts/make_tf_checkpoint_golden.py      (.tfenv: scripts/interop-setup)

tests/kernels/test_checkpoint.py restores every tensor with distserver's RestoreV2
and checks the values against `golden_tensors()` of this file (keep both in sync:
the test imports this module's `golden_tensors` without TensorFlow), then writes the
same tensors with distserver's SaveV2 and compares the files byte for byte; `sliced`
holds the slices of `golden_slices()` (partitioned variables), checked the same way.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

OUT = Path(__file__).resolve().parent.parent / "tests" / "data" / "tf_checkpoint"


def golden_tensors() -> list[tuple[str, Any]]:
    """(name, numpy value) in the order they are saved; strings are object arrays of bytes."""
    rng = np.random.default_rng(1234)
    return [
        ("float32", rng.standard_normal((3, 4)).astype(np.float32)),
        ("float64", rng.standard_normal(5)),
        ("float16", np.array([0.5, -2.0, 65504.0], np.float16)),
        ("bfloat16", np.array([[1.5, -3.0], [0.0, 7.0]], ml_dtypes.bfloat16)),
        ("int8", np.array([-128, 0, 127], np.int8)),
        ("int16", np.array([-30000, 30000], np.int16)),
        ("int32", np.arange(-3, 3, dtype=np.int32).reshape(2, 3)),
        ("int64", np.array([-(2**62), 2**62], np.int64)),
        ("uint8", np.arange(0, 256, 51, dtype=np.uint8)),
        ("uint16", np.array([0, 65535], np.uint16)),
        ("uint32", np.array([0, 2**32 - 1], np.uint32)),
        ("uint64", np.array([0, 2**64 - 1], np.uint64)),
        ("bool", np.array([True, False, True])),
        ("complex64", np.array([1 + 2j, -3.5j], np.complex64)),
        ("complex128", np.array([[1e300 - 1j]], np.complex128)),
        ("scalar", np.array(42.0, np.float32)),
        ("empty", np.zeros((0, 3), np.float32)),
        ("strings", np.array([[b"", b"a"], [b"\xff\x00bytes", b"x" * 200]], dtype=object)),
        ("string_scalar", np.array(b"hello", dtype=object)),
        ("scope/nested/name", np.arange(2048, dtype=np.float32)),  # larger than crc32c's short path
    ]


def golden_slices() -> list[tuple[str, str, Any]]:
    """(name, shape_and_slice, numpy value of that slice), in the order they are saved."""
    full = np.arange(15, dtype=np.float32).reshape(5, 3)
    rows = np.arange(12, dtype=np.int64).reshape(4, 3)
    text = np.array([b"a", b"bb", b"", b"dddd"], dtype=object)
    return [
        ("part", "5 3 0,3:0,3", full[:3]),
        ("part", "5 3 3,2:0,3", full[3:]),
        ("rows", "4 3 2,2:-", rows[2:]),
        ("rows", "4 3 0,2:-", rows[:2]),
        ("text", "4 0,1", text[:1]),
        ("text", "4 1,3", text[1:]),
        ("whole", "2 0,2", np.array([7.0, 8.0])),  # a slice covering its tensor: saved whole
        ("plain", "", np.array(3, np.int32)),
    ]


def main() -> None:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import tensorflow as tf

    OUT.mkdir(parents=True, exist_ok=True)
    names, values = zip(*golden_tensors(), strict=True)
    tensors = [tf.constant(v) if v.dtype != object else tf.constant(v.tolist(), tf.string) for v in values]
    tensors = [tf.reshape(t, v.shape) for t, v in zip(tensors, values, strict=True)]
    tf.raw_ops.SaveV2(
        prefix=str(OUT / "model"),
        tensor_names=list(names),
        shape_and_slices=[""] * len(names),
        tensors=tensors,
    )
    names, specs, values = zip(*golden_slices(), strict=True)
    tensors = [tf.constant(v) if v.dtype != object else tf.constant(v.tolist(), tf.string) for v in values]
    tf.raw_ops.SaveV2(
        prefix=str(OUT / "sliced"), tensor_names=list(names), shape_and_slices=list(specs), tensors=tensors
    )
    print(f"wrote {sorted(p.name for p in OUT.iterdir())}")


if __name__ == "__main__":
    main()
