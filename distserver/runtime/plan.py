"""Planning a step: from a session's graph and a step's signature to one GraphDef per task.

Pure: no I/O, no asyncio, nothing kept between calls. `build_plan` runs the passes
in order (each in its own module or below):

1. `subgraph.rewrite_for_step`: feeds become client-terminated `_Recv` nodes, fetches
   `_Send` nodes; the graph is pruned to what the fetches and targets need.
2. `placement.place`: every node gets a full device name.
3. `read_refs_late`: a TF 1.x variable read on another task after control inputs.
4. `subgraph.move_client_endpoints`: feeds and fetches travel with the partition
   that uses them instead of through the client device.
5. `partition.partition`: one GraphDef per task, `_Send`/`_Recv` pairs on every
   edge that crosses tasks.
6. `push.plan_pushes`: which values ride RunGraph responses (the push protocol).
7. `mark_receives_first`: the partitions whose steps may run what needs no receive,
   wait for all their receives, then run the rest (as one sequence,
   `executor._Straight`).

`import_graph` is the validation CreateSession and ExtendSession run on a client's
GraphDef (kernels, names, inputs, cycles), before any worker is involved.
The master registers the partitions with the workers and runs the steps.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from distserver import errors
from distserver.devices import task_of_device
from distserver.kernels import has_kernel
from distserver.kernels.ref_variables import REF_OUTPUT_OPS
from distserver.kernels.sendrecv import RECEIVES_FIRST_ATTR
from distserver.protos.function_pb2 import FunctionDef
from distserver.protos.graph_pb2 import GraphDef
from distserver.protos.node_def_pb2 import NodeDef
from distserver.runtime.control_loops import ENTER_OPS, LoopFrames
from distserver.runtime.functions import (
    has_function_calls,
    index_library,
    inline_functions,
    runtime_functions,
)
from distserver.runtime.names import parse_input, sendrecv_key
from distserver.runtime.partition import partition
from distserver.runtime.placement import place
from distserver.runtime.push import plan_pushes
from distserver.runtime.subgraph import move_client_endpoints, rewrite_for_step


@dataclass
class StepPlan:
    """What a step runs where, and the keys its values travel under."""

    graphs: dict[str, GraphDef]
    """Task -> the partition it runs."""
    feed_keys: dict[str, str]
    """Fed tensor ("x:0") -> the rendezvous key of its value."""
    fetch_keys: dict[str, str]
    """Fetched tensor -> the rendezvous key of its value."""
    pushed_keys: dict[str, set[str]]
    """Task -> keys of values its RunGraph response brings to the master's task."""

    def client_keys(self, task: str) -> set[str]:
        """Keys of the feeds and fetches that task's partition receives or sends itself."""
        return {sendrecv_key(node) for node in self.graphs[task].node if node.attr["client_terminated"].b}


def build_plan(
    nodes: Mapping[str, NodeDef],
    *,
    feeds: Sequence[tuple[str, int]],
    fetches: Sequence[str],
    targets: Sequence[str],
    incarnations: Mapping[str, int],
    client_device: str,
    master_task: str,
    allow_soft_placement: bool = False,
    functions: Mapping[str, FunctionDef] | None = None,
) -> StepPlan:
    """Plan one step signature.

    Args:
        nodes: The session's graph, node name -> NodeDef (not modified).
        feeds: (tensor name, DataType) of every fed tensor.
        fetches: Tensor names to fetch (feeds excluded: the master answers those).
        targets: Names of nodes to run.
        incarnations: Full name -> incarnation of every device of the session.
        client_device: The master's device (feeds and fetches go through it).
        master_task: The master's task.
        allow_soft_placement: ConfigProto's option, for placement.
        functions: The function library every partition gets, for the nodes that call
            functions at run time (`While`, and `IteratorGetNext` over a dataset whose
            map function another step's graph named); None when no node does.

    Raises:
        InvalidArgumentError, NotFoundError: unknown feeds, fetches or targets, or
            devices that cannot be placed (the passes' errors).
    """
    step = rewrite_for_step(
        nodes,
        feeds=feeds,
        fetches=fetches,
        targets=targets,
        client_device=client_device,
        client_incarnation=incarnations[client_device],
    )
    place(
        step.nodes,
        devices=list(incarnations),
        client_device=client_device,
        allow_soft_placement=allow_soft_placement,
    )
    read_refs_late(step.nodes)
    move_client_endpoints(step, incarnations.__getitem__)
    graphs = partition(step.nodes, incarnation=incarnations.__getitem__)
    if functions:
        for graph in graphs.values():
            graph.library.function.extend(functions.values())
    pushed_keys = plan_pushes(graphs, master_task)
    mark_receives_first(graphs)
    return StepPlan(
        graphs=graphs,
        feed_keys=step.feed_keys,
        fetch_keys=step.fetch_keys,
        pushed_keys=pushed_keys,
    )


