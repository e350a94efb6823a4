"""An embedding lookup's ids split by shard in one compiled pass, for a region
(`regions.FusedRegionKernel`) that is that split.

A lookup in a table of several shards (TensorFlow's `embedding_lookup` of a list or a
partitioned variable, `ds.embedding_lookup` of a list) flattens its ids and finds,
for each, its shard and its row in that shard with element-wise integer nodes, which
the executor makes one region:

* "div" (shards of consecutive rows, the first ones a row longer: TensorFlow 2's way
  and ours) takes eleven nodes, four of them divisions by a constant, ~30 us for
  2,048 ids hot and twice that in a step;
* "mod" (id i in shard i % n: `tf.compat.v1.nn.embedding_lookup`'s default) four.

`match` recognises either program in a region's parts, as TensorFlow's graph writes
it: each node's op, dtype and inputs, the constants region inputs. The region then
hands its inputs to `IdSplit.run`, which runs `_loops.split_ids_by_blocks` or
`_loops.split_ids_by_remainder` (~4 us for 2,048 ids): the same bits, each division
by a float reciprocal corrected to the exact floor. Inputs the loop is not for (no
compiled loops, ids that are not an int64 array, a constant that is not an
int64 scalar, a divisor that is not positive) make `run` return None, and the region
runs its parts, whose errors name them.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import numpy as np

from distserver.kernels import _compiled
from distserver.protos.node_def_pb2 import NodeDef
from distserver.protos.types_pb2 import DT_INT32, DT_INT64

# The programs, as trees of (op or ops, operands...): a str operand is a region input
# that `match` binds by name ("ids", the flat shape, the constants); the flat ids are
# `Reshape(ids, [-1])`.
_FLAT = ("Reshape", "ids", "flat")
_SHARD_BY_BLOCKS = (
    "Maximum",
    ("FloorDiv", _FLAT, "block_rows"),
    ("FloorDiv", ("Sub", _FLAT, "extras"), "rows"),
)
# {output: program}; the loop's constants in its argument order; which are divisors.
_PROGRAMS: dict[str, tuple[dict[str, Any], tuple[str, ...], tuple[str, ...]]] = {
    "split_ids_by_blocks": (
        {
            "shards": ("Cast", _SHARD_BY_BLOCKS),
            "rows": (
                ("Select", "SelectV2"),  # (TensorFlow 1's `where`, and 2's)
                ("Less", _SHARD_BY_BLOCKS, "extras_bound"),
                ("FloorMod", _FLAT, "block_rows_again"),
                ("FloorMod", ("Sub", _FLAT, "extras_again"), "rows_again"),
            ),
        },
        (
            "block_rows",
            "extras",
            "block_rows_again",
            "extras_again",
            "rows",
            "rows_again",
            "extras_bound",
        ),
        ("block_rows", "block_rows_again", "rows", "rows_again"),
    ),
    "split_ids_by_remainder": (
        {"shards": ("Cast", ("FloorMod", _FLAT, "count")), "rows": ("FloorDiv", _FLAT, "count_again")},
        ("count", "count_again"),
        ("count", "count_again"),
    ),
}


class IdSplit:
    """A region that is an embedding lookup's split of its ids by shard (`match`)."""

    def __init__(
        self,
        loop: str,
        inputs: dict[str, int],
        constants: tuple[str, ...],
        divisors: tuple[str, ...],
        shards_first: bool,
    ) -> None:
        self.loop = loop
        self._ids = inputs["ids"]
        # The flat shape, then the constants in the loop's order.
        self._fixed = [inputs["flat"], *(inputs[name] for name in constants)]
        self._divisors = [constants.index(name) for name in divisors]  # (in the loop's constants)
        self._shards_first = shards_first
        # The fixed inputs last checked, and the loop's constants from them: arrays no
        # one writes (a graph's constants), so the same objects hold the same values.
        self._checked: tuple[list[Any], list[int]] = ([], [])

    def run(self, inputs: Sequence[Any]) -> list[np.ndarray] | None:
        """The region's outputs for `inputs` from the compiled loop, or None when it does
        not take them (see the module docstring)."""
        loops = _compiled.loops()
        ids = inputs[self._ids]
        if loops is None or type(ids) is not np.ndarray or ids.dtype != _INT64:
            return None
        fixed = [inputs[k] for k in self._fixed]
        checked, constants = self._checked
        if len(checked) != len(fixed) or not all(map(operator.is_, fixed, checked)):
            found = _constants(fixed, self._divisors)
            if found is None:
                return None
            constants = found
            if not any(value.flags.writeable for value in fixed):
                self._checked = (fixed, constants)
        shards = np.empty(ids.size, np.int32)
        rows = np.empty(ids.size, np.int64)
        flat_ids = _compiled.read_only(np.ascontiguousarray(ids), ids.size)
        getattr(loops, self.loop)(flat_ids, *constants, shards, rows)
        return [shards, rows] if self._shards_first else [rows, shards]


