"""Convolution, pooling and padding kernels against slow, direct numpy references.

The references loop over output pixels (small shapes only) and derive the padding
from TensorFlow's documented rules on their own; the gradients are checked against
references too, against the forward ops through the adjoint identity
<op(x), dy> = <x, grad(dy)> (every gradient here is of a linear map, or piecewise
linear for max pooling) and by finite differences.
"""

from __future__ import annotations

import itertools

import ml_dtypes
import numpy as np
import pytest

from distserver import errors
from distserver.kernels import create_kernel

RNG = np.random.default_rng(11)


def _pads(size, window, stride, dilation, padding, explicit=(0, 0)):
    """(out, before, after) by TensorFlow's documented rules."""
    effective = (window - 1) * dilation + 1
    if padding == "VALID":
        return max(0, (size - effective) // stride + 1), 0, 0
    if padding == "EXPLICIT":
        before, after = explicit
        return (size + before + after - effective) // stride + 1, before, after
    out = -(-size // stride)
    total = max((out - 1) * stride + effective - size, 0)
    return out, total // 2, total - total // 2


def _conv_geometry(x_shape, f_shape, strides, dilations, padding, explicit):
    ex = explicit or [0] * 8
    return [
        _pads(
            x_shape[1 + d],
            f_shape[d],
            strides[1 + d],
            dilations[1 + d],
            padding,
            (ex[2 + 2 * d], ex[3 + 2 * d]),
        )
        for d in range(2)
    ]


def _reference_conv(x, f, strides, padding, dilations=(1, 1, 1, 1), explicit=None):
    """out[n, y, x, o] by its definition, one output pixel at a time, in float64."""
    (oh, pt, _), (ow, pl, _) = _conv_geometry(x.shape, f.shape, strides, dilations, padding, explicit)
    kh, kw, cg, out_depth = f.shape
    groups = x.shape[3] // cg
    og = out_depth // groups
    out = np.zeros((x.shape[0], oh, ow, out_depth))
    for y, xx, i, j in itertools.product(range(oh), range(ow), range(kh), range(kw)):
        row = y * strides[1] + i * dilations[1] - pt
        col = xx * strides[2] + j * dilations[2] - pl
        if 0 <= row < x.shape[1] and 0 <= col < x.shape[2]:
            for g in range(groups):
                pixel = x[:, row, col, g * cg : (g + 1) * cg].astype(np.float64)
                out[:, y, xx, g * og : (g + 1) * og] += pixel @ f[i, j, :, g * og : (g + 1) * og]
    return out


def _reference_conv_grads(x, f, dy, strides, padding, dilations=(1, 1, 1, 1), explicit=None):
    """(d input, d filter) of sum(conv(x, f) * dy), by the same loop."""
    (oh, pt, _), (ow, pl, _) = _conv_geometry(x.shape, f.shape, strides, dilations, padding, explicit)
    kh, kw, cg, out_depth = f.shape
    groups = x.shape[3] // cg
    og = out_depth // groups
    dx, df = np.zeros(x.shape), np.zeros(f.shape)
    for y, xx, i, j in itertools.product(range(oh), range(ow), range(kh), range(kw)):
        row = y * strides[1] + i * dilations[1] - pt
        col = xx * strides[2] + j * dilations[2] - pl
        if 0 <= row < x.shape[1] and 0 <= col < x.shape[2]:
            for g in range(groups):
                grad = dy[:, y, xx, g * og : (g + 1) * og].astype(np.float64)
                weights = f[i, j, :, g * og : (g + 1) * og].astype(np.float64)
                dx[:, row, col, g * cg : (g + 1) * cg] += grad @ weights.T
                df[i, j, :, g * og : (g + 1) * og] += x[:, row, col, g * cg : (g + 1) * cg].T @ grad
    return dx, df


# (input shape, filter shape, strides, padding, dilations, explicit_paddings)
CONV_CASES = [
    ((2, 7, 7, 3), (3, 3, 3, 4), (1, 1, 1, 1), "SAME", (1, 1, 1, 1), None),
    ((2, 7, 9, 3), (3, 3, 3, 5), (1, 2, 2, 1), "SAME", (1, 1, 1, 1), None),
    ((1, 8, 6, 2), (2, 2, 2, 3), (1, 2, 2, 1), "SAME", (1, 1, 1, 1), None),
    ((3, 9, 8, 4), (3, 2, 4, 2), (1, 2, 3, 1), "VALID", (1, 1, 1, 1), None),
    ((1, 5, 5, 1), (5, 5, 1, 1), (1, 1, 1, 1), "SAME", (1, 1, 1, 1), None),
    ((2, 9, 9, 2), (3, 3, 2, 3), (1, 1, 1, 1), "SAME", (1, 2, 2, 1), None),
    ((2, 10, 8, 3), (3, 2, 3, 2), (1, 1, 1, 1), "VALID", (1, 3, 2, 1), None),
    ((2, 6, 7, 3), (3, 3, 3, 2), (1, 2, 1, 1), "EXPLICIT", (1, 1, 1, 1), [0, 0, 1, 2, 0, 3, 0, 0]),
    ((2, 6, 6, 4), (3, 3, 2, 6), (1, 1, 2, 1), "SAME", (1, 1, 1, 1), None),  # 2 groups
    ((1, 4, 4, 3), (1, 1, 3, 2), (1, 3, 3, 1), "VALID", (1, 1, 1, 1), None),
]
CONV_IDS = [f"{c[0]}x{c[1]}-s{c[2][1]}{c[2][2]}-{c[3]}-d{c[4][1]}{c[4][2]}" for c in CONV_CASES]


def _conv_attrs(strides, padding, dilations, explicit):
    attrs = {"strides": list(strides), "padding": padding, "dilations": list(dilations)}
    if explicit is not None:
        attrs["explicit_paddings"] = explicit
    return attrs


@pytest.mark.parametrize(
    ("x_shape", "f_shape", "strides", "padding", "dilations", "explicit"), CONV_CASES, ids=CONV_IDS
)
def test_conv2d_matches_the_definition(run_op, x_shape, f_shape, strides, padding, dilations, explicit):
    x = RNG.normal(size=x_shape).astype(np.float32)
    f = RNG.normal(size=f_shape).astype(np.float32)
    attrs = _conv_attrs(strides, padding, dilations, explicit)
    (out,) = run_op("Conv2D", x, f, T=np.float32, **attrs)
    expected = _reference_conv(x, f, strides, padding, dilations, explicit)
    assert out.dtype == np.float32
    assert out.shape == expected.shape
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("x_shape", "f_shape", "strides", "padding", "dilations", "explicit"), CONV_CASES, ids=CONV_IDS
)
def test_conv2d_gradients_match_the_definition(
    run_op, x_shape, f_shape, strides, padding, dilations, explicit
):
    x = RNG.normal(size=x_shape)
    f = RNG.normal(size=f_shape)
    attrs = _conv_attrs(strides, padding, dilations, explicit)
    (out,) = run_op("Conv2D", x, f, T=np.float64, **attrs)
    dy = RNG.normal(size=out.shape)
    (dx,) = run_op("Conv2DBackpropInput", np.array(x_shape, np.int32), f, dy, T=np.float64, **attrs)
    (df,) = run_op("Conv2DBackpropFilter", x, np.array(f_shape, np.int64), dy, T=np.float64, **attrs)
    expected_dx, expected_df = _reference_conv_grads(x, f, dy, strides, padding, dilations, explicit)
    np.testing.assert_allclose(dx, expected_dx, rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(df, expected_df, rtol=1e-10, atol=1e-10)
    # The adjoint identity ties both to the forward op: <conv(x, f), dy> = <x, dx> = <f, df>.
    inner = np.sum(out * dy)
    assert np.sum(x * dx) == pytest.approx(inner, rel=1e-10)
    assert np.sum(f * df) == pytest.approx(inner, rel=1e-10)


def test_conv2d_gradients_by_finite_differences(run_op):
    x = RNG.normal(size=(1, 5, 6, 2))
    f = RNG.normal(size=(3, 2, 2, 3))
    attrs = {"strides": [1, 2, 2, 1], "padding": "SAME"}
    dy = RNG.normal(size=run_op("Conv2D", x, f, T=np.float64, **attrs)[0].shape)

    def loss(x, f):
        return float(np.sum(run_op("Conv2D", x, f, T=np.float64, **attrs)[0] * dy))

    (dx,) = run_op("Conv2DBackpropInput", np.array(x.shape, np.int32), f, dy, T=np.float64, **attrs)
    (df,) = run_op("Conv2DBackpropFilter", x, np.array(f.shape, np.int32), dy, T=np.float64, **attrs)
    eps = 1e-6
    for index in [(0, 0, 0, 0), (0, 2, 3, 1), (0, 4, 5, 0), (0, 1, 4, 1)]:
        bump = np.zeros_like(x)
        bump[index] = eps
        assert dx[index] == pytest.approx((loss(x + bump, f) - loss(x - bump, f)) / (2 * eps), abs=1e-6)
    for index in [(0, 0, 0, 0), (2, 1, 1, 2), (1, 0, 1, 1)]:
        bump = np.zeros_like(f)
        bump[index] = eps
        assert df[index] == pytest.approx((loss(x, f + bump) - loss(x, f - bump)) / (2 * eps), abs=1e-6)


def test_conv2d_backprop_input_takes_two_spatial_sizes(run_op):
    x = RNG.normal(size=(2, 6, 5, 3)).astype(np.float32)
    f = RNG.normal(size=(3, 3, 3, 4)).astype(np.float32)
    dy = RNG.normal(size=(2, 3, 3, 4)).astype(np.float32)
    attrs = {"T": np.float32, "strides": [1, 2, 2, 1], "padding": "SAME"}
    (full,) = run_op("Conv2DBackpropInput", np.array([2, 6, 5, 3], np.int32), f, dy, **attrs)
    (spatial,) = run_op("Conv2DBackpropInput", np.array([6, 5], np.int32), f, dy, **attrs)
    assert full.shape == x.shape
    np.testing.assert_array_equal(full, spatial)


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16, np.float64])
def test_conv2d_other_float_types(run_op, dtype):
    x = RNG.normal(size=(2, 5, 5, 3))
    f = RNG.normal(size=(3, 3, 3, 2)) * 0.5
    (out,) = run_op("Conv2D", x.astype(dtype), f.astype(dtype), T=dtype, strides=[1, 1, 1, 1], padding="SAME")
    assert out.dtype == np.dtype(dtype)
    expected = _reference_conv(x.astype(dtype).astype(np.float64), f.astype(dtype).astype(np.float64),
                               (1, 1, 1, 1), "SAME")  # fmt: skip
    tolerance = {np.float16: 1e-2, ml_dtypes.bfloat16: 5e-2, np.float64: 1e-12}[dtype]
    np.testing.assert_allclose(out.astype(np.float64), expected, rtol=tolerance, atol=tolerance)