# A step with one of these is never marked by `mark_receives_first`: a Switch makes
# dead values (which only the ready queue handles), loops run frame by frame.
_UNMARKED_OPS = frozenset({"Switch", "RefSwitch", "Enter", "RefEnter"})


def mark_receives_first(graphs: Mapping[str, GraphDef]) -> None:
    """Mark (`RECEIVES_FIRST_ATTR`) the `_Recv` nodes of the partitions whose steps may
    run the nodes that need no receive, then wait for every receive, then run the
    rest (`executor._Straight`: one sequence, no ready queue).

    Waiting so adds, in each marked partition, an edge from every receive to every
    node that needs a receive (a "gate"). That is safe when the step's graph, these
    edges and the `_Send` -> `_Recv` edges between tasks included, has no cycle: then
    every receive arrives. A worker's partition of a parameter-server step and the
    ps's both qualify (the ps sends the variables before its gate, the gradients
    arrive at it). Partitions whose gate lies on a cycle are left out one at a time
    (in task order) until none does. Changes `graphs` in place."""
    if any(node.op in _UNMARKED_OPS for graph in graphs.values() for node in graph.node):
        return
    # Every node of the step, (task, name), and what waits for it: its consumers in
    # its partition and, for a `_Send`, the `_Recv` of its key in another.
    consumers: dict[tuple[str, str], list[tuple[str, str]]] = {}
    receivers: dict[str, tuple[str, str]] = {}
    for task, graph in graphs.items():
        for node in graph.node:
            consumers.setdefault((task, node.name), [])
            for text in node.input:
                consumers.setdefault((task, parse_input(text)[0]), []).append((task, node.name))
            if node.op == "_Recv":
                receivers[sendrecv_key(node)] = (task, node.name)
    for task, graph in graphs.items():
        for node in graph.node:
            receiver = receivers.get(sendrecv_key(node)) if node.op == "_Send" else None
            if receiver is not None:
                consumers[(task, node.name)].append(receiver)
    # Per partition that receives: its receives, and the nodes that need one.
    gates: dict[str, tuple[list[tuple[str, str]], set[tuple[str, str]]]] = {}
    for task, graph in graphs.items():
        # (The client's feeds arrive with RunGraph: they never wait.)
        receives = [
            (task, node.name)
            for node in graph.node
            if node.op == "_Recv" and not node.attr["client_terminated"].b
        ]
        if receives:
            after: set[tuple[str, str]] = set()
            pending = list(receives)
            while pending:
                for consumer in consumers[pending.pop()]:
                    if consumer[0] == task and consumer not in after:
                        after.add(consumer)
                        pending.append(consumer)
            gates[task] = (receives, after)
    waits = dict.fromkeys(consumers, 0)  # edges into each node, gates left out
    for targets in consumers.values():
        for target in targets:
            waits[target] += 1
    while gates:
        stuck = _gates_on_cycles(consumers, waits, gates)
        if not stuck:
            break
        del gates[min(stuck)]
    for task in gates:
        for node in graphs[task].node:
            if node.op == "_Recv" and not node.attr["client_terminated"].b:
                node.attr[RECEIVES_FIRST_ATTR].b = True


