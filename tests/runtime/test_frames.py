"""Loops of control flow v1 in the executor: frames, iterations, dead tensors.

Graphs are written node by node, as `tf.while_loop` under `disable_control_flow_v2`
builds them (Enter -> Merge -> LoopCond -> Switch -> body -> NextIteration -> Merge,
Switch's false port -> Exit), and run by one `Executor` with `_Arg`/`_Retval` for
inputs and results. TensorFlow itself runs the same loops in tests/interop/test_v1_loops.py.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from typing import Any

import numpy as np
import pytest

from distserver import errors
from distserver.kernels.registry import FunctionFrame
from distserver.kernels.resources import ResourceManager
from distserver.protos import types_pb2
from distserver.protos.attr_value_pb2 import AttrValue
from distserver.protos.graph_pb2 import GraphDef
from distserver.runtime import executor as executor_module
from distserver.runtime.executor import Executor, StepContext
from distserver.runtime.partition import partition
from distserver.runtime.rendezvous import StepRendezvous
from distserver.tensors import to_tensor_proto

TASK = "/job:localhost/replica:0/task:0"
DEVICE = f"{TASK}/device:CPU:0"
INT = types_pb2.DT_INT32
UNSET = object()


class Builder:
    def __init__(self) -> None:
        self.graph = GraphDef()

    def node(self, name: str, op: str, inputs: list[str], **attrs: Any) -> str:
        node = self.graph.node.add(name=name, op=op, input=inputs)
        for key, value in attrs.items():
            if isinstance(value, AttrValue):
                node.attr[key].CopyFrom(value)
            elif isinstance(value, bool):
                node.attr[key].b = value
            elif isinstance(value, int):
                node.attr[key].i = value
            elif isinstance(value, str):
                node.attr[key].s = value.encode()
        return name

    def const(self, name: str, value: int, control: str | None = None) -> str:
        tensor = AttrValue(tensor=to_tensor_proto(np.int32(value)))
        return self.node(
            name, "Const", [f"^{control}"] if control else [], dtype=AttrValue(type=INT), value=tensor
        )

    def arg(self, name: str, index: int) -> str:
        return self.node(name, "_Arg", [], T=AttrValue(type=INT), index=index)

    def retval(self, name: str, value: str, index: int) -> str:
        return self.node(name, "_Retval", [value], T=AttrValue(type=INT), index=index)

    def less_than(self, name: str) -> Any:
        """A loop's `cond`: its first loop variable < its first invariant."""
        return lambda vars_, invs, pivot: self.node(name, "Less", [vars_[0], invs[0]], T=AttrValue(type=INT))

    def op(self, name: str, op: str, inputs: list[str], **attrs: Any) -> str:
        return self.node(name, op, inputs, T=AttrValue(type=INT), **attrs)

    def loop(
        self,
        frame: str,
        init: list[str],
        invariants: list[str],
        cond: Any,
        body: Any,
        parallel: int = 10,
    ) -> list[str]:
        """A `while_loop` over `init` (loop variables) and `invariants` (constant Enters);
        `cond(vars, invs, pivot)` gives a bool node, `body(vars, invs, pivot)` new vars.
        Returns the Exit nodes."""
        enters = [
            self.op(f"{frame}/enter{k}", "Enter", [v], frame_name=frame, parallel_iterations=parallel)
            for k, v in enumerate(init)
        ]
        invs = [
            self.op(
                f"{frame}/inv{k}",
                "Enter",
                [v],
                frame_name=frame,
                is_constant=True,
                parallel_iterations=parallel,
            )
            for k, v in enumerate(invariants)
        ]
        merges = [
            self.node(
                f"{frame}/merge{k}",
                "Merge",
                [e, f"{frame}/next{k}"],
                T=AttrValue(type=INT),
                N=2,
            )
            for k, e in enumerate(enters)
        ]
        pred = cond(merges, invs, merges[0])
        loop_cond = self.node(f"{frame}/cond", "LoopCond", [pred])
        switches = [self.op(f"{frame}/switch{k}", "Switch", [m, loop_cond]) for k, m in enumerate(merges)]
        exits = [self.op(f"{frame}/exit{k}", "Exit", [s]) for k, s in enumerate(switches)]
        body_in = [self.op(f"{frame}/body_in{k}", "Identity", [f"{s}:1"]) for k, s in enumerate(switches)]
        new = body(body_in, invs, body_in[0])
        for k, value in enumerate(new):
            self.op(f"{frame}/next{k}", "NextIteration", [value])
        return exits