def test_conv2d_on_int32(run_op):
    x = RNG.integers(-5, 5, size=(1, 4, 5, 2)).astype(np.int32)
    f = RNG.integers(-3, 3, size=(2, 2, 2, 3)).astype(np.int32)
    (out,) = run_op("Conv2D", x, f, T=np.int32, strides=[1, 1, 2, 1], padding="SAME")
    assert out.dtype == np.int32
    np.testing.assert_array_equal(out, _reference_conv(x, f, (1, 1, 2, 1), "SAME").astype(np.int32))


def test_conv2d_empty_and_zero_sized_outputs(run_op):
    f = np.ones((3, 3, 2, 4), np.float32)
    (out,) = run_op(
        "Conv2D", np.ones((0, 5, 5, 2), np.float32), f, T=np.float32, strides=[1, 1, 1, 1], padding="SAME"
    )
    assert out.shape == (0, 5, 5, 4)
    (out,) = run_op(
        "Conv2D", np.ones((1, 2, 2, 2), np.float32), f, T=np.float32, strides=[1, 1, 1, 1], padding="VALID"
    )
    assert out.shape == (1, 0, 0, 4)


def test_conv2d_splits_a_large_batch_into_chunks(run_op, monkeypatch):
    from distserver.kernels import conv

    x = RNG.normal(size=(5, 6, 6, 3)).astype(np.float32)
    f = RNG.normal(size=(3, 3, 3, 2)).astype(np.float32)
    attrs = {"T": np.float32, "strides": [1, 1, 1, 1], "padding": "SAME"}
    (whole,) = run_op("Conv2D", x, f, **attrs)
    dy = RNG.normal(size=whole.shape).astype(np.float32)
    (whole_df,) = run_op("Conv2DBackpropFilter", x, np.array(f.shape, np.int32), dy, **attrs)
    monkeypatch.setattr(conv, "_PATCH_BYTES", 1)  # one image at a time
    (chunked,) = run_op("Conv2D", x, f, **attrs)
    (chunked_df,) = run_op("Conv2DBackpropFilter", x, np.array(f.shape, np.int32), dy, **attrs)
    np.testing.assert_array_equal(whole, chunked)
    np.testing.assert_allclose(whole_df, chunked_df, rtol=1e-5, atol=1e-5)


