"""Tests for distserver.tensors: numpy <-> TensorProto, dtypes, shapes, resource handles."""

from __future__ import annotations

import struct
import tracemalloc

import hypothesis.extra.numpy as hnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from distserver import errors, tensors
from distserver.protos import types_pb2 as t
from distserver.protos.resource_handle_pb2 import ResourceHandleProto
from distserver.protos.tensor_pb2 import TensorProto, VariantTensorDataProto
from distserver.protos.tensor_shape_pb2 import TensorShapeProto
from distserver.tensors import (
    DecodeBudget,
    ResourceHandle,
    as_datatype,
    as_numpy_dtype,
    datatype_name,
    from_tensor_proto,
    make_tensor_proto,
    shape_from_proto,
    shape_to_proto,
    tensor_nbytes,
    to_tensor_proto,
)

NUMERIC = [
    (t.DT_FLOAT, np.float32),
    (t.DT_DOUBLE, np.float64),
    (t.DT_INT8, np.int8),
    (t.DT_INT16, np.int16),
    (t.DT_INT32, np.int32),
    (t.DT_INT64, np.int64),
    (t.DT_UINT8, np.uint8),
    (t.DT_UINT16, np.uint16),
    (t.DT_UINT32, np.uint32),
    (t.DT_UINT64, np.uint64),
    (t.DT_BOOL, np.bool_),
    (t.DT_COMPLEX64, np.complex64),
    (t.DT_COMPLEX128, np.complex128),
    (t.DT_HALF, np.float16),
    (t.DT_BFLOAT16, ml_dtypes.bfloat16),
]
HANDLE = ResourceHandle("/job:ps/replica:0/task:0/device:CPU:0", "", "v", np.dtype(np.float32), (2, None))


def roundtrip(value, **kwargs):
    return from_tensor_proto(TensorProto.FromString(to_tensor_proto(value, **kwargs).SerializeToString()))


def assert_same(result, expected):
    """Same dtype, shape and bytes (so NaN payloads and -0.0 count)."""
    expected = np.asarray(expected)
    assert result.dtype == expected.dtype.newbyteorder("=")
    assert result.shape == expected.shape
    assert result.tobytes() == np.ascontiguousarray(expected, dtype=result.dtype).tobytes()


def shape_proto(*sizes):
    return shape_to_proto(sizes)


# --------------------------------------------------------------------------- dtypes


def test_all_is_sorted():
    # ruff's order (RUF022): CONSTANTS, then Classes, then functions, each alphabetical.
    def kind(name: str) -> tuple[int, str]:
        return (0 if name.isupper() else 1 if name[0].isupper() else 2), name

    assert tensors.__all__ == sorted(tensors.__all__, key=kind)
    assert all(hasattr(tensors, name) for name in tensors.__all__)


@pytest.mark.parametrize(("datatype", "numpy_type"), NUMERIC)
def test_numeric_dtype_table(datatype, numpy_type):
    assert as_numpy_dtype(datatype) == np.dtype(numpy_type)
    assert as_numpy_dtype(datatype + 100) == np.dtype(numpy_type)  # *_REF
    assert as_datatype(np.dtype(numpy_type)) == datatype
    assert as_datatype(numpy_type) == datatype
    assert as_datatype(np.dtype(numpy_type).name) == datatype


@pytest.mark.parametrize("datatype", [t.DT_STRING, t.DT_RESOURCE, t.DT_VARIANT, t.DT_STRING_REF])
def test_object_dtypes(datatype):
    assert as_numpy_dtype(datatype) == np.dtype(object)


@pytest.mark.parametrize(
    "datatype",
    [t.DT_INVALID, t.DT_QINT8, t.DT_QUINT8, t.DT_QINT32, t.DT_QINT16, t.DT_QUINT16, t.DT_QINT8_REF],
)
def test_unsupported_datatypes_are_named(datatype):
    with pytest.raises(errors.InvalidArgumentError, match=datatype_name(datatype)):
        as_numpy_dtype(datatype)


def test_unknown_datatype_value():
    with pytest.raises(errors.InvalidArgumentError, match=r"DataType\(77\)"):
        as_numpy_dtype(77)


