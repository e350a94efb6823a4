"""Dense layers as one node: a `MatMul` whose product only a bias add reads, and that
add's activation, fused when a worker registers a graph (TensorFlow's remapper fuses
the same chains into `_FusedMatMul` on CPU).

A one-task step of 30 small layers runs 90 such nodes; each costs the executor and
its kernel's checks a few microseconds over numpy's own call. The fused node
(`kernels.math.FusedMatMulKernel`) computes the product, adds the bias into it and
applies the activation in place: the same numpy calls in the same order, so the same
bits. It carries its parts' NodeDefs (attr
`FUSED_NODES_ATTR`): for inputs its fast path does not take, it runs their kernels
one by one, so errors name the node TensorFlow would name.

A chain is fused only when nothing else can see its inner values: the product and
the sum each have exactly one data edge out (to the next node of the chain) and no
control edge out, all nodes share a device and a dtype, and the dtype is float32 or
float64. The fused node takes the name of the chain's last node, so the edges out
of the chain stay as they are; it waits for every control input of its parts.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Mapping
from typing import TypeVar

from distserver import errors
from distserver.kernels.math import ACTIVATION_OPS, BIAS_ADD_OPS, FUSED_MATMUL_OP, FUSED_NODES_ATTR
from distserver.kernels.sparse import DEDUPLICATED_SPARSE_UPDATE_OP
from distserver.kernels.state import (
    ARENA_MAX_VARIABLE_BYTES,
    GROUPABLE_UPDATE_OPS,
    GROUPED_READS_OP,
    GROUPED_UPDATES_OP,
)
from distserver.protos.graph_pb2 import GraphDef
from distserver.protos.node_def_pb2 import NodeDef
from distserver.protos.types_pb2 import DT_DOUBLE, DT_FLOAT
from distserver.runtime.names import parse_input
from distserver.tensors import as_numpy_dtype, shape_from_proto

_T = TypeVar("_T")

_FUSED_TYPES = frozenset({DT_FLOAT, DT_DOUBLE})  # `kernels.math.FUSED_TYPES`


def fuse_dense_layers(graph_def: GraphDef) -> GraphDef:
    """`graph_def` with its dense layers fused (see the module docstring); `graph_def`
    itself when it has none."""
    data_reads: Counter[str] = Counter()  # node -> data edges out of it
    control_reads: Counter[str] = Counter()  # node -> control edges out of it
    reader: dict[str, NodeDef] = {}  # node -> a node that reads it (the one, when one does)
    for node in graph_def.node:
        for text in node.input:
            name, index, is_control = parse_input(text)
            if is_control:
                control_reads[name] += 1
            elif index == 0:
                data_reads[name] += 1
                reader[name] = node
            else:  # (not an output these ops have: the executor names the error)
                data_reads[name] += 2

    def only_reader(node: NodeDef) -> NodeDef | None:
        """The node that alone reads `node`'s output, through one data edge."""
        if data_reads[node.name] != 1 or control_reads[node.name]:
            return None
        return reader[node.name]

    chains: dict[str, list[NodeDef]] = {}  # the chain's last node -> the chain
    fused: set[str] = set()
    for matmul in graph_def.node:
        if matmul.op != "MatMul" or _dtype(matmul) not in _FUSED_TYPES or len(_data_inputs(matmul)) != 2:
            continue
        add = only_reader(matmul)
        if add is None or add.name in fused or not _same_kind(matmul, add) or add.op not in BIAS_ADD_OPS:
            continue  # (an add of two products joins the first one's chain)
        data_inputs = _data_inputs(add)
        if len(data_inputs) != 2:
            continue
        if add.op == "BiasAdd" and (
            parse_input(data_inputs[0])[0] != matmul.name
            or ("data_format" in add.attr and add.attr["data_format"].s not in (b"", b"NHWC"))
        ):
            continue
        chain = [matmul, add]
        activation = only_reader(add)
        if activation is not None and activation.op in ACTIVATION_OPS and _same_kind(matmul, activation):
            chain.append(activation)
        chains[chain[-1].name] = chain
        fused.update(part.name for part in chain)
    return _with_chains_fused(graph_def, chains, _fused_node)


