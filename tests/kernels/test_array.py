"""Array kernels against numpy references and TensorFlow's documented semantics."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from distserver import errors
from distserver.kernels import create_kernel
from distserver.tensors import shape_to_proto, to_tensor_proto

I32 = np.int32


def ints(*values):
    return np.array(values, I32)


# --------------------------------------------------------------------------- constants and feeds


def test_const_outputs_its_value_read_only(run_op):
    value = np.arange(6, dtype=np.float32).reshape(2, 3)
    (out,) = run_op("Const", value=value, dtype=np.float32)
    np.testing.assert_array_equal(out, value)
    assert out.dtype == np.float32
    assert not out.flags.writeable  # shared by every step
    (text,) = run_op("Const", value=np.array([b"a", b"bc"], dtype=object), dtype=object)
    assert text.tolist() == [b"a", b"bc"]


def test_const_dtype_mismatch_fails_at_creation(make_node):
    node = make_node("Const", name="c", value=to_tensor_proto(np.ones(2, np.float32)), dtype=np.int32)
    with pytest.raises(
        errors.InvalidArgumentError, match=r"Type mismatch between value \(float\) and dtype \(int32\)"
    ):
        create_kernel(node)


@pytest.mark.parametrize(
    ("shape", "suffix"),
    [
        ((None, 3), " and shape [?,3]"),
        ((2,), " and shape [2]"),
        ((), ""),
        (shape_to_proto(None), ""),
    ],
)
def test_placeholder_must_be_fed(run_op, shape, suffix):
    with pytest.raises(errors.InvalidArgumentError) as info:
        run_op("Placeholder", name="x", dtype=np.float32, shape=shape)
    assert info.value.message.startswith(
        f"You must feed a value for placeholder tensor 'x' with dtype float{suffix}"
    )
    assert info.value.message.endswith("[[{{node x}}]]")
    assert info.value.node_name == "x"


def test_pass_through_ops(run_op):
    x = np.arange(3)
    for op in ("Identity", "StopGradient", "PlaceholderWithDefault", "Snapshot"):
        assert run_op(op, x, T=np.int64, dtype=np.int64)[0] is x
    y = np.array([b"s"], dtype=object)
    assert run_op("IdentityN", x, y, T=[np.int64, object]) == [x, y]
    assert run_op("NoOp") == []


# --------------------------------------------------------------------------- shapes


@pytest.mark.parametrize(
    ("in_shape", "sizes", "out_shape"),
    [
        ((2, 3), [3, 2], (3, 2)),
        ((2, 3), [-1], (6,)),
        ((2, 3), [3, -1], (3, 2)),
        ((6,), [1, -1, 1], (1, 6, 1)),
        ((), [1, 1], (1, 1)),
        ((1,), [], ()),
        ((0, 5), [0, -1], (0, 5)),  # TF infers -1 next to a zero dimension
        ((0,), [-1, 5], (0, 5)),
        ((4,), 4, (4,)),  # legacy scalar shape
    ],
)
def test_reshape(run_op, in_shape, sizes, out_shape):
    x = np.arange(int(np.prod(in_shape)), dtype=np.float32).reshape(in_shape)
    (out,) = run_op("Reshape", x, np.array(sizes, I32), T=np.float32, Tshape=I32)
    assert out.shape == out_shape
    np.testing.assert_array_equal(out.reshape(-1), x.reshape(-1))


@pytest.mark.parametrize(
    ("in_shape", "sizes", "message"),
    [
        ((2, 3), [4], "Input to reshape is a tensor with 6 values, but the requested shape has 4"),
        (
            (7,),
            [2, -1],
            "Input to reshape is a tensor with 7 values, but the requested shape requires a multiple of 2",
        ),
        ((6,), [-1, -1], "Only one input size may be -1, not both 0 and 1"),
        ((6,), [-2, 3], "Size 0 must be non-negative, not -2"),
    ],
)
def test_reshape_errors(run_op, in_shape, sizes, message):
    with pytest.raises(errors.InvalidArgumentError) as info:
        run_op("Reshape", np.zeros(in_shape, np.float32), np.array(sizes, I32), T=np.float32, name="r")
    assert info.value.message.startswith(message)
    assert info.value.node_name == "r"


@pytest.mark.parametrize("out_type", [np.int32, np.int64])
def test_shape_size_rank(run_op, out_type):
    x = np.zeros((2, 0, 3), np.float32)
    (shape,) = run_op("Shape", x, T=np.float32, out_type=out_type)
    (size,) = run_op("Size", x, T=np.float32, out_type=out_type)
    assert shape.dtype == size.dtype == np.dtype(out_type)
    assert shape.tolist() == [2, 0, 3]
    assert size.shape == ()
    assert size == 0
    (rank,) = run_op("Rank", np.float32(1), T=np.float32)
    assert rank.dtype == np.int32
    assert rank.shape == ()
    assert rank == 0


def test_fill(run_op):
    (out,) = run_op("Fill", ints(2, 3), np.float32(1.5), T=np.float32, index_type=I32)
    np.testing.assert_array_equal(out, np.full((2, 3), 1.5, np.float32))
    (scalar,) = run_op("Fill", np.zeros(0, I32), np.int64(7), T=np.int64)
    assert scalar.shape == ()
    assert scalar == 7
    (text,) = run_op("Fill", ints(2), np.array(b"x", dtype=object), T=object)
    assert text.tolist() == [b"x", b"x"]
    with pytest.raises(errors.InvalidArgumentError, match=r"value must be a scalar, got shape \[2\]"):
        run_op("Fill", ints(2), np.ones(2, np.float32), T=np.float32)
    with pytest.raises(errors.InvalidArgumentError, match=r"dims must be a vector, got shape \[\]"):
        run_op("Fill", np.int32(2), np.float32(1), T=np.float32)


@pytest.mark.parametrize("dtype", [np.float32, np.int64, np.bool_, np.complex64])
def test_zeros_like_and_ones_like(run_op, dtype):
    x = np.empty((2, 3), dtype)
    np.testing.assert_array_equal(run_op("ZerosLike", x, T=dtype)[0], np.zeros((2, 3), dtype))
    (ones,) = run_op("OnesLike", x, T=dtype)
    assert ones.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(ones, np.ones((2, 3), dtype))


@pytest.mark.parametrize(
    ("shape", "perm"), [((2, 3, 4), [2, 0, 1]), ((2, 3), [1, 0]), ((), []), ((0, 2), [1, 0])]
)
def test_transpose(run_op, shape, perm):
    x = np.arange(int(np.prod(shape))).reshape(shape)
    (out,) = run_op("Transpose", x, np.array(perm, I32), T=np.int64, Tperm=I32)
    np.testing.assert_array_equal(out, np.transpose(x, perm))


def test_transpose_errors(run_op):
    x = np.zeros((2, 3))
    with pytest.raises(errors.InvalidArgumentError, match=r"1 is missing from \{0,0\}\."):
        run_op("Transpose", x, ints(0, 0), T=np.float64)
    with pytest.raises(errors.InvalidArgumentError, match=r"transpose expects a vector of size 2. But input"):
        run_op("Transpose", x, ints(0, 1, 2), T=np.float64)
    with pytest.raises(errors.InvalidArgumentError, match=r"2 is out of range \[0 \.\. 2\)"):
        run_op("Transpose", x, ints(0, 2), T=np.float64)


@pytest.mark.parametrize("dim", [0, 1, 2, -1, -3])
def test_expand_dims(run_op, dim):
    x = np.arange(24.0).reshape(4, 6)[::2, ::3]  # (not contiguous: still a view)
    (out,) = run_op("ExpandDims", x, np.array(dim, I32), T=np.float64, Tdim=I32)
    expected = np.expand_dims(x, dim)
    assert out.shape == expected.shape
    assert out.strides == expected.strides
    np.testing.assert_array_equal(out, expected)
    assert np.shares_memory(out, x)


@pytest.mark.parametrize("dim", [0, -1])
def test_expand_dims_of_a_scalar(run_op, dim):
    (out,) = run_op("ExpandDims", np.array(7.0), np.array([dim], I32), T=np.float64, Tdim=I32)
    np.testing.assert_array_equal(out, np.array([7.0]))


def test_expand_dims_errors(run_op):
    with pytest.raises(
        errors.InvalidArgumentError, match=r"Tried to expand dim index 3 for tensor with 2 dimensions."
    ):
        run_op("ExpandDims", np.zeros((2, 3)), np.array(3, I32), T=np.float64)
    with pytest.raises(errors.InvalidArgumentError, match="'dim' must be a tensor with a single value"):
        run_op("ExpandDims", np.zeros((2, 3)), ints(0, 1), T=np.float64)


@pytest.mark.parametrize(
    ("shape", "squeeze_dims", "out_shape"),
    [((1, 2, 1, 3), [], (2, 3)), ((1, 2, 1, 3), [2], (1, 2, 3)), ((1, 2, 1), [-1, 0], (2,)), ((1,), [], ())],
)
def test_squeeze(run_op, shape, squeeze_dims, out_shape):
    (out,) = run_op("Squeeze", np.zeros(shape), T=np.float64, squeeze_dims=squeeze_dims)
    assert out.shape == out_shape


def test_squeeze_errors(run_op):
    with pytest.raises(
        errors.InvalidArgumentError, match=r"Can not squeeze dim\[1\], expected a dimension of 1, got 2"
    ):
        run_op("Squeeze", np.zeros((1, 2)), T=np.float64, squeeze_dims=[1])
    with pytest.raises(
        errors.InvalidArgumentError, match=r"Tried to squeeze dim index 2 for tensor with 2 dimensions."
    ):
        run_op("Squeeze", np.zeros((1, 2)), T=np.float64, squeeze_dims=[2])


@pytest.mark.parametrize(
    ("shape", "multiples"), [((2, 3), [2, 1]), ((2,), [3]), ((), []), ((2, 0), [2, 2]), ((2,), [0])]
)
def test_tile(run_op, shape, multiples):
    x = np.arange(int(np.prod(shape))).reshape(shape)
    (out,) = run_op("Tile", x, np.array(multiples, I32), T=np.int64)
    np.testing.assert_array_equal(out, np.tile(x, multiples) if shape else x)


def test_tile_errors(run_op):
    with pytest.raises(
        errors.InvalidArgumentError, match="Expected multiples argument to be a vector of length 2"
    ):
        run_op("Tile", np.zeros((2, 3)), ints(1), T=np.float64)
    with pytest.raises(errors.InvalidArgumentError, match=r"Expected multiples\[1\] >= 0, but got -1"):
        run_op("Tile", np.zeros((2, 3)), ints(1, -1), T=np.float64)


# --------------------------------------------------------------------------- joining and splitting


@pytest.mark.parametrize("axis", [0, 1, -1, -2])
def test_concat(run_op, axis):
    a, b = np.arange(6).reshape(2, 3), np.arange(6, 12).reshape(2, 3)
    (out,) = run_op("ConcatV2", a, b, np.array(axis, I32), T=np.int64, N=2, Tidx=I32)
    np.testing.assert_array_equal(out, np.concatenate([a, b], axis=axis))


def test_concat_errors(run_op):
    a = np.zeros((2, 3))
    with pytest.raises(
        errors.InvalidArgumentError,
        match=r"ConcatOp : Dimension 1 in both shapes must be equal: "
        r"shape\[0\] = \[2,3\] vs. shape\[1\] = \[2,4\]",
    ):
        run_op("ConcatV2", a, np.zeros((2, 4)), np.array(0, I32), T=np.float64, N=2)
    with pytest.raises(
        errors.InvalidArgumentError,
        match=r"Expected concatenating dimensions in the range \[-2, 2\), but got 2",
    ):
        run_op("ConcatV2", a, a, np.array(2, I32), T=np.float64, N=2)
    with pytest.raises(errors.InvalidArgumentError, match="Ranks of all input tensors should match"):
        run_op("ConcatV2", a, np.zeros(3), np.array(0, I32), T=np.float64, N=2)
    with pytest.raises(errors.InvalidArgumentError, match="Can't concatenate scalars"):
        run_op("ConcatV2", np.float64(1), np.float64(2), np.array(0, I32), T=np.float64, N=2)


@pytest.mark.parametrize("axis", [0, 1, 2, -1, -3])
def test_pack_and_unpack_round_trip(run_op, axis):
    values = [np.arange(6).reshape(2, 3) + 10 * i for i in range(4)]
    (packed,) = run_op("Pack", *values, T=np.int64, N=4, axis=axis)
    np.testing.assert_array_equal(packed, np.stack(values, axis=axis))
    unpacked = run_op("Unpack", packed, T=np.int64, num=4, axis=axis)
    for got, want in zip(unpacked, values, strict=True):
        np.testing.assert_array_equal(got, want)


def test_pack_scalars_and_unpack_vector_give_arrays(run_op):
    (packed,) = run_op("Pack", np.int32(1), np.int32(2), T=I32, N=2)
    assert packed.tolist() == [1, 2]
    parts = run_op("Unpack", packed, T=I32, num=2)
    assert all(isinstance(p, np.ndarray) and p.shape == () for p in parts)


def test_pack_unpack_errors(run_op):
    with pytest.raises(
        errors.InvalidArgumentError,
        match=r"Shapes of all inputs must match: values\[0\].shape = \[2\] != values\[1\].shape = \[3\]",
    ):
        run_op("Pack", np.zeros(2), np.zeros(3), T=np.float64, N=2)
    with pytest.raises(errors.InvalidArgumentError, match=r"axis = 2 not in \[-2, 2\)"):
        run_op("Pack", np.zeros(2), np.zeros(2), T=np.float64, N=2, axis=2)
    with pytest.raises(
        errors.InvalidArgumentError, match=r"Input shape axis 0 must equal 3, got shape \[2,3\]"
    ):
        run_op("Unpack", np.zeros((2, 3)), T=np.float64, num=3)


# --------------------------------------------------------------------------- Range, Slice


@pytest.mark.parametrize(
    ("start", "limit", "delta", "dtype"),
    [
        (0, 10, 3, I32),
        (10, 0, -3, np.int64),
        (5, 5, 1, I32),
        (0.0, 1.0, 0.1, np.float32),
        (1.0, -1.0, -0.5, np.float64),
    ],
)
def test_range(run_op, start, limit, delta, dtype):
    (out,) = run_op(
        "Range", np.array(start, dtype), np.array(limit, dtype), np.array(delta, dtype), Tidx=dtype
    )
    expected = np.arange(start, limit, delta, dtype=dtype)
    assert out.dtype == np.dtype(dtype)
    np.testing.assert_allclose(out, expected, rtol=1e-6)


def test_range_errors(run_op):
    with pytest.raises(errors.InvalidArgumentError, match="Requires delta != 0: 0"):
        run_op("Range", np.int32(0), np.int32(5), np.int32(0), Tidx=I32)
    with pytest.raises(errors.InvalidArgumentError, match="Requires start <= limit when delta > 0: 5/1"):
        run_op("Range", np.int32(5), np.int32(1), np.int32(1), Tidx=I32)
    with pytest.raises(errors.InvalidArgumentError, match="Requires start >= limit when delta < 0: 1/5"):
        run_op("Range", np.int32(1), np.int32(5), np.int32(-1), Tidx=I32)
    with pytest.raises(errors.InvalidArgumentError, match=r"start must be a scalar, not shape \[2\]"):
        run_op("Range", ints(1, 2), np.int32(5), np.int32(1), Tidx=I32)


def test_slice(run_op):
    x = np.arange(24).reshape(2, 3, 4)
    (out,) = run_op("Slice", x, ints(1, 0, 1), ints(-1, 2, 3), T=np.int64, Index=I32)
    np.testing.assert_array_equal(out, x[1:, 0:2, 1:4])
    (empty,) = run_op("Slice", x, ints(2, 0, 0), ints(0, -1, -1), T=np.int64, Index=I32)
    assert empty.shape == (0, 3, 4)
    with pytest.raises(errors.InvalidArgumentError, match=r"Expected size\[1\] in \[0, 2\], but got 3"):
        run_op("Slice", x, ints(0, 1, 0), ints(1, 3, 1), T=np.int64)
    with pytest.raises(errors.InvalidArgumentError, match=r"Expected begin\[0\] in \[0, 2\], but got 3"):
        run_op("Slice", x, ints(3, 0, 0), ints(0, 0, 0), T=np.int64)
    with pytest.raises(
        errors.InvalidArgumentError, match="Expected begin and size arguments to be 1-D tensors of size 3"
    ):
        run_op("Slice", x, ints(0, 0), ints(1, 1), T=np.int64)


# --------------------------------------------------------------------------- StridedSlice


def _encode_index(index):
    """Encode a Python index tuple exactly as TensorFlow's `tensor[...]` does."""
    begin, end, strides = [], [], []
    masks = dict.fromkeys(("begin_mask", "end_mask", "ellipsis_mask", "new_axis_mask", "shrink_axis_mask"), 0)
    for i, item in enumerate(index):
        bit = 1 << i
        if isinstance(item, slice):
            begin.append(0 if item.start is None else item.start)
            end.append(0 if item.stop is None else item.stop)
            strides.append(1 if item.step is None else item.step)
            masks["begin_mask"] |= bit if item.start is None else 0
            masks["end_mask"] |= bit if item.stop is None else 0
        elif item is Ellipsis:
            begin.append(0), end.append(0), strides.append(1)
            masks["ellipsis_mask"] |= bit
        elif item is None:
            begin.append(0), end.append(0), strides.append(1)
            masks["new_axis_mask"] |= bit
        else:
            begin.append(item), end.append(item + 1), strides.append(1)
            masks["shrink_axis_mask"] |= bit
    return begin, end, strides, masks


