"""Hash tables, string ops and DenseBincount: behaviour and error paths (values vs TensorFlow:
tests/interop/test_same_values.py)."""

from __future__ import annotations

import numpy as np
import pytest

from distserver import errors
from distserver.kernels import create_kernel
from tests.kernels.conftest import Context, make_node, run_op


def strings(*values: str) -> np.ndarray:
    out = np.empty(len(values), dtype=object)
    out[:] = [v.encode() for v in values]
    return out


def test_a_table_is_found_filled_and_sized():
    ctx = Context()
    table = create_kernel(make_node("HashTableV2", name="t", key_dtype=object, value_dtype=np.int64))
    (handle,) = table.compute(ctx, [])
    find = create_kernel(
        make_node("LookupTableFindV2", ["t", "k", "d"], name="find", Tin=object, Tout=np.int64)
    )
    with pytest.raises(errors.FailedPreconditionError, match="Table not initialized"):
        find.compute(ctx, [handle, strings("a"), np.int64(-1)])
    load = create_kernel(
        make_node("LookupTableImportV2", ["t", "k", "v"], name="load", Tin=object, Tout=np.int64)
    )
    load.compute(ctx, [handle, strings("a", "b"), np.array([3, 4], np.int64)])
    (found,) = find.compute(ctx, [handle, strings("b", "zz", "a"), np.int64(-1)])
    assert found.tolist() == [4, -1, 3]
    (size,) = create_kernel(make_node("LookupTableSizeV2", ["t"], name="size")).compute(ctx, [handle])
    assert size == 2
    with pytest.raises(errors.InvalidArgumentError, match="Key must be type"):
        find.compute(ctx, [handle, np.array([1], np.int64), np.int64(-1)])


def test_string_to_number_names_the_bad_string():
    (numbers,) = run_op("StringToNumber", strings("1.5", " -2"), out_type=np.float32)
    assert numbers.tolist() == [1.5, -2.0]
    with pytest.raises(errors.InvalidArgumentError, match="could not correctly convert string: x1"):
        run_op("StringToNumber", strings("x1"), out_type=np.float32)
    with pytest.raises(errors.InvalidArgumentError, match="convert string: 99999999999"):
        run_op("StringToNumber", strings("99999999999"), out_type=np.int32)


def test_string_length_in_bytes_and_characters():
    assert run_op("StringLength", strings("héllo"), unit="BYTE")[0].tolist() == [6]
    assert run_op("StringLength", strings("héllo"), unit="UTF8_CHAR")[0].tolist() == [5]


def test_split_on_whitespace_drops_empty_pieces_and_on_a_separator_keeps_them():
    indices, values, shape = run_op("StringSplitV2", strings(" a  b", ""), np.array(b"", dtype=object))
    assert (indices.tolist(), values.tolist(), shape.tolist()) == ([[0, 0], [0, 1]], [b"a", b"b"], [2, 2])
    _, values, _ = run_op("StringSplitV2", strings("a,,b"), np.array(b",", dtype=object))
    assert values.tolist() == [b"a", b"", b"b"]


def test_dense_bincount_counts_weights_and_drops_values_past_size():
    values = np.array([0, 2, 2, 5], np.int32)
    (counts,) = run_op(
        "DenseBincount", values, np.int32(4), np.zeros(0, np.float32), Tidx=np.int32, T=np.float32
    )
    assert counts.tolist() == [1, 0, 2, 0]
    weights = np.array([1.5, 1.0, 2.0, 9.0], np.float32)
    (summed,) = run_op("DenseBincount", values, np.int32(3), weights, Tidx=np.int32, T=np.float32)
    assert summed.tolist() == [1.5, 0, 3.0]
    with pytest.raises(errors.InvalidArgumentError, match="non-negative"):
        run_op("DenseBincount", np.array([-1], np.int32), np.int32(2), np.zeros(0, np.float32), Tidx=np.int32,
               T=np.float32)  # fmt: skip


def test_string_to_hash_bucket_fast_is_tensorflows():
    """Buckets TensorFlow 2.21 gave for these strings (num_buckets 1000003), lengths 0 to 200
    (each branch of farmhash; tests/interop/test_same_values.py compares more, live)."""
    texts = [b"", b"a", b"hello", b"x" * 17, b"y" * 40, b"z" * 65, bytes(range(200))]
    values = np.empty(len(texts), dtype=object)
    values[:] = texts
    (buckets,) = run_op("StringToHashBucketFast", values, num_buckets=1000003)
    assert buckets.tolist() == [377723, 291400, 497363, 200771, 641401, 666247, 568369]


def test_dense_bincount_sizes_its_output_so_a_large_one_leaves_the_event_loop(make_node):
    kernel = create_kernel(make_node("DenseBincount", name="count", Tidx=np.int32, T=np.float32))
    values = np.zeros((3, 2), np.int32)
    assert kernel.output_nbytes([values, np.int32(1 << 20), np.zeros(0, np.float32)]) == 3 * (1 << 20) * 4