def test_conv2d_says_it_sizes_its_work(make_node):
    kernel = create_kernel(make_node("Conv2D", T=np.float32, strides=[1, 1, 1, 1], padding="SAME"))
    x, f = np.zeros((8, 16, 16, 3), np.float32), np.zeros((3, 3, 3, 32), np.float32)
    # patches (8*16*16 rows of 27) and the output (8*16*16*32)
    assert kernel.output_nbytes([x, f]) == 8 * 16 * 16 * (27 + 32) * 4
    assert kernel.output_nbytes([np.zeros(3), f]) == 0


@pytest.mark.parametrize(
    ("op", "attrs", "inputs", "error", "text"),
    [
        ("Conv2D", {}, [(5, 5, 3), (3, 3, 3, 4)], errors.InvalidArgumentError,
         r"convolution input must be 4-dimensional: \[5,5,3\]"),
        ("Conv2D", {}, [(1, 5, 5, 3), (3, 3, 3)], errors.InvalidArgumentError,
         r"convolution filter must be 4-dimensional: \[3,3,3\]"),
        ("Conv2D", {}, [(1, 5, 5, 3), (3, 3, 2, 4)], errors.InvalidArgumentError,
         "input depth must be evenly divisible by filter depth: 3 vs 2"),
        ("Conv2D", {}, [(1, 5, 5, 4), (3, 3, 2, 3)], errors.InvalidArgumentError,
         "output depth must be evenly divisible by number of groups: 3 vs 2"),
        ("Conv2D", {"padding": "VALID"}, [(1, 1, 1, 3), (5, 5, 3, 2)], errors.InvalidArgumentError,
         r"Computed output size would be negative: -3 \[input_size: 1, effective_filter_size: 5, "
         r"stride: 1\]"),
        ("Conv2DBackpropInput", {}, [(1, 5, 5, 3), (3, 3, 3, 4), (1, 4, 5, 4)], errors.InvalidArgumentError,
         "Conv2DCustomBackpropInput: Size of out_backprop doesn't match computed: actual = 4, computed = 5 "
         "spatial_dim: 1 input: 5 filter: 3 output: 4 stride: 1 dilation: 1"),
        ("Conv2DBackpropInput", {}, [(1, 5, 5), (3, 3, 3, 4), (1, 5, 5, 4)], errors.InvalidArgumentError,
         "input_sizes to contain 4 values or 2 values, but got: 3"),
        ("Conv2DBackpropFilter", {}, [(2, 5, 5, 3), (3, 3, 3, 4), (1, 5, 5, 4)], errors.InvalidArgumentError,
         "input and out_backprop must have the same batch size. Input batch: 2, outbackprop batch: 1"),
        ("Conv2DBackpropFilter", {}, [(1, 5, 5, 3), (3, 3, 3, 5), (1, 5, 5, 4)], errors.InvalidArgumentError,
         "Conv2DCustomBackpropFilter: filter and out_backprop must have the same out_depth"),
    ],
)  # fmt: skip
def test_conv_shape_errors(run_op, op, attrs, inputs, error, text):
    values = []
    for i, shape in enumerate(inputs):
        takes_a_shape = (op == "Conv2DBackpropInput" and i == 0) or (op == "Conv2DBackpropFilter" and i == 1)
        values.append(np.array(shape, np.int32) if takes_a_shape else np.ones(shape, np.float32))
    merged = {"strides": [1, 1, 1, 1], "padding": "SAME", **attrs}
    with pytest.raises(error, match=text):
        run_op(op, *values, T=np.float32, name="conv", **merged)


