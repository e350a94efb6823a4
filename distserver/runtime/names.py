"""Tensor and input names as they appear in NodeDefs: "node:k", "node", "^node"; and
the rendezvous key of a `_Send`/`_Recv` node."""

from __future__ import annotations

from distserver.devices import rendezvous_key
from distserver.protos.node_def_pb2 import NodeDef


def parse_input(text: str) -> tuple[str, int, bool]:
    """`"node:k"` -> (node, k, False); `"node"` -> (node, 0, False); `"^node"` -> (node, -1, True)."""
    if text.startswith("^"):
        return text[1:], -1, True
    name, sep, index = text.rpartition(":")
    if sep and index.isdigit():
        return name, int(index), False
    return text, 0, False


def canonical_tensor_name(name: str) -> str:
    """`"x"` -> `"x:0"`; `"x:1"` stays."""
    _, sep, index = name.rpartition(":")
    if sep and index.isascii() and index.isdigit() and (index == "0" or index[0] != "0") and name[0] != "^":
        return name  # (already canonical: the master's feeds and fetches, every step)
    node, number, _ = parse_input(name)
    return f"{node}:{number}"


def split_tensor_name(name: str) -> tuple[str, int]:
    """`"x:1"` -> ("x", 1); `"x"` -> ("x", 0)."""
    node, index, _ = parse_input(name)
    return node, index


def int64_attr(value: int) -> int:
    """A uint64 (a device incarnation) as the int64 that TensorFlow stores in attrs."""
    return value - (1 << 64) if value >= 1 << 63 else value


def sendrecv_key(node: NodeDef) -> str:
    """The rendezvous key a `_Send` or `_Recv` node's attrs make (frame and iteration 0)."""
    return rendezvous_key(
        node.attr["send_device"].s.decode(),
        node.attr["send_device_incarnation"].i,
        node.attr["recv_device"].s.decode(),
        node.attr["tensor_name"].s.decode(),
    )