@pytest.mark.parametrize(
    ("dtype_like", "expected"),
    [
        (float, t.DT_DOUBLE),
        (int, t.DT_INT64),
        (bool, t.DT_BOOL),
        (complex, t.DT_COMPLEX128),
        (str, t.DT_STRING),
        (bytes, t.DT_STRING),
        (object, t.DT_STRING),
        (np.str_, t.DT_STRING),
        (np.bytes_, t.DT_STRING),
        (np.dtype("U5"), t.DT_STRING),
        ("float32", t.DT_FLOAT),
        ("float", t.DT_DOUBLE),
        ("half", t.DT_HALF),
        (">f4", t.DT_FLOAT),
        ("<i8", t.DT_INT64),
        (np.dtype(">u2"), t.DT_UINT16),
        ("bfloat16", t.DT_BFLOAT16),
        (ml_dtypes.bfloat16, t.DT_BFLOAT16),
        ("string", t.DT_STRING),
        ("resource", t.DT_RESOURCE),
        ("variant", t.DT_VARIANT),
        ("DT_FLOAT", t.DT_FLOAT),
        ("DT_INT32_REF", t.DT_INT32_REF),
        (t.DT_UINT64, t.DT_UINT64),
        (t.DT_RESOURCE, t.DT_RESOURCE),
    ],
)
def test_as_datatype(dtype_like, expected):
    assert as_datatype(dtype_like) == expected


def test_as_datatype_accepts_tf_dtype_like_objects():
    class FakeTfDType:
        as_datatype_enum = t.DT_HALF

    assert as_datatype(FakeTfDType()) == t.DT_HALF


@pytest.mark.parametrize(
    "dtype_like",
    [
        None,
        True,
        999,
        "DT_NOPE",
        "nonsense",
        np.float128 if hasattr(np, "float128") else np.longdouble,
        "M8[s]",
    ],
)
def test_as_datatype_unknown(dtype_like):
    if dtype_like is np.longdouble and np.dtype(np.longdouble) == np.dtype(np.float64):
        pytest.skip("longdouble is float64 on this platform")
    with pytest.raises(TypeError, match=r"DataType|datatype"):
        as_datatype(dtype_like)


def test_as_datatype_structured_dtype():
    with pytest.raises(TypeError, match="no TensorFlow equivalent"):
        as_datatype(np.dtype([("a", np.float32)]))


def test_datatype_name():
    assert datatype_name(t.DT_FLOAT) == "DT_FLOAT"
    assert datatype_name(t.DT_BFLOAT16_REF) == "DT_BFLOAT16_REF"
    assert datatype_name(1000) == "DataType(1000)"


# --------------------------------------------------------------------------- shapes


@pytest.mark.parametrize(
    "shape", [(), (0,), (3,), (2, 3), (None,), (2, None, 4), (0, 3), (1 << 40,)], ids=str
)
def test_shape_roundtrip(shape):
    proto = shape_to_proto(shape)
    assert not proto.unknown_rank
    assert shape_from_proto(TensorShapeProto.FromString(proto.SerializeToString())) == shape


def test_unknown_rank_shape():
    proto = shape_to_proto(None)
    assert proto.unknown_rank
    assert not proto.dim
    assert shape_from_proto(proto) is None


def test_shape_to_proto_sizes():
    proto = shape_to_proto([np.int64(2), None, -1])
    assert [d.size for d in proto.dim] == [2, -1, -1]
    assert shape_from_proto(proto) == (2, None, None)


def test_shape_to_proto_rejects_bad_sizes():
    with pytest.raises(ValueError, match=">= 0"):
        shape_to_proto([2, -3])
    with pytest.raises(TypeError):
        shape_to_proto([2.5])  # type: ignore[list-item]


def test_shape_from_proto_rejects_negative_sizes():
    with pytest.raises(errors.InvalidArgumentError, match=r"\[2,-5\]"):
        shape_from_proto(TensorShapeProto(dim=[TensorShapeProto.Dim(size=2), TensorShapeProto.Dim(size=-5)]))


# --------------------------------------------------------------------------- wire layout


def test_float32_vector_bytes_match_tensorflow_layout():
    proto = to_tensor_proto(np.array([1.0, 2.0], dtype=np.float32))
    content = struct.pack("<2f", 1.0, 2.0)
    expected = (
        b"\x08\x01"  # field 1 (dtype), varint: DT_FLOAT = 1
        + b"\x12\x04"  # field 2 (tensor_shape), 4 bytes:
        + b"\x12\x02"  #   field 2 (dim), 2 bytes:
        + b"\x08\x02"  #     field 1 (size), varint: 2
        + b"\x22\x08"  # field 4 (tensor_content), 8 bytes
        + content
    )
    assert proto.SerializeToString() == expected
    assert_same(from_tensor_proto(TensorProto.FromString(expected)), np.array([1.0, 2.0], np.float32))


def test_scalar_has_no_dims():
    proto = to_tensor_proto(np.int64(7))
    assert proto.dtype == t.DT_INT64
    assert not proto.tensor_shape.dim
    assert not proto.tensor_shape.unknown_rank
    assert proto.tensor_content == struct.pack("<q", 7)


# --------------------------------------------------------------------------- numeric round trips