@pytest.mark.parametrize(
    ("op", "attrs", "error", "text"),
    [
        ("Conv2D", {"strides": [2, 1, 1, 1]}, errors.UnimplementedError,
         "does not yet support strides in the batch and depth dimensions"),
        ("Conv2D", {"strides": [1, 1, 1]}, errors.InvalidArgumentError,
         "Sliding window strides field must specify 4 dimensions"),
        ("Conv2D", {"strides": [1, 0, 1, 1]}, errors.InvalidArgumentError,
         "Row and column strides should be larger than 0."),
        ("Conv2D", {"dilations": [1, 1, 1, 2]}, errors.UnimplementedError,
         "does not yet support dilations in the batch and depth dimensions"),
        ("Conv2D", {"data_format": "NCHW"}, errors.UnimplementedError,
         "only supports the NHWC tensor format on the CPU. The op was given the format: NCHW"),
        ("Conv2DBackpropInput", {"data_format": "NCHW"}, errors.InvalidArgumentError,
         "Conv2DCustomBackpropInputOp only supports NHWC."),
        ("Conv2D", {"padding": "EXPLICIT", "explicit_paddings": [0, 0, 1, 1]}, errors.InvalidArgumentError,
         "explicit_paddings attribute must contain 8 values, but got: 4"),
        ("Conv2D", {"padding": "EXPLICIT", "explicit_paddings": [1, 0, 1, 1, 1, 1, 0, 0]},
         errors.InvalidArgumentError, "Nonzero explicit padding in the batch or depth dimensions"),
        ("Conv2D", {"padding": "FULL"}, errors.InvalidArgumentError, "Value for attr 'padding' of \"FULL\""),
        ("MaxPool", {"ksize": [2, 2, 2, 1]}, errors.UnimplementedError,
         "Pooling is not yet supported on the batch dimension."),
        ("MaxPool", {"ksize": [1, 0, 2, 1]}, errors.InvalidArgumentError,
         "Sliding window ksize must be positive. The specified or inferred ksize is: 1,0,2,1"),
        ("MaxPool", {"ksize": [1, 2, 2, 2]}, errors.UnimplementedError,
         "MaxPooling supports exactly one of pooling across depth or pooling across width/height."),
        ("MaxPool", {"padding": "EXPLICIT", "explicit_paddings": [0, 0, 2, 0, 0, 0, 0, 0]},
         errors.InvalidArgumentError, "Top padding 2 needs to be smaller than the window size 2"),
        ("MaxPool", {"data_format": "NCHW"}, errors.InvalidArgumentError,
         "Default MaxPoolingOp only supports NHWC on device type CPU"),
        ("AvgPool", {"ksize": [1, 1, 1, 2], "strides": [1, 1, 1, 2]}, errors.UnimplementedError,
         "Non-spatial pooling is not yet supported."),
        ("AvgPool", {"padding": "EXPLICIT"}, errors.InvalidArgumentError,
         "not in the list of allowed values"),
        ("MaxPoolGrad", {"ksize": [1, 1, 1, 2], "strides": [1, 1, 1, 2]}, errors.UnimplementedError,
         "MaxPoolingGrad is not yet supported on the depth dimension."),
    ],
)  # fmt: skip
def test_attr_errors_fail_when_the_kernel_is_built(make_node, op, attrs, error, text):
    defaults = {"strides": [1, 1, 1, 1], "padding": "SAME", "T": np.float32}
    if op in ("MaxPool", "AvgPool", "MaxPoolGrad"):
        defaults["ksize"] = [1, 2, 2, 1]
    with pytest.raises(error, match=text) as info:
        create_kernel(make_node(op, name="bad", **{**defaults, **attrs}))
    assert info.value.node_name == "bad"