def _strided_slice(run_op, x, index, index_type=I32):
    begin, end, strides, masks = _encode_index(index)
    (out,) = run_op(
        "StridedSlice",
        x,
        np.array(begin, index_type).reshape(-1),
        np.array(end, index_type).reshape(-1),
        np.array(strides, index_type).reshape(-1),
        T=x.dtype,
        Index=index_type,
        name="ss",
        **masks,
    )
    return out


@st.composite
def _array_and_index(draw):
    shape = tuple(draw(st.lists(st.integers(0, 5), max_size=4)))
    bound = st.one_of(st.none(), st.integers(-7, 7))
    items = []
    has_ellipsis = False
    for _ in range(draw(st.integers(0, 6))):
        kind = draw(st.sampled_from(["slice", "slice", "int", "newaxis", "ellipsis"]))
        if kind == "slice":
            step = draw(st.one_of(st.none(), st.integers(-3, 3).filter(bool)))
            items.append(slice(draw(bound), draw(bound), step))
        elif kind == "int":
            items.append(draw(st.integers(-6, 6)))
        elif kind == "newaxis":
            items.append(None)
        elif not has_ellipsis:
            has_ellipsis = True
            items.append(Ellipsis)
    return np.arange(int(np.prod(shape))).reshape(shape), tuple(items)