@pytest.mark.parametrize(("datatype", "numpy_type"), NUMERIC)
@pytest.mark.parametrize("shape", [(), (0,), (0, 3), (5,), (2, 3, 4)], ids=str)
def test_numeric_roundtrip(datatype, numpy_type, shape):
    rng = np.random.default_rng(1)
    raw = rng.integers(0, 256, size=int(np.prod(shape)) * np.dtype(numpy_type).itemsize, dtype=np.uint8)
    if numpy_type is np.bool_:
        raw = raw % 2
    array = raw.view(numpy_type).reshape(shape)
    proto = to_tensor_proto(array)
    assert proto.dtype == datatype
    assert shape_from_proto(proto.tensor_shape) == shape
    assert len(proto.tensor_content) == array.nbytes
    assert_same(roundtrip(array), array)


NUMERIC_DTYPES = st.sampled_from(
    [np.dtype(numpy_type) for _, numpy_type in NUMERIC if numpy_type is not ml_dtypes.bfloat16]
)
ANY_ORDER_DTYPES = NUMERIC_DTYPES.flatmap(lambda d: st.sampled_from([d, d.newbyteorder(">")]))
SHAPES = hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=6)


@given(hnp.arrays(ANY_ORDER_DTYPES, SHAPES))
def test_numeric_roundtrip_property(array):
    assert_same(roundtrip(array), array)


@given(hnp.arrays(NUMERIC_DTYPES, hnp.array_shapes(min_dims=2, max_dims=3, min_side=1, max_side=6)))
def test_non_contiguous_roundtrip_property(array):
    for view in (array.T, array[::2], array[..., ::-1]):
        assert_same(roundtrip(view), view)


@given(hnp.arrays(np.uint16, SHAPES))
def test_bfloat16_roundtrip_property(bits):
    array = bits.view(ml_dtypes.bfloat16)
    proto = to_tensor_proto(array)
    assert proto.dtype == t.DT_BFLOAT16
    assert_same(from_tensor_proto(proto), array)


def test_big_endian_input_is_written_little_endian():
    array = np.array([1, 258, -2], dtype=">i4")
    proto = to_tensor_proto(array)
    assert proto.dtype == t.DT_INT32
    assert proto.tensor_content == struct.pack("<3i", 1, 258, -2)
    result = from_tensor_proto(proto)
    assert result.dtype == np.dtype(np.int32)
    assert result.tolist() == [1, 258, -2]


def test_big_endian_complex_and_non_contiguous():
    array = (np.arange(24).reshape(4, 6) * (1 + 2j)).astype(">c16")[1::2, ::-3]
    assert array.dtype.byteorder == ">"
    assert not array.flags.c_contiguous
    result = roundtrip(array)
    assert result.dtype == np.dtype(np.complex128)
    np.testing.assert_array_equal(result, array)


def test_large_tensor_roundtrip():
    array = np.arange(1_000_000, dtype=np.float32).reshape(1000, 1000)
    proto = to_tensor_proto(array)
    assert len(proto.tensor_content) == 4_000_000
    assert_same(from_tensor_proto(proto), array)


def test_result_is_read_only_unless_writable():
    proto = to_tensor_proto(np.array([1.0, 2.0], np.float32))
    shared = from_tensor_proto(proto)
    assert not shared.flags.writeable
    private = from_tensor_proto(proto, writable=True)
    assert private.flags.writeable
    private[0] = 9
    assert from_tensor_proto(proto).tolist() == [1.0, 2.0]


def test_content_size_mismatch():
    proto = TensorProto(dtype=t.DT_FLOAT, tensor_shape=shape_proto(2, 3), tensor_content=b"\0" * 20)
    with pytest.raises(errors.InvalidArgumentError, match=r"20 bytes of tensor_content, expected 24"):
        from_tensor_proto(proto)


def test_content_with_zero_elements():
    proto = TensorProto(dtype=t.DT_FLOAT, tensor_shape=shape_proto(0, 3), tensor_content=b"\0" * 4)
    with pytest.raises(errors.InvalidArgumentError, match="expected 0"):
        from_tensor_proto(proto)


def test_content_wins_over_typed_field():
    proto = TensorProto(
        dtype=t.DT_INT32, tensor_shape=shape_proto(2), tensor_content=struct.pack("<2i", 5, 6), int_val=[1, 2]
    )
    assert from_tensor_proto(proto).tolist() == [5, 6]


def test_content_limit(monkeypatch):
    monkeypatch.setattr(tensors, "_MAX_CONTENT_BYTES", 15)
    to_tensor_proto(np.zeros(15, np.uint8))
    with pytest.raises(ValueError, match="larger than 2GB"):
        to_tensor_proto(np.zeros(4, np.float32))


# --------------------------------------------------------------------------- typed fields


