"""V2 checkpoints: SaveV2/RestoreV2/MergeV2Checkpoints, the file format, and the checkpoint root."""

from __future__ import annotations

import importlib.util
import io
import os
import shutil
import struct
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from distserver import crc32c, errors
from distserver.kernels import create_kernel
from distserver.kernels import tensor_bundle as tb
from distserver.protos import types_pb2
from distserver.protos.tensor_bundle_pb2 import BundleEntryProto, BundleHeaderProto
from distserver.tensors import as_datatype

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = ROOT / "tests" / "data" / "tf_checkpoint"


def _golden_module():
    spec = importlib.util.spec_from_file_location(
        "make_tf_checkpoint_golden", ROOT / "scripts" / "make_tf_checkpoint_golden.py"
    )
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, module)
    spec.loader.exec_module(module)
    return module


GOLDEN_TENSORS = _golden_module().golden_tensors()


def strings(*items):
    value = np.empty(len(items), dtype=object)
    value[:] = list(items)
    return value


def string_scalar(text: str):
    return np.array(text.encode(), dtype=object)


def datatype_of(value: np.ndarray) -> int:
    return types_pb2.DT_STRING if value.dtype == object else as_datatype(value.dtype)


@pytest.fixture
def root(tmp_path: Path) -> Path:
    path = tmp_path / "root"
    path.mkdir()
    return Path(os.path.realpath(path))


@pytest.fixture
def ckpt_ctx(new_context, root):
    ctx = new_context()
    ctx.checkpoint_root = str(root)
    return ctx


def run(make_node, ctx, op, *inputs, **attrs):
    node = make_node(op, [f"input_{i}" for i in range(len(inputs))], **attrs)
    kernel = create_kernel(node)
    assert kernel.does_io == (op in {"SaveV2", "RestoreV2", "MergeV2Checkpoints"})
    return kernel.compute(ctx, [np.asarray(x) if not isinstance(x, np.ndarray) else x for x in inputs])


def save(make_node, ctx, prefix, tensors, specs=None):
    names = [name for name, _ in tensors]
    values = [value for _, value in tensors]
    return run(
        make_node,
        ctx,
        "SaveV2",
        string_scalar(str(prefix)),
        strings(*(n.encode() for n in names)),
        strings(*(s.encode() for s in (specs or [""] * len(names)))),
        *values,
        dtypes=[v.dtype if v.dtype != object else object for v in values],
    )


def restore(make_node, ctx, prefix, names, dtypes, specs=None):
    return run(
        make_node,
        ctx,
        "RestoreV2",
        string_scalar(str(prefix)),
        strings(*(n.encode() for n in names)),
        strings(*(s.encode() for s in (specs or [""] * len(names)))),
        dtypes=list(dtypes),
    )


def assert_same(restored: np.ndarray, expected: np.ndarray) -> None:
    assert restored.dtype == expected.dtype
    assert restored.shape == expected.shape
    if expected.dtype == object:
        assert restored.tolist() == expected.tolist()
    else:
        assert restored.tobytes() == expected.tobytes()


# --------------------------------------------------------------------------- round trips


def test_every_dtype_round_trips(make_node, ckpt_ctx, root):
    assert save(make_node, ckpt_ctx, root / "model", GOLDEN_TENSORS) == []
    names = [name for name, _ in GOLDEN_TENSORS]
    dtypes = [v.dtype if v.dtype != object else object for _, v in GOLDEN_TENSORS]
    restored = restore(make_node, ckpt_ctx, root / "model", names, dtypes)
    for (_name, expected), value in zip(GOLDEN_TENSORS, restored, strict=True):
        assert_same(value, expected)
    assert restored[[n for n, _ in GOLDEN_TENSORS].index("bfloat16")].dtype == np.dtype(ml_dtypes.bfloat16)
    assert sorted(os.listdir(root)) == ["model.data-00000-of-00001", "model.index"]


def test_a_tensorflow_checkpoint_is_restored(make_node, ckpt_ctx, root):
    for path in GOLDEN.iterdir():
        shutil.copy(path, root / path.name)
    names = [name for name, _ in GOLDEN_TENSORS][::-1]  # any order, any subset
    dtypes = [dict(GOLDEN_TENSORS)[n].dtype for n in names]
    restored = restore(make_node, ckpt_ctx, "model", names, [object if d.kind == "O" else d for d in dtypes])
    for name, value in zip(names, restored, strict=True):
        assert_same(value, dict(GOLDEN_TENSORS)[name])