@settings(max_examples=400, deadline=None)
@given(_array_and_index(), st.sampled_from([np.int32, np.int64]))
def test_strided_slice_matches_numpy_indexing(run_op, case, index_type):
    x, index = case
    try:
        expected = x[index] if index else x[...]
    except IndexError:
        with pytest.raises(errors.InvalidArgumentError) as info:
            _strided_slice(run_op, x, index, index_type)
        assert info.value.node_name == "ss"
        return
    out = _strided_slice(run_op, x, index, index_type)
    assert isinstance(out, np.ndarray)
    assert out.shape == np.shape(expected)
    np.testing.assert_array_equal(out, expected)


def _strided(run_op, x, begin, end, strides, **masks):
    (out,) = run_op(
        "StridedSlice", x, ints(*begin), ints(*end), ints(*strides), T=x.dtype, Index=I32, **masks
    )
    return out


def test_strided_slice_mask_precedence(run_op):
    x = np.arange(12).reshape(3, 4)
    # shrink ignores begin_mask/end_mask and uses begin: x[2]
    np.testing.assert_array_equal(
        _strided(run_op, x, [2], [0], [1], shrink_axis_mask=1, begin_mask=1, end_mask=1), x[2]
    )
    # new_axis wins over shrink on the same position: x[None]
    assert _strided(run_op, x, [1], [2], [1], new_axis_mask=1, shrink_axis_mask=1).shape == (1, 3, 4)
    # ellipsis wins over new_axis: x[...]
    assert _strided(run_op, x, [0], [0], [1], ellipsis_mask=1, new_axis_mask=1).shape == (3, 4)
    # negative shrink index counts from the end: x[:, -1]
    np.testing.assert_array_equal(
        _strided(run_op, x, [0, -1], [0, 0], [1, 1], begin_mask=1, end_mask=1, shrink_axis_mask=2), x[:, -1]
    )
    # reverse with masks: x[::-1, ::-2]
    np.testing.assert_array_equal(
        _strided(run_op, x, [0, 0], [0, 0], [-1, -2], begin_mask=3, end_mask=3), x[::-1, ::-2]
    )
    # everything shrunk: a 0-d array, not a numpy scalar
    scalar = _strided(run_op, x, [1, 2], [2, 3], [1, 1], shrink_axis_mask=3)
    assert isinstance(scalar, np.ndarray)
    assert scalar.shape == ()
    assert scalar == 6