def _gates_on_cycles(
    consumers: Mapping[tuple[str, str], list[tuple[str, str]]],
    waits: Mapping[tuple[str, str], int],
    gates: Mapping[str, tuple[list[tuple[str, str]], set[tuple[str, str]]]],
) -> set[str]:
    """The tasks of `gates` whose gate a topological sort of the step's graph (`consumers`,
    `waits` the edges into each node) with the gates' edges never opens (on a cycle, or
    after one)."""
    waits = dict(waits)
    for _, after in gates.values():
        for node in after:
            waits[node] += 1
    gate_of = {receive: task for task, (receives, _) in gates.items() for receive in receives}
    closed = {task: len(receives) for task, (receives, _) in gates.items()}  # receives not yet done
    ready = [node for node, count in waits.items() if not count]
    while ready:
        node = ready.pop()
        released = list(consumers[node])
        task = gate_of.get(node)
        if task is not None:
            closed[task] -= 1
            if not closed[task]:
                released.extend(gates[task][1])
        for target in released:
            waits[target] -= 1
            if not waits[target]:
                ready.append(target)
    return {task for task, count in closed.items() if count}


def import_graph(
    graph_def: GraphDef,
    existing: Mapping[str, NodeDef],
    functions: Mapping[str, FunctionDef] | None = None,
) -> dict[str, NodeDef]:
    """The nodes of `graph_def`, checked against the graph so far and copied, ready to add.

    Function calls are inlined first (`functions.inline_functions`), from `functions`
    (the session's library with `graph_def.library` added: `index_library`), so the
    session's graph holds only ops with kernels and may be placed across tasks.

    Refused, with TensorFlow's texts, when: an op has no kernel (`check_kernels`); a
    node name repeats, or is in `existing` already; an input names no node; the
    nodes form a cycle. CPU-bound on large graphs: the master runs it in a thread
    (it only reads `existing`). The copies do not pin the request.

    Raises:
        UnimplementedError: ops without a kernel.
        InvalidArgumentError: the other faults, naming a node.
    """
    if functions is None:
        functions = index_library(graph_def.library)
    graph_nodes: Sequence[NodeDef] = graph_def.node
    if has_function_calls(graph_def.node, functions):
        graph_nodes = inline_functions(graph_def.node, functions)
        inlined = GraphDef()
        inlined.node.extend(graph_nodes)
        check_kernels(inlined)
    else:
        check_kernels(graph_def)
    for body in runtime_functions(graph_nodes, functions).values():
        checked = GraphDef()
        checked.node.extend(body)
        check_kernels(checked)
    nodes: dict[str, NodeDef] = {}
    for node in graph_nodes:
        if node.name in existing:
            raise errors.InvalidArgumentError(
                f"Node '{node.name}' is already in the graph; ExtendSession may only add new nodes",
                node_name=node.name,
            )
        if node.name in nodes:
            raise errors.InvalidArgumentError(
                f"Duplicate node name in graph: '{node.name}'", node_name=node.name
            )
        copy = NodeDef()
        copy.CopyFrom(node)
        nodes[node.name] = copy
    # Kahn's algorithm over the new nodes; inputs from `existing` are already there. A
    # loop's NextIteration feeds its Merge in the next iteration: not a cycle.
    waiting: dict[str, int] = {}
    consumers: dict[str, list[str]] = {}
    for node in nodes.values():
        count = 0
        for text in node.input:
            source = parse_input(text)[0]
            if source in nodes and nodes[source].op in _NEXT_ITERATION_OPS:
                continue
            if source in nodes:
                count += 1
                consumers.setdefault(source, []).append(node.name)
            elif source not in existing:
                raise errors.InvalidArgumentError(
                    f"Node '{node.name}': Unknown input node '{text}'", node_name=node.name
                )
        waiting[node.name] = count
    ready = [name for name, count in waiting.items() if not count]
    done = 0
    while ready:
        name = ready.pop()
        done += 1
        for consumer in consumers.get(name, ()):
            waiting[consumer] -= 1
            if not waiting[consumer]:
                ready.append(consumer)
    if done != len(nodes):
        stuck = [name for name, count in waiting.items() if count]
        raise errors.InvalidArgumentError(
            f"Graph is invalid, contains a cycle with {len(stuck)} nodes, including: {', '.join(stuck[:5])}",
            node_name=stuck[0],
        )
    return nodes