def test_files_are_byte_for_byte_tensorflows(make_node, ckpt_ctx, root):
    save(make_node, ckpt_ctx, root / "model", GOLDEN_TENSORS)
    for name in ("model.index", "model.data-00000-of-00001"):
        assert (root / name).read_bytes() == (GOLDEN / name).read_bytes(), name


def test_slices_tensorflow_saved_restore_and_our_files_are_byte_for_byte_tensorflows(
    make_node, ckpt_ctx, root
):
    slices = _golden_module().golden_slices()
    save(
        make_node, ckpt_ctx, root / "sliced", [(n, v) for n, _, v in slices], [spec for _, spec, _ in slices]
    )
    for name in ("sliced.index", "sliced.data-00000-of-00001"):
        assert (root / name).read_bytes() == (GOLDEN / name).read_bytes(), name
    (root / "tf").mkdir()
    for path in GOLDEN.glob("sliced.*"):
        shutil.copy(path, root / "tf" / path.name)
    part, rows, text, whole, middle = restore(
        make_node, ckpt_ctx, "tf/sliced", ["part", "rows", "text", "whole", "rows"],
        [np.float32, np.int64, object, np.float64, np.int64], ["", "", "", "", "4 3 1,2:1,2"],
    )  # fmt: skip
    np.testing.assert_array_equal(part, np.arange(15, dtype=np.float32).reshape(5, 3))
    np.testing.assert_array_equal(rows, np.arange(12).reshape(4, 3))
    assert text.tolist() == [b"a", b"bb", b"", b"dddd"]
    np.testing.assert_array_equal(whole, [7.0, 8.0])
    np.testing.assert_array_equal(middle, [[4, 5], [7, 8]])


def test_index_table_reads_back(make_node, ckpt_ctx, root):
    tensors = [("b", np.arange(3, dtype=np.int32)), ("a", strings(b"xy", b"z")), ("c", np.ones((2, 2)))]
    save(make_node, ckpt_ctx, root / "m", tensors)
    index = (root / "m.index").read_bytes()
    low, high = struct.unpack("<II", index[-8:])
    assert (high << 32) | low == 0xDB4775248B80FB57
    items = tb.read_table(index)
    assert [key for key, _ in items] == [b"", b"a", b"b", b"c"]
    header = BundleHeaderProto.FromString(items[0][1])
    assert header.num_shards == 1
    assert header.endianness == BundleHeaderProto.LITTLE
    assert (header.version.producer, header.version.min_consumer) == (1, 0)
    data = (root / "m.data-00000-of-00001").read_bytes()
    entries = {key.decode(): BundleEntryProto.FromString(value) for key, value in items[1:]}
    # Data is written in the order given: b, a, c.
    assert [entries[n].offset for n in "bac"] == [0, 12, 12 + entries["a"].size]
    b = entries["b"]
    assert b.dtype == types_pb2.DT_INT32
    assert [d.size for d in b.shape.dim] == [3]
    assert data[b.offset : b.offset + b.size] == np.arange(3, dtype="<i4").tobytes()
    assert crc32c.unmask(b.crc32c) == crc32c.value(np.arange(3, dtype="<i4").tobytes())
    # A string tensor: varint lengths, their masked crc, the bytes.
    a = entries["a"]
    raw = data[a.offset : a.offset + a.size]
    assert raw[:2] == b"\x02\x01"
    lengths_crc = crc32c.value(struct.pack("<II", 2, 1))
    assert struct.unpack("<I", raw[2:6])[0] == crc32c.mask(lengths_crc)
    assert raw[6:] == b"xyz"
    assert crc32c.unmask(a.crc32c) == crc32c.extend(crc32c.extend(lengths_crc, raw[2:6]), b"xyz")