@pytest.mark.parametrize(
    ("fields", "datatype", "expected"),
    [
        ({"float_val": [1.5, -2]}, t.DT_FLOAT, np.array([1.5, -2], np.float32)),
        ({"double_val": [1e300, 2]}, t.DT_DOUBLE, np.array([1e300, 2])),
        ({"int_val": [1, -2]}, t.DT_INT32, np.array([1, -2], np.int32)),
        ({"int_val": [-128, 127]}, t.DT_INT8, np.array([-128, 127], np.int8)),
        ({"int_val": [-3, 30000]}, t.DT_INT16, np.array([-3, 30000], np.int16)),
        ({"int_val": [0, 255]}, t.DT_UINT8, np.array([0, 255], np.uint8)),
        ({"int_val": [0, 65535]}, t.DT_UINT16, np.array([0, 65535], np.uint16)),
        ({"int64_val": [-(1 << 62), 5]}, t.DT_INT64, np.array([-(1 << 62), 5], np.int64)),
        ({"uint32_val": [1 << 31, 5]}, t.DT_UINT32, np.array([1 << 31, 5], np.uint32)),
        ({"uint64_val": [(1 << 64) - 1, 5]}, t.DT_UINT64, np.array([(1 << 64) - 1, 5], np.uint64)),
        ({"bool_val": [True, False]}, t.DT_BOOL, np.array([True, False])),
        ({"half_val": [0x3C00, 0xC000]}, t.DT_HALF, np.array([1.0, -2.0], np.float16)),
        ({"half_val": [0x3F80, 0xC000]}, t.DT_BFLOAT16, np.array([1.0, -2.0], ml_dtypes.bfloat16)),
        ({"scomplex_val": [1, 2, 3, -4]}, t.DT_COMPLEX64, np.array([1 + 2j, 3 - 4j], np.complex64)),
        ({"dcomplex_val": [1, 2, 3, -4]}, t.DT_COMPLEX128, np.array([1 + 2j, 3 - 4j])),
    ],
)
def test_typed_fields(fields, datatype, expected):
    proto = TensorProto(dtype=datatype, tensor_shape=shape_proto(2), **fields)
    result = from_tensor_proto(proto)
    assert_same(result, expected)
    assert result.flags.writeable

    # One value fills the whole shape.
    one = {
        name: values[: 2 if name in ("scomplex_val", "dcomplex_val") else 1]
        for name, values in fields.items()
    }
    proto = TensorProto(dtype=datatype, tensor_shape=shape_proto(2, 3), **one)
    assert_same(from_tensor_proto(proto), np.full((2, 3), expected[0], dtype=expected.dtype))

    # No values mean zeros.
    proto = TensorProto(dtype=datatype, tensor_shape=shape_proto(3))
    assert_same(from_tensor_proto(proto), np.zeros(3, dtype=expected.dtype))

    # A scalar.
    proto = TensorProto(dtype=datatype, **one)
    assert_same(from_tensor_proto(proto), expected[0])


def test_typed_field_padded_with_last_value():
    # TF1 `tf.constant([1, 2], shape=[5])` sends two values for five elements.
    proto = TensorProto(dtype=t.DT_INT32, tensor_shape=shape_proto(5), int_val=[1, 2])
    assert from_tensor_proto(proto).tolist() == [1, 2, 2, 2, 2]


def test_typed_field_with_too_many_values():
    proto = TensorProto(dtype=t.DT_FLOAT, tensor_shape=shape_proto(2), float_val=[1, 2, 3])
    with pytest.raises(errors.InvalidArgumentError, match="3 values, more than its 2 elements"):
        from_tensor_proto(proto)


def test_typed_field_ref_dtype():
    proto = TensorProto(dtype=t.DT_FLOAT_REF, tensor_shape=shape_proto(2), float_val=[3])
    assert_same(from_tensor_proto(proto), np.array([3, 3], np.float32))


def test_odd_complex_values():
    proto = TensorProto(dtype=t.DT_COMPLEX64, tensor_shape=shape_proto(2), scomplex_val=[1, 2, 3])
    with pytest.raises(errors.InvalidArgumentError, match="odd number"):
        from_tensor_proto(proto)


@pytest.mark.parametrize(
    "shape",
    [TensorShapeProto(unknown_rank=True), shape_to_proto([2, None])],
    ids=["unknown_rank", "unknown_dim"],
)
def test_value_needs_fully_defined_shape(shape):
    proto = TensorProto(dtype=t.DT_FLOAT, tensor_shape=shape, float_val=[1])
    with pytest.raises(errors.InvalidArgumentError, match="fully defined shape"):
        from_tensor_proto(proto)


@pytest.mark.parametrize("datatype", [t.DT_INVALID, t.DT_QINT8, t.DT_QUINT16])
def test_unsupported_dtype_in_proto(datatype):
    proto = TensorProto(dtype=datatype, tensor_shape=shape_proto(1), int_val=[1])
    with pytest.raises(errors.InvalidArgumentError, match=datatype_name(datatype)):
        from_tensor_proto(proto)


# --------------------------------------------------------------------------- python values


