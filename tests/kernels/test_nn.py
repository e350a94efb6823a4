"""Neural-network kernels and the gradient kernels TF's graph builder emits, against numpy."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from distserver import errors
from distserver.kernels import create_kernel, nn

RNG = np.random.default_rng(7)


def _x(shape=(3, 4), dtype=np.float32, low=-3.0, high=3.0):
    return RNG.uniform(low, high, size=shape).astype(dtype)


def _softmax(x):
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


# --------------------------------------------------------------------------- activations


@pytest.mark.parametrize(
    ("op", "reference"),
    [
        ("Relu6", lambda x: np.minimum(np.maximum(x, 0), 6)),
        ("LeakyRelu", lambda x: np.where(x > 0, x, 0.2 * x)),
        ("Elu", lambda x: np.where(x > 0, x, np.exp(x) - 1)),
        ("Softplus", lambda x: np.log1p(np.exp(x))),
        ("Softsign", lambda x: x / (1 + np.abs(x))),
        ("Selu", lambda x: 1.0507009873554805 * np.where(x > 0, x, 1.6732632423543772 * (np.exp(x) - 1))),
    ],
)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_activations(run_op, op, reference, dtype):
    x = _x(shape=(2, 5), dtype=dtype, low=-8, high=8)
    (y,) = run_op(op, x, T=dtype)
    assert y.dtype == dtype
    np.testing.assert_allclose(y, reference(x.astype(np.float64)), rtol=1e-5, atol=1e-6)


def test_leaky_relu_reads_alpha(run_op):
    (y,) = run_op("LeakyRelu", np.array([-2.0, 3.0], np.float32), T=np.float32, alpha=0.5)
    np.testing.assert_array_equal(y, [-1.0, 3.0])


def test_softplus_does_not_overflow(run_op):
    (y,) = run_op("Softplus", np.array([-1000.0, 0.0, 1000.0], np.float32), T=np.float32)
    np.testing.assert_allclose(y, [0.0, np.log(2.0), 1000.0])


def test_relu6_takes_integers(run_op):
    (y,) = run_op("Relu6", np.array([-3, 2, 9], np.int32), T=np.int32)
    np.testing.assert_array_equal(y, [0, 2, 6])
    assert y.dtype == np.int32


def test_half_precision_activation_rounds_back(run_op):
    x = np.array([-1.0, 0.5, 2.0], ml_dtypes.bfloat16)
    (y,) = run_op("Elu", x, T=ml_dtypes.bfloat16)
    assert y.dtype == ml_dtypes.bfloat16
    np.testing.assert_allclose(y.astype(np.float32), [np.expm1(-1.0), 0.5, 2.0], rtol=1e-2)


# --------------------------------------------------------------------------- gradients


@pytest.mark.parametrize(
    ("op", "reference"),
    [
        ("ReluGrad", lambda dy, x: dy * (x > 0)),
        ("Relu6Grad", lambda dy, x: dy * ((x > 0) & (x < 6))),
        ("LeakyReluGrad", lambda dy, x: np.where(x > 0, dy, 0.2 * dy)),
        ("SoftplusGrad", lambda dy, x: dy / (1 + np.exp(-x))),
        ("SoftsignGrad", lambda dy, x: dy / (1 + np.abs(x)) ** 2),
        ("EluGrad", lambda dy, y: np.where(y < 0, dy * (y + 1), dy)),
    ],
)
def test_activation_gradients(run_op, op, reference):
    dy, x = _x(), _x(low=-8, high=8)
    (grad,) = run_op(op, dy, x, T=np.float32)
    assert grad.dtype == np.float32
    np.testing.assert_allclose(grad, reference(dy, x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    ("op", "reference"),
    [
        ("SigmoidGrad", lambda y, dy: dy * y * (1 - y)),
        ("TanhGrad", lambda y, dy: dy * (1 - y * y)),
        ("SqrtGrad", lambda y, dy: dy * 0.5 / y),
        ("RsqrtGrad", lambda y, dy: dy * -0.5 * y**3),
        ("ReciprocalGrad", lambda y, dy: -dy * y * y),
    ],
)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_output_gradients_take_y_then_dy(run_op, op, reference, dtype):
    y, dy = _x(dtype=dtype, low=0.1, high=0.9), _x(dtype=dtype)
    (grad,) = run_op(op, y, dy, T=dtype)
    assert grad.dtype == dtype
    np.testing.assert_allclose(grad, reference(y, dy), rtol=1e-5)


def test_sigmoid_grad_matches_a_finite_difference(run_op):
    x = np.linspace(-3, 3, 7)
    (y,) = run_op("Sigmoid", x, T=np.float64)
    (grad,) = run_op("SigmoidGrad", y, np.ones_like(x), T=np.float64)
    (y_plus,) = run_op("Sigmoid", x + 1e-6, T=np.float64)
    np.testing.assert_allclose(grad, (y_plus - y) / 1e-6, rtol=1e-4)


def test_gradient_inputs_must_have_the_same_shape(run_op):
    with pytest.raises(errors.InvalidArgumentError, match=r"ReluGrad inputs must have the same shape"):
        run_op("ReluGrad", np.ones((2, 3), np.float32), np.ones((3,), np.float32), T=np.float32)


def test_gradient_dtype_must_match_t(run_op):
    with pytest.raises(errors.InvalidArgumentError, match=r"input 1 has type double"):
        run_op("TanhGrad", np.ones(3, np.float32), np.ones(3), T=np.float32)


# --------------------------------------------------------------------------- BiasAddGrad, L2Loss


@pytest.mark.parametrize(
    ("shape", "data_format", "axes"),
    [((5, 3), "NHWC", (0,)), ((2, 4, 4, 3), "NHWC", (0, 1, 2)), ((2, 3, 4, 4), "NCHW", (0, 2, 3))],
)
def test_bias_add_grad_sums_all_but_the_channel_dimension(run_op, shape, data_format, axes):
    grad = _x(shape)
    (out,) = run_op("BiasAddGrad", grad, T=np.float32, data_format=data_format)
    np.testing.assert_allclose(out, grad.sum(axis=axes), rtol=1e-5)
    assert out.dtype == np.float32


def test_bias_add_grad_needs_two_dimensions(run_op):
    with pytest.raises(errors.InvalidArgumentError, match=r"at least 2D: \[3\]"):
        run_op("BiasAddGrad", np.ones(3, np.float32), T=np.float32)


def test_bias_add_grad_rejects_unknown_data_formats(make_node):

    with pytest.raises(errors.InvalidArgumentError, match="Invalid data format: NDHWC"):
        create_kernel(make_node("BiasAddGrad", ["g"], T=np.float32, data_format="NDHWC"))


def test_l2_loss(run_op):
    t = _x((3, 5))
    (loss,) = run_op("L2Loss", t, T=np.float32)
    assert loss.shape == ()
    np.testing.assert_allclose(loss, (t.astype(np.float64) ** 2).sum() / 2, rtol=1e-5)


# --------------------------------------------------------------------------- softmax family


def test_log_softmax(run_op):
    x = _x((4, 6), dtype=np.float64)
    (y,) = run_op("LogSoftmax", x, T=np.float64)
    np.testing.assert_allclose(y, np.log(_softmax(x)), rtol=1e-12)


def test_log_softmax_is_stable_for_large_logits(run_op):
    (y,) = run_op("LogSoftmax", np.array([[1000.0, 0.0]], np.float32), T=np.float32)
    np.testing.assert_allclose(y, [[0.0, -1000.0]])


@pytest.mark.parametrize("shape", [(256, 10), (3, 7, 5), (64, 32), (9, 2), (5, 33), (6,)])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_the_softmax_family_gives_the_bits_of_its_formula_with_numpys_row_max(run_op, shape, dtype):
    # Rows of few values take their maximum column by column (`nn._row_max`): the
    # same maxima, so the same outputs, bit for bit, inf and nan rows included.
    rng = np.random.default_rng(len(shape) * 100 + shape[-1])
    x = (rng.standard_normal(shape) * 5).astype(dtype)
    flat = x.reshape(-1, shape[-1])
    if len(flat) >= 4:
        flat[1, 0], flat[2, -1], flat[3, 1 % shape[-1]] = np.inf, -np.inf, np.nan
    largest = np.max(x, axis=-1, keepdims=True)
    np.testing.assert_array_equal(nn._row_max(x), largest)  # (nan equal to nan)
    with np.errstate(all="ignore"):
        shifted = x - largest
        log_probs = shifted - np.log(np.sum(np.exp(shifted), axis=-1, keepdims=True))
        exps = np.exp(shifted)
        probs = exps / np.sum(exps, axis=-1, keepdims=True)
    (got,) = run_op("LogSoftmax", x, T=dtype)
    np.testing.assert_array_equal(got.view(np.uint8), log_probs.view(np.uint8))
    (got,) = run_op("Softmax", x, T=dtype)
    np.testing.assert_array_equal(got.view(np.uint8), probs.view(np.uint8))
    if len(shape) == 2:
        labels = rng.integers(0, shape[1], shape[0]).astype(np.int64)
        loss, backprop = run_op("SparseSoftmaxCrossEntropyWithLogits", x, labels, T=dtype, Tlabels=np.int64)
        rows = np.arange(shape[0])
        np.testing.assert_array_equal(loss.view(np.uint8), (-log_probs[rows, labels]).view(np.uint8))
        want = np.exp(log_probs)
        want[rows, labels] -= 1
        np.testing.assert_array_equal(backprop.view(np.uint8), want.view(np.uint8))


def test_softmax_cross_entropy_returns_loss_and_backprop(run_op):
    logits = _x((5, 3), dtype=np.float64)
    labels = _softmax(_x((5, 3), dtype=np.float64))
    loss, backprop = run_op("SoftmaxCrossEntropyWithLogits", logits, labels, T=np.float64)
    np.testing.assert_allclose(loss, -(labels * np.log(_softmax(logits))).sum(axis=1), rtol=1e-12)
    np.testing.assert_allclose(backprop, _softmax(logits) - labels, rtol=1e-12, atol=1e-15)


def test_softmax_cross_entropy_broadcasts_labels(run_op):
    logits = _x((4, 3))
    labels = np.array([[0.0, 1.0, 0.0]], np.float32)
    loss, backprop = run_op("SoftmaxCrossEntropyWithLogits", logits, labels, T=np.float32)
    assert loss.shape == (4,)
    assert backprop.shape == (4, 3)


def test_softmax_cross_entropy_needs_rank_two(run_op):
    with pytest.raises(errors.InvalidArgumentError, match="must be either 2-dimensional"):
        run_op("SoftmaxCrossEntropyWithLogits", np.ones(3, np.float32), np.ones(3, np.float32), T=np.float32)


@pytest.mark.parametrize("label_type", [np.int32, np.int64])
def test_sparse_softmax_cross_entropy(run_op, label_type):
    logits = _x((5, 4), dtype=np.float64)
    labels = np.array([0, 3, 1, 1, 2], label_type)
    loss, backprop = run_op(
        "SparseSoftmaxCrossEntropyWithLogits", logits, labels, T=np.float64, Tlabels=label_type
    )
    probs = _softmax(logits)
    np.testing.assert_allclose(loss, -np.log(probs[np.arange(5), labels]), rtol=1e-12)
    np.testing.assert_allclose(backprop, probs - np.eye(4)[labels], rtol=1e-12, atol=1e-15)


def test_sparse_softmax_cross_entropy_refuses_labels_out_of_range(run_op):
    with pytest.raises(errors.InvalidArgumentError) as info:
        run_op(
            "SparseSoftmaxCrossEntropyWithLogits",
            np.zeros((3, 3), np.float32),
            np.array([0, 5, 1], np.int32),
            T=np.float32,
            Tlabels=np.int32,
            name="xent",
        )
    assert info.value.message.startswith(
        "Received a label value of 5 which is outside the valid range of [0, 3).  Label values: 0 5 1"
    )
    assert info.value.node_name == "xent"


def test_sparse_softmax_cross_entropy_refuses_a_negative_label_and_names_the_first_bad_one(run_op):
    with pytest.raises(errors.InvalidArgumentError) as info:
        run_op(
            "SparseSoftmaxCrossEntropyWithLogits",
            np.zeros((4, 3), np.float32),
            np.array([2, -1, 7, 0], np.int64),
            T=np.float32,
            Tlabels=np.int64,
        )
    assert info.value.message.startswith(
        "Received a label value of -1 which is outside the valid range of [0, 3).  Label values: 2 -1 7 0"
    )


def test_sparse_softmax_cross_entropy_of_an_empty_batch(run_op):
    loss, backprop = run_op(
        "SparseSoftmaxCrossEntropyWithLogits",
        np.zeros((0, 3), np.float32),
        np.zeros(0, np.int32),
        T=np.float32,
        Tlabels=np.int32,
    )
    assert loss.shape == (0,)
    assert backprop.shape == (0, 3)


def test_sparse_softmax_cross_entropy_checks_shapes(run_op):
    with pytest.raises(errors.InvalidArgumentError, match="same first dimension"):
        run_op(
            "SparseSoftmaxCrossEntropyWithLogits",
            np.zeros((3, 2), np.float32),
            np.zeros(2, np.int64),
            T=np.float32,
            Tlabels=np.int64,
        )