def test_table_with_many_blocks_round_trips():
    items = [(f"key{i:06d}".encode(), bytes([i % 256]) * (i % 50)) for i in range(3000)]
    out = io.BytesIO()
    tb.write_table(out, items, block_size=1024)
    data = out.getvalue()
    assert tb.read_table(data) == items
    with pytest.raises(ValueError, match="strictly increasing"):
        tb.write_table(io.BytesIO(), [(b"b", b""), (b"a", b"")])
    corrupt = bytearray(data)
    corrupt[100] ^= 0xFF
    with pytest.raises(errors.DataLossError, match="checksum mismatch"):
        tb.read_table(bytes(corrupt))
    with pytest.raises(errors.DataLossError, match="bad magic"):
        tb.read_table(data[:-1] + b"\x00")


def test_corrupt_data_is_data_loss(make_node, ckpt_ctx, root):
    save(make_node, ckpt_ctx, root / "m", [("v", np.arange(4, dtype=np.float32))])
    data_file = root / "m.data-00000-of-00001"
    raw = bytearray(data_file.read_bytes())
    raw[0] ^= 1
    data_file.write_bytes(bytes(raw))
    with pytest.raises(errors.DataLossError, match="Checksum does not match"):
        restore(make_node, ckpt_ctx, root / "m", ["v"], [np.float32])


def test_restore_errors(make_node, ckpt_ctx, root):
    save(make_node, ckpt_ctx, root / "m", [("v", np.arange(6, dtype=np.float32).reshape(2, 3))])
    with pytest.raises(errors.NotFoundError, match="Key w not found in checkpoint"):
        restore(make_node, ckpt_ctx, root / "m", ["w"], [np.float32])
    with pytest.raises(
        errors.InvalidArgumentError, match="expected dtype double does not equal restored dtype float"
    ):
        restore(make_node, ckpt_ctx, root / "m", ["v"], [np.float64])
    with pytest.raises(errors.NotFoundError, match="Failed to find any matching files"):
        restore(make_node, ckpt_ctx, root / "nothing", ["v"], [np.float32])
    # A slice of a tensor saved whole.
    (part,) = restore(make_node, ckpt_ctx, root / "m", ["v"], [np.float32], ["2 3 1,1:0,3"])
    np.testing.assert_array_equal(part, [[3, 4, 5]])
    (whole,) = restore(make_node, ckpt_ctx, root / "m", ["v"], [np.float32], ["2 3 -:-"])
    assert whole.shape == (2, 3)
    with pytest.raises(errors.InvalidArgumentError, match="does not match the shape stored"):
        restore(make_node, ckpt_ctx, root / "m", ["v"], [np.float32], ["3 3 -:-"])


def test_save_errors(make_node, ckpt_ctx, root):
    with pytest.raises(errors.InvalidArgumentError, match="duplicate key: v"):
        save(make_node, ckpt_ctx, root / "m", [("v", np.zeros(1)), ("v", np.zeros(1))])
    with pytest.raises(errors.InvalidArgumentError, match="does not match the shape of the tensor to  save"):
        save(make_node, ckpt_ctx, root / "m", [("v", np.zeros(3))], ["4 0,2"])
    with pytest.raises(errors.InvalidArgumentError, match="Extent in dimension 0 out of bounds"):
        save(make_node, ckpt_ctx, root / "m", [("v", np.zeros(2))], ["4 3,2"])
    with pytest.raises(errors.InvalidArgumentError, match="Mismatching ranks"):
        save(make_node, ckpt_ctx, root / "m", [("v", np.zeros(2))], ["4 2 0,2"])
    with pytest.raises(errors.InvalidArgumentError, match="Expected a pair of numbers or '-'"):
        save(make_node, ckpt_ctx, root / "m", [("v", np.zeros(2))], ["4 0;2"])
    with pytest.raises(errors.InvalidArgumentError, match="Need least two elements"):
        save(make_node, ckpt_ctx, root / "m", [("v", np.zeros(2))], ["0,2"])
    with pytest.raises(errors.InvalidArgumentError, match="duplicate key: v"):
        save(make_node, ckpt_ctx, root / "m", [("v", np.zeros(2)), ("v", np.zeros(2))], ["4 0,2", "4 0,2"])
    with pytest.raises(errors.InvalidArgumentError, match="duplicate key: v"):
        save(make_node, ckpt_ctx, root / "m", [("v", np.zeros(4)), ("v", np.zeros(2))], ["", "4 0,2"])
    with pytest.raises(errors.InvalidArgumentError, match="The slices of v disagree"):
        save(make_node, ckpt_ctx, root / "m", [("v", np.zeros(2)), ("v", np.zeros(2))], ["4 0,2", "5 2,2"])
    assert not (root / "m.index").exists()
    assert [p for p in os.listdir(root) if "tempstate" in p] == []


