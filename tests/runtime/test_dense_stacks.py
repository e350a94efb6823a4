"""Chains of fused dense layers, and of their gradients, run as one node each
(`executor._stack_dense_layers`, `kernels.math.DenseStackKernel`): the same bits as the
members one by one, errors naming the member's part, the pool when a member alone
would go there, and chains cut where stacking would hold a peer's value back or make
a cycle."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import distserver as ds
from distserver import errors
from distserver.kernels.math import DENSE_STACK_OP, FUSED_MATMUL_GRAD_OP, FUSED_MATMUL_OP, FUSED_NODES_ATTR
from distserver.protos.graph_pb2 import GraphDef
from distserver.protos.node_def_pb2 import NodeDef
from distserver.protos.types_pb2 import DT_FLOAT
from distserver.runtime import executor as executor_module
from distserver.runtime.executor import Executor
from distserver.runtime.fusion import fuse_dense_layers
from tests.runtime.conftest import assert_same_training

F32 = np.float32
PS = "/job:ps/replica:0/task:0"
HERE = "/job:localhost/replica:0/task:0"


def _mlp(layers: int, width: int, rng: np.random.Generator) -> tuple[ds.Graph, Any, Any, Any, Any]:
    """A training graph of `layers` dense layers (tanh, relu and sigmoid in turn) and a
    momentum update: (graph, init, train, loss, x)."""
    activations = [ds.tanh, ds.relu, ds.sigmoid]
    with ds.Graph().as_default() as graph:
        x = ds.placeholder(ds.float32, [8, width], name="x")
        h = x
        for i in range(layers):
            w = ds.Variable(rng.standard_normal((width, width)).astype(F32) * F32(0.5), name=f"w{i}")
            b = ds.Variable(rng.standard_normal(width).astype(F32) * F32(0.1), name=f"b{i}")
            h = activations[i % 3](ds.matmul(h, w) + b, name=f"layer{i}")
        loss = ds.reduce_mean(ds.square(h), name="loss")
        train = ds.train.MomentumOptimizer(0.05, 0.9).minimize(loss)
        init = ds.global_variables_initializer()
    return graph, init, train, loss, x


def _live(executor: Executor, op: str) -> list[Any]:
    return [node for node in executor._nodes if not node.left_out and node.kernel.op == op]


def _members(node: Any) -> list[NodeDef]:
    return [NodeDef.FromString(data) for data in node.kernel.node.attr[FUSED_NODES_ATTR].list.s]


def _train(server: ds.Server, graph: ds.Graph, feeds: list[Any], *step: Any) -> Any:
    """The losses of steps fed `feeds` (`step`: init, train, loss, x), then every
    variable's value."""
    init, train, loss, x = step
    config = ds.ConfigProto(isolate_session_state=True)  # (each session its own variables)
    with ds.Session(server.target, graph=graph, config=config) as session:
        session.run(init)
        losses = [session.run([train, loss], {x: feed})[1] for feed in feeds]
        with graph.as_default():
            return losses, session.run(ds.global_variables())


def test_a_deep_mlp_runs_its_layers_and_their_gradients_as_two_stacks_with_the_same_bits(
    server, monkeypatch, executors
):
    rng = np.random.default_rng(5)
    graph, init, train, loss, x = _mlp(6, 16, rng)
    feeds = [rng.standard_normal((8, 16)).astype(F32) for _ in range(4)]
    stacked = _train(server, graph, feeds, init, train, loss, x)
    step = max(executors, key=lambda e: len(_live(e, DENSE_STACK_OP)))
    forward, backward = sorted(_live(step, DENSE_STACK_OP), key=lambda n: n.kernel.forward, reverse=True)
    assert [m.op for m in _members(forward)] == [FUSED_MATMUL_OP] * 6
    assert [m.name for m in _members(forward)] == [f"layer{i}" for i in range(6)]
    assert [m.op for m in _members(backward)] == [FUSED_MATMUL_GRAD_OP] * 6
    assert [m.attr["N"].i for m in _members(backward)] == [1] * 5 + [0]  # (no gradient of x)
    assert not _live(step, FUSED_MATMUL_OP)
    assert not _live(step, FUSED_MATMUL_GRAD_OP)
    assert len(forward.kernel.node.attr[FUSED_NODES_ATTR].list.s) == forward.kernel.node.attr["M"].i
    assert backward.kernel.node.attr["M"].i == 12  # each layer's bias and weights gradients
    # The same steps with every layer and gradient a node of its own: the same bits.
    monkeypatch.setattr(executor_module, "_stack_dense_layers", lambda nodes, control_sources: None)
    assert_same_training(stacked, _train(server, graph, feeds, init, train, loss, x), len(feeds))