@pytest.mark.parametrize(
    ("value", "datatype", "expected"),
    [
        (1.5, t.DT_FLOAT, np.float32(1.5)),
        ([1.0, 2.0], t.DT_FLOAT, np.array([1, 2], np.float32)),
        ([[1, 2.5]], t.DT_FLOAT, np.array([[1, 2.5]], np.float32)),
        (7, t.DT_INT32, np.int32(7)),
        ([1, -2], t.DT_INT32, np.array([1, -2], np.int32)),
        ([1, 1 << 40], t.DT_INT64, np.array([1, 1 << 40], np.int64)),
        (True, t.DT_BOOL, np.bool_(True)),
        (1 + 2j, t.DT_COMPLEX128, np.complex128(1 + 2j)),
        ([], t.DT_FLOAT, np.zeros(0, np.float32)),
        (np.float64(1.5), t.DT_DOUBLE, np.float64(1.5)),
        (np.array([1, 2]), t.DT_INT64, np.array([1, 2], np.int64)),
        (np.array(3.0), t.DT_DOUBLE, np.float64(3.0)),
    ],
)
def test_python_values_follow_make_tensor_proto(value, datatype, expected):
    proto = make_tensor_proto(value)
    assert proto.dtype == datatype
    assert_same(from_tensor_proto(proto), expected)


@pytest.mark.parametrize(
    ("value", "dtype", "expected"),
    [
        ([1, 2], np.float64, np.array([1, 2], np.float64)),
        ([1, 2], "int8", np.array([1, 2], np.int8)),
        ([1.5], t.DT_HALF, np.array([1.5], np.float16)),
        ([1.5], "bfloat16", np.array([1.5], ml_dtypes.bfloat16)),
        (3, t.DT_COMPLEX64, np.complex64(3)),
        ([True, False], t.DT_INT32, np.array([1, 0], np.int32)),
        ([], t.DT_INT64, np.zeros(0, np.int64)),
        (np.array([1.7, -1.7]), np.int32, np.array([1, -1], np.int32)),
        (np.array([1, 2], ">i2"), t.DT_FLOAT, np.array([1, 2], np.float32)),
        (5, t.DT_FLOAT_REF, np.float32(5)),
    ],
)
def test_explicit_dtype(value, dtype, expected):
    assert_same(roundtrip(value, dtype=dtype), expected)


@pytest.mark.parametrize(
    ("value", "dtype"),
    [
        ([1.5], np.int32),
        ([1 + 1j], np.float32),
        ([1], np.bool_),
        (["1"], np.float32),
        (np.array(["1"]), np.float32),
        ([None], np.float32),
        ([1.0], t.DT_STRING),
        (np.array([1.0]), t.DT_STRING),
        ([1], t.DT_RESOURCE),
        ([b"x"], t.DT_VARIANT),
    ],
)
def test_explicit_dtype_incompatible(value, dtype):
    with pytest.raises(TypeError):
        to_tensor_proto(value, dtype=dtype)


def test_explicit_dtype_unsupported():
    with pytest.raises(errors.InvalidArgumentError, match="DT_QINT8"):
        to_tensor_proto([1], dtype=t.DT_QINT8)
    with pytest.raises(TypeError):
        to_tensor_proto([1], dtype="nonsense")


def test_python_float_beyond_float32_becomes_inf():
    assert roundtrip([1e300, -1e300]).tolist() == [np.inf, -np.inf]


def test_python_int_out_of_range():
    with pytest.raises(ValueError, match="DT_INT8"):
        to_tensor_proto([300], dtype=np.int8)


def test_ragged_list():
    with pytest.raises(ValueError, match="Cannot convert"):
        to_tensor_proto([[1, 2], [3]])


@pytest.mark.parametrize(
    "value", [[object()], np.array([object()]), np.array([1, "a"], dtype=object), np.zeros(2, "M8[s]")]
)
def test_unconvertible_values(value):
    with pytest.raises(TypeError, match="Cannot convert"):
        to_tensor_proto(value)


# --------------------------------------------------------------------------- strings


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (b"abc", [b"abc"]),
        ("héllo", ["héllo".encode()]),
        ([b"a", "b", b""], [b"a", b"b", b""]),
        ([[b"a\x00", b"\x00"], [b"c", b"dd"]], [b"a\x00", b"\x00", b"c", b"dd"]),
        (np.array(["x", "yz"]), [b"x", b"yz"]),
        (np.array([b"x", b"yz"]), [b"x", b"yz"]),
        (np.array([b"x", "y"], dtype=object), [b"x", b"y"]),
        (np.array([], dtype=object), []),
        (np.str_("s"), [b"s"]),
    ],
)
def test_strings(value, expected):
    proto = to_tensor_proto(value)
    assert proto.dtype == t.DT_STRING
    assert not proto.tensor_content
    assert list(proto.string_val) == expected
    result = roundtrip(value)
    assert result.dtype == np.dtype(object)
    assert result.shape == np.shape(value)
    assert result.ravel().tolist() == expected