def test_unsupported_type_is_refused(make_node):
    with pytest.raises(
        errors.InvalidArgumentError, match="No OpKernel was registered to support Op 'AvgPool'"
    ):
        create_kernel(
            make_node("AvgPool", T=np.int32, ksize=[1, 2, 2, 1], strides=[1, 1, 1, 1], padding="SAME")
        )


# --------------------------------------------------------------------------- pooling


def _windows(x, ksize, strides, padding, explicit=None):
    """Yield (y, x, rows, columns) for every output pixel: the input rows/columns its window covers."""
    ex = explicit or [0] * 8
    (oh, pt, _), (ow, pl, _) = (
        _pads(x.shape[1 + d], ksize[1 + d], strides[1 + d], 1, padding, (ex[2 + 2 * d], ex[3 + 2 * d]))
        for d in range(2)
    )
    for y, xx in itertools.product(range(oh), range(ow)):
        top, left = y * strides[1] - pt, xx * strides[2] - pl
        rows = [r for r in range(top, top + ksize[1]) if 0 <= r < x.shape[1]]
        columns = [c for c in range(left, left + ksize[2]) if 0 <= c < x.shape[2]]
        yield y, xx, rows, columns


def _out_shape(x, ksize, strides, padding, explicit=None):
    ex = explicit or [0] * 8
    dims = [
        _pads(x.shape[1 + d], ksize[1 + d], strides[1 + d], 1, padding, (ex[2 + 2 * d], ex[3 + 2 * d]))[0]
        for d in range(2)
    ]
    return (x.shape[0], *dims, x.shape[3])


def _reference_pool(x, ksize, strides, padding, reduce, explicit=None):
    out = np.zeros(_out_shape(x, ksize, strides, padding, explicit))
    for y, xx, rows, columns in _windows(x, ksize, strides, padding, explicit):
        out[:, y, xx, :] = reduce(x[:, rows][:, :, columns].reshape(x.shape[0], -1, x.shape[3]), axis=1)
    return out


def _reference_max_pool_grad(x, dy, ksize, strides, padding, explicit=None):
    """Each window's gradient to its first maximum (row-major), per image and channel."""
    dx = np.zeros(x.shape)
    for y, xx, rows, columns in _windows(x, ksize, strides, padding, explicit):
        cells = [(r, c) for r in rows for c in columns]
        for n, ch in itertools.product(range(x.shape[0]), range(x.shape[3])):
            values = [x[n, r, c, ch] for r, c in cells]
            r, c = cells[int(np.argmax(values))]
            dx[n, r, c, ch] += dy[n, y, xx, ch]
    return dx


def _reference_avg_pool_grad(x_shape, dy, ksize, strides, padding):
    dx = np.zeros(x_shape)
    for y, xx, rows, columns in _windows(np.zeros(x_shape), ksize, strides, padding):
        share = dy[:, y, xx, :] / (len(rows) * len(columns))
        for r, c in itertools.product(rows, columns):
            dx[:, r, c, :] += share
    return dx


