"""Stateless random kernels give TensorFlow's numbers.

The expected values were computed by TensorFlow 2.21 (CPU) with
`gen_stateless_random_ops_v2.stateless_random_get_key_counter(seed)` and
`stateless_random_uniform_v2` / `stateless_random_normal_v2(shape, key, counter, alg=3)`.
"""

from __future__ import annotations

import numpy as np
import pytest

from distserver import errors
from distserver.kernels import create_kernel

# seed -> (key, counter, first four float32 uniforms of shape [3, 7], three float64
# uniforms, four float32 normals, three float64 normals)
TENSORFLOW = {
    (1, 2): (
        [10413732777507651514],
        [0, 17830669156045600267],
        [0.8440604209899902, 0.19204533100128174, 0.9962232112884521, 0.16038739681243896],
        [0.7524837538451801, 0.9697857725627486, 0.17592233912897481],
        [0.544110119342804, 0.20738030970096588, 0.0735643208026886, 0.04643455147743225],
        [-0.1423118100189212, 0.7406072461585091, -1.469047669443883],
    ),
    (-5, 123456789012): (
        [916771484641006134],
        [0, 3594452602128618859],
        [0.2992689609527588, 0.009908914566040039, 0.26102399826049805, 0.4040771722793579],
        [0.39415243083594165, 0.08819278963669608, 0.45711719996662814],
        [0.09664697200059891, 1.5503175258636475, 0.929093062877655, -1.3502118587493896],
        [0.7180405537686602, 1.1603675674376783, -0.8145361002148416],
    ),
}


def _key_counter(make_node, ctx, seed):
    kernel = create_kernel(make_node("StatelessRandomGetKeyCounter", ["seed"], Tseed=np.int64))
    return kernel.compute(ctx, [np.array(seed, np.int64)])


def _draw(make_node, ctx, op, dtype, shape, key, counter, alg=3):
    kernel = create_kernel(make_node(op, ["shape", "key", "counter", "alg"], dtype=dtype, Tshape=np.int32))
    (values,) = kernel.compute(ctx, [np.array(shape, np.int32), key, counter, np.int32(alg)])
    return values


@pytest.mark.parametrize("seed", list(TENSORFLOW))
def test_key_counter_and_values_equal_tensorflow_s(make_node, ctx, seed):
    key_tf, counter_tf, u32, u64, n32, n64 = TENSORFLOW[seed]
    key, counter = _key_counter(make_node, ctx, seed)
    assert key.dtype == counter.dtype == np.uint64
    assert key.tolist() == key_tf
    assert counter.tolist() == counter_tf
    uniform = _draw(make_node, ctx, "StatelessRandomUniformV2", np.float32, [3, 7], key, counter)
    assert uniform.shape == (3, 7)
    np.testing.assert_array_equal(uniform[0, :4], np.array(u32, np.float32))
    np.testing.assert_array_equal(
        _draw(make_node, ctx, "StatelessRandomUniformV2", np.float64, [5], key, counter, alg=1)[:3], u64
    )
    # float32 Box-Muller: TensorFlow's float sin/cos/log may differ in the last bit.
    np.testing.assert_allclose(
        _draw(make_node, ctx, "StatelessRandomNormalV2", np.float32, [9], key, counter)[:4], n32, rtol=3e-7
    )
    np.testing.assert_array_equal(
        _draw(make_node, ctx, "StatelessRandomNormalV2", np.float64, [3], key, counter), n64
    )


def test_the_same_seed_gives_the_same_values_and_large_draws_have_the_right_moments(make_node, ctx):
    key, counter = _key_counter(make_node, ctx, (7, 8))
    first = _draw(make_node, ctx, "StatelessRandomNormalV2", np.float32, [100, 100], key, counter)
    again = _draw(make_node, ctx, "StatelessRandomNormalV2", np.float32, [100, 100], key, counter)
    np.testing.assert_array_equal(first, again)
    assert abs(first.mean()) < 0.03
    assert abs(first.std() - 1) < 0.03
    uniform = _draw(make_node, ctx, "StatelessRandomUniformV2", np.float32, [10001], key, counter)
    assert uniform.min() >= 0
    assert uniform.max() < 1
    # A prefix of a longer draw is the shorter draw (each group of four comes from its own counter).
    np.testing.assert_array_equal(
        _draw(make_node, ctx, "StatelessRandomUniformV2", np.float32, [9], key, counter), uniform[:9]
    )


def test_bad_inputs_are_invalid_argument(make_node, ctx):
    with pytest.raises(errors.InvalidArgumentError, match="seed must have shape"):
        _key_counter(make_node, ctx, (1, 2, 3))
    key, counter = _key_counter(make_node, ctx, (1, 2))
    with pytest.raises(errors.InvalidArgumentError, match="Unsupported algorithm id: 2"):
        _draw(make_node, ctx, "StatelessRandomUniformV2", np.float32, [3], key, counter, alg=2)
    with pytest.raises(errors.InvalidArgumentError, match="negative dimension"):
        _draw(make_node, ctx, "StatelessRandomUniformV2", np.float32, [-1], key, counter)