_INT64 = np.dtype(np.int64)


def _constants(fixed: list[Any], divisors: list[int]) -> list[int] | None:
    """The loop's constants from the region's fixed inputs (the flat shape [-1], then
    int64 scalars), or None when they are not those or a divisor is not positive (the
    parts raise TensorFlow's error for a zero one)."""
    flat, *scalars = fixed
    if type(flat) is not np.ndarray or flat.size != 1 or flat.reshape(-1)[0] != -1:
        return None
    if any(type(v) is not np.ndarray or v.shape != () or v.dtype != _INT64 for v in scalars):
        return None
    constants = [int(v) for v in scalars]
    if any(constants[i] <= 0 for i in divisors):
        return None
    return constants


def match(
    parts: Sequence[NodeDef], sources: Sequence[Sequence[int]], outputs: Sequence[int], count: int
) -> IdSplit | None:
    """The `IdSplit` a region of `parts` is, or None. `sources[p]`: the places part p
    reads (k < `count`: the region's input k; `count` + q: part q's value);
    `outputs`: the places of the region's outputs."""
    if len(outputs) != 2:
        return None
    for loop, (programs, constants, divisors) in _PROGRAMS.items():
        for shards_first in (True, False):
            names = ("shards", "rows") if shards_first else ("rows", "shards")
            bound: dict[str, int] = {}
            used: set[int] = set()
            if all(
                _matches(programs[name], place, parts, sources, count, bound, used)
                for name, place in zip(names, outputs, strict=True)
            ) and len(used) == len(parts):
                return IdSplit(loop, bound, constants, divisors, shards_first)
    return None


def _typed_as_programs(part: NodeDef) -> bool:
    """Whether `part` has the dtypes of the programs' nodes: int64, the Cast to int32."""
    attr = part.attr  # (read without adding: a missing key is none of these dtypes)
    dtype = {name: attr[name].type for name in ("T", "SrcT", "DstT", "Tshape") if name in attr}
    if part.op == "Cast":
        truncate = "Truncate" in attr and attr["Truncate"].b
        return dtype.get("SrcT") == DT_INT64 and dtype.get("DstT") == DT_INT32 and not truncate
    if part.op == "Reshape":
        return dtype.get("T") == DT_INT64 and dtype.get("Tshape") in (DT_INT32, DT_INT64)
    return dtype.get("T") == DT_INT64


def _matches(
    program: Any,
    place: int,
    parts: Sequence[NodeDef],
    sources: Sequence[Sequence[int]],
    count: int,
    bound: dict[str, int],
    used: set[int],
) -> bool:
    """Whether the value at `place` is `program`, binding its named inputs in `bound`
    (a name already bound must be the same input) and adding the parts it takes to `used`."""
    if isinstance(program, str):
        if place >= count:
            return False
        return bound.setdefault(program, place) == place
    if place < count:
        return False
    q = place - count
    op, *operands = program
    part = parts[q]
    if part.op not in ((op,) if isinstance(op, str) else op) or len(sources[q]) != len(operands):
        return False
    if not _typed_as_programs(part):
        return False
    used.add(q)
    return all(
        _matches(operand, source, parts, sources, count, bound, used)
        for operand, source in zip(operands, sources[q], strict=True)
    )


__all__ = ["IdSplit", "match"]