# (input shape, ksize, strides, padding)
POOL_CASES = [
    ((2, 6, 6, 3), (1, 2, 2, 1), (1, 2, 2, 1), "VALID"),
    ((2, 7, 7, 2), (1, 2, 2, 1), (1, 2, 2, 1), "SAME"),
    ((1, 7, 5, 3), (1, 3, 3, 1), (1, 2, 2, 1), "SAME"),
    ((2, 5, 8, 1), (1, 3, 2, 1), (1, 1, 3, 1), "SAME"),
    ((1, 9, 9, 2), (1, 3, 3, 1), (1, 1, 1, 1), "VALID"),
    ((3, 4, 4, 2), (1, 4, 4, 1), (1, 1, 1, 1), "SAME"),
    ((1, 5, 7, 2), (1, 5, 3, 1), (1, 3, 2, 1), "VALID"),
]
POOL_IDS = [f"{c[0]}-k{c[1][1]}{c[1][2]}-s{c[2][1]}{c[2][2]}-{c[3]}" for c in POOL_CASES]


def _pool_attrs(ksize, strides, padding, dtype=np.float32):
    return {"ksize": list(ksize), "strides": list(strides), "padding": padding, "T": dtype}


@pytest.mark.parametrize(("shape", "ksize", "strides", "padding"), POOL_CASES, ids=POOL_IDS)
def test_max_pool_and_its_gradient(run_op, shape, ksize, strides, padding):
    # Halves make ties; negative values check that padding never wins.
    x = (np.round(RNG.normal(size=shape) * 2) / 2 - 1).astype(np.float32)
    attrs = _pool_attrs(ksize, strides, padding)
    (y,) = run_op("MaxPool", x, **attrs)
    np.testing.assert_array_equal(y, _reference_pool(x, ksize, strides, padding, np.max))
    dy = RNG.normal(size=y.shape).astype(np.float32)
    (dx,) = run_op("MaxPoolGrad", x, y, dy, **attrs)
    np.testing.assert_allclose(
        dx, _reference_max_pool_grad(x, dy, ksize, strides, padding), rtol=1e-6, atol=1e-6
    )


@pytest.mark.parametrize(("shape", "ksize", "strides", "padding"), POOL_CASES, ids=POOL_IDS)
def test_avg_pool_and_its_gradient(run_op, shape, ksize, strides, padding):
    x = RNG.normal(size=shape)
    attrs = _pool_attrs(ksize, strides, padding, np.float64)
    (y,) = run_op("AvgPool", x, **attrs)
    np.testing.assert_allclose(y, _reference_pool(x, ksize, strides, padding, np.mean), rtol=1e-12)
    dy = RNG.normal(size=y.shape)
    (dx,) = run_op("AvgPoolGrad", np.array(shape, np.int32), dy, **attrs)
    np.testing.assert_allclose(dx, _reference_avg_pool_grad(shape, dy, ksize, strides, padding), rtol=1e-12)
    assert np.sum(x * dx) == pytest.approx(np.sum(y * dy), rel=1e-10)  # adjoint of a linear map


def test_max_pool_gradient_by_finite_differences(run_op):
    x = RNG.permutation(2 * 5 * 5 * 2).reshape(2, 5, 5, 2).astype(np.float64)  # distinct: no ties
    attrs = _pool_attrs((1, 3, 3, 1), (1, 2, 2, 1), "SAME", np.float64)
    (y,) = run_op("MaxPool", x, **attrs)
    dy = RNG.normal(size=y.shape)
    (dx,) = run_op("MaxPoolGrad", x, y, dy, **attrs)
    eps = 1e-3
    for index in [(0, 0, 0, 0), (1, 4, 4, 1), (0, 2, 3, 1), (1, 1, 2, 0), (0, 3, 1, 0)]:
        bump = np.zeros_like(x)
        bump[index] = eps
        plus = np.sum(run_op("MaxPool", x + bump, **attrs)[0] * dy)
        minus = np.sum(run_op("MaxPool", x - bump, **attrs)[0] * dy)
        assert dx[index] == pytest.approx((plus - minus) / (2 * eps), abs=1e-8)


def test_max_pool_with_explicit_padding(run_op):
    x = (np.round(RNG.normal(size=(2, 5, 6, 2)) * 2) / 2).astype(np.float32)
    explicit = [0, 0, 1, 0, 2, 1, 0, 0]
    attrs = {**_pool_attrs((1, 2, 3, 1), (1, 2, 1, 1), "EXPLICIT"), "explicit_paddings": explicit}
    (y,) = run_op("MaxPool", x, **attrs)
    np.testing.assert_array_equal(
        y, _reference_pool(x, (1, 2, 3, 1), (1, 2, 1, 1), "EXPLICIT", np.max, explicit)
    )
    dy = RNG.normal(size=y.shape).astype(np.float32)
    (dx,) = run_op("MaxPoolGrad", x, y, dy, **attrs)
    expected = _reference_max_pool_grad(x, dy, (1, 2, 3, 1), (1, 2, 1, 1), "EXPLICIT", explicit)
    np.testing.assert_allclose(dx, expected, rtol=1e-6, atol=1e-6)