def test_strided_slice_errors(run_op):
    x = np.arange(12).reshape(3, 4)
    with pytest.raises(errors.InvalidArgumentError, match=r"slice index 3 of dimension 0 out of bounds."):
        _strided(run_op, x, [3], [4], [1], shrink_axis_mask=1)
    with pytest.raises(errors.InvalidArgumentError, match=r"strides\[0\] must be non-zero"):
        _strided(run_op, x, [0], [1], [0])
    with pytest.raises(errors.InvalidArgumentError, match=r"only stride 1 allowed on non-range indexing."):
        _strided(run_op, x, [0], [1], [-1], shrink_axis_mask=1)
    with pytest.raises(
        errors.InvalidArgumentError, match="Index out of range using input dim 2; input has only 2 dims"
    ):
        _strided(run_op, x, [0, 0, 0], [1, 1, 1], [1, 1, 1])
    with pytest.raises(errors.InvalidArgumentError, match="Multiple ellipses in slice spec not allowed"):
        _strided(run_op, x, [0, 0], [0, 0], [1, 1], ellipsis_mask=3)
    with pytest.raises(
        errors.InvalidArgumentError, match="Expected begin, end, and strides to be 1D equal size tensors"
    ):
        run_op("StridedSlice", x, ints(0), ints(0, 1), ints(1), T=np.int64, Index=I32)