def run(graph: GraphDef, args: list[Any], num_results: int, pool: Any = None) -> list[Any]:
    executor = Executor(graph)
    frame = FunctionFrame(args=[np.int32(a) for a in args], retvals=[UNSET] * num_results)
    ctx = StepContext(
        step_id=1,
        device=DEVICE,
        device_incarnation=1,
        rendezvous=StepRendezvous(1, TASK, None),
        resources=ResourceManager(),
        pool=pool,
        frame=frame,
    )
    asyncio.run(asyncio.wait_for(executor.run(ctx), 60))
    return frame.retvals


def counting_loop(parallel: int = 10) -> GraphDef:
    """i, total = 0, 0; while i < n: total += i * step; i += 1 -> (i, total)."""
    b = Builder()
    n = b.arg("n", 0)
    step = b.arg("step", 1)
    zero = b.const("zero", 0)

    cond = b.less_than("loop/less")

    def body(vars_: list[str], invs: list[str], pivot: str) -> list[str]:
        one = b.const("loop/one", 1, control=pivot)
        i = b.op("loop/add_i", "AddV2", [vars_[0], one])
        total = b.op("loop/add_t", "AddV2", [vars_[1], b.op("loop/mul", "Mul", [vars_[0], invs[1]])])
        return [i, total]

    exits = b.loop("loop", [zero, zero], [n, step], cond, body, parallel=parallel)
    b.retval("i_out", exits[0], 0)
    b.retval("total_out", exits[1], 1)
    return b.graph


@pytest.mark.parametrize("n", [0, 1, 7])
def test_a_counting_loop_runs_its_body_until_the_condition_fails(n):
    i, total = run(counting_loop(), [n, 3], 2)
    assert i == n
    assert total == 3 * sum(range(n))


@pytest.mark.parametrize("parallel", [1, 2, 32])
def test_parallel_iterations_give_the_same_result(parallel, monkeypatch):
    most_alive = 0
    new_iteration = executor_module._Frame.new_iteration

    def counting(frame: Any) -> Any:
        nonlocal most_alive
        iteration = new_iteration(frame)
        if frame.parent is not None:
            most_alive = max(most_alive, len(frame.iterations))
        return iteration

    monkeypatch.setattr(executor_module._Frame, "new_iteration", counting)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        assert run(counting_loop(parallel), [25, 2], 2, pool) == [25, 2 * sum(range(25))]
    assert 1 <= most_alive <= parallel


def test_nested_loops_run_the_inner_loop_once_per_outer_iteration():
    """for i in range(n): for j in range(m): total += 1 (an inner frame per outer iteration)."""
    b = Builder()
    n = b.arg("n", 0)
    m = b.arg("m", 1)
    zero = b.const("zero", 0)

    outer_cond = b.less_than("outer/less")

    def outer_body(vars_: list[str], invs: list[str], pivot: str) -> list[str]:
        inner_zero = b.const("outer/zero", 0, control=pivot)

        inner_cond = b.less_than("inner/less")

        def inner_body(ivars: list[str], iinvs: list[str], ipivot: str) -> list[str]:
            one = b.const("inner/one", 1, control=ipivot)
            return [
                b.op("inner/add_j", "AddV2", [ivars[0], one]),
                b.op("inner/add_t", "AddV2", [ivars[1], one]),
            ]

        inner_exits = b.loop("inner", [inner_zero, vars_[1]], [invs[1]], inner_cond, inner_body, parallel=3)
        one = b.const("outer/one", 1, control=pivot)
        return [b.op("outer/add_i", "AddV2", [vars_[0], one]), inner_exits[1]]

    exits = b.loop("outer", [zero, zero], [n, m], outer_cond, outer_body, parallel=4)
    b.retval("total_out", exits[1], 0)
    b.retval("i_out", exits[0], 1)
    assert run(b.graph, [5, 4], 2) == [20, 5]
    assert run(b.graph, [3, 0], 2) == [0, 3]
    assert run(b.graph, [0, 9], 2) == [0, 0]


