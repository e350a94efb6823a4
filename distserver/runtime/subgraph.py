"""Turn a session's graph into what one step runs: feeds and fetches rewritten, then pruned.

Pure functions, no I/O. As in TensorFlow, a feed `x:k` becomes a client-terminated
`_Recv` node named `_recv_x_k` that replaces every use of `x:k`, and a fetch `y:k`
becomes a `_Send` node `_send_y_k`; both run on the client device and meet the
client's values in the step's rendezvous under keys built from their attrs. Then
only the nodes the fetches and targets need are kept.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from distserver import errors
from distserver.devices import rendezvous_key
from distserver.protos.node_def_pb2 import NodeDef
from distserver.runtime.names import canonical_tensor_name, int64_attr, parse_input, split_tensor_name


@dataclass
class ClientGraph:
    """The nodes one step runs, plus the rendezvous keys of its feeds and fetches."""

    nodes: list[NodeDef]
    feed_keys: dict[str, str] = field(default_factory=dict)  # feed tensor name -> key
    fetch_keys: dict[str, str] = field(default_factory=dict)  # fetch tensor name -> key


_PLACEHOLDER_OPS = frozenset({"Placeholder", "PlaceholderV2"})


def _set_sendrecv_attrs(node: NodeDef, tensor_name: str, device: str, incarnation: int) -> None:
    node.attr["tensor_name"].s = tensor_name.encode()
    node.attr["send_device"].s = device.encode()
    node.attr["send_device_incarnation"].i = int64_attr(incarnation)
    node.attr["recv_device"].s = device.encode()
    node.attr["client_terminated"].b = True


def rewrite_for_step(
    graph: Mapping[str, NodeDef],
    *,
    feeds: Sequence[tuple[str, int]],
    fetches: Sequence[str],
    targets: Sequence[str],
    client_device: str,
    client_incarnation: int,
) -> ClientGraph:
    """Rewrite feeds/fetches into `_Recv`/`_Send` nodes and prune to what is needed.

    Args:
        graph: The session's nodes by name (not modified).
        feeds: (tensor name, DataType) of each fed tensor.
        fetches: Tensor names to fetch.
        targets: Node names to run.
        client_device: Full name of the device that talks to the client.
        client_incarnation: That device's incarnation.

    Raises:
        NotFoundError: a feed, fetch or target names nothing in the graph.
    """
    nodes: dict[str, NodeDef] = {}
    replaced: dict[str, str] = {}  # "x:k" -> "_recv_x_k:0"
    # A fed placeholder's control edges leave from its `_Recv` instead, as in TensorFlow
    # (so `control_dependencies([placeholder])` does not run the placeholder itself).
    replaced_control: dict[str, str] = {}  # "^x" -> "^_recv_x_0"
    result = ClientGraph(nodes=[])

    for name, dtype in feeds:
        tensor = canonical_tensor_name(name)
        node_name, index = split_tensor_name(tensor)
        if node_name not in graph:
            raise errors.NotFoundError(f"FeedInputs: unable to find feed output {name}")
        recv = NodeDef(name=f"_recv_{node_name}_{index}", op="_Recv", device=client_device)
        recv.attr["tensor_type"].type = dtype  # type: ignore[assignment]
        _set_sendrecv_attrs(recv, tensor, client_device, client_incarnation)
        nodes[recv.name] = recv
        replaced[tensor] = f"{recv.name}:0"
        if graph[node_name].op in _PLACEHOLDER_OPS:
            replaced_control["^" + node_name] = "^" + recv.name
        result.feed_keys[tensor] = rendezvous_key(client_device, client_incarnation, client_device, tensor)

    for name, original in graph.items():
        # Always copies: placement writes device names into the step's nodes, and
        # the session's graph must keep what the client sent.
        copy = NodeDef()
        copy.CopyFrom(original)
        for i, text in enumerate(copy.input):
            if text.startswith("^"):
                new = replaced_control.get(text)
            else:
                new = replaced.get(canonical_tensor_name(text))
            if new is not None:
                copy.input[i] = new
        nodes[name] = copy

    roots: list[str] = []
    for name in fetches:
        tensor = canonical_tensor_name(name)
        if tensor in result.fetch_keys:
            continue
        node_name, index = split_tensor_name(tensor)
        if node_name not in graph:
            raise errors.NotFoundError(f"FetchOutputs node {name}: not found")
        send = NodeDef(name=f"_send_{node_name}_{index}", op="_Send", device=client_device)
        send.input.append(replaced.get(tensor, tensor))
        _set_sendrecv_attrs(send, tensor, client_device, client_incarnation)
        nodes[send.name] = send
        roots.append(send.name)
        result.fetch_keys[tensor] = rendezvous_key(client_device, client_incarnation, client_device, tensor)

    missing = [t for t in targets if t.lstrip("^") not in graph]
    if missing:
        raise errors.NotFoundError(f"PruneForTargets: Some target nodes not found: {', '.join(missing)}")
    roots.extend(t.lstrip("^") for t in targets)

    keep = _reachable(nodes, roots)
    result.nodes = [node for name, node in nodes.items() if name in keep]
    return result


def _reachable(nodes: Mapping[str, NodeDef], roots: Sequence[str]) -> set[str]:
    keep: set[str] = set()
    stack = list(roots)
    while stack:
        name = stack.pop()
        if name in keep:
            continue
        keep.add(name)
        node = nodes.get(name)
        if node is None:
            continue
        for text in node.input:
            src = parse_input(text)[0]
            if src not in keep:
                stack.append(src)
    return keep


def move_client_endpoints(step: ClientGraph, incarnation: Callable[[str], int]) -> None:
    """Run each feed's `_Recv` and fetch's `_Send` on the device that uses the value.

    After placement, a feed whose consumers all sit on one other device is received
    there directly (the master puts the value in that task's RunGraph request), and
    a fetch is sent from the device that computes it (the value comes back in that
    task's RunGraph response). This saves the RecvTensor hops through the client
    device that TensorFlow makes; rendezvous keys are updated to match.
    """
    by_name = {node.name: node for node in step.nodes}
    consumers: dict[str, set[str]] = {}
    for node in step.nodes:
        for text in node.input:
            consumers.setdefault(parse_input(text)[0], set()).add(node.device)
    for node in step.nodes:
        if node.op not in ("_Recv", "_Send") or not node.attr["client_terminated"].b:
            continue
        if node.op == "_Recv":
            devices = consumers.get(node.name, set())
        else:
            producer = by_name.get(parse_input(node.input[0])[0])
            devices = {producer.device} if producer is not None else set()
        if len(devices) != 1:
            continue
        (device,) = devices
        if device == node.device:
            continue
        tensor = node.attr["tensor_name"].s.decode()
        _set_sendrecv_attrs(node, tensor, device, incarnation(device))
        node.device = device
        key = rendezvous_key(device, incarnation(device), device, tensor)
        (step.feed_keys if node.op == "_Recv" else step.fetch_keys)[tensor] = key