# --------------------------------------------------------------------------- Select, Gather, OneHot


def test_select(run_op):
    t, e = np.arange(6).reshape(3, 2), -np.arange(6).reshape(3, 2)
    (rows,) = run_op("Select", np.array([True, False, True]), t, e, T=np.int64)
    np.testing.assert_array_equal(rows, np.where(np.array([True, False, True])[:, None], t, e))
    cond = np.array([[True, False], [False, True], [True, True]])
    np.testing.assert_array_equal(run_op("Select", cond, t, e, T=np.int64)[0], np.where(cond, t, e))
    np.testing.assert_array_equal(run_op("Select", np.array(False), t, e, T=np.int64)[0], e)
    with pytest.raises(
        errors.InvalidArgumentError,
        match=r"Number of batches of 'then' must match size of 'condition', but saw: 3 vs. 2",
    ):
        run_op("Select", np.array([True, False]), t, e, T=np.int64)
    with pytest.raises(errors.InvalidArgumentError, match=r"'then' and 'else' must have the same size."):
        run_op("Select", np.array(True), t, e[:2], T=np.int64)


def test_select_v2_broadcasts(run_op):
    cond = np.array([True, False, True])
    t = np.arange(6).reshape(2, 3)
    (out,) = run_op("SelectV2", cond, t, np.array(-1), T=np.int64)
    np.testing.assert_array_equal(out, np.where(cond, t, -1))
    with pytest.raises(
        errors.InvalidArgumentError,
        match=r"condition \[2\], then \[2,3\], and else \[\] must be broadcastable",
    ):
        run_op("SelectV2", np.array([True, False]), t, np.array(-1), T=np.int64)