def loop_in_cond() -> GraphDef:
    """x if pred is false, else (count x up to 10 in a loop); a Merge joins the branches."""
    b = Builder()
    pred = b.node("pred", "_Arg", [], T=AttrValue(type=types_pb2.DT_BOOL), index=0)
    x = b.arg("x", 1)
    limit = b.const("limit", 10)
    switch = b.op("cond/switch", "Switch", [x, pred])
    switch_limit = b.op("cond/switch_limit", "Switch", [limit, pred])
    taken = b.op("cond/taken", "Identity", [f"{switch}:1"])

    cond = b.less_than("loop/less")

    def body(vars_: list[str], invs: list[str], pivot: str) -> list[str]:
        one = b.const("loop/one", 1, control=pivot)
        return [b.op("loop/add", "AddV2", [vars_[0], one])]

    exits = b.loop("loop", [taken], [f"{switch_limit}:1"], cond, body)
    after = b.op("cond/after_loop", "Identity", [exits[0]])
    not_taken = b.op("cond/not_taken", "Neg", [f"{switch}:0"])
    b.node("cond/merge", "Merge", [not_taken, after], T=AttrValue(type=INT), N=2)
    b.retval("out", "cond/merge", 0)
    b.retval("loop_out", after, 1)
    return b.graph


def test_a_loop_inside_a_cond_runs_only_on_the_branch_taken():
    graph = loop_in_cond()
    assert run(graph, [True, 3], 2) == [10, 10]
    # On the branch not taken, the loop is dead: its Exit's consumer never computes,
    # and the Merge takes the other branch.
    out, loop_out = run(graph, [False, 3], 2)
    assert out == -3
    assert loop_out is UNSET


def test_dead_tensors_leave_a_finished_loop_only_through_its_exits():
    """Every iteration but the last sends DEAD to the Exit; what leaves is the last live value."""
    b = Builder()
    zero = b.const("zero", 0)
    n = b.arg("n", 0)

    cond = b.less_than("loop/less")

    def body(vars_: list[str], invs: list[str], pivot: str) -> list[str]:
        one = b.const("loop/one", 1, control=pivot)
        return [b.op("loop/add", "AddV2", [vars_[0], one])]

    exits = b.loop("loop", [zero], [n], cond, body)
    # A node after the loop with a control edge from the Exit runs once, live.
    after = b.const("after", 42, control=exits[0])
    b.retval("exit_out", exits[0], 0)
    b.retval("after_out", after, 1)
    # Switch's true port inside the loop is dead in the last iteration: a node there
    # never leaves the loop.
    assert run(b.graph, [4], 2) == [4, 42]


def test_a_graph_without_loops_still_refuses_cycles():
    b = Builder()
    b.op("a", "Identity", ["b"])
    b.op("b", "Identity", ["a"])
    with pytest.raises(errors.InvalidArgumentError, match="cycle"):
        Executor(b.graph)


PS_TASK = "/job:ps/replica:0/task:0"
PS = f"{PS_TASK}/device:CPU:0"