# Ops that call graph functions which distserver neither inlines (function calls, If,
# Case: `functions.inline_functions`) nor runs (While: kernels/functional.py).
_FUNCTION_CALL_OPS = frozenset({"SymbolicGradient", "RemoteCall"})
_MAX_LISTED_OPS = 10
_NEXT_ITERATION_OPS = frozenset({"NextIteration", "RefNextIteration"})


def check_kernels(graph_def: GraphDef) -> None:
    """Refuse a graph that uses an op distserver has no kernel for, naming the op and the node.

    TensorFlow would refuse an unknown op when the graph is imported (CreateSession or
    ExtendSession), and an op without a kernel when the step runs; distserver has one
    registry for both, so it refuses up front, before any worker is involved.

    Raises:
        UnimplementedError: listing every unsupported op type with a node that uses it.
    """
    unsupported: dict[str, list[str]] = {}
    for node in graph_def.node:
        if not has_kernel(node.op):
            unsupported.setdefault(node.op, []).append(node.name)
    if not unsupported:
        return
    parts = []
    for op, nodes in list(unsupported.items())[:_MAX_LISTED_OPS]:
        more = f" and {len(nodes) - 1} more" if len(nodes) > 1 else ""
        parts.append(f"'{op}' (node '{nodes[0]}'{more})")
    if len(unsupported) > _MAX_LISTED_OPS:
        parts.append(f"and {len(unsupported) - _MAX_LISTED_OPS} more op types")
    message = (
        f"distserver has no kernel for {'this op' if len(unsupported) == 1 else 'these ops'}: "
        f"{', '.join(parts)}. The supported ops are listed in docs/tf-compat.md "
        "(distserver.kernels.registered_ops())."
    )
    if not _FUNCTION_CALL_OPS.isdisjoint(unsupported):
        message += (
            " SymbolicGradient and RemoteCall are not supported (tf.function calls, tf.cond, "
            "tf.switch_case and tf.while_loop are)."
        )
    first_node = next(iter(unsupported.values()))[0]
    raise errors.UnimplementedError(message, node_name=first_node)


def read_refs_late(nodes: list[NodeDef]) -> None:
    """Read a reference variable sent to another task only after the consumer's control inputs.

    A consumer of a reference (TF 1.x variable) reads the variable when it runs, so
    `with tf.control_dependencies([update]): v.read_value()` sees the update. When
    the consumer is on another task than the variable, the value crosses in a
    `_Send` that would otherwise read as soon as `VariableV2` has run. TensorFlow
    gets the late read from sending the variable's live buffer; distserver inserts
    an `Identity` next to the variable that waits for the consumer's control inputs,
    and sends its output instead. Pure; changes `nodes` in place.
    """
    by_name = {node.name: node for node in nodes}
    added: list[NodeDef] = []
    for position, node in enumerate(nodes):
        controls = [text for text in node.input if text.startswith("^")]
        if not controls:
            continue
        for i, text in enumerate(node.input):
            if text.startswith("^"):
                continue
            src = by_name.get(parse_input(text)[0])
            if src is None or src.op not in REF_OUTPUT_OPS:
                continue
            if task_of_device(src.device) == task_of_device(node.device):
                continue
            if nodes[position] is node:  # the session's own NodeDef: change a copy
                copy = NodeDef()
                copy.CopyFrom(node)
                nodes[position] = copy
            read = NodeDef(name=f"{node.name}/_late_read_{i}", op="Identity", device=src.device)
            read.input.extend([text, *controls])
            nodes[position].input[i] = read.name
            added.append(read)
    nodes.extend(added)
    _read_snapshots_after_updates(nodes, by_name)
    _fetch_refs_after_their_users(nodes, by_name)


_VARIABLE_OPS = frozenset({"VariableV2", "Variable"})