def _with_chains_fused(
    graph_def: GraphDef, chains: dict[str, list[NodeDef]], fused_node: Callable[[list[NodeDef]], NodeDef]
) -> GraphDef:
    """`graph_def` with each chain (by its last node's name) replaced by
    `fused_node(chain)`, where its last node was; `graph_def` itself without chains."""
    if not chains:
        return graph_def
    parts = {part.name for chain in chains.values() for part in chain}
    result = GraphDef()
    result.CopyFrom(graph_def)
    del result.node[:]
    for node in graph_def.node:
        if node.name not in parts:
            result.node.append(node)
        elif node.name in chains:
            result.node.append(fused_node(chains[node.name]))
    return result


def _dtype(node: NodeDef) -> int | None:
    """The node's `T` (read without adding it to the map: the graph is the caller's)."""
    return node.attr["T"].type if "T" in node.attr else None


def _data_inputs(node: NodeDef) -> list[str]:
    return [text for text in node.input if not text.startswith("^")]


def _same_kind(first: NodeDef, other: NodeDef) -> bool:
    """Same device and the same `T`."""
    return first.device == other.device and _dtype(first) == _dtype(other)


def _fused_node(chain: list[NodeDef]) -> NodeDef:
    """The node computing `chain` (MatMul, bias add[, activation]): inputs a, b, bias,
    then the control inputs of every part (none comes from another part: only the last
    part may be waited for)."""
    matmul, add = chain[0], chain[1]
    (bias,) = (text for text in _data_inputs(add) if parse_input(text)[0] != matmul.name)
    controls: list[str] = []
    for part in chain:
        for text in part.input:
            if text.startswith("^") and text not in controls:
                controls.append(text)
    node = NodeDef(name=chain[-1].name, op=FUSED_MATMUL_OP, device=matmul.device)
    node.input.extend([*_data_inputs(matmul), bias, *controls])
    node.attr["T"].CopyFrom(matmul.attr["T"])
    node.attr[FUSED_NODES_ATTR].list.s.extend(part.SerializeToString() for part in chain)
    return node


def fuse_deduplicated_sparse_updates(graph_def: GraphDef) -> GraphDef:
    """`graph_def` with each sparse Adagrad update of rows that may repeat, as TF's
    optimizers write it for an embedding's gradient (`_deduplicate_indexed_slices`:
    Unique, Shape, StridedSlice, UnsortedSegmentSum, then ResourceSparseApplyAdagrad
    of the sums at the distinct rows), made one `DEDUPLICATED_SPARSE_UPDATE_OP` node
    (`kernels.sparse.DeduplicatedSparseUpdateKernel`); `graph_def` itself when it has
    none.

    Fused only where nothing else can see the inner values: the distinct ids go to
    the Shape and the update alone, the positions to the sum alone, the shape to the
    slice, the slice to the sum (as its count), the sum to the update, with no
    control edge out of any of them; all five on one device. The node takes the
    update's name (the edges out of it stay) and its inputs are indices, values, var,
    accum, lr, and the slice's begin, end and strides, then every control input of
    the parts. Not in graphs with TF 1.x control flow (`group_variable_updates`)."""
    if not any(node.op == "ResourceSparseApplyAdagrad" for node in graph_def.node) or any(
        node.op in _V1_CONTROL_FLOW_OPS for node in graph_def.node
    ):
        return graph_def
    nodes = {node.name: node for node in graph_def.node}
    # node -> (reader, output read, whether a control edge) for every edge out of it
    reads: defaultdict[str, list[tuple[str, int, bool]]] = defaultdict(list)
    for node in graph_def.node:
        for text in node.input:
            name, index, is_control = parse_input(text)
            reads[name].append((node.name, index, is_control))

    def producer(text: str, op: str, output: int = 0) -> NodeDef | None:
        name, index, is_control = parse_input(text)
        node = nodes.get(name)
        return node if node is not None and not is_control and index == output and node.op == op else None

    chains: dict[str, list[NodeDef]] = {}  # the update's name -> Unique, Shape, slice, sum, update
    for update in graph_def.node:
        inputs = _data_inputs(update)
        if update.op != "ResourceSparseApplyAdagrad" or len(inputs) != 5:
            continue
        total = producer(inputs[3], "UnsortedSegmentSum")
        unique = producer(inputs[4], "Unique")
        total_inputs = _data_inputs(total) if total is not None else []
        if unique is None or len(total_inputs) != 3 or producer(total_inputs[1], "Unique", 1) is not unique:
            continue
        count = producer(total_inputs[2], "StridedSlice")
        count_inputs = _data_inputs(count) if count is not None else []
        shape = producer(count_inputs[0], "Shape") if len(count_inputs) == 4 else None
        if (
            shape is None
            or len(_data_inputs(shape)) != 1
            or producer(_data_inputs(shape)[0], "Unique") is not unique
        ):
            continue
        assert total is not None
        assert count is not None
        chain = [unique, shape, count, total, update]
        expected = {
            unique.name: sorted([(shape.name, 0, False), (update.name, 0, False), (total.name, 1, False)]),
            shape.name: [(count.name, 0, False)],
            count.name: [(total.name, 0, False)],
            total.name: [(update.name, 0, False)],
        }
        if (
            len(_data_inputs(unique)) == 1
            and all(part.device == update.device for part in chain)
            and all(sorted(reads[name]) == readers for name, readers in expected.items())
        ):
            chains[update.name] = chain
    return _with_chains_fused(graph_def, chains, _deduplicated_update_node)