def run_on_two_tasks(graph: GraphDef, on_ps: set[str], args: list[Any], num_results: int) -> list[Any]:
    """Place the nodes named in `on_ps` on a second task, split the graph as the master
    does (`partition`) and run both partitions, each with its own rendezvous, as two
    workers would. Checks that every value one task sent the other was taken."""
    for node in graph.node:
        node.device = PS if node.name in on_ps else DEVICE
    parts = partition(list(graph.node), incarnation=lambda device: 1)
    assert set(parts) == {TASK, PS_TASK}
    rendezvous: dict[str, StepRendezvous] = {}

    async def fetch(step_id: int, key: Any, together: bool) -> Any:  # what RecvTensor does between workers
        sender = rendezvous[key.src_task]
        value = await sender.recv_local(key)
        sender.hand_over([key.text])
        return value

    frames = {
        TASK: FunctionFrame(args=[np.int32(a) for a in args], retvals=[UNSET] * num_results),
        PS_TASK: FunctionFrame(args=[], retvals=[]),
    }

    async def step() -> None:
        runs = []
        for task, part in parts.items():
            rendezvous[task] = StepRendezvous(1, task, fetch)
            ctx = StepContext(
                step_id=1,
                device=PS if task == PS_TASK else DEVICE,
                device_incarnation=1,
                rendezvous=rendezvous[task],
                resources=ResourceManager(),
                frame=frames[task],
            )
            runs.append(Executor(part).run(ctx))
        await asyncio.gather(*runs)

    asyncio.run(asyncio.wait_for(step(), 60))
    for task in parts:
        assert not rendezvous[task].needed_elsewhere(), f"{task} sent values nobody took"
        assert not rendezvous[task].pending_keys()
    return frames[TASK].retvals


def loop_with_body_on_ps(parallel: int) -> tuple[GraphDef, set[str]]:
    """i, total = 0, 0; while i < n: total += i * step; i += 1, with `i * step` on the ps."""
    b = Builder()
    n = b.arg("n", 0)
    step = b.arg("step", 1)
    zero = b.const("zero", 0)

    cond = b.less_than("loop/less")

    def body(vars_: list[str], invs: list[str], pivot: str) -> list[str]:
        product = b.op("loop/product", "Mul", [vars_[0], invs[1]])
        one = b.const("loop/one", 1, control=pivot)
        return [b.op("loop/next_i", "AddV2", [vars_[0], one]), b.op("loop/sum", "AddV2", [vars_[1], product])]

    exits = b.loop("while_frame", [zero, zero], [n, step], cond, body, parallel=parallel)
    b.retval("i", exits[0], 0)
    b.retval("total", exits[1], 1)
    return b.graph, {"loop/product"}


@pytest.mark.parametrize("parallel", [1, 10])
@pytest.mark.parametrize("n", [0, 1, 5])
# The invariant's Enter on the ps too: that task holds no part of the loop's own
# machinery, yet its Enter's value must be used in every iteration there.
@pytest.mark.parametrize("invariant_on_ps", [False, True])
def test_a_loop_whose_body_spans_two_tasks_runs_each_iteration_on_both(parallel, n, invariant_on_ps):
    graph, on_ps = loop_with_body_on_ps(parallel)
    if invariant_on_ps:
        on_ps.add("while_frame/inv1")
    expected = [n, sum(i * 3 for i in range(n))]
    assert run(graph, [n, 3], 2) == expected  # on one task
    assert run_on_two_tasks(graph, on_ps, [n, 3], 2) == expected


def test_the_other_task_gets_a_control_loop_and_keys_with_the_iteration():
    graph, on_ps = loop_with_body_on_ps(10)
    for node in graph.node:
        node.device = PS if node.name in on_ps else DEVICE
    parts = partition(list(graph.node), incarnation=lambda device: 1)
    ps_ops = sorted(node.op for node in parts[PS_TASK].node)
    # Mul, its two inputs and the loop predicate received, the product sent back, and
    # the control loop (start, Enter, Merge, Switch, NextIteration).
    assert ps_ops == sorted(
        ["Mul", "_Recv", "_Recv", "_Recv", "_Send", "Const", "Enter", "Merge", "Switch", "NextIteration"]
    )
    for node in parts[PS_TASK].node:
        if node.op in ("_Send", "_Recv"):
            assert node.attr["_loop_frame"].s == b"while_frame"
        if node.op == "_Recv":  # each waits on the control loop's iteration
            assert any(text.startswith("^_control_loop_0/") for text in node.input)


