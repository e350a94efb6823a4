"""The pure planning passes and `build_plan`: rewrite/prune, placement, partitioning, pushes (no I/O)."""

from __future__ import annotations

import numpy as np
import pytest

from distserver import errors
from distserver.devices import rendezvous_key
from distserver.protos.node_def_pb2 import NodeDef
from distserver.runtime.partition import COPIED_CONST_BYTES, partition
from distserver.runtime.placement import place
from distserver.runtime.plan import build_plan, mark_receives_first
from distserver.runtime.push import plan_pushes
from distserver.runtime.subgraph import move_client_endpoints, rewrite_for_step
from distserver.tensors import from_tensor_proto, to_tensor_proto

PS0 = "/job:ps/replica:0/task:0/device:CPU:0"
PS1 = "/job:ps/replica:0/task:1/device:CPU:0"
W0 = "/job:worker/replica:0/task:0/device:CPU:0"
W1 = "/job:worker/replica:0/task:1/device:CPU:0"
DEVICES = [PS0, PS1, W0, W1]
INCARNATIONS = {PS0: 11, PS1: 12, W0: 13, W1: (1 << 64) - 5}


def node(name, op="Identity", inputs=(), device="", **attrs):
    n = NodeDef(name=name, op=op, input=list(inputs), device=device)
    for key, value in attrs.items():
        if isinstance(value, list):
            n.attr[key].list.s.extend(v.encode() for v in value)
        else:
            n.attr[key].s = value.encode()
    return n


def graph(*nodes):
    return {n.name: n for n in nodes}


class TestRewrite:
    def test_feeds_and_fetches_become_client_terminated_recv_and_send(self):
        g = graph(node("x", "Placeholder"), node("y", "Neg", ["x"]), node("z", "Neg", ["y:0"]))
        step = rewrite_for_step(
            g, feeds=[("x:0", 1)], fetches=["z:0"], targets=[], client_device=W0, client_incarnation=13
        )
        names = [n.name for n in step.nodes]
        assert names == ["_recv_x_0", "y", "z", "_send_z_0"]
        by = {n.name: n for n in step.nodes}
        assert by["y"].input == ["_recv_x_0:0"]
        assert by["_send_z_0"].input == ["z:0"]
        recv = by["_recv_x_0"]
        assert recv.attr["client_terminated"].b
        assert recv.attr["tensor_name"].s == b"x:0"
        assert recv.attr["send_device"].s.decode() == W0
        assert step.feed_keys == {"x:0": rendezvous_key(W0, 13, W0, "x:0")}
        assert step.fetch_keys == {"z:0": rendezvous_key(W0, 13, W0, "z:0")}
        assert g["y"].input == ["x"]  # the session's graph is untouched

    def test_pruning_keeps_only_what_fetches_and_targets_need(self):
        g = graph(
            node("a", "Const"),
            node("b", "Neg", ["a"]),
            node("unused", "Neg", ["a"]),
            node("init", "NoOp", ["^b"]),
        )
        step = rewrite_for_step(
            g, feeds=[], fetches=[], targets=["init"], client_device=W0, client_incarnation=1
        )
        assert [n.name for n in step.nodes] == ["a", "b", "init"]

    def test_fed_tensor_cuts_its_producer(self):
        g = graph(node("a", "Const"), node("b", "Neg", ["a"]), node("c", "Neg", ["b"]))
        step = rewrite_for_step(
            g, feeds=[("b", 1)], fetches=["c"], targets=[], client_device=W0, client_incarnation=1
        )
        assert {n.name for n in step.nodes} == {"_recv_b_0", "c", "_send_c_0"}

    @pytest.mark.parametrize(
        ("kwargs", "message"),
        [
            ({"feeds": [("nope:0", 1)]}, "FeedInputs: unable to find feed output nope:0"),
            ({"fetches": ["nope:0"]}, "FetchOutputs node nope:0: not found"),
            ({"targets": ["nope"]}, "PruneForTargets: Some target nodes not found: nope"),
        ],
    )
    def test_unknown_names_are_not_found_errors(self, kwargs, message):
        args = {"feeds": [], "fetches": [], "targets": [], **kwargs}
        with pytest.raises(errors.NotFoundError) as info:
            rewrite_for_step(graph(node("a", "Const")), client_device=W0, client_incarnation=1, **args)
        assert info.value.message == message