def test_strings_non_contiguous():
    array = np.array([[b"a", b"b"], [b"c", b"d"]], dtype=object).T
    assert roundtrip(array).tolist() == [[b"a", b"c"], [b"b", b"d"]]


def test_string_typed_field_broadcast_and_zeros():
    proto = TensorProto(dtype=t.DT_STRING, tensor_shape=shape_proto(2, 2), string_val=[b"z"])
    assert from_tensor_proto(proto).tolist() == [[b"z", b"z"], [b"z", b"z"]]
    proto = TensorProto(dtype=t.DT_STRING, tensor_shape=shape_proto(2))
    assert from_tensor_proto(proto).tolist() == [b"", b""]
    proto = TensorProto(dtype=t.DT_STRING, string_val=[b"s"])
    result = from_tensor_proto(proto)
    assert result.shape == ()
    assert result[()] == b"s"


def test_strings_in_tensor_content():
    # TensorFlow's AsProtoTensorContent: varint32 length of each string, then the bytes.
    long = b"x" * 200
    content = b"\x01\x00\xc8\x01" + b"a" + long
    proto = TensorProto(dtype=t.DT_STRING, tensor_shape=shape_proto(3), tensor_content=content)
    assert from_tensor_proto(proto).tolist() == [b"a", b"", long]


@pytest.mark.parametrize(
    "content",
    [b"\x01\x02ab", b"\x02\x01ab", b"\x01", b"\x80\x80\x80\x80\x80\x01" + b"a", b"\x05abc"],
)
def test_bad_strings_in_tensor_content(content):
    proto = TensorProto(dtype=t.DT_STRING, tensor_shape=shape_proto(2), tensor_content=content)
    with pytest.raises(errors.InvalidArgumentError, match="does not encode 2 elements"):
        from_tensor_proto(proto)


# --------------------------------------------------------------------------- resources and variants


def test_resource_handle_proto_roundtrip():
    proto = HANDLE.to_proto()
    assert proto.device == HANDLE.device
    assert proto.name == "v"
    assert len(proto.dtypes_and_shapes) == 1
    assert proto.dtypes_and_shapes[0].dtype == t.DT_FLOAT
    assert shape_from_proto(proto.dtypes_and_shapes[0].shape) == (2, None)
    assert ResourceHandle.from_proto(ResourceHandleProto.FromString(proto.SerializeToString())) == HANDLE


def test_resource_handle_without_dtype_and_with_tf_fields():
    handle = ResourceHandle(
        "/job:w/replica:0/task:0/device:CPU:0", "c", "q", hash_code=123, maybe_type_name="T"
    )
    proto = handle.to_proto()
    assert not proto.dtypes_and_shapes
    assert (proto.hash_code, proto.maybe_type_name) == (123, "T")
    assert ResourceHandle.from_proto(proto) == handle


def test_resource_handle_dtype_unknown_rank_and_normalisation():
    handle = ResourceHandle("d", "", "n", dtype="float64")  # type: ignore[arg-type]
    assert handle.dtype == np.dtype(np.float64)
    back = ResourceHandle.from_proto(handle.to_proto())
    assert back.dtype == np.dtype(np.float64)
    assert back.shape is None
    assert hash(back) == hash(handle)


def test_resource_tensor():
    proto = to_tensor_proto(HANDLE)
    assert proto.dtype == t.DT_RESOURCE
    assert not proto.tensor_shape.dim
    assert len(proto.resource_handle_val) == 1
    result = roundtrip(HANDLE)
    assert result.shape == ()
    assert result.dtype == np.dtype(object)
    assert result[()] == HANDLE

    array = np.empty(2, dtype=object)
    array[0], array[1] = HANDLE, ResourceHandle("d", "", "w")
    assert roundtrip(array).tolist() == array.tolist()
    assert roundtrip(array, dtype=t.DT_RESOURCE).tolist() == array.tolist()


def test_resource_handles_in_tensor_content():
    pieces = [
        HANDLE.to_proto().SerializeToString(),
        ResourceHandle("d", "", "w").to_proto().SerializeToString(),
    ]
    assert all(len(piece) < 128 for piece in pieces)
    content = bytes([len(pieces[0]), len(pieces[1])]) + b"".join(pieces)
    proto = TensorProto(dtype=t.DT_RESOURCE, tensor_shape=shape_proto(2), tensor_content=content)
    assert from_tensor_proto(proto).tolist() == [HANDLE, ResourceHandle("d", "", "w")]


def test_resource_typed_field_zeros_and_broadcast():
    proto = TensorProto(dtype=t.DT_RESOURCE, tensor_shape=shape_proto(2))
    assert from_tensor_proto(proto).tolist() == [ResourceHandle("", "", "")] * 2
    proto = TensorProto(
        dtype=t.DT_RESOURCE, tensor_shape=shape_proto(2), resource_handle_val=[HANDLE.to_proto()]
    )
    assert from_tensor_proto(proto).tolist() == [HANDLE, HANDLE]