def test_a_member_that_fails_is_named_by_its_part(server, executors):
    with ds.Graph().as_default() as graph:
        x = ds.placeholder(ds.float32, [4, 3], name="x")
        weights = [ds.placeholder(ds.float32, None, name=f"w{i}") for i in range(3)]
        h = x
        for i, w in enumerate(weights):
            h = ds.relu(ds.matmul(h, w) + ds.zeros([3]), name=f"layer{i}")
    ok = np.ones((3, 3), F32)
    with ds.Session(server.target, graph=graph) as session:
        value = session.run(h, {x: np.ones((4, 3), F32), weights[0]: ok, weights[1]: ok, weights[2]: ok})
        np.testing.assert_array_equal(value, np.full((4, 3), 27.0, F32))
        bad = np.ones((2, 3), F32)
        with pytest.raises(errors.InvalidArgumentError) as raised:
            session.run(h, {x: np.ones((4, 3), F32), weights[0]: ok, weights[1]: bad, weights[2]: ok})
    assert [["layer0", "layer1", "layer2"]] in [_stacks(executor) for executor in executors]  # (one stack)
    assert raised.value.node_name == "MatMul_1"  # layer1's product, as TensorFlow names it
    assert "Matrix size-incompatible" in raised.value.message


def _layers_graph(count: int) -> GraphDef:
    rng = np.random.default_rng(7)
    with ds.Graph().as_default() as graph:
        h = ds.constant(rng.standard_normal((4, 5)).astype(F32), name="x")
        for i in range(count):
            w = ds.constant(rng.standard_normal((5, 5)).astype(F32), name=f"w{i}")
            h = ds.tanh(ds.matmul(h, w) + ds.constant(np.zeros(5, F32), name=f"b{i}"), name=f"layer{i}")
        ds.identity(h, name="out")
    return fuse_dense_layers(graph.as_graph_def())


def _send(name: str, source: str, task: str) -> NodeDef:
    node = NodeDef(name=name, op="_Send", input=[source])
    node.attr["T"].type = DT_FLOAT
    node.attr["send_device"].s = f"{HERE}/device:CPU:0".encode()
    node.attr["recv_device"].s = f"{task}/device:CPU:0".encode()
    node.attr["send_device_incarnation"].i = 1
    node.attr["tensor_name"].s = name.encode()
    return node


def _stacks(executor: Executor) -> list[list[str]]:
    return [[m.name for m in _members(node)] for node in _live(executor, DENSE_STACK_OP)]


def test_a_layer_another_task_waits_for_is_left_out_of_the_stack():
    graph_def = _layers_graph(5)
    assert _stacks(Executor(graph_def)) == [[f"layer{i}" for i in range(5)]]
    graph_def.node.append(_send("to_ps", "layer1", PS))
    graph_def.node.append(_send("to_client", "layer3", HERE))  # (the client: no hurry)
    assert _stacks(Executor(graph_def)) == [["layer2", "layer3", "layer4"]]


def test_a_chain_is_cut_before_a_layer_that_waits_for_a_value_from_the_chain():
    graph_def = _layers_graph(4)
    square = NodeDef(name="square", op="Square", input=["layer0"])
    square.attr["T"].type = DT_FLOAT
    graph_def.node.append(square)
    graph_def.node.append(_send("fetch_square", "square", HERE))  # (read: not skipped)
    for node in graph_def.node:
        if node.name == "layer2":
            node.input.append("^square")  # stacked with layer0, it would wait for itself
    assert _stacks(Executor(graph_def)) == [["layer0", "layer1"], ["layer2", "layer3"]]