def test_select_v2_of_alike_shapes(run_op):
    cond = np.array([[True, False, True], [False, False, True]])
    t, e = np.arange(6).reshape(2, 3), -np.arange(6).reshape(2, 3)
    (out,) = run_op("SelectV2", cond, t, e, T=np.int64)
    np.testing.assert_array_equal(out, np.where(cond, t, e))
    with pytest.raises(
        errors.InvalidArgumentError, match=r"condition \[2,3\], then \[2,3\], and else \[3,2\]"
    ):
        run_op("SelectV2", cond, t, e.reshape(3, 2), T=np.int64)


@pytest.mark.parametrize("axis", [0, 1, 2, -1])
@pytest.mark.parametrize("indices_shape", [(), (4,), (2, 3)])
def test_gather_v2_matches_take(run_op, axis, indices_shape):
    params = np.arange(60).reshape(3, 4, 5)
    limit = params.shape[axis]
    indices = np.random.default_rng(1).integers(0, limit, size=indices_shape).astype(I32)
    (out,) = run_op(
        "GatherV2", params, indices, np.array(axis, I32), Tparams=np.int64, Tindices=I32, Taxis=I32
    )
    np.testing.assert_array_equal(out, np.take(params, indices, axis=axis))


def test_gather_names_the_first_index_out_of_range(run_op):
    params = np.arange(6, dtype=np.float32).reshape(3, 2)
    for indices, text in (
        (np.array([0, 7, -1], np.int32), r"indices\[1\] = 7 is not in \[0, 3\)"),
        (np.array([[2, -1], [5, 0]], np.int64), r"indices\[0,1\] = -1 is not in \[0, 3\)"),
    ):
        with pytest.raises(errors.InvalidArgumentError, match=text):
            run_op(
                "GatherV2",
                params,
                indices,
                np.int32(0),
                Tparams=np.float32,
                Tindices=indices.dtype,
                Taxis=np.int32,
            )
    (empty,) = run_op(
        "GatherV2",
        params,
        np.zeros(0, np.int32),
        np.int32(0),
        Tparams=np.float32,
        Tindices=np.int32,
        Taxis=np.int32,
    )
    assert empty.shape == (0, 2)


def test_gather_v1_uses_axis_zero(run_op):
    params = np.array([b"a", b"b", b"c"], dtype=object)
    (out,) = run_op("Gather", params, np.array([[2, 0]], np.int64), Tparams=object, Tindices=np.int64)
    assert out.tolist() == [[b"c", b"a"]]


@pytest.mark.parametrize(("batch_dims", "axis"), [(1, 1), (1, 2), (2, 2), (-1, 2)])
def test_gather_v2_batch_dims(run_op, batch_dims, axis):
    rng = np.random.default_rng(2)
    params = rng.normal(size=(2, 3, 4, 5))
    indices = rng.integers(0, params.shape[axis], size=(2, 3, 6)) if batch_dims == 2 else None
    if indices is None:
        indices = rng.integers(0, params.shape[axis], size=(2, 6))
    indices = indices.astype(I32)
    (out,) = run_op(
        "GatherV2",
        params,
        indices,
        np.array(axis, I32),
        Tparams=np.float64,
        Tindices=I32,
        batch_dims=batch_dims,
    )
    b = batch_dims % indices.ndim
    # Reference: loop over the shared batch dims and take from each batch's slice.
    expected = np.stack(
        [np.take(params[i], indices[i], axis=axis - b) for i in np.ndindex(params.shape[:b])]
    ).reshape(params.shape[:axis] + indices.shape[b:] + params.shape[axis + 1 :])
    np.testing.assert_array_equal(out, expected)


def test_gather_errors(run_op):
    params = np.arange(6).reshape(3, 2)
    with pytest.raises(errors.InvalidArgumentError, match=r"indices\[1,0\] = 5 is not in \[0, 3\)"):
        run_op(
            "GatherV2", params, np.array([[0], [5]], I32), np.array(0, I32), Tparams=np.int64, Tindices=I32
        )
    with pytest.raises(errors.InvalidArgumentError, match=r"indices = -1 is not in \[0, 3\)"):
        run_op("GatherV2", params, np.array(-1, I32), np.array(0, I32), Tparams=np.int64, Tindices=I32)
    with pytest.raises(errors.InvalidArgumentError, match=r"Expected axis in the range \[-2, 2\), but got 2"):
        run_op("GatherV2", params, np.array(0, I32), np.array(2, I32), Tparams=np.int64, Tindices=I32)
    with pytest.raises(
        errors.InvalidArgumentError,
        match=r"params.shape\[0\]: 3 should be equal to indices.shape\[0\]: 2",
    ):
        run_op(
            "GatherV2",
            params,
            np.zeros((2, 1), I32),
            np.array(1, I32),
            Tparams=np.int64,
            Tindices=I32,
            batch_dims=1,
        )