def _read_snapshots_after_updates(nodes: list[NodeDef], by_name: Mapping[str, NodeDef]) -> None:
    """A node that follows an in-place update of a variable reads its snapshot after the update.

    `tf.compat.v1` turns a reference variable into its snapshot `v/read` (an
    `Identity` of the reference). TensorFlow's Identity forwards the variable's
    buffer, which `AssignAdd`, `Assign*`'s in-place forms and the `Apply*` ops change
    in place, so a consumer of the snapshot that runs after such an update sees the
    new value: SyncReplicasOptimizer's tokens, `fill(n, global_step)` ordered after
    the update that increments the global step, rely on it. Here the snapshot is a
    copy taken when it runs; a consumer that (transitively) follows an update of the
    same variable gets its own read of the variable, placed with the variable, that
    waits for those updates. Consumers that do not follow an update are left alone.
    """
    updaters: dict[str, list[str]] = {}
    for node in nodes:
        if node.op in REF_OUTPUT_OPS and node.op not in _VARIABLE_OPS and node.input:
            source = by_name.get(parse_input(node.input[0])[0])
            if source is not None and source.op in _VARIABLE_OPS:
                updaters.setdefault(source.name, []).append(node.name)
    snapshots: dict[str, list[NodeDef]] = {}
    for node in nodes:
        if node.op == "Identity" and len(node.input) == 1 and parse_input(node.input[0])[0] in updaters:
            snapshots.setdefault(parse_input(node.input[0])[0], []).append(node)
    if not snapshots:
        return
    users: dict[str, list[int]] = {}
    for position, node in enumerate(nodes):
        for text in node.input:
            users.setdefault(parse_input(text)[0], []).append(position)
    added: list[NodeDef] = []
    for variable, reads in snapshots.items():
        followers: dict[int, list[str]] = {}  # node position -> the updates it follows
        for update in updaters[variable]:
            for position in _descendants(update, users, nodes):
                followers.setdefault(position, []).append(update)
        for snapshot in reads:
            for position in users.get(snapshot.name, []):
                after = followers.get(position)
                node = nodes[position]
                if not after:
                    continue
                for i, text in enumerate(node.input):
                    if text.startswith("^") or parse_input(text)[0] != snapshot.name:
                        continue
                    read = NodeDef(
                        name=f"{node.name}/_late_read_{i}", op="Identity", device=by_name[variable].device
                    )
                    read.input.extend([snapshot.input[0], *(f"^{update}" for update in sorted(set(after)))])
                    if nodes[position] is by_name.get(node.name):  # the session's own NodeDef: change a copy
                        node = NodeDef()
                        node.CopyFrom(nodes[position])
                        nodes[position] = node
                    node.input[i] = read.name
                    added.append(read)
    nodes.extend(added)


def _descendants(start: str, users: Mapping[str, list[int]], nodes: Sequence[NodeDef]) -> set[int]:
    """Positions of the nodes that depend on `start` (data or control), transitively."""
    seen: set[int] = set()
    pending = list(users.get(start, []))
    while pending:
        position = pending.pop()
        if position in seen:
            continue
        seen.add(position)
        pending.extend(users.get(nodes[position].name, []))
    return seen


def _fetch_refs_after_their_users(nodes: list[NodeDef], by_name: Mapping[str, NodeDef]) -> None:
    """A fetched reference variable is read after the step's other uses of it.

    TensorFlow fetches a reference as the variable's live buffer and copies it into the
    response when the step is over, so `run([train_op, global_step])` returns the step
    after the update. Here the fetch's `_Send` reads when it runs: it gets a control
    input from every other node of the step that takes the variable (its updates among
    them), which gives the same value; a use inside a loop stands for the loop's Exit
    nodes. The `_Send` has no consumers: no cycle can form.
    """
    frames = LoopFrames(nodes) if any(node.op in ENTER_OPS for node in nodes) else None
    users: dict[str, list[str]] = {}
    for node in nodes:
        for text in node.input:
            if not text.startswith("^"):
                users.setdefault(parse_input(text)[0], []).append(node.name)
    for node in nodes:
        if node.op != "_Send" or not node.attr["client_terminated"].b or not node.input:
            continue
        source = by_name.get(parse_input(node.input[0])[0])
        if source is None or source.op not in REF_OUTPUT_OPS:
            continue
        others = {name for name in users.get(source.name, ()) if name != node.name}
        if frames is not None:
            others = {after for name in others for after in frames.after_loops(name)}
        node.input.extend(f"^{name}" for name in sorted(others))