# --------------------------------------------------------------------------- slices (partitioned variables)


def test_slice_keys_are_tensorflows():
    # Bytes of the keys TensorFlow 2.21 wrote for fixed_size_partitioner(2) over a [5, 3] variable.
    assert (
        tb.encode_slice_key("v", tb.TensorSlice.parse("0,3:0,3")) == b"\x00v\x00\x01\x01\x02\x80\x83\x80\x83"
    )
    assert (
        tb.encode_slice_key("v", tb.TensorSlice.parse("3,2:0,3")) == b"\x00v\x00\x01\x01\x02\x83\x82\x80\x83"
    )
    # A full extent is (0, -1); a 0 byte in a name is escaped; multi-byte signed numbers.
    assert tb.encode_slice_key("a", tb.TensorSlice.parse("-")) == b"\x00a\x00\x01\x01\x01\x80\x7f"
    assert tb.encode_slice_key("\x00\xff", tb.TensorSlice(((64, 100000),))) == (
        b"\x00" + b"\x00\xff" + b"\xc3\xbf" + b"\x00\x01" + b"\x01\x01" + b"\xc0\x40" + b"\xe1\x86\xa0"
    )


def test_partitioned_variable_saved_in_slices_and_restored_any_way(make_node, ckpt_ctx, root):
    full = np.arange(15, dtype=np.float32).reshape(5, 3)
    save(make_node, ckpt_ctx, root / "m", [("v", full[:3]), ("v", full[3:]), ("w", np.ones(2, np.float32))],
         ["5 3 0,3:0,3", "5 3 3,2:0,3", ""])  # fmt: skip
    items = dict(tb.read_table((root / "m.index").read_bytes()))
    entry = BundleEntryProto.FromString(items[b"v"])
    assert [tb.TensorSlice.from_proto(p) for p in entry.slices] == [
        tb.TensorSlice(((0, 3), (0, 3))),
        tb.TensorSlice(((3, 2), (0, 3))),
    ]
    assert entry.size == 0  # metadata only
    assert [d.size for d in entry.shape.dim] == [5, 3]
    assert tb.encode_slice_key("v", tb.TensorSlice.parse("3,2:0,3")) in items
    # The stored slices, the whole tensor, and slices across the stored ones.
    specs = ["5 3 0,3:0,3", "", "5 3 -:-", "5 3 1,3:1,2", "5 3 4,1:-"]
    parts = restore(make_node, ckpt_ctx, root / "m", ["v"] * len(specs), [np.float32] * len(specs), specs)
    for part, expected in zip(parts, [full[:3], full, full, full[1:4, 1:3], full[4:]], strict=True):
        np.testing.assert_array_equal(part, expected)
    # A partitioning into 3 restores from a checkpoint saved with 2.
    thirds = restore(make_node, ckpt_ctx, root / "m", ["v"] * 3, [np.float32] * 3,
                     ["5 3 0,2:0,3", "5 3 2,2:0,3", "5 3 4,1:0,3"])  # fmt: skip
    np.testing.assert_array_equal(np.concatenate(thirds), full)
    with pytest.raises(errors.InvalidArgumentError, match="shape in shape_and_slice spec \\[6,3\\]"):
        restore(make_node, ckpt_ctx, root / "m", ["v"], [np.float32], ["6 3 0,3:0,3"])