@pytest.mark.parametrize("axis", [-1, 0, 1])
def test_one_hot(run_op, axis):
    indices = np.array([0, 2, -1, 5], np.int64)
    (out,) = run_op(
        "OneHot",
        indices,
        np.array(3, I32),
        np.float32(5),
        np.float32(-1),
        T=np.float32,
        TI=np.int64,
        axis=axis,
    )
    expected = np.where(indices[:, None] == np.arange(3), 5.0, -1.0).astype(np.float32)
    np.testing.assert_array_equal(out, expected if axis in (-1, 1) else expected.T)
    with pytest.raises(
        errors.InvalidArgumentError, match=r"Expected axis to be -1 or between \[0, 2\).  But received: 2"
    ):
        run_op("OneHot", indices, np.array(3, I32), np.float32(1), np.float32(0), T=np.float32, axis=2)
    with pytest.raises(errors.InvalidArgumentError, match="depth must be non-negative, got: -1"):
        run_op("OneHot", indices, np.array(-1, I32), np.float32(1), np.float32(0), T=np.float32)


# --------------------------------------------------------------------------- broadcasting helpers, Assert


def test_broadcast_to(run_op):
    (out,) = run_op("BroadcastTo", np.arange(3), ints(2, 3), T=np.int64, Tidx=I32)
    np.testing.assert_array_equal(out, np.broadcast_to(np.arange(3), (2, 3)))
    assert out.flags.writeable  # a real array, not a zero-stride view
    with pytest.raises(errors.InvalidArgumentError, match=r"Incompatible shapes: \[3\] vs. \[4\]"):
        run_op("BroadcastTo", np.arange(3), ints(4), T=np.int64)
    with pytest.raises(
        errors.InvalidArgumentError,
        match=r"Unable to broadcast tensor of shape \[3\] to tensor of shape \[1\]",
    ):
        run_op("BroadcastTo", np.arange(3), ints(1), T=np.int64)


@pytest.mark.parametrize(
    ("s0", "s1", "r0", "r1"),
    [
        ([2, 3], [3], [], [0]),
        ([2, 1], [2, 3], [1], []),
        ([1], [1], [0], [0]),
        ([], [2, 2], [0, 1], []),
        ([5, 1, 3], [4, 1], [1], [0, 2]),
        ([1, 3], [2, 1], [0], [1]),
    ],
)
@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_broadcast_gradient_args(run_op, s0, s1, r0, r1, dtype):
    out0, out1 = run_op("BroadcastGradientArgs", np.array(s0, dtype), np.array(s1, dtype), T=dtype)
    assert out0.dtype == out1.dtype == np.dtype(dtype)
    assert out0.tolist() == r0
    assert out1.tolist() == r1


def test_broadcast_gradient_args_incompatible(run_op):
    with pytest.raises(errors.InvalidArgumentError, match=r"Incompatible shapes: \[2,3\] vs. \[4\]"):
        run_op("BroadcastGradientArgs", ints(2, 3), ints(4), T=I32)


def test_assert(run_op):
    assert run_op("Assert", np.array(True), np.arange(3), T=[np.int64]) == []
    with pytest.raises(errors.InvalidArgumentError) as info:
        run_op(
            "Assert",
            np.array(False),
            np.array([b"x must be positive"], dtype=object),
            np.arange(10).reshape(2, 5),
            T=[object, np.int64],
            name="check",
        )
    assert info.value.message.startswith("assertion failed: [x must be positive] [[0 1 2...]...]")
    assert info.value.node_name == "check"
    with pytest.raises(errors.InvalidArgumentError, match=r"In\[0\] should be a scalar: \[2\]"):
        run_op("Assert", np.array([True, True]), T=[])


def test_assert_is_stateful(make_node):
    assert create_kernel(make_node("Assert", ["c"], T=[])).is_stateful


# --------------------------------------------------------------------------- Where, DynamicStitch


@pytest.mark.parametrize("dtype", [np.bool_, np.float32, np.int64])
def test_where_lists_the_coordinates_of_true_elements(run_op, dtype):
    condition = np.array([[True, False, True], [False, False, True]]).astype(dtype)
    (coordinates,) = run_op("Where", condition, T=dtype)
    assert coordinates.dtype == np.int64
    np.testing.assert_array_equal(coordinates, [[0, 0], [0, 2], [1, 2]])