def test_variant_tensor():
    variant = VariantTensorDataProto(type_name="T", metadata=b"m", tensors=[to_tensor_proto(1.0)])
    proto = to_tensor_proto(variant)
    assert proto.dtype == t.DT_VARIANT
    result = roundtrip(variant)
    assert result.shape == ()
    assert result[()] == variant

    content = bytes([variant.ByteSize()]) + variant.SerializeToString()
    proto = TensorProto(dtype=t.DT_VARIANT, tensor_shape=shape_proto(1), tensor_content=content)
    assert from_tensor_proto(proto).tolist() == [variant]


def test_unparsable_resource_in_content():
    proto = TensorProto(dtype=t.DT_RESOURCE, tensor_shape=shape_proto(1), tensor_content=b"\x02\xff\xff")
    with pytest.raises(errors.InvalidArgumentError, match="does not parse"):
        from_tensor_proto(proto)


# --------------------------------------------------------------------------- sizes


def test_tensor_nbytes():
    assert tensor_nbytes(np.zeros((3, 4), np.float64)) == 96
    assert tensor_nbytes([1.0, 2.0]) == 16
    assert tensor_nbytes(np.array([b"ab", "é"], dtype=object)) == 4
    assert tensor_nbytes(np.array(["ab", "c"])) == 3
    assert tensor_nbytes(HANDLE) == HANDLE.to_proto().ByteSize()
    with pytest.raises(TypeError):
        tensor_nbytes(np.array([object()]))


# -- budgets: a few bytes must not claim gigabytes -------------------------------------


@pytest.mark.parametrize(
    ("datatype", "elements"),
    [
        (t.DT_VARIANT, 1 << 40),  # 23 bytes on the wire: took a task down once
        (t.DT_STRING, 1 << 30),
        (t.DT_FLOAT, 1 << 30),
        (t.DT_RESOURCE, 1 << 28),
    ],
)
def test_a_tiny_proto_claiming_a_huge_shape_is_refused_before_anything_is_allocated(datatype, elements):
    proto = TensorProto(dtype=datatype)
    proto.tensor_shape.dim.add(size=elements)
    assert len(proto.SerializeToString()) < 32
    tracemalloc.start()
    try:
        with pytest.raises(errors.ResourceExhaustedError, match="DISTSERVER_DECODE") as info:
            from_tensor_proto(proto)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20
    assert f"shape [{elements}]" in info.value.message


def test_padding_is_bounded_but_values_that_travel_are_not():
    budget = DecodeBudget(limit_bytes=1 << 30, padding_limit_bytes=1 << 10)
    carried = to_tensor_proto(np.zeros(4096, np.float32))  # 16 KiB in tensor_content
    assert from_tensor_proto(carried, budget=budget).shape == (4096,)
    padded = TensorProto(dtype=t.DT_FLOAT, float_val=[1.0])
    padded.tensor_shape.dim.add(size=4096)
    with pytest.raises(errors.ResourceExhaustedError, match="1024 bytes of padding per message"):
        from_tensor_proto(padded, budget=budget)


def test_one_budget_is_shared_by_the_tensors_of_a_message():
    budget = DecodeBudget(limit_bytes=10_000, what="a RunGraph request")
    proto = to_tensor_proto(np.zeros(1000, np.float32))  # 4,000 bytes each
    from_tensor_proto(proto, budget=budget)
    from_tensor_proto(proto, budget=budget)
    with pytest.raises(errors.ResourceExhaustedError, match=r"in a RunGraph request .* limit of 10000 bytes"):
        from_tensor_proto(proto, budget=budget)
    assert budget.used_bytes == 8000


def test_padded_object_tensors_share_their_item_without_a_python_loop():
    proto = TensorProto(dtype=t.DT_VARIANT)
    proto.tensor_shape.dim.add(size=1 << 20)
    value = from_tensor_proto(proto)
    assert value.shape == (1 << 20,)
    assert value[0] is value[-1]
    assert value[0] == VariantTensorDataProto()


# -- the short paths of the usual case (a numeric array, a numeric tensor_content) ---------

_NUMERIC = [
    np.float32,
    np.float64,
    np.int32,
    np.int64,
    np.uint8,
    np.int8,
    np.int16,
    np.uint16,
    np.uint32,
    np.uint64,
    np.bool_,
    np.float16,
    np.complex64,
    np.complex128,
    ml_dtypes.bfloat16,
]