def test_missing_slices_are_refused(make_node, ckpt_ctx, root):
    full = np.arange(8, dtype=np.float64).reshape(4, 2)
    save(make_node, ckpt_ctx, root / "m", [("v", full[:2])], ["4 2 0,2:-"])
    (first,) = restore(make_node, ckpt_ctx, root / "m", ["v"], [np.float64], ["4 2 0,1:-"])
    np.testing.assert_array_equal(first, full[:1])
    with pytest.raises(
        errors.InvalidArgumentError,
        match="Does not have sufficient slices for partitioned tensor v to restore in slice_spec: 1,2:-",
    ):
        restore(make_node, ckpt_ctx, root / "m", ["v"], [np.float64], ["4 2 1,2:-"])
    with pytest.raises(errors.InvalidArgumentError, match=r"sufficient slices .* slice_spec: -:-"):
        restore(make_node, ckpt_ctx, root / "m", ["v"], [np.float64])


def test_sharded_save_of_slices_merges_their_entries(make_node, ckpt_ctx, root):
    full = np.arange(6, dtype=np.int64).reshape(3, 2)
    save(
        make_node,
        ckpt_ctx,
        root / "p0",
        [("v", full[:1]), ("s", strings(b"a", b"b"))],
        ["3 2 0,1:0,2", "4 0,2"],
    )
    save(
        make_node,
        ckpt_ctx,
        root / "p1",
        [("v", full[1:]), ("s", strings(b"c", b"d"))],
        ["3 2 1,2:0,2", "4 2,2"],
    )
    run(make_node, ckpt_ctx, "MergeV2Checkpoints", strings(b"p0", b"p1"), string_scalar("merged"))
    v, s = restore(make_node, ckpt_ctx, root / "merged", ["v", "s"], [np.int64, object])
    np.testing.assert_array_equal(v, full)
    assert s.tolist() == [b"a", b"b", b"c", b"d"]


# --------------------------------------------------------------------------- sharded saves


def test_sharded_save_and_merge(make_node, ckpt_ctx, root):
    (tmp_base,) = run(
        make_node, ckpt_ctx, "StringJoin", string_scalar(str(root / "ckpt")), string_scalar("_temp/part"), N=2
    )
    shards = []
    for shard, tensors in enumerate([[("w", np.arange(4.0))], [("s", strings(b"x")), ("b", np.array(True))]]):
        (name,) = run(make_node, ckpt_ctx, "ShardedFilename", tmp_base, np.int32(shard), np.int32(2))
        save(make_node, ckpt_ctx, name.item().decode(), tensors)
        shards.append(name.item())
    assert shards[1].endswith(b"ckpt_temp/part-00001-of-00002")
    run(
        make_node,
        ckpt_ctx,
        "MergeV2Checkpoints",
        strings(*shards),
        string_scalar(str(root / "ckpt")),
        delete_old_dirs=True,
    )
    assert sorted(os.listdir(root)) == ["ckpt.data-00000-of-00002", "ckpt.data-00001-of-00002", "ckpt.index"]
    items = tb.read_table((root / "ckpt.index").read_bytes())
    assert BundleHeaderProto.FromString(items[0][1]).num_shards == 2
    shard_of = {k.decode(): BundleEntryProto.FromString(v).shard_id for k, v in items[1:]}
    assert shard_of == {"b": 1, "s": 1, "w": 0}
    w, s, b = restore(make_node, ckpt_ctx, root / "ckpt", ["w", "s", "b"], [np.float64, object, np.bool_])
    np.testing.assert_array_equal(w, np.arange(4.0))
    assert s.tolist() == [b"x"]
    assert bool(b)


def test_merge_keeps_a_directory_that_is_not_empty_and_the_root(make_node, ckpt_ctx, root):
    save(make_node, ckpt_ctx, root / "d" / "part", [("a", np.zeros(1))])
    (root / "d" / "keep.txt").write_text("user data")
    save(make_node, ckpt_ctx, root / "part2", [("b", np.zeros(1))])
    run(
        make_node,
        ckpt_ctx,
        "MergeV2Checkpoints",
        strings(str(root / "d" / "part").encode(), b"part2"),
        string_scalar("out/merged"),
        delete_old_dirs=True,
    )
    assert (root / "d" / "keep.txt").exists()
    assert root.is_dir()
    assert sorted(os.listdir(root / "out")) == [
        "merged.data-00000-of-00002",
        "merged.data-00001-of-00002",
        "merged.index",
    ]