def _inputs_and_member_counts(executor: Executor) -> tuple[Any, list[Any], list[int]]:
    """The forward stack of a graph of constants, its inputs, and what each member weighs
    (`OpKernel.work_nbytes`) on the inputs it sees when the members run one by one."""
    (stack,) = _live(executor, DENSE_STACK_OP)
    inputs = [executor._nodes[src].kernel.compute(None, [])[k] for src, k in stack.inputs]  # (Consts)
    counts, passed = [], None
    for member, (start, end) in zip(stack.kernel.members, stack.kernel._spans, strict=True):
        own = inputs[start:end]
        if start:
            own.insert(0, passed)
        counts.append(member.work_nbytes(own))
        (passed,) = member.compute(None, own)
    return stack, inputs, counts


def test_a_stack_goes_to_the_pool_when_one_of_its_layers_would():
    rng = np.random.default_rng(9)
    with ds.Graph().as_default() as graph:
        h = ds.constant(rng.standard_normal((256, 784)).astype(F32), name="x")
        for i, (rows, columns) in enumerate([(784, 512), (512, 10), (10, 10)]):
            w = ds.constant(rng.standard_normal((rows, columns)).astype(F32), name=f"w{i}")
            h = ds.relu(ds.matmul(h, w) + ds.constant(np.zeros(columns, F32)), name=f"layer{i}")
    stack, inputs, counts = _inputs_and_member_counts(Executor(fuse_dense_layers(graph.as_graph_def())))
    assert stack.kernel.work_nbytes(inputs) == max(counts) == counts[0]  # (the first layer's)
    assert executor_module._large(stack.kernel, inputs)
    # Small layers: a bound from the largest input, at least what the heaviest weighs.
    stack, inputs, counts = _inputs_and_member_counts(Executor(_layers_graph(6)))
    assert max(counts) <= stack.kernel.work_nbytes(inputs) < executor_module.OFFLOAD_BYTES
    assert not executor_module._large(stack.kernel, inputs)


def _record_stack_inputs(monkeypatch: pytest.MonkeyPatch) -> dict[bool, tuple[Any, list[Any]]]:
    """The last inputs each kind of stack computed (by `forward`), with its kernel, as
    steps run."""
    from distserver.kernels.math import DenseStackKernel

    seen: dict[bool, tuple[Any, list[Any]]] = {}
    compute = DenseStackKernel.compute

    def recording(kernel: Any, ctx: Any, inputs: list[Any]) -> list[Any]:
        seen[kernel.forward] = (kernel, list(inputs))
        return compute(kernel, ctx, inputs)

    monkeypatch.setattr(DenseStackKernel, "compute", recording)
    return seen


def test_a_gradient_stack_weighs_a_last_member_without_weights_itself(server, monkeypatch):
    # The first layer's gradient (the stack's last member) has no weights input (N = 0):
    # its product, h.T @ g, is 2048 x 2048 multiply-adds from two 1 x 2048 inputs, which
    # the bound from the stack's largest input (layer 1's 2048 x 4 weights) does not see.
    seen = _record_stack_inputs(monkeypatch)
    rng = np.random.default_rng(11)
    with ds.Graph().as_default() as graph:
        x = ds.placeholder(ds.float32, [1, 2048], name="x")
        w0 = ds.Variable(ds.random_uniform([2048, 2048], -0.01, 0.01, seed=1), name="w0")
        w1 = ds.Variable(rng.standard_normal((2048, 4)).astype(F32), name="w1")
        b0, b1 = ds.Variable(np.zeros(2048, F32), name="b0"), ds.Variable(np.zeros(4, F32), name="b1")
        hidden = ds.tanh(ds.matmul(x, w0) + b0, name="layer0")
        out = ds.tanh(ds.matmul(hidden, w1) + b1, name="layer1")
        grads = ds.gradients(ds.reduce_sum(ds.square(out)), [w0, b0, w1, b1])
        init = ds.global_variables_initializer()
    config = ds.ConfigProto(isolate_session_state=True)
    with ds.Session(server.target, graph=graph, config=config) as session:
        session.run(init)
        session.run(grads, {x: rng.standard_normal((1, 2048)).astype(F32)})
    kernel, inputs = seen[False]
    assert [member.attr_int("N") for member in kernel.members] == [1, 0]
    largest = max(value.nbytes for value in inputs)
    assert largest == 2048 * 4 * 4  # (w1)
    own = inputs[kernel._spans[-1][0] :]
    own.insert(1, own[0])  # (TanhGrad's y stands in for the gradient coming down: its shape)
    assert kernel.members[-1].work_nbytes(own) >= executor_module.OFFLOAD_BYTES
    assert executor_module._large(kernel, inputs)


