"""A real `tf.compat.v1.Session` against a distserver cluster: every MasterService RPC it makes.

The client (clients/session_rpcs.py) talks to worker 0's master through a
`RecordingProxy`, so the tests see the RPCs on the wire as well as the results.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from distserver.protos import master_pb2
from distserver.testing import LocalCluster

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120, func_only=True)]


@pytest.fixture(scope="module")
def session_run(tf_client, recording_proxy) -> Iterator[tuple[dict[str, Any], Any]]:
    """(the client's results, the proxy that saw its RPCs)."""
    with LocalCluster({"ps": 1, "worker": 2}) as cluster:
        proxy = recording_proxy(cluster.cluster["worker"][0])
        results = tf_client.run("session_rpcs.py", {"target": proxy.address, "cluster": cluster.cluster})
        yield results, proxy


@pytest.fixture(scope="module")
def results(session_run):
    return session_run[0]


def test_the_client_uses_every_session_rpc(session_run):
    _, proxy = session_run
    expected = {
        "CreateSession",
        "ExtendSession",
        "RunStep",
        "ListDevices",
        "MakeCallable",
        "RunCallable",
        "ReleaseCallable",
        "PartialRunSetup",
        "CloseSession",
        "Reset",
    }
    assert expected <= proxy.methods()
    assert all(call.method.startswith("/tensorflow.MasterService/") for call in proxy.calls)


def test_run_step_errors_travel_in_the_response_body(session_run):
    _, proxy = session_run
    steps = [call for call in proxy.calls if call.method.endswith("/RunStep")]
    requests = [master_pb2.RunStepRequest.FromString(call.request) for call in steps]
    assert all(request.store_errors_in_response_body for request in requests)
    # Feeds arrive as tensor_content, as TF clients send them.
    fed = [named.tensor for request in requests for named in request.feed]
    assert any(tensor.tensor_content for tensor in fed)
    responses = [master_pb2.RunStepResponse.FromString(call.response) for call in steps if call.response]
    failed = [response for response in responses if response.status_code]
    assert failed, "no step error was reported in a response body"
    assert all(not response.tensor for response in failed)


def test_arithmetic_with_feeds(results, check):
    y, row_sums, gram = check(results, "arithmetic")
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    np.testing.assert_allclose(y, x * 2 + 1)
    np.testing.assert_allclose(row_sums, (x * 2 + 1).sum(axis=1))
    np.testing.assert_allclose(gram, x @ x.T)
    assert check(results, "integers") == [3, 1]
    assert check(results, "booleans") is False
    assert check(results, "big_constant") == 4950.0
    assert check(results, "fetch_a_feed") == [[4.0, 4.0, 4.0]]
    large = np.arange(3 * 150_000, dtype=np.float32).reshape(-1, 3)
    total, last = check(results, "large_feed")
    assert total == pytest.approx(float((large.astype(np.float64) * 2 + 1).sum()), rel=1e-6)
    assert last == (large[-1] * 2 + 1).tolist()
    assert check(results, "large_string_feed") == [10_000, [[1.0, 3.0, 5.0]]]
    assert check(results, "make_callable_large_feed") == (large[-1] * 2 + 1).tolist()


def test_string_feeds_and_fetches(results, check):
    shouted, greeting = check(results, "strings")
    assert shouted == ["a!", "été!"]
    assert greeting == ["hello", "wörld", ""]


def test_nested_fetches_keep_their_structure(results, check):
    nested = check(results, "nested_fetches")
    assert nested["a"] == [[3.0, 3.0, 3.0]]
    row_sums, (big_total, inner) = nested["b"]
    assert row_sums == [9.0]
    assert big_total == 4950.0
    assert inner == {"c": 2}
    assert nested["p"] == [2, True]


def test_extend_session_and_list_devices(results, check):
    assert check(results, "extended") == [[9.0, 9.0, 9.0]]
    assert check(results, "list_devices") == [
        "/job:ps/replica:0/task:0/device:CPU:0",
        "/job:worker/replica:0/task:0/device:CPU:0",
        "/job:worker/replica:0/task:1/device:CPU:0",
    ]


def test_callables(results, check):
    assert check(results, "make_callable_feed_list") == [[3.0, 3.0, 3.0]]
    assert check(results, "make_callable_no_feeds") == 4950.0
    first, second = check(results, "callable_options")
    assert first == [[9.0, 9.0], [[3.0, 3.0], [3.0, 3.0]]]
    assert second == [[15.0], [[12.0]]]


@pytest.mark.parametrize(
    ("name", "error", "text"),
    [
        ("error_bad_reshape", "InvalidArgumentError", "Input to reshape is a tensor with 6 values"),
        ("error_missing_feed", "InvalidArgumentError", "You must feed a value for placeholder tensor 'x'"),
        ("error_bad_matmul", "InvalidArgumentError", "Matrix size-incompatible"),
        ("error_label_out_of_range", "InvalidArgumentError", "Received a label value of 7"),
        ("error_uninitialized", "FailedPreconditionError", "never_initialized"),
        ("error_deadline", "DeadlineExceededError", ""),
        ("error_partial_run", "UnimplementedError", "Partial runs"),
    ],
)
def test_step_errors_arrive_as_the_right_tf_error(results, check_error, name, error, text):
    raised, message = check_error(results, name)
    assert raised == error, message
    assert text in message


def test_the_session_keeps_working_after_errors(results, check):
    assert check(results, "after_errors") == 4


def test_an_op_without_a_kernel_is_refused_when_the_session_is_created(results, check_error):
    raised, message = check_error(results, "error_unsupported_at_create")
    assert raised == "UnimplementedError"
    assert "'Svd' (node 'svd')" in message
    assert "docs/tf-compat.md" in message


def test_an_op_without_a_kernel_is_refused_when_the_session_is_extended(results, check, check_error):
    assert check(results, "before_unsupported") == 6.0
    raised, message = check_error(results, "error_unsupported_at_extend")
    assert raised == "UnimplementedError"
    assert "'Svd' (node 'svd_later')" in message


def test_a_cond_of_control_flow_v2_runs(results, check):
    # tf.cond under control flow v2 builds an If over two library functions, which the
    # master lowers to Switch/Merge (runtime/functions.py).
    assert check(results, "control_flow_v2") == 1.0


def test_reset(results, check):
    assert check(results, "reset") is None