def test_where_of_nothing_and_of_a_scalar(run_op):
    (none,) = run_op("Where", np.zeros((2, 2), bool), T=np.bool_)
    assert none.shape == (0, 2)
    (scalar,) = run_op("Where", np.array(True), T=np.bool_)
    assert scalar.shape == (1, 0)


def test_dynamic_stitch_interleaves(run_op):
    indices = [np.array(6, np.int32), np.array([4, 1], np.int32), np.array([[5, 2], [0, 3]], np.int32)]
    data = [
        np.array([61, 62], np.float32),
        np.array([[41, 42], [11, 12]], np.float32),
        np.array([[[51, 52], [21, 22]], [[1, 2], [31, 32]]], np.float32),
    ]
    for op in ("DynamicStitch", "ParallelDynamicStitch"):
        (merged,) = run_op(op, *indices, *data, N=3, T=np.float32)
        np.testing.assert_array_equal(
            merged, [[1, 2], [11, 12], [21, 22], [31, 32], [41, 42], [51, 52], [61, 62]]
        )


def test_dynamic_stitch_later_inputs_win_and_gaps_are_zero(run_op):
    (merged,) = run_op(
        "DynamicStitch",
        np.array([0, 3], np.int32),
        np.array([3], np.int32),
        np.array([1, 2], np.int64),
        np.array([9], np.int64),
        N=2,
        T=np.int64,
    )
    np.testing.assert_array_equal(merged, [1, 0, 0, 9])


def test_dynamic_stitch_checks_shapes(run_op):
    with pytest.raises(errors.InvalidArgumentError, match=r"does not start with indices\[0\].shape"):
        run_op("DynamicStitch", np.array([0, 1], np.int32), np.array([1.0], np.float32), N=1, T=np.float32)


# --------------------------------------------------------------------------- gradient helpers


def test_invert_permutation(run_op):
    (out,) = run_op("InvertPermutation", ints(2, 0, 3, 1), T=I32)
    np.testing.assert_array_equal(out, [1, 3, 0, 2])
    with pytest.raises(errors.InvalidArgumentError, match="2 is duplicated in the input"):
        run_op("InvertPermutation", ints(2, 2, 0), T=I32)
    with pytest.raises(errors.InvalidArgumentError, match="5 is not between 0 and 3"):
        run_op("InvertPermutation", ints(5, 0, 1), T=I32)


def test_strided_slice_grad_writes_dy_where_the_slice_was(run_op):
    dy = np.array([[1.0, 2.0], [3.0, 4.0]])
    (out,) = run_op(
        "StridedSliceGrad", ints(3, 4), ints(1, 0), ints(3, 4), ints(1, 2), dy, T=np.float64, Index=I32
    )
    expected = np.zeros((3, 4))
    expected[1:3, 0:4:2] = dy
    np.testing.assert_array_equal(out, expected)
    (shrunk,) = run_op(
        "StridedSliceGrad", ints(2, 3), ints(0, 1), ints(0, 2), ints(1, 1), np.array([5.0, 6.0]),
        T=np.float64, Index=I32, begin_mask=1, end_mask=1, shrink_axis_mask=2,
    )  # fmt: skip
    np.testing.assert_array_equal(shrunk, [[0, 5, 0], [0, 6, 0]])
    with pytest.raises(errors.InvalidArgumentError, match=r"shape of dy was \[3\] instead of \[2\]"):
        run_op(
            "StridedSliceGrad", ints(2, 3), ints(0, 1), ints(0, 2), ints(1, 1), np.ones(3),
            T=np.float64, Index=I32, begin_mask=1, end_mask=1, shrink_axis_mask=2,
        )  # fmt: skip


def test_list_diff(run_op):
    out, idx = run_op("ListDiff", ints(1, 2, 3, 4, 5, 6), ints(1, 3, 5), T=I32, out_idx=I32)
    np.testing.assert_array_equal(out, [2, 4, 6])
    np.testing.assert_array_equal(idx, [1, 3, 5])


def test_scatter_nd_adds_updates_at_indices(run_op):
    indices = np.array([[1], [3], [1]], I32)
    updates = np.array([[1.0, 2.0], [3.0, 4.0], [10.0, 20.0]])
    (out,) = run_op("ScatterNd", indices, updates, ints(4, 2), T=np.float64, Tindices=I32)
    np.testing.assert_array_equal(out, [[0, 0], [11, 22], [0, 0], [3, 4]])
    with pytest.raises(errors.InvalidArgumentError, match=r"indices\[1\] = \[4\] does not index into shape"):
        run_op(
            "ScatterNd", np.array([[0], [4]], I32), np.ones((2, 2)), ints(4, 2), T=np.float64, Tindices=I32
        )
    with pytest.raises(errors.InvalidArgumentError, match="Dimensions mismatch"):
        run_op("ScatterNd", np.array([[0]], I32), np.ones((1, 3)), ints(4, 2), T=np.float64, Tindices=I32)