def _deduplicated_update_node(chain: list[NodeDef]) -> NodeDef:
    """The node of `chain` (see `fuse_deduplicated_sparse_updates`)."""
    unique, _, count, total, update = chain
    var, accum, lr = _data_inputs(update)[:3]
    controls: list[str] = []
    for part in chain:
        for text in part.input:
            if text.startswith("^") and text not in controls:
                controls.append(text)
    node = NodeDef(name=update.name, op=DEDUPLICATED_SPARSE_UPDATE_OP, device=update.device)
    node.input.extend(
        [_data_inputs(unique)[0], _data_inputs(total)[0], var, accum, lr, *_data_inputs(count)[1:], *controls]
    )
    node.attr[FUSED_NODES_ATTR].list.s.extend(part.SerializeToString() for part in chain)
    return node


# TF 1.x control flow: a dead input (an untaken branch) would make a whole group dead.
_V1_CONTROL_FLOW_OPS = frozenset({"Switch", "RefSwitch", "Merge", "RefMerge", "Enter", "RefEnter"})
_RECEIVE_OPS = frozenset({"_Recv", "_HostRecv"})
_SEND_OPS = frozenset({"_Send", "_HostSend"})


def group_variable_updates(graph_def: GraphDef) -> GraphDef:
    """`graph_def` with the independent dense updates of resource variables on each
    device (an optimizer's `ResourceApplyMomentum` per variable: 60 a step for 60
    variables) grouped into one `GROUPED_UPDATES_OP` node, which runs their kernels
    in turn: one node for the executor instead of one per variable. `graph_def`
    itself when there is nothing to group.

    Grouped are updates that nothing reads (they have no outputs) and that do not
    depend on one another: none is reached, through data or control edges, from
    another update of the graph (that would make the group wait for itself). The
    group waits for the inputs of all its parts, and whatever waited for a part
    (control edges) waits for the group. An update that takes a value from another
    task (a parameter server's update of a worker's gradient: a `_Recv` upstream of
    it) is grouped only when
    - its variable is small enough for the group's arena
      (`kernels.state.ARENA_MAX_VARIABLE_BYTES`, by its VarHandleOp's shape): a large
      one's update runs as its value arrives, while the sender still computes the
      others, where a group would wait for the last one; small ones cost less as one
      update over their arena at the end (cluster `small`: 4.03 -> 3.85 ms a step,
      the ps's CPU 1.79 -> 1.58 ms);
    - and nothing downstream of an update goes to another task: the other task could
      then need it to compute a value the group waits for (it would wait for itself
      across tasks).
    The updates of a graph with TF 1.x control flow are never grouped: a dead input
    to one part would make the whole group dead.
    """
    updates = [node for node in graph_def.node if node.op in GROUPABLE_UPDATE_OPS]
    if len(updates) < 2 or any(node.op in _V1_CONTROL_FLOW_OPS for node in graph_def.node):
        return graph_def
    readers: defaultdict[str, list[str]] = defaultdict(list)  # node -> nodes with an edge from it
    data_read: set[str] = set()
    for node in graph_def.node:
        for text in node.input:
            name, _, is_control = parse_input(text)
            readers[name].append(node.name)
            if not is_control:
                data_read.add(name)
    # Every node downstream of an update: an update there depends on another one.
    downstream = reached_from([node.name for node in updates], readers)
    # Nodes that take, directly or not, a value from another task.
    received = reached_from(
        [node.name for node in graph_def.node if node.op in _RECEIVE_OPS and not _to_client(node)], readers
    )
    exported = any(
        node.op in _SEND_OPS and not _to_client(node) and node.name in downstream for node in graph_def.node
    )
    handles = {node.name: node for node in graph_def.node if node.op == "VarHandleOp"}
    by_device: defaultdict[str, list[NodeDef]] = defaultdict(list)
    for node in updates:
        if (
            node.name not in downstream
            and node.name not in data_read
            and (node.name not in received or (not exported and _of_a_small_variable(node, handles)))
        ):
            by_device[node.device].append(node)
    groups = [parts for parts in by_device.values() if len(parts) > 1]
    if not groups:
        return graph_def

    names = {node.name for node in graph_def.node}
    group_of: dict[str, str] = {}  # a grouped update -> its group's name
    result = GraphDef()
    result.CopyFrom(graph_def)
    del result.node[:]
    grouped_nodes = []
    for parts in groups:
        name = _unique(f"{parts[0].name}/_grouped_updates", names)
        grouped_nodes.append(_grouped_node(name, parts))
        group_of.update((part.name, name) for part in parts)
    for node in graph_def.node:
        if node.name in group_of:
            continue
        if any(text.startswith("^") and text[1:] in group_of for text in node.input):
            node = _rewired(node, {}, group_of)
        result.node.append(node)
    result.node.extend(grouped_nodes)
    return result


