"""Loops of control flow v1 (tf.while_loop under disable_control_flow_v2) from a real
TensorFlow client: counting loops, a loop's gradient (stacks), TensorArrays (an RNN and
its gradient), parallel_iterations=1, nested loops with a cond inside, a loop inside a
cond, loops reading variables; compared with TensorFlow alone."""

from __future__ import annotations

import numpy as np
import pytest

from distserver.testing import LocalCluster

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300, func_only=True)]

COUNTS = (0, 1, 5)
SAME = [
    *(
        f"{check}_{count}"
        for check in (
            "count",
            "powered",
            "grad",
            "tensor_array",
            "serial",
            "alternating",
            "local_read",
            "ps_invariant",
            "ps_read_in_body",
            "in_cond_True",
            "in_cond_False",
        )
        for count in COUNTS
    ),
    "rnn_outputs",
    "rnn_grad",
    # Loops whose bodies span the ps and the worker.
    "ps_updates_in_body",
    "ps_in_cond_True",
    "ps_in_cond_False",
    "nested_ps_updates",
    "ps_rnn_losses",
    "ps_rnn_weights",
]


@pytest.fixture(scope="module")
def results(tf_client):
    with LocalCluster({"ps": 1, "worker": 1}) as cluster:
        yield tf_client.run("v1_loops.py", {"cluster": cluster.cluster})


@pytest.mark.parametrize("name", SAME)
def test_the_same_values_as_tensorflow(results, check, name):
    # tanh and summation order differ from TensorFlow's kernels in the last bits.
    np.testing.assert_allclose(
        check(results, f"distserver/{name}"), check(results, f"tensorflow/{name}"), rtol=1e-5, atol=1e-6
    )