def _count_checked_calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The members' fast paths that check their inputs (`layer`, `gradients`), as they are called."""
    from distserver.kernels.math import FusedMatMulGradKernel, FusedMatMulKernel

    checked: list[str] = []
    for kernel, name in ((FusedMatMulKernel, "layer"), (FusedMatMulGradKernel, "gradients")):
        original = getattr(kernel, name)

        def counting(self: Any, *args: Any, _original: Any = original, _name: str = name) -> Any:
            checked.append(_name)
            return _original(self, *args)

        monkeypatch.setattr(kernel, name, counting)
    return checked


def test_a_stack_skips_its_members_checks_for_inputs_like_those_they_took(server, monkeypatch):
    # After a step whose inputs every member's fast path took, inputs of the same dtypes
    # and shapes (and the same constants) go straight to the members' arithmetic: the
    # same bits as the members one by one.
    checked = _count_checked_calls(monkeypatch)
    rng = np.random.default_rng(13)
    graph, init, train, loss, x = _mlp(4, 16, rng)
    feeds = [rng.standard_normal((8, 16)).astype(F32) for _ in range(4)]
    stacked = _train(server, graph, feeds, init, train, loss, x)
    assert sorted(checked) == ["gradients"] * 4 + ["layer"] * 4  # (the first step's)
    monkeypatch.setattr(executor_module, "_stack_dense_layers", lambda nodes, control_sources: None)
    alone = _train(server, graph, feeds, init, train, loss, x)
    np.testing.assert_array_equal(stacked[0], alone[0])
    for value, expected in zip(stacked[1], alone[1], strict=True):
        np.testing.assert_array_equal(value, expected)


def test_inputs_unlike_those_the_members_took_go_through_their_checks(monkeypatch):
    checked = _count_checked_calls(monkeypatch)
    stack, inputs, _ = _inputs_and_member_counts(Executor(_layers_graph(3)))
    kernel = stack.kernel
    checked.clear()  # (the members' own runs above)
    layers = kernel.compute(None, inputs)
    assert len(checked) == 3
    np.testing.assert_array_equal(kernel.compute(None, list(inputs))[-1], layers[-1])
    assert len(checked) == 3  # (the same shapes: unchecked)
    # Another batch size: each member checks its inputs again, and the result is theirs.
    rows = np.ones((2, 5), F32)
    expected = rows
    for member, (_, end) in zip(kernel.members, kernel._spans, strict=True):
        (expected,) = member.compute(None, [expected, *inputs[end - 2 : end]])
    checked.clear()
    np.testing.assert_array_equal(kernel.compute(None, [rows, *inputs[1:]])[-1], expected)
    assert len(checked) == 3
    # Another dtype: the first member's checks refuse it, and its own kernel says why
    # (its unchecked arithmetic would have made a float64 product).
    with pytest.raises(errors.InvalidArgumentError) as raised:
        kernel.compute(None, [rows.astype(np.float64), *inputs[1:]])
    assert raised.value.node_name == "MatMul"