def group_variable_reads(graph_def: GraphDef) -> GraphDef:
    """`graph_def` with the reads of small resource variables on each device (a
    ReadVariableOp per variable at the start of a step: 60 a step for 60 variables)
    grouped into one `GROUPED_READS_OP` node, whose output p is part p's value: one
    node for the executor instead of one per variable. `graph_def` itself when there
    is nothing to group.

    Grouped are reads that wait for nothing but their handle, straight from a
    VarHandleOp of their device that has no inputs either: the group then waits for
    nothing a read did not, and is ready when each of them was, as a step starts.
    Reads with a control input (a value read after an update) stay apart. So do
    reads of a variable larger than an arena takes (`_of_a_small_variable`): the
    group's values are held until the last of them has been read, and an update of
    a variable whose value is still held copies it rather than writing in place,
    which costs a large variable more than its read's node does.
    """
    handles = {node.name: node for node in graph_def.node if node.op == "VarHandleOp" and not node.input}
    # (a node's output other than its first: a ReadVariableOp has none, and its read
    # stays apart for the executor to name the error)
    beyond_first = {
        name for node in graph_def.node for name, index, _ in map(parse_input, node.input) if index > 0
    }
    by_device: defaultdict[str, list[NodeDef]] = defaultdict(list)
    for node in graph_def.node:
        if node.op != "ReadVariableOp" or len(node.input) != 1 or node.name in beyond_first:
            continue
        name, index, is_control = parse_input(node.input[0])
        handle = handles.get(name)
        if (
            not is_control
            and index == 0
            and handle is not None
            and handle.device == node.device
            and _of_a_small_variable(node, handles)
        ):
            by_device[node.device].append(node)
    groups = [parts for parts in by_device.values() if len(parts) > 1]
    if not groups:
        return graph_def

    names = {node.name for node in graph_def.node}
    value_of: dict[str, str] = {}  # a grouped read -> its value's input text
    group_of: dict[str, str] = {}  # a grouped read -> its group's name
    grouped_nodes: dict[str, NodeDef] = {}  # the first part's name -> the group
    for parts in groups:
        name = _unique(f"{parts[0].name}/_grouped_reads", names)
        node = NodeDef(name=name, op=GROUPED_READS_OP, device=parts[0].device)
        node.input.extend(part.input[0] for part in parts)
        node.attr["N"].i = len(parts)
        node.attr[FUSED_NODES_ATTR].list.s.extend(part.SerializeToString() for part in parts)
        grouped_nodes[parts[0].name] = node
        for p, part in enumerate(parts):
            value_of[part.name] = f"{name}:{p}"
            group_of[part.name] = name
    result = GraphDef()
    result.CopyFrom(graph_def)
    del result.node[:]
    for node in graph_def.node:
        if node.name in grouped_nodes:
            result.node.append(grouped_nodes[node.name])  # (where its first part was)
        elif node.name in group_of:
            continue
        elif any(parse_input(text)[0] in group_of for text in node.input):
            result.node.append(_rewired(node, value_of, group_of))
        else:
            result.node.append(node)
    return result


