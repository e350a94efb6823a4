"""Assign every node of a step's graph a full device name. Pure; no I/O.

Rules (TensorFlow's, as far as a CPU-only cluster can see them):

* A node's requested device may be partial (`/job:ps`, `/job:ps/task:1`,
  `/device:CPU:0`, or empty). Missing parts are filled from the client device for
  job/replica/task when no job is named, otherwise from the lowest task of the
  named job; the device is the task's CPU:0.
* Nodes that must share a device are placed together: a node colocated by a
  `_class: "loc:@other"` attr, and a node consuming a resource handle (a variable or
  a queue) from a resource-producing node, go where that node goes. The requests of
  a group's members merge (`/job:ps` and `/task:1` give `/job:ps/task:1`); requests
  that contradict each other are an error, except that a resource consumer's own
  request yields to its resource's device, as in TensorFlow ("Ignoring device
  specification ... because the input edge ... is a reference connection"): under
  `replica_device_setter`, `VarIsInitializedOp` or `AssignAddVariableOp` ask for
  the worker but run on the variable's ps task. (TF 1.x reference variables are
  colocated through the `_class` attrs `tf.compat.v1` gives their consumers.)
* A request that matches no device of the cluster is an `InvalidArgumentError`
  naming the node and the device, unless `allow_soft_placement` lets a device type
  that does not exist (a GPU) fall back to the CPU.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from distserver import errors
from distserver.devices import DeviceSpec
from distserver.protos.node_def_pb2 import NodeDef
from distserver.runtime.names import parse_input

# Ops whose output 0 is a resource handle that consumers must be colocated with.
RESOURCE_PRODUCERS = frozenset(
    {
        "VarHandleOp",
        "FIFOQueueV2",
        "PaddingFIFOQueueV2",
        "RandomShuffleQueueV2",
        "PriorityQueueV2",
        # Accumulators; the first two output TF 1.x string references, which cannot
        # cross devices either.
        "ConditionalAccumulator",
        "SparseConditionalAccumulator",
        "ResourceConditionalAccumulator",
        # tf.data iterators: GetNext and MakeIterator run where the iterator is.
        "IteratorV2",
        "OneShotIterator",
        "AnonymousIteratorV2",
        "AnonymousIteratorV3",
        # Stacks (v1 loop gradients) and TensorArrays: held by their handle's value,
        # they live on one task, where every op using them runs.
        "StackV2",
        "TensorArrayV3",
        "TensorArrayGradV3",
        "TensorArrayGradWithShape",
    }
)


class _Groups:
    """Union-find over node names."""

    def __init__(self, names: Iterable[str]) -> None:
        self.parent = {name: name for name in names}

    def find(self, name: str) -> str:
        root = name
        while self.parent[root] != root:
            root = self.parent[root]
        while self.parent[name] != root:
            self.parent[name], name = root, self.parent[name]
        return root

    def union(self, a: str, b: str) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            self.parent[rb] = ra


# Feeds and fetches stay on the client device even when the value is a resource handle.
_SEND_RECV = frozenset({"_Send", "_Recv", "_HostSend", "_HostRecv"})


def _colocation_targets(node: NodeDef, by_name: dict[str, NodeDef]) -> tuple[list[str], list[str]]:
    """(nodes named by `_class` colocation, resource producers `node` consumes)."""
    classes = []
    if "_class" in node.attr:
        for entry in node.attr["_class"].list.s:
            text = entry.decode()
            if text.startswith("loc:@") and text[5:] in by_name:
                classes.append(text[5:])
    resources = []
    # An `IdentityN` (the results of an inlined function, a lowered loop's body) only
    # passes handles on, maybe of resources on different tasks: it stays where it was
    # asked to be. Other pass-throughs go with their handle's resource, so that the
    # handle does not cross tasks on its way to its readers.
    if node.op not in _SEND_RECV and node.op not in _PORT_FOR_PORT:
        for text in node.input:
            src, port, is_control = parse_input(text)
            if not is_control:
                producer = _resource_producer(src, port, by_name)
                if producer is not None:
                    resources.append(producer)
    return classes, resources


# Ops that pass a value through unchanged (output k is input k, or input 0): a resource
# handle keeps its device through them. Inlined functions put an `Identity` per argument
# and an `IdentityN` per call between a variable and its readers; lowered `If`s a `Switch`;
# a loop's `Enter` (and `Merge`, `NextIteration`, `Exit`) passes its input 0 into or out
# of the loop (lowered `While`s too).
_PASS_THROUGH = frozenset(
    {
        "Identity",
        "IdentityN",
        "Switch",
        "Enter",
        "RefEnter",
        "Merge",
        "NextIteration",
        "Exit",
    }
)
_PORT_FOR_PORT = frozenset({"IdentityN"})


def _resource_producer(src: str, port: int, by_name: dict[str, NodeDef]) -> str | None:
    """The resource-producing node whose handle output `src:port` is, through pass-throughs."""
    seen: set[str] = set()
    while src in by_name and src not in seen:
        seen.add(src)
        node = by_name[src]
        if node.op in RESOURCE_PRODUCERS:
            return src if port == 0 else None  # (a TensorArray's output 1 is its flow)
        if node.op not in _PASS_THROUGH:
            return None
        data = [text for text in node.input if not text.startswith("^")]
        index = port if node.op in _PORT_FOR_PORT else 0
        if index >= len(data):
            return None
        src, port, _ = parse_input(data[index])
    return None


def place(
    nodes: Sequence[NodeDef],
    *,
    devices: Sequence[str],
    client_device: str,
    allow_soft_placement: bool = False,
) -> None:
    """Set `node.device` of every node to a full device name from `devices`.

    Args:
        nodes: The step's nodes; their `device` fields are overwritten.
        devices: Full names of every device in the cluster.
        client_device: Full name of the master's device (default placement).
        allow_soft_placement: Let unavailable device types fall back to the CPU.

    Raises:
        InvalidArgumentError: a node asks for a device that does not exist, or two
            colocated nodes ask for different devices; the message names the node.
    """
    by_name = {node.name: node for node in nodes}
    groups = _Groups(by_name)
    resource_consumers: set[str] = set()
    for node in nodes:
        classes, resources = _colocation_targets(node, by_name)
        for target in classes + resources:
            groups.union(target, node.name)
        if resources:
            resource_consumers.add(node.name)

    # The requested device of a group: the merge of its members' requests. Resource
    # consumers come last, so that their requests can yield to the rest of the group.
    requests: dict[str, tuple[DeviceSpec, NodeDef]] = {}
    for node in sorted(nodes, key=lambda n: n.name in resource_consumers):
        spec = _parse(node)
        root = groups.find(node.name)
        seen = requests.get(root)
        if seen is None or _is_empty(seen[0]):
            requests[root] = (spec, node)
        elif _compatible(seen[0], spec):
            requests[root] = (seen[0].make_merged_spec(spec), seen[1])
        elif node.name not in resource_consumers:
            raise errors.InvalidArgumentError(
                f"Cannot colocate nodes {seen[1].name!r} and {node.name!r}: they request "
                f"{seen[1].device!r} and {node.device!r}",
                node_name=node.name,
            )

    available = [DeviceSpec.from_string(d) for d in devices]
    client = DeviceSpec.from_string(client_device)
    resolved: dict[str, str] = {}
    for root, (spec, node) in requests.items():
        resolved[root] = _resolve(spec, node, available, client, allow_soft_placement)
    for node in nodes:
        node.device = resolved[groups.find(node.name)]


def _parse(node: NodeDef) -> DeviceSpec:
    try:
        return DeviceSpec.from_string(node.device)
    except ValueError as exc:
        raise errors.InvalidArgumentError(
            f"Malformed device specification '{node.device}' in node '{node.name}': {exc}",
            node_name=node.name,
        ) from exc


def _is_empty(spec: DeviceSpec) -> bool:
    return spec == DeviceSpec()


def _compatible(a: DeviceSpec, b: DeviceSpec) -> bool:
    for field in ("job", "replica", "task", "device_type", "device_index"):
        va, vb = getattr(a, field), getattr(b, field)
        if va is not None and vb is not None and va != vb:
            return False
    return True


def _resolve(
    spec: DeviceSpec,
    node: NodeDef,
    available: Sequence[DeviceSpec],
    client: DeviceSpec,
    allow_soft_placement: bool,
) -> str:
    wanted = spec
    if wanted.job is None:
        wanted = DeviceSpec(job=client.job, replica=client.replica, task=client.task).make_merged_spec(wanted)
    if wanted.device_type is not None and wanted.device_type.upper() != "CPU" and allow_soft_placement:
        wanted = DeviceSpec(
            job=wanted.job, replica=wanted.replica, task=wanted.task, device_type=None, device_index=None
        )
    matches = [d for d in available if _compatible(d, wanted)]
    if not matches:
        names = ", ".join(d.to_string() for d in available)
        raise errors.InvalidArgumentError(
            f"Cannot assign a device for operation {node.name}: {{{{node {node.name}}}}} was explicitly "
            f"assigned to {node.device} but available devices are [ {names} ]. Make sure the device "
            "specification refers to a valid device.",
            node_name=node.name,
        )
    best = min(matches, key=lambda d: (d.replica or 0, d.task or 0, d.device_index or 0))
    return best.to_string()