def test_max_pool_ignores_nan_and_takes_integers(run_op):
    x = np.array([[np.nan, 1.0], [2.0, 3.0]], np.float32).reshape(1, 2, 2, 1)
    (y,) = run_op("MaxPool", x, **_pool_attrs((1, 2, 2, 1), (1, 1, 1, 1), "VALID"))
    assert y.ravel().tolist() == [3.0]
    xi = RNG.integers(-100, 100, size=(2, 5, 5, 3)).astype(np.int32)
    (yi,) = run_op("MaxPool", xi, **_pool_attrs((1, 2, 2, 1), (1, 2, 2, 1), "SAME", np.int32))
    assert yi.dtype == np.int32
    np.testing.assert_array_equal(yi, _reference_pool(xi, (1, 2, 2, 1), (1, 2, 2, 1), "SAME", np.max))


def test_depthwise_max_pool(run_op):
    x = RNG.normal(size=(2, 3, 3, 6)).astype(np.float32)
    (y,) = run_op("MaxPool", x, **_pool_attrs((1, 1, 1, 3), (1, 1, 1, 3), "VALID"))
    np.testing.assert_array_equal(y, x.reshape(2, 3, 3, 2, 3).max(axis=-1))
    with pytest.raises(errors.UnimplementedError, match="depth window to evenly divide the input depth"):
        run_op("MaxPool", x, **_pool_attrs((1, 1, 1, 4), (1, 1, 1, 4), "VALID"))


def test_pool_gradient_shape_errors(run_op):
    x = np.ones((1, 5, 5, 3), np.float32)
    attrs = _pool_attrs((1, 2, 2, 1), (1, 2, 2, 1), "SAME")
    with pytest.raises(
        errors.InvalidArgumentError, match=r"Expected grad shape to be \[1,3,3,3\], but got \[1,2,3,3\]"
    ):
        run_op(
            "MaxPoolGrad", x, np.ones((1, 3, 3, 3), np.float32), np.ones((1, 2, 3, 3), np.float32), **attrs
        )
    with pytest.raises(errors.InvalidArgumentError, match=r"Expected orig_output shape to be \[1,3,3,3\]"):
        run_op(
            "MaxPoolGrad", x, np.ones((1, 2, 3, 3), np.float32), np.ones((1, 3, 3, 3), np.float32), **attrs
        )
    with pytest.raises(
        errors.InvalidArgumentError, match="out_backprop must be 1-dimensional and 4 elements"
    ):
        run_op("AvgPoolGrad", np.array([1, 5, 5], np.int32), np.ones((1, 3, 3, 3), np.float32), **attrs)
    with pytest.raises(errors.InvalidArgumentError, match=r"Expected grad shape to be \[1,3,3,3\]"):
        run_op("AvgPoolGrad", np.array([1, 5, 5, 3], np.int32), np.ones((1, 2, 3, 3), np.float32), **attrs)


def test_avg_pool_in_half_precision(run_op):
    x = RNG.normal(size=(1, 6, 6, 2))
    (y,) = run_op(
        "AvgPool", x.astype(np.float16), **_pool_attrs((1, 3, 3, 1), (1, 2, 2, 1), "SAME", np.float16)
    )
    assert y.dtype == np.float16
    expected = _reference_pool(
        x.astype(np.float16).astype(np.float64), (1, 3, 3, 1), (1, 2, 2, 1), "SAME", np.mean
    )
    np.testing.assert_allclose(y, expected, rtol=2e-3, atol=2e-3)


# --------------------------------------------------------------------------- padding


@pytest.mark.parametrize("paddings_type", [np.int32, np.int64])
def test_pad_and_pad_v2(run_op, paddings_type):
    x = RNG.normal(size=(2, 3, 4)).astype(np.float32)
    paddings = np.array([[0, 1], [2, 0], [1, 3]], paddings_type)
    (out,) = run_op("Pad", x, paddings, T=np.float32, Tpaddings=paddings_type)
    np.testing.assert_array_equal(out, np.pad(x, paddings))
    (out,) = run_op("PadV2", x, paddings, np.float32(-2.5), T=np.float32, Tpaddings=paddings_type)
    np.testing.assert_array_equal(out, np.pad(x, paddings, constant_values=-2.5))