class TestPlacement:
    def test_partial_specs_complete_against_the_cluster(self):
        nodes = [
            node("free"),
            node("ps_any", device="/job:ps"),
            node("ps1", device="/job:ps/task:1"),
            node("cpu", device="/device:CPU:0"),
            node("w1", device="/job:worker/replica:0/task:1/device:CPU:0"),
        ]
        place(nodes, devices=DEVICES, client_device=W0)
        assert [n.device for n in nodes] == [W0, PS0, PS1, W0, W1]

    def test_colocation_with_class_attr_and_with_resource_producers(self):
        var = node("v", "VarHandleOp", device="/job:ps/task:1")
        read = node("read", "ReadVariableOp", ["v"])
        init = node("init_value", "Const", **{"_class": ["loc:@v"]})
        assign = node("assign", "AssignVariableOp", ["v", "init_value"])
        nodes = [var, read, init, assign]
        place(nodes, devices=DEVICES, client_device=W0)
        assert {n.device for n in nodes} == {PS1}

    def test_unknown_job_or_task_names_the_node_and_device(self):
        with pytest.raises(
            errors.InvalidArgumentError, match=r"operation bad: .*/job:nope.*available devices"
        ) as info:
            place([node("bad", device="/job:nope")], devices=DEVICES, client_device=W0)
        assert info.value.node_name == "bad"
        with pytest.raises(errors.InvalidArgumentError, match="far"):
            place([node("far", device="/job:ps/task:9")], devices=DEVICES, client_device=W0)

    def test_gpu_requests_need_soft_placement(self):
        with pytest.raises(errors.InvalidArgumentError, match="gpu_op"):
            place([node("gpu_op", device="/job:ps/device:GPU:0")], devices=DEVICES, client_device=W0)
        soft = [node("gpu_op", device="/job:ps/task:1/device:GPU:0")]
        place(soft, devices=DEVICES, client_device=W0, allow_soft_placement=True)
        assert soft[0].device == PS1

    def test_conflicting_colocation_is_an_error(self):
        nodes = [
            node("v", "VariableV2", device="/job:ps/task:0"),
            node("r", "Identity", ["v"], device=PS1, **{"_class": ["loc:@v"]}),
        ]
        with pytest.raises(errors.InvalidArgumentError, match="Cannot colocate"):
            place(nodes, devices=DEVICES, client_device=W0)

    def test_a_resource_consumer_request_yields_to_the_resource(self):
        # TF: "Ignoring device specification ... because the input edge ... is a
        # reference connection"; replica_device_setter asks for the worker here.
        nodes = [
            node("v", "VarHandleOp", device="/job:ps/task:0"),
            node("r", "ReadVariableOp", ["v"], device=PS1),
            node("init", "VarIsInitializedOp", ["v"], device="/job:worker"),
        ]
        place(nodes, devices=DEVICES, client_device=W0)
        assert [n.device for n in nodes] == [PS0, PS0, PS0]

    def test_requests_of_a_group_merge(self):
        nodes = [
            node("v", "VarHandleOp", device="/job:ps"),
            node("r", "ReadVariableOp", ["v"], device="/job:ps/task:1"),
            node("c", "Const", device="/device:CPU:0", **{"_class": ["loc:@v"]}),
        ]
        place(nodes, devices=DEVICES, client_device=W0)
        assert {n.device for n in nodes} == {PS1}

    def test_feeds_and_fetches_of_handles_stay_on_the_client_device(self):
        nodes = [node("v", "VarHandleOp", device=PS1), node("_send_v_0", "_Send", ["v"], device=W0)]
        place(nodes, devices=DEVICES, client_device=W0)
        assert [n.device for n in nodes] == [PS1, W0]