def test_merge_refuses_duplicates_and_missing_inputs(make_node, ckpt_ctx, root):
    save(make_node, ckpt_ctx, root / "p1", [("a", np.zeros(1))])
    save(make_node, ckpt_ctx, root / "p2", [("a", np.zeros(1))])
    with pytest.raises(errors.InvalidArgumentError, match="Duplicate tensor keyed by a"):
        run(make_node, ckpt_ctx, "MergeV2Checkpoints", strings(b"p1", b"p2"), string_scalar("m"))
    with pytest.raises(errors.NotFoundError):
        run(make_node, ckpt_ctx, "MergeV2Checkpoints", strings(b"p1", b"gone"), string_scalar("m"))
    run(
        make_node,
        ckpt_ctx,
        "MergeV2Checkpoints",
        strings(b"p1", b"gone"),
        string_scalar("m"),
        allow_missing_files=True,
    )
    (a,) = restore(make_node, ckpt_ctx, "m", ["a"], [np.float64])
    assert a.tolist() == [0.0]


# --------------------------------------------------------------------------- the checkpoint root


def test_no_root_refuses_and_says_how_to_enable(make_node, new_context, tmp_path):
    ctx = new_context()
    with pytest.raises(errors.PermissionDeniedError, match="checkpoint_root") as raised:
        save(make_node, ctx, tmp_path / "m", [("v", np.zeros(1))])
    assert "--checkpoint-root" in str(raised.value)
    with pytest.raises(errors.PermissionDeniedError, match="checkpoint_root"):
        restore(make_node, ctx, tmp_path / "m", ["v"], [np.float64])
    with pytest.raises(errors.PermissionDeniedError, match="checkpoint_root"):
        run(make_node, ctx, "MergeV2Checkpoints", strings(b"a"), string_scalar(str(tmp_path / "m")))
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "path",
    [
        "../outside/m",
        "sub/../../outside/m",
        "{tmp}/outside/m",
        "{root}",
        "/etc/passwd",
        "{root}/../outside/m",
    ],
)
def test_paths_outside_the_root_are_refused(make_node, ckpt_ctx, root, path):
    outside = root.parent / "outside"
    outside.mkdir(exist_ok=True)
    prefix = path.format(tmp=root.parent, root=root)
    with pytest.raises(errors.PermissionDeniedError, match="outside this server's checkpoint root") as raised:
        save(make_node, ckpt_ctx, prefix, [("v", np.zeros(1))])
    assert "--checkpoint-root" in str(raised.value)
    with pytest.raises(errors.PermissionDeniedError, match="outside"):
        restore(make_node, ckpt_ctx, prefix, ["v"], [np.float64])
    assert list(outside.iterdir()) == []


def test_symlink_escapes_are_refused(make_node, ckpt_ctx, root):
    outside = root.parent / "outside"
    outside.mkdir()
    (root / "link").symlink_to(outside, target_is_directory=True)
    with pytest.raises(errors.PermissionDeniedError, match="outside"):
        save(make_node, ckpt_ctx, root / "link" / "m", [("v", np.zeros(1))])
    assert list(outside.iterdir()) == []
    # A checkpoint outside, reached through a link to its index or its data file.
    tb.write_bundle(str(outside / "m"), [("v", types_pb2.DT_DOUBLE, np.zeros(1))])
    with pytest.raises(errors.PermissionDeniedError, match="outside"):
        restore(make_node, ckpt_ctx, root / "link" / "m", ["v"], [np.float64])
    (root / "m.index").symlink_to(outside / "m.index")
    with pytest.raises(errors.PermissionDeniedError, match="outside"):
        restore(make_node, ckpt_ctx, root / "m", ["v"], [np.float64])
    save(make_node, ckpt_ctx, root / "n", [("v", np.ones(1))])
    (root / "n.data-00000-of-00001").unlink()
    (root / "n.data-00000-of-00001").symlink_to(outside / "m.data-00000-of-00001")
    with pytest.raises(errors.PermissionDeniedError, match="outside"):
        restore(make_node, ckpt_ctx, root / "n", ["v"], [np.float64])


