"""Control flow v2 loops from a real TensorFlow client (graph mode, tf.compat.v1.Session):
tf.while_loop and its gradient, nested loops with a cond inside, TensorArrays, map_fn,
a loop updating a variable on the ps, one updating variables on the ps and the worker
(a lowered While spanning tasks), and an RNN unrolled by a loop with its weights on
the ps trained for some steps; compared with TensorFlow alone."""

from __future__ import annotations

import numpy as np
import pytest

from distserver.testing import LocalCluster

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300, func_only=True)]

SAME = [
    *(
        f"{check}_{count}"
        for check in ("while", "while_grad", "nested_with_cond", "tensor_array")
        for count in (0, 3)
    ),
    "map_fn",
    "map_fn_ints",
    "loop_on_ps",
    "loop_on_two_tasks",
    "rnn_training",
    "rnn_weights",
]


@pytest.fixture(scope="module")
def results(tf_client):
    with LocalCluster({"ps": 1, "worker": 1}) as cluster:
        yield tf_client.run("loops.py", {"cluster": cluster.cluster})


@pytest.mark.parametrize("name", SAME)
def test_the_same_values_as_tensorflow(results, check, name):
    ours = check(results, f"distserver/{name}")
    theirs = check(results, f"tensorflow/{name}")
    # Summation order inside numpy and TensorFlow's kernels differs in the last bits.
    np.testing.assert_allclose(ours, theirs, rtol=1e-5)