def test_pad_strings_scalars_and_nothing(run_op):
    (out,) = run_op("Pad", np.array([b"a", b"b"], object), np.array([[1, 2]], np.int32), T=object)
    assert out.tolist() == [b"", b"a", b"b", b"", b""]
    (out,) = run_op("Pad", np.float32(3), np.zeros((0, 2), np.int32), T=np.float32)
    assert out.shape == ()
    assert out == 3
    x = np.arange(4, dtype=np.int64).reshape(2, 2)
    np.testing.assert_array_equal(run_op("Pad", x, np.zeros((2, 2), np.int32), T=np.int64)[0], x)


@pytest.mark.parametrize(
    ("op", "inputs", "text"),
    [
        ("Pad", [np.ones((2, 3)), np.zeros((2, 3), np.int32)],
         r"paddings must be a matrix with 2 columns: \[2,3\]"),
        ("Pad", [np.ones((2, 3)), np.zeros((3, 2), np.int32)],
         r"The first dimension of paddings must be the rank of inputs\[3,2\] \[2,3\]"),
        ("Pad", [np.ones((2, 3)), np.array([[0, 0], [-1, 0]], np.int32)],
         "Paddings must be non-negative: -1 0"),
        ("PadV2", [np.ones((2, 3)), np.zeros((2, 2), np.int32), np.ones(2)],
         r"constant_values must be a scalar. Found: \[2\]"),
        ("MirrorPad", [np.ones((2, 3)), np.array([[0, 0], [3, 0]], np.int32)],
         "paddings must be less than the dimension size: 3, 0 not less than 3"),
        ("MirrorPad", [np.ones((2, 3)), np.array([[0, 0], [-1, 0]], np.int32)],
         "paddings must be non-negative: -1 0"),
        ("MirrorPadGrad", [np.ones((2, 7)), np.array([[0, 0], [3, 3]], np.int32)],
         "paddings must be less than the output dimension size: 3, 3 not less than 1"),
    ],
)  # fmt: skip
def test_pad_errors(run_op, op, inputs, text):
    attrs = {"T": np.float64}
    if op.startswith("Mirror"):
        attrs["mode"] = "REFLECT"
    with pytest.raises(errors.InvalidArgumentError, match=text):
        run_op(op, *inputs, **attrs)


def test_symmetric_mirror_pad_limits(run_op):
    x = np.arange(3.0)
    (out,) = run_op("MirrorPad", x, np.array([[3, 3]], np.int32), T=np.float64, mode="SYMMETRIC")
    np.testing.assert_array_equal(out, np.pad(x, (3, 3), mode="symmetric"))
    with pytest.raises(
        errors.InvalidArgumentError, match="no greater than the dimension size: 4, 0 greater than 3"
    ):
        run_op("MirrorPad", x, np.array([[4, 0]], np.int32), T=np.float64, mode="SYMMETRIC")


@pytest.mark.parametrize("mode", ["REFLECT", "SYMMETRIC"])
def test_mirror_pad_and_its_gradient(run_op, mode):
    x = RNG.normal(size=(3, 4, 5))
    paddings = np.array([[1, 2], [0, 3], [2, 2]], np.int32)
    (out,) = run_op("MirrorPad", x, paddings, T=np.float64, mode=mode)
    np.testing.assert_array_equal(out, np.pad(x, paddings, mode=mode.lower()))
    grad = RNG.normal(size=out.shape)
    (dx,) = run_op("MirrorPadGrad", grad, paddings, T=np.float64, mode=mode)
    assert dx.shape == x.shape
    assert np.sum(x * dx) == pytest.approx(np.sum(out * grad), rel=1e-12)  # adjoint of a linear map
    # By its definition: every padded cell's gradient goes to the cell it copies.
    index = np.pad(np.arange(x.size).reshape(x.shape), paddings, mode=mode.lower())
    expected = np.bincount(index.ravel(), weights=grad.ravel(), minlength=x.size).reshape(x.shape)
    np.testing.assert_allclose(dx, expected, rtol=1e-12)


def test_mirror_pad_of_strings(run_op):
    (out,) = run_op("MirrorPad", np.array([b"a", b"b", b"c"], object), np.array([[2, 1]], np.int32),
                    T=object, mode="REFLECT")  # fmt: skip
    assert out.tolist() == [b"c", b"b", b"a", b"b", b"c", b"b"]


def test_shape_n(run_op):
    a, b = np.zeros((2, 3, 4)), np.zeros(())
    outs = run_op("ShapeN", a, b, T=np.float64, N=2, out_type=np.int64)
    assert [o.tolist() for o in outs] == [[2, 3, 4], []]
    assert outs[0].dtype == np.int64
    (out,) = run_op("ShapeN", np.zeros((5, 1), np.float32), T=np.float32, N=1)
    assert out.dtype == np.int32
    assert out.tolist() == [5, 1]