def test_small_checked_stacks_run_their_members_calls_from_a_plan_with_the_same_bits(
    server, monkeypatch, executors
):
    # Inputs like those the members took, every product one np.dot: the stack makes each
    # member's numpy calls itself from a plan (no call a member), with the same bits as
    # the members one by one; tanh, relu and sigmoid layers alike.
    from distserver.kernels import _compiled

    assert _compiled.wait(300), "the compiled loops are not there: numba missing? (pip install -e '.[dev]')"
    rng = np.random.default_rng(17)
    graph, init, train, loss, x = _mlp(6, 16, rng)
    feeds = [rng.standard_normal((8, 16)).astype(F32) for _ in range(4)]
    stacked = _train(server, graph, feeds, init, train, loss, x)
    step = max(executors, key=lambda e: len(_live(e, DENSE_STACK_OP)))
    stacks = [node.kernel for node in _live(step, DENSE_STACK_OP)]
    assert sorted(kernel.forward for kernel in stacks) == [False, True]
    for kernel in stacks:
        assert kernel._plan is not None
        assert kernel._plan[0] is kernel._took
        assert len(kernel._plan[1]) == 6  # (a step planned: one entry a member)
    monkeypatch.setattr(executor_module, "_stack_dense_layers", lambda nodes, control_sources: None)
    assert_same_training(stacked, _train(server, graph, feeds, init, train, loss, x), len(feeds))


def test_a_planned_gradient_stack_takes_numpys_calls_for_a_member_with_a_strided_input(server, monkeypatch):
    # The compiled gradient pass reads C-contiguous arrays only: an activation input that
    # is not goes through the member's own `checked_gradients` (numpy's calls); and a
    # plan made for other shapes is made again.
    from distserver.kernels import _compiled
    from distserver.kernels.math import DenseStackKernel

    assert _compiled.wait(300), "the compiled loops are not there: numba missing? (pip install -e '.[dev]')"
    compute = DenseStackKernel.compute
    seen = _record_stack_inputs(monkeypatch)
    rng = np.random.default_rng(19)
    graph, init, train, loss, x = _mlp(3, 5, rng)  # (8 rows of 5: a row's arrays are told apart)
    _train(server, graph, [rng.standard_normal((8, 5)).astype(F32) for _ in range(2)], init, train, loss, x)
    kernel, inputs = seen[False]

    def members_one_by_one(values: list[Any]) -> list[Any]:
        out, passed = [], None
        for member, taken, (start, end) in zip(kernel.members, kernel._taken, kernel._spans, strict=True):
            own = values[start:end]
            if start:
                own.insert(taken, passed)
            result = member.compute(None, own)
            out += result[:2]
            passed = result[2] if len(result) == 3 else None
        return out + ([passed] if passed is not None else [])

    def assert_members_bits(values: list[Any]) -> None:
        expected = members_one_by_one(values)
        got = compute(kernel, None, list(values))
        assert len(got) == len(expected)
        for value, want in zip(got, expected, strict=True):
            np.testing.assert_array_equal(value, want)

    assert_members_bits(inputs)
    plan = kernel._plan
    assert plan is not None
    assert plan[0] is kernel._took
    assert plan[1] is not None
    # The first member's activation output (its SigmoidGrad's y: the last layer is a
    # sigmoid), as a strided view of the same values.
    strided = list(inputs)
    wide = np.zeros((8, 10), F32)
    wide[:, ::2] = inputs[0]
    strided[0] = wide[:, ::2]
    assert not strided[0].flags.c_contiguous
    calls: list[int] = []
    first = kernel.members[0]
    own = first.checked_gradients
    monkeypatch.setattr(first, "checked_gradients", lambda *args: calls.append(1) or own(*args))
    assert_members_bits(strided)
    assert calls == [1]
    assert kernel._plan is plan
    # Another batch size (six of the rows): the members check the inputs, then a plan is
    # made for their shapes.
    fewer = [v[:6] if v.ndim == 2 and v.shape[0] == 8 else v for v in inputs]
    assert_members_bits(fewer)  # (unlike: the members' checks; remembered)
    assert kernel._plan is plan
    assert_members_bits(fewer)
    assert kernel._plan is not plan
    assert kernel._plan[0] is kernel._took
    assert kernel._plan[1] is not None