class TestPartition:
    def placed(self):
        return [
            node("a", "Const", device=PS0),
            node("b", "Neg", ["a"], device=W1),
            node("c", "Neg", ["a:0"], device=W1),  # same value, same destination: one transfer
            node("d", "Neg", ["b", "^a"], device=W0),
        ]

    def test_cross_task_edges_become_send_recv_pairs_with_tf_attrs(self):
        parts = partition(self.placed(), incarnation=INCARNATIONS.__getitem__)
        assert set(parts) == {
            "/job:ps/replica:0/task:0",
            "/job:worker/replica:0/task:1",
            "/job:worker/replica:0/task:0",
        }
        ps = {n.name: n for n in parts["/job:ps/replica:0/task:0"].node}
        w1 = {n.name: n for n in parts["/job:worker/replica:0/task:1"].node}
        sends = [n for n in ps.values() if n.op == "_Send"]
        recvs = [n for n in w1.values() if n.op == "_Recv"]
        assert len(recvs) == 1  # deduplicated per destination device
        recv = recvs[0]
        assert w1["b"].input == [recv.name + ":0"]
        assert w1["c"].input == [recv.name + ":0"]
        matching = [s for s in sends if s.attr["recv_device"].s.decode() == W1]
        assert len(matching) == 1
        send = matching[0]
        assert send.input == ["a:0"]
        for attr in ("tensor_name", "send_device", "recv_device", "send_device_incarnation"):
            assert send.attr[attr] == recv.attr[attr]
        assert send.attr["tensor_name"].s.decode().startswith("edge_")
        assert send.attr["tensor_name"].s.decode().endswith("_a")
        assert send.attr["send_device_incarnation"].i == 11
        assert not send.attr["client_terminated"].b

    def test_uint64_incarnations_are_stored_as_int64(self):
        nodes = [node("a", "Const", device=W1), node("b", "Neg", ["a"], device=PS0)]
        parts = partition(nodes, incarnation=INCARNATIONS.__getitem__)
        (send,) = [n for n in parts["/job:worker/replica:0/task:1"].node if n.op == "_Send"]
        assert send.attr["send_device_incarnation"].i == -5

    def test_control_edges_across_tasks_carry_a_dummy_value(self):
        parts = partition(self.placed(), incarnation=INCARNATIONS.__getitem__)
        ps = {n.name: n for n in parts["/job:ps/replica:0/task:0"].node}
        w0 = {n.name: n for n in parts["/job:worker/replica:0/task:0"].node}
        (dummy,) = [n for n in ps.values() if n.op == "Const" and n.name != "a"]
        assert dummy.input == ["^a"]
        control = [i for i in w0["d"].input if i.startswith("^")]
        assert len(control) == 1
        assert w0[control[0][1:]].op == "_Recv"

    def test_a_small_constant_another_task_uses_is_copied_there_not_sent(self):
        rate = constant("rate", np.float32(0.01), W0, _class="loc:@w")
        big = constant("big", np.zeros(COPIED_CONST_BYTES // 4 + 1, np.float32), W0)
        waits = constant("waits", np.float32(2.0), W0)
        waits.input.append("^rate")  # ordered after another node: not a plain value
        nodes = [
            rate,
            big,
            waits,
            node("w", "VarHandleOp", device=PS0),
            node("update", "Apply", ["w", "rate", "big", "waits", "rate:0"], device=PS0),
            node("also", "Neg", ["rate"], device=PS1),
        ]
        parts = partition(nodes, incarnation=INCARNATIONS.__getitem__)
        ps = {n.name: n for n in parts["/job:ps/replica:0/task:0"].node}
        ps1 = {n.name: n for n in parts["/job:ps/replica:0/task:1"].node}
        worker = parts["/job:worker/replica:0/task:0"].node
        copies = [n for n in ps.values() if n.op == "Const"]
        assert len(copies) == 1  # one copy for both uses of the rate
        (copy,) = copies
        assert copy.device == PS0
        assert not copy.input
        assert "_class" not in copy.attr
        assert from_tensor_proto(copy.attr["value"].tensor) == np.float32(0.01)
        update = ps["update"].input
        assert update[0] == "w"
        assert update[1] == update[4] == copy.name + ":0"
        # The large constant and the one with a control input cross as values.
        assert [ps[name.split(":")[0]].op for name in update[2:4]] == ["_Recv", "_Recv"]
        assert sorted(n.input[0] for n in worker if n.op == "_Send") == ["big:0", "waits:0"]
        # Each task that uses it gets its own copy; the original stays where it was.
        (other,) = [n for n in ps1.values() if n.op == "Const"]
        assert ps1["also"].input == [other.name + ":0"]
        assert other.device == PS1
        assert [n.name for n in worker if n.op == "Const"] == ["rate", "big", "waits"]

    def test_a_control_edge_from_a_small_constant_still_carries_a_dummy_value(self):
        nodes = [constant("rate", np.float32(0.01), W0), node("after", "NoOp", ["^rate"], device=PS0)]
        parts = partition(nodes, incarnation=INCARNATIONS.__getitem__)
        ps = {n.name: n for n in parts["/job:ps/replica:0/task:0"].node}
        (control,) = ps["after"].input
        assert ps[control[1:]].op == "_Recv"


def constant(name, value, device, **attrs):
    n = node(name, "Const", device=device, **attrs)
    n.attr["dtype"].type = to_tensor_proto(value).dtype
    n.attr["value"].tensor.CopyFrom(to_tensor_proto(value))
    return n


def test_feeds_and_fetches_move_to_the_device_that_uses_them():
    g = graph(node("x", "Placeholder"), node("y", "Neg", ["x"], device="/job:ps/task:0"))
    step = rewrite_for_step(
        g, feeds=[("x", 1)], fetches=["y"], targets=[], client_device=W0, client_incarnation=13
    )
    place(step.nodes, devices=DEVICES, client_device=W0)
    move_client_endpoints(step, INCARNATIONS.__getitem__)
    assert {n.device for n in step.nodes} == {PS0}
    assert step.feed_keys["x:0"] == rendezvous_key(PS0, 11, PS0, "x:0")
    assert step.fetch_keys["y:0"] == rendezvous_key(PS0, 11, PS0, "y:0")


def test_values_from_a_partition_without_receives_are_pushed():
    nodes = [node("a", "Const", device=PS0), node("b", "Neg", ["a"], device=W0)]
    parts = partition(nodes, incarnation=INCARNATIONS.__getitem__)
    pushed = plan_pushes(parts, "/job:worker/replica:0/task:0")
    assert list(pushed) == ["/job:ps/replica:0/task:0"]
    (recv,) = [n for n in parts["/job:worker/replica:0/task:0"].node if n.op == "_Recv"]
    assert recv.attr["_recv_pushed"].b
    # A partition that also receives keeps RecvTensor (pushing could deadlock).
    nodes = [
        node("a", "Const", device=W0),
        node("b", "Neg", ["a"], device=PS0),
        node("c", "Neg", ["b"], device=W0),
    ]
    parts = partition(nodes, incarnation=INCARNATIONS.__getitem__)
    assert plan_pushes(parts, "/job:worker/replica:0/task:0") == {}


def _marks(parts, task):
    return {n.attr["_receives_first"].b for n in parts[task].node if n.op == "_Recv"}


def test_partitions_wait_for_their_receives_after_what_needs_none_unless_that_makes_a_cycle():
    # The parameter-server step: the worker receives w from ps and sends ps the update;
    # ps sends w before it waits for its receives, the update after.
    nodes = [
        node("w", "Const", device=PS0),
        node("x", "Const", device=W0),
        node("grad", "Mul", ["w", "x"], device=W0),
        node("apply", "Sub", ["w", "grad"], device=PS0),
        node("other", "Neg", ["x"], device=W1),  # a value that goes to W1 and back
        node("back", "Neg", ["other"], device=W0),
    ]
    parts = partition(nodes, incarnation=INCARNATIONS.__getitem__)
    mark_receives_first(parts)
    for task in ("/job:worker/replica:0/task:0", "/job:worker/replica:0/task:1", "/job:ps/replica:0/task:0"):
        assert _marks(parts, task) == {True}, task
    # A lookup: W0 sends ids to PS0, which sends back rows, from which W0 computes
    # what it sends PS0 next. Waiting for all its receives, PS0 would wait for a value
    # that needs its own rows: it keeps the ready queue; W0 may still wait.
    nodes = [
        node("ids", "Const", device=W0),
        node("rows", "Neg", ["ids"], device=PS0),
        node("loss", "Neg", ["rows"], device=W0),
        node("update", "Neg", ["loss"], device=PS0),
    ]
    parts = partition(nodes, incarnation=INCARNATIONS.__getitem__)
    mark_receives_first(parts)
    assert _marks(parts, "/job:ps/replica:0/task:0") == {False}
    assert _marks(parts, "/job:worker/replica:0/task:0") == {True}
    # A step with a conditional (dead values) marks nothing.
    nodes = [
        node("pred", "Const", device=W0),
        node("value", "Const", device=PS0),
        node("switch", "Switch", ["value", "pred"], device=W0),
    ]
    parts = partition(nodes, incarnation=INCARNATIONS.__getitem__)
    mark_receives_first(parts)
    assert _marks(parts, "/job:worker/replica:0/task:0") == {False}


def test_build_plan_runs_every_pass_for_a_two_task_step():
    g = graph(
        node("x", "Placeholder"),
        node("w", "Const", device="/job:ps/task:0"),
        node("read", "Identity", ["w"], device="/job:ps/task:0"),
        node("y", "Mul", ["x", "read"], device="/job:worker/task:0"),
    )
    plan = build_plan(
        g,
        feeds=[("x:0", 1)],
        fetches=["y:0"],
        targets=[],
        incarnations={PS0: 11, W0: 13},
        client_device=W0,
        master_task="/job:worker/replica:0/task:0",
    )
    assert set(plan.graphs) == {"/job:ps/replica:0/task:0", "/job:worker/replica:0/task:0"}
    worker = {n.name: n for n in plan.graphs["/job:worker/replica:0/task:0"].node}
    assert worker["y"].device == W0
    # The ps partition receives nothing, so the value it sends rides its RunGraph response.
    (pushed,) = plan.pushed_keys["/job:ps/replica:0/task:0"]
    (recv,) = [n for n in worker.values() if n.op == "_Recv" and not n.attr["client_terminated"].b]
    assert recv.attr["_recv_pushed"].b
    assert pushed == rendezvous_key(PS0, 11, W0, recv.attr["tensor_name"].s.decode())
    # The feed and the fetch travel with the worker's partition.
    assert plan.client_keys("/job:worker/replica:0/task:0") == {plan.feed_keys["x:0"], plan.fetch_keys["y:0"]}
    assert plan.client_keys("/job:ps/replica:0/task:0") == set()
    assert g["y"].input == ["x", "read"]  # the session's graph is untouched
    assert g["y"].device == "/job:worker/task:0"