@pytest.mark.parametrize("dtype", _NUMERIC, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("shape", [(), (0,), (3,), (2, 3), (4, 1, 2)])
def test_short_paths_give_what_the_general_ones_give(dtype, shape):
    value = (np.arange(int(np.prod(shape))) % 3).astype(dtype).reshape(shape)
    short = to_tensor_proto(value)
    general = to_tensor_proto(value, dtype=value.dtype)  # an explicit dtype takes the general path
    assert short.SerializeToString() == general.SerializeToString()
    decoded = from_tensor_proto(short)
    assert decoded.dtype == value.dtype
    assert decoded.shape == shape
    assert decoded.flags.writeable == (value.size == 0)  # content is shared, read-only
    np.testing.assert_array_equal(decoded, value)
    writable = from_tensor_proto(short, writable=True)  # the general path
    assert writable.flags.writeable
    np.testing.assert_array_equal(writable, value)


def test_short_encode_handles_strides_and_byte_order():
    value = np.arange(12, dtype=np.float32).reshape(3, 4)
    assert to_tensor_proto(value.T).tensor_content == np.ascontiguousarray(value.T).tobytes()
    big = value.astype(">f4")  # not in the short path's table: the general path swaps it
    assert to_tensor_proto(big).tensor_content == value.tobytes()


def test_short_decode_still_refuses_bad_shapes_and_sizes():
    unknown = to_tensor_proto(np.zeros(2, np.float32))
    unknown.tensor_shape.unknown_rank = True
    with pytest.raises(errors.InvalidArgumentError, match="fully defined shape"):
        from_tensor_proto(unknown)
    negative = to_tensor_proto(np.zeros(2, np.float32))
    negative.tensor_shape.dim[0].size = -1
    with pytest.raises(errors.InvalidArgumentError, match="fully defined shape"):
        from_tensor_proto(negative)
    short = to_tensor_proto(np.zeros(2, np.float32))
    short.tensor_shape.dim[0].size = 3
    with pytest.raises(errors.InvalidArgumentError, match="has 8 bytes of tensor_content, expected 12"):
        from_tensor_proto(short)


def test_the_shape_caches_stay_bounded():
    for size in range(tensors._SHAPE_PROTOS_KEPT + 10):
        value = np.zeros((1, size), np.uint8)
        assert from_tensor_proto(to_tensor_proto(value)).shape == (1, size)
    assert len(tensors._SHAPES_BY_WIRE) <= tensors._SHAPE_PROTOS_KEPT
    assert len(tensors._SHAPE_PROTOS) <= tensors._SHAPE_PROTOS_KEPT


@pytest.mark.parametrize(
    "value",
    [
        np.arange(6, dtype=np.float32).reshape(2, 3),
        np.array(b"text", dtype=object),
        1.5,
        np.arange(4).astype(">i4"),
    ],
    ids=["numeric", "string", "python", "big-endian"],
)
def test_write_tensor_proto_writes_what_to_tensor_proto_makes(value):
    written = TensorProto()
    tensors.write_tensor_proto(written, value)
    assert written.SerializeToString() == to_tensor_proto(value).SerializeToString()


@pytest.mark.parametrize("field", ["tensor_content", "float_val"])
def test_a_tensor_of_more_dimensions_than_an_array_holds_is_refused_and_its_shape_not_kept(field):
    def proto(rank: int) -> TensorProto:
        value = TensorProto(dtype=t.DT_FLOAT)
        if field == "tensor_content":
            value.tensor_content = np.float32(2).tobytes()
        else:
            value.float_val.append(2.0)
        for _ in range(rank):
            value.tensor_shape.dim.add(size=1)
        return value

    assert tensors.from_tensor_proto(proto(tensors.MAX_RANK)).shape == (1,) * tensors.MAX_RANK
    kept = dict(tensors._SHAPES_BY_WIRE)
    for rank in (tensors.MAX_RANK + 1, 100_000):  # (a peer's: 400 KB of shape)
        with pytest.raises(errors.InvalidArgumentError, match=f"has {rank} dimensions; .* at most 64"):
            tensors.from_tensor_proto(proto(rank))
    assert kept == tensors._SHAPES_BY_WIRE


def test_an_empty_tensor_whose_other_sizes_no_array_can_hold_is_refused():
    def proto(sizes: tuple[int, ...]) -> TensorProto:
        value = TensorProto(dtype=t.DT_FLOAT)
        for size in sizes:
            value.tensor_shape.dim.add(size=size)
        return value

    assert tensors.from_tensor_proto(proto((0, 1 << 20, 1 << 20))).shape == (0, 1 << 20, 1 << 20)
    # Empty, yet numpy refuses the shape ("array is too big"): refused by name.
    with pytest.raises(errors.InvalidArgumentError, match=r"shape \[0,35184372088832,.*more elements than"):
        tensors.from_tensor_proto(proto((0, 1 << 45, 1 << 45)))
    assert tensors.holdable((0, 1 << 30, 1 << 30), 4)
    assert not tensors.holdable((0, 1 << 45, 1 << 45), 4)