def test_nested_loops_spanning_tasks_name_each_inner_execution_apart():
    """for i < n: for j < i: total += j * step (the product on the ps): the inner loop's
    executions in different outer iterations must not mix their values."""
    b = Builder()
    n = b.arg("n", 0)
    step = b.arg("step", 1)
    zero = b.const("zero", 0)

    outer_cond = b.less_than("outer/less")

    def outer_body(vars_: list[str], invs: list[str], pivot: str) -> list[str]:
        inner_zero = b.const("outer/zero", 0, control=pivot)

        inner_cond = b.less_than("inner/less")

        def inner_body(ivars: list[str], iinvs: list[str], ipivot: str) -> list[str]:
            product = b.op("inner/product", "Mul", [ivars[0], iinvs[1]])
            one = b.const("inner/one", 1, control=ipivot)
            return [
                b.op("inner/next_j", "AddV2", [ivars[0], one]),
                b.op("inner/sum", "AddV2", [ivars[1], product]),
            ]

        inner = b.loop("inner_frame", [inner_zero, vars_[1]], [vars_[0], invs[1]], inner_cond, inner_body)
        one = b.const("outer/one", 1, control=pivot)
        return [b.op("outer/next_i", "AddV2", [vars_[0], one]), b.op("outer/total", "Identity", [inner[1]])]

    exits = b.loop("outer_frame", [zero, zero], [n, step], outer_cond, outer_body)
    b.retval("total", exits[1], 0)
    for count in (0, 1, 4):
        expected = [sum(j * 3 for i in range(count) for j in range(i))]
        assert run(b.graph, [count, 3], 1) == expected
        assert run_on_two_tasks(b.graph, {"inner/product"}, [count, 3], 1) == expected


def test_a_next_iteration_apart_from_its_merge_is_refused():
    graph, _ = loop_with_body_on_ps(10)
    with pytest.raises(errors.UnimplementedError, match="NextIteration node 'while_frame/next1'"):
        run_on_two_tasks(graph, {"while_frame/next1"}, [3, 3], 2)


def test_stacks_pop_in_reverse_and_report_misuse():
    """A stack's values come back last first; popping an empty stack or overflowing fails."""
    b = Builder()
    size = b.arg("size", 0)
    stack = b.node("stack", "StackV2", [size], elem_type=AttrValue(type=INT), stack_name="s")
    first = b.op("push1", "StackPushV2", [stack, b.const("one", 1)])
    second = b.op("push2", "StackPushV2", [stack, b.const("two", 2)])
    b.graph.node[-1].input.append(f"^{first}")
    pop1 = b.node("pop1", "StackPopV2", [stack, f"^{second}"], elem_type=AttrValue(type=INT))
    pop2 = b.node("pop2", "StackPopV2", [stack, f"^{pop1}"], elem_type=AttrValue(type=INT))
    b.retval("r1", pop1, 0)
    b.retval("r2", pop2, 1)
    assert run(b.graph, [-1], 2) == [2, 1]
    with pytest.raises(errors.InvalidArgumentError, match=r"overflowed its max_size \(1\)"):
        run(b.graph, [1], 2)
    b.node("pop3", "StackPopV2", [stack, f"^{pop2}"], elem_type=AttrValue(type=INT))
    with pytest.raises(errors.InvalidArgumentError, match="is empty"):
        run(b.graph, [-1], 2)


def test_a_loop_that_never_ends_can_be_cancelled():
    """The step yields to the event loop while it loops, so its timeout can stop it."""
    b = Builder()
    zero = b.const("zero", 0)
    limit = b.const("limit", 1)

    cond = b.less_than("loop/less")

    def body(vars_: list[str], invs: list[str], pivot: str) -> list[str]:
        return [b.op("loop/same", "Identity", [vars_[0]])]  # never reaches the limit

    exits = b.loop("loop", [zero], [limit], cond, body)
    b.retval("out", exits[0], 0)
    executor = Executor(b.graph)
    ctx = StepContext(
        step_id=1,
        device=DEVICE,
        device_incarnation=1,
        rendezvous=StepRendezvous(1, TASK, None),
        resources=ResourceManager(),
        frame=FunctionFrame(args=[], retvals=[UNSET]),
    )

    async def step_with_timeout() -> None:
        await asyncio.wait_for(executor.run(ctx), 0.5)

    with pytest.raises(TimeoutError):
        asyncio.run(step_with_timeout())