def _unique(name: str, names: set[str]) -> str:
    """`name`, with underscores added until no node of `names` has it; added to `names`."""
    while name in names:
        name += "_"
    names.add(name)
    return name


def _rewired(node: NodeDef, value_of: dict[str, str], group_of: dict[str, str]) -> NodeDef:
    """A copy of `node` whose data inputs from grouped nodes take their groups' outputs
    (`value_of`: a part -> its value's input text), and whose control inputs on them
    wait for their groups (`group_of`: a part -> its group's name)."""
    copy = NodeDef()
    copy.CopyFrom(node)
    del copy.input[:]
    for text in node.input:
        name, _, is_control = parse_input(text)
        if is_control and name in group_of:
            text = "^" + group_of[name]
        elif name in value_of:  # (its output 0: see `beyond_first`)
            text = value_of[name]
        if not (text.startswith("^") and text in copy.input):
            copy.input.append(text)
    return copy


def reached_from(starts: Iterable[_T], edges: Mapping[_T, Iterable[_T]]) -> set[_T]:
    """The nodes reached from `starts` through `edges` (node -> the nodes it has an edge
    to), not counting `starts` themselves unless reached."""
    reached: set[_T] = set()
    frontier = list(starts)
    while frontier:
        for target in edges.get(frontier.pop(), ()):
            if target not in reached:
                reached.add(target)
                frontier.append(target)
    return reached


def _to_client(node: NodeDef) -> bool:
    """Whether a `_Send`/`_Recv` talks to the client (a fetch or a feed), not to a task."""
    return "client_terminated" in node.attr and node.attr["client_terminated"].b


def _of_a_small_variable(node: NodeDef, handles: dict[str, NodeDef]) -> bool:
    """Whether the variable of `node` (an update or a read: its first input) comes
    straight from a VarHandleOp whose shape is known and whose size an arena takes."""
    inputs = _data_inputs(node)
    handle = handles.get(parse_input(inputs[0])[0]) if inputs else None
    if handle is None or "shape" not in handle.attr or "dtype" not in handle.attr:
        return False
    try:
        shape = shape_from_proto(handle.attr["shape"].shape)
        itemsize = as_numpy_dtype(handle.attr["dtype"].type).itemsize
    except errors.InvalidArgumentError:  # (a malformed shape, a dtype numpy lacks: not an arena's)
        return False
    if shape is None or None in shape:  # (a scalar's shape, (), is known: one element)
        return False
    return 0 < math.prod(shape) * itemsize <= ARENA_MAX_VARIABLE_BYTES  # type: ignore[arg-type]


def _grouped_node(name: str, parts: list[NodeDef]) -> NodeDef:
    """The node running `parts` in turn: their data inputs one part after the other,
    then every control input of any of them."""
    data: list[str] = []
    controls: list[str] = []
    for part in parts:
        data.extend(_data_inputs(part))
        for text in part.input:
            if text.startswith("^") and text not in controls:
                controls.append(text)
    node = NodeDef(name=name, op=GROUPED_UPDATES_OP, device=parts[0].device)
    node.input.extend([*data, *controls])
    node.attr["N"].i = len(data)
    node.attr[FUSED_NODES_ATTR].list.s.extend(part.SerializeToString() for part in parts)
    return node