def test_links_that_stay_inside_are_followed(make_node, ckpt_ctx, root):
    (root / "real").mkdir()
    (root / "alias").symlink_to(root / "real", target_is_directory=True)
    save(make_node, ckpt_ctx, "alias/m", [("v", np.arange(2.0))])
    assert sorted(os.listdir(root / "real")) == ["m.data-00000-of-00001", "m.index"]
    (value,) = restore(make_node, ckpt_ctx, root / "real" / "m", ["v"], [np.float64])
    assert value.tolist() == [0.0, 1.0]


def test_merge_never_touches_files_outside_the_root(make_node, ckpt_ctx, root):
    outside = root.parent / "outside"
    (outside / "tmp").mkdir(parents=True)
    tb.write_bundle(str(outside / "tmp" / "part"), [("v", types_pb2.DT_DOUBLE, np.zeros(1))])
    before = sorted(p.name for p in (outside / "tmp").iterdir())
    for inputs, dest in [
        (strings(str(outside / "tmp" / "part").encode()), "merged"),
        (strings(b"../outside/tmp/part"), "merged"),
    ]:
        with pytest.raises(errors.PermissionDeniedError):
            run(make_node, ckpt_ctx, "MergeV2Checkpoints", inputs, string_scalar(dest), delete_old_dirs=True)
    save(make_node, ckpt_ctx, root / "tmp" / "part", [("v", np.zeros(1))])
    with pytest.raises(errors.PermissionDeniedError):
        run(
            make_node,
            ckpt_ctx,
            "MergeV2Checkpoints",
            strings(b"tmp/part"),
            string_scalar(str(outside / "merged")),
            delete_old_dirs=True,
        )
    assert sorted(p.name for p in (outside / "tmp").iterdir()) == before
    assert (root / "tmp" / "part.index").exists()


def test_the_server_checks_its_root(tmp_path):
    from distserver.server import AsyncServer

    cluster = {"worker": ["localhost:0"]}
    with pytest.raises(ValueError, match="not an existing directory"):
        AsyncServer(cluster, checkpoint_root=tmp_path / "missing")
    (tmp_path / "dir").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "dir")
    server = AsyncServer(cluster, checkpoint_root=tmp_path / "link")
    assert server.checkpoint_root == os.path.realpath(tmp_path / "dir")
    assert AsyncServer(cluster).checkpoint_root is None


# --------------------------------------------------------------------------- string ops


def test_string_ops(run_op):
    (name,) = run_op("ShardedFilename", string_scalar("/x/model"), np.int32(3), np.int32(12))
    assert name.item() == b"/x/model-00003-of-00012"
    (spec,) = run_op("ShardedFilespec", string_scalar("/x/model"), np.int32(2))
    assert spec.item() == b"/x/model-?????-of-00002"
    (joined,) = run_op("StringJoin", strings(b"a", b"b"), string_scalar("-"), separator="/", N=2)
    assert joined.tolist() == [b"a/-", b"b/-"]
    with pytest.raises(errors.InvalidArgumentError, match="shapes do not match"):
        run_op("StringJoin", strings(b"a", b"b"), strings(b"c"), N=2)
    (match,) = run_op("StaticRegexFullMatch", strings(b"s3://bucket/x", b"/local/s3://"), pattern="^s3://.*")
    assert match.tolist() == [True, False]
    with pytest.raises(errors.InvalidArgumentError, match="Invalid pattern"):
        run_op("StaticRegexFullMatch", strings(b"x"), pattern="(")


# --------------------------------------------------------------------------- crc32c


def test_crc32c_known_values_and_long_inputs():
    assert crc32c.value(b"123456789") == 0xE3069283
    assert crc32c.value(b"") == 0
    assert crc32c.value(bytes(32)) == 0x8A9136AA
    rng = np.random.default_rng(5)
    for size in (4095, 4096, 5000, 65536 + 7, 1 << 20):
        data = rng.integers(0, 256, size, dtype=np.uint8).tobytes()
        expected = 0
        for piece in (data[: size // 3], data[size // 3 :]):  # crossing the short/long paths
            expected = crc32c.extend(expected, piece)
        assert crc32c.value(data) == expected
        assert crc32c._raw_python(0xFFFFFFFF, data[:5000]) ^ 0xFFFFFFFF == crc32c.value(data[:5000])
    assert crc32c.unmask(crc32c.mask(0x12345678)) == 0x12345678
