"""Kernels for embeddings and sparse training: what `tf.nn.embedding_lookup` over a
partitioned variable and the optimizers' sparse updates build.

* `Unique`, `UniqueV2`, `UniqueWithCounts(V2)`: the distinct values of a tensor in
  order of first appearance, and where each element went.
* `UnsortedSegmentSum/Max/Min/Prod`: `data` reduced by segment id; ids < 0 are
  dropped, empty segments hold the reduction's identity (0, 1, lowest, highest).
* `DynamicPartition`: `data` split by a partition number per row (`DynamicStitch`,
  its inverse, lives in `kernels.array`).
* `ConcatOffset`: where each input of a concat starts (ConcatV2's gradient).
* The sparse optimizer updates `SparseApply{Adagrad,AdagradV2,ProximalAdagrad,
  Momentum,RMSProp,CenteredRMSProp,Ftrl,FtrlV2}` (TF 1.x reference variables, output
  the reference to `var`) and their `ResourceSparseApply*` twins (variable handles,
  no output). They apply TF's per-row formulas to the rows `indices` names.

Duplicate indices: TensorFlow's kernels walk `indices` in order and update the row
once per occurrence, so a row named twice takes two consecutive updates (Adagrad's
accumulator grows by both squared gradients, the variable moves twice). Here the
occurrences are applied in passes, the k-th occurrence of every row in pass k, which
gives the same result as that walk. (The optimizers' Python code sums duplicate
gradients with `Unique` + `UnsortedSegmentSum` before calling these kernels, so
training graphs rarely pass duplicates.)

Out-of-range indices are TF's InvalidArgumentError ("Index 7 at offset 1 in indices
is out of range"); distserver checks every index before changing anything, where some
TF kernels have updated the rows before the bad one.
"""

from __future__ import annotations

import functools
import math as _math
from typing import TYPE_CHECKING, Any, ClassVar, NoReturn

import ml_dtypes
import numpy as np

from distserver import errors
from distserver.kernels import _compiled
from distserver.kernels._common import (
    ALL_TYPES,
    BOOL,
    FLOATS,
    INDEX_TYPES,
    INT32,
    INTEGERS,
    NUMBER,
    OBJECT,
    REAL,
    array,
    attr_type_in,
    check_input_dtype,
    int_list,
    int_scalar,
    kernel_error,
    quiet,
    shape_str,
)
from distserver.kernels.math import fused_parts
from distserver.kernels.registry import (
    KernelContext,
    OpKernel,
    compute_without_dereference,
    create_kernel,
    register_kernel,
)
from distserver.kernels.state import (
    NOT_IN_PLACE,
    OPTIMIZER_UPDATES,
    _ApplyKernel,
    _locked,
    ftrl_update,
    proximal_step,
    update_pair_in_place,
)

if TYPE_CHECKING:
    from distserver.protos.node_def_pb2 import NodeDef


# --------------------------------------------------------------------------- Unique


def _first_occurrence_unique(
    rows: np.ndarray, with_counts: bool = True
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """For `rows` (shape [n, ...]): (positions of the first occurrence of each distinct row,
    in order of appearance; the index of each row's distinct value; the count of each,
    or None for a vector of integers when not `with_counts`)."""
    n = rows.shape[0]
    if n == 0:
        empty = np.zeros(0, np.int64)
        return empty, empty, empty
    if rows.dtype in (OBJECT, BOOL):
        keys: dict[Any, int] = {}
        first: list[int] = []
        inverse = np.empty(n, np.int64)
        flat = rows.reshape(n, -1)
        for i in range(n):
            key = tuple(flat[i].tolist())
            slot = keys.get(key)
            if slot is None:
                slot = keys[key] = len(first)
                first.append(i)
            inverse[i] = slot
        return np.asarray(first, np.int64), inverse, np.bincount(inverse, minlength=len(first))
    flat = rows.reshape(n, -1)
    if flat.shape[1] == 1 and rows.dtype in INTEGERS:
        return _first_occurrence_unique_ints(flat[:, 0], with_counts)
    if flat.shape[1] == 1:
        _, first_sorted, inverse_sorted, counts_sorted = np.unique(
            flat[:, 0], return_index=True, return_inverse=True, return_counts=True
        )
    else:
        _, first_sorted, inverse_sorted, counts_sorted = np.unique(
            flat, axis=0, return_index=True, return_inverse=True, return_counts=True
        )
    # np.unique sorts; TF keeps the order of first appearance.
    order = np.argsort(first_sorted, kind="stable")
    rank = np.empty_like(order)
    rank[order] = np.arange(order.size)
    return first_sorted[order], rank[inverse_sorted.reshape(-1)], counts_sorted[order]


@register_kernel("Unique", "UniqueV2", "UniqueWithCounts", "UniqueWithCountsV2")
class UniqueKernel(OpKernel):
    """y: the distinct values (or slices along `axis`, V2) in order of first appearance;
    idx: for each element (slice), the position of its value in y; count (WithCounts)."""

    def __init__(self, node: NodeDef) -> None:
        super().__init__(node)
        self.dtype = attr_type_in(self, "T", ALL_TYPES)
        self.index_type = attr_type_in(self, "out_idx", INDEX_TYPES, default=INT32)
        self.has_axis = self.op.endswith("V2")
        self.with_counts = self.op.startswith("UniqueWithCounts")
        if self.dtype in _LOOP_INDEX_TYPES:
            _compiled.prepare()

    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        x = inputs[0]
        check_input_dtype(self, 0, x, self.dtype)
        axis: int | None = None
        if self.has_axis:
            axes = int_list(self, inputs[1], "axis", allow_scalar=True)
            if len(axes) > 1:
                raise kernel_error(
                    self,
                    f"Axis tensor should be a scalar or a vector of 1 element, got {len(axes)} elements",
                )
            if axes:
                axis = axes[0]
                if not -x.ndim <= axis < max(x.ndim, 1):
                    raise kernel_error(self, f"axis has to be between [{-x.ndim}, {x.ndim}), got {axis}")
                axis %= max(x.ndim, 1)
        if axis is None:
            if x.ndim != 1:
                raise kernel_error(self, "unique expects a 1D vector.")
            axis = 0
        rows = x if axis == 0 else np.moveaxis(x, axis, 0)
        first, inverse, counts = _first_occurrence_unique(rows, self.with_counts)
        y = rows[first] if axis == 0 else np.moveaxis(rows[first], 0, axis)
        outputs = [np.ascontiguousarray(y), inverse.astype(self.index_type)]
        if self.with_counts:
            assert counts is not None
            outputs.append(counts.astype(self.index_type))
        return outputs


def _first_occurrence_unique_ints(
    values: np.ndarray, with_counts: bool = True
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """`_first_occurrence_unique` of a non-empty integer vector. Values in a narrow
    range (ids into an embedding table) take a table indexed by value: one compiled
    pass (`_loops.first_occurrences`; 1,024 ids into 25,000 rows: ~7 us) or numpy's
    passes over a table of first positions (`first_positions`, ~19 us); others one
    stable sort and a sort of the distinct values' first positions: what np.unique
    computes and then reorders, without its extra passes (~48 us)."""
    n = values.size
    loops = _compiled.loops()
    if loops is not None and values.dtype in _LOOP_INDEX_TYPES and values.flags.c_contiguous:
        narrow = _narrow_range(values)
        if narrow is not None:
            firsts = np.empty(n, np.int64)
            inverse = np.empty(n, np.int64)
            distinct = loops.first_occurrences(values, *narrow, firsts, inverse)
            counts = np.bincount(inverse, minlength=distinct) if with_counts else None
            return firsts[:distinct], inverse, counts
    first = first_positions(values)
    if first is not None:
        firsts = np.flatnonzero(first == np.arange(n))  # in order of appearance
        rank = np.empty(n, np.int64)
        rank[firsts] = np.arange(firsts.size)
        inverse = rank[first]
        counts = np.bincount(inverse, minlength=firsts.size) if with_counts else None
        return firsts, inverse, counts
    order = np.argsort(values, kind="stable")
    ordered = values[order]
    starts = np.empty(n, np.bool_)
    starts[0] = True
    np.not_equal(ordered[1:], ordered[:-1], out=starts[1:])
    group = np.cumsum(starts) - 1  # the distinct value of each sorted position, by value
    first_by_value = order[starts]  # stable: the first occurrence of each
    by_first = np.argsort(first_by_value)  # distinct positions: no ties
    rank = np.empty_like(by_first)
    rank[by_first] = np.arange(by_first.size)
    inverse = np.empty(n, np.int64)
    inverse[order] = rank[group]
    counts = np.diff(np.append(np.flatnonzero(starts), n))[by_first] if with_counts else None
    return first_by_value[by_first], inverse, counts


# A table of first positions costs a fill of one entry per value in the range; it
# is used while that range is at most this many times the number of values ...
_TABLE_SPAN_PER_VALUE = 64
# ... and at most this many entries (8 MiB).
_MAX_TABLE_ENTRIES = 1 << 20


# The integer types the compiled loops take as values or ids.
_LOOP_INDEX_TYPES = frozenset({np.dtype(np.int32), np.dtype(np.int64)})


def _narrow_range(values: np.ndarray) -> tuple[int, int] | None:
    """(lowest value, span) of a non-empty integer vector whose values lie in a range
    narrow enough for a table indexed by value (`_TABLE_SPAN_PER_VALUE`,
    `_MAX_TABLE_ENTRIES`); None otherwise."""
    if values.dtype == np.uint64:  # (offsets are int64)
        return None
    low = int(values.min())
    span = int(values.max()) - low + 1
    if span > min(_TABLE_SPAN_PER_VALUE * values.size, _MAX_TABLE_ENTRIES):
        return None
    return low, span


def first_positions(values: np.ndarray) -> np.ndarray | None:
    """For a non-empty integer vector whose values lie in a narrow range: the position
    of the first occurrence of each element's value (so `first[i] == i` where a value
    first appears), found through a table indexed by value; None for a wide range.
    Cheaper than sorting: 1,024 ids into 25,000 rows take ~12 us, a stable sort ~14."""
    narrow = _narrow_range(values)
    if narrow is None:
        return None
    low, span = narrow
    offsets = values.astype(np.int64, copy=False)
    if low:
        offsets = offsets - low
    table = np.full(span, values.size, np.int64)
    np.minimum.at(table, offsets, np.arange(values.size))
    return table[offsets]


# --------------------------------------------------------------------------- segment reductions

_SEGMENT_REDUCTIONS = {
    "UnsortedSegmentSum": np.add,
    "UnsortedSegmentProd": np.multiply,
    "UnsortedSegmentMax": np.maximum,
    "UnsortedSegmentMin": np.minimum,
}


def _identity(op: str, dtype: np.dtype[Any]) -> Any:
    """The value of an empty segment: TF's reduction identity for `dtype`."""
    if op == "UnsortedSegmentSum":
        return 0
    if op == "UnsortedSegmentProd":
        return 1
    lowest = op == "UnsortedSegmentMax"  # the lowest / highest finite value, as TF
    info: Any = np.iinfo(dtype) if dtype not in FLOATS else ml_dtypes.finfo(dtype)  # type: ignore[no-untyped-call]
    return info.min if lowest else info.max


@register_kernel(*_SEGMENT_REDUCTIONS)
class UnsortedSegmentReductionKernel(OpKernel):
    """output[j, ...] = reduce(data[i..., ...] for every i with segment_ids[i...] == j)."""

    def __init__(self, node: NodeDef) -> None:
        super().__init__(node)
        allowed = NUMBER if self.op in ("UnsortedSegmentSum", "UnsortedSegmentProd") else REAL
        self.dtype = attr_type_in(self, "T", allowed)
        self.index_type = attr_type_in(self, "Tindices", INDEX_TYPES)
        self.ufunc = _SEGMENT_REDUCTIONS[self.op]
        self._use_loops = self.op == "UnsortedSegmentSum" and self.dtype in _compiled.DTYPES
        if self._use_loops:
            _compiled.prepare()

    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        data, segment_ids, num_segments_value = inputs
        check_input_dtype(self, 0, data, self.dtype)
        check_input_dtype(self, 1, segment_ids, self.index_type)
        if num_segments_value.ndim != 0:
            raise kernel_error(
                self,
                f"num_segments should be a scalar, not shape {shape_str(num_segments_value.shape)}",
            )
        num_segments = int_scalar(self, num_segments_value, "num_segments")
        if num_segments < 0:
            raise kernel_error(self, f"Input num_segments == {num_segments} must be non-negative.")
        if data.shape[: segment_ids.ndim] != segment_ids.shape:
            raise kernel_error(
                self,
                f"data.shape = {shape_str(data.shape)} does not start with segment_ids.shape = "
                f"{shape_str(segment_ids.shape)}",
            )
        ids = segment_ids.reshape(-1)
        inner = data.shape[segment_ids.ndim :]
        loops = _compiled.loops() if self._use_loops else None
        if loops is not None and _compiled.contiguous(ids, data):
            # (one pass that checks the ids as it adds their rows: no passes for the
            # smallest and the largest id, no filled output first; 982 rows of 32 floats
            # 15 -> 8 us)
            width = _math.prod(inner)
            output = np.empty((num_segments, *inner), self.dtype)
            bad = loops.segment_sum_rows(
                output.reshape(num_segments, width), ids, data.reshape(ids.size, width)
            )
            if bad < 0:
                return [output]
            self._out_of_range(segment_ids, num_segments, bad)
        if ids.size and ids.max() >= num_segments:
            self._out_of_range(segment_ids, num_segments, int(np.flatnonzero(ids >= num_segments)[0]))
        rows = data.reshape((ids.size, *inner))
        if ids.size and ids.min() < 0:  # negative ids are dropped, as in TF
            keep = ids >= 0
            ids, rows = ids[keep], rows[keep]
        output = np.full((num_segments, *inner), _identity(self.op, self.dtype), dtype=self.dtype)
        with np.errstate(all="ignore"):
            reduce_rows_at(self.ufunc, output, ids, rows)
        return [output]

    def _out_of_range(self, segment_ids: np.ndarray, num_segments: int, bad: int) -> NoReturn:
        """Raise TF's error for the id at flat position `bad`, past `num_segments`."""
        position = np.unravel_index(bad, segment_ids.shape)
        raise kernel_error(
            self,
            f"segment_ids[{','.join(map(str, position))}] = {int(segment_ids.reshape(-1)[bad])} is out of "
            f"range [0, {num_segments})",
        )


# --------------------------------------------------------------------------- DynamicPartition


@register_kernel("DynamicPartition")
class DynamicPartitionKernel(OpKernel):
    """outputs[i] = data[partitions == i], rows kept in order (`num_partitions` outputs)."""

    def __init__(self, node: NodeDef) -> None:
        super().__init__(node)
        self.dtype = attr_type_in(self, "T", ALL_TYPES)
        self.count = self.attr_int("num_partitions")
        if self.count < 1:
            raise kernel_error(self, f"num_partitions must be at least 1, got {self.count}")
        _compiled.prepare()

    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        data, partitions = inputs
        check_input_dtype(self, 0, data, self.dtype)
        check_input_dtype(self, 1, partitions, INT32)
        if data.shape[: partitions.ndim] != partitions.shape:
            raise kernel_error(
                self,
                f"data.shape must start with partitions.shape, got data.shape = {shape_str(data.shape)}"
                f", partitions.shape = {shape_str(partitions.shape)}",
            )
        flat = partitions.reshape(-1)
        rows = data.reshape((flat.size, *data.shape[partitions.ndim :]))
        loops = _compiled.loops()
        if loops is not None and flat.flags.c_contiguous:
            # One compiled pass orders the positions by partition (~8 us for 2,048 ids
            # into two, where a mask per partition took ~24), then one take each.
            order = np.empty(flat.size, np.int64)
            sizes = np.empty(self.count, np.int64)
            if loops.partition_order(flat, self.count, order, sizes) < 0:
                ends = np.cumsum(sizes).tolist()
                return [
                    rows.take(order[end - size : end], axis=0)
                    for end, size in zip(ends, sizes.tolist(), strict=True)
                ]
        elif not flat.size or (flat.min() >= 0 and flat.max() < self.count):
            return [rows[flat == i] for i in range(self.count)]
        bad = int(np.flatnonzero((flat < 0) | (flat >= self.count))[0])
        position = np.unravel_index(bad, partitions.shape)
        where = f"[{','.join(map(str, position))}]" if partitions.ndim else ""
        raise kernel_error(self, f"partitions{where} = {int(flat[bad])} is not in [0, {self.count})")


# --------------------------------------------------------------------------- ConcatOffset


@register_kernel("ConcatOffset")
class ConcatOffsetKernel(OpKernel):
    """offset[i]: zeros except at the concat axis, where it is the sum of the earlier inputs' sizes."""

    runs_on_loop = True  # a few shape vectors

    def __init__(self, node: NodeDef) -> None:
        super().__init__(node)
        self.count = self.attr_int("N")
        self.shape_type = attr_type_in(self, "shape_type", INDEX_TYPES, default=INT32)

    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        concat_dim, *shapes = inputs
        if concat_dim.ndim != 0:
            raise kernel_error(
                self, f"Concat dim tensor should be a scalar, but got shape {shape_str(concat_dim.shape)}"
            )
        cdim = int_scalar(self, concat_dim, "concat_dim")
        first = shapes[0]
        if first.ndim != 1:
            raise kernel_error(self, f"input 0 should be a vector, but got shape {shape_str(first.shape)}")
        dims = first.size
        axis = cdim + dims if cdim < 0 else cdim
        if not 0 <= axis < dims:
            raise kernel_error(self, f"Concat dim is out of range: {cdim} vs. {dims}")
        offsets = []
        offset = 0
        for i, shape in enumerate(shapes):
            check_input_dtype(self, 1 + i, shape, self.shape_type)
            if shape.size != dims:
                raise kernel_error(self, f"input {i} should contain {dims} elements, but got {shape.size}")
            values = shape.reshape(-1)
            mismatch = [j for j in range(dims) if j != axis and values[j] != first[j]]
            if mismatch:
                raise kernel_error(
                    self,
                    f"All dimensions except {axis} must match. Input {i} has shape "
                    f"[{' '.join(map(str, values.tolist()))}] and doesn't match input 0 with shape "
                    f"[{' '.join(map(str, first.tolist()))}].",
                )
            out = np.zeros(dims, self.shape_type)
            out[axis] = offset
            offset += int(values[axis])
            offsets.append(out)
        return offsets


# --------------------------------------------------------------------------- sparse optimizers


def sparse_rows_passes(rows: np.ndarray) -> list[np.ndarray]:
    """Positions into `rows` grouped so that no pass names a row twice: pass k holds the
    k-th occurrence of every row named at least k + 1 times, in order.

    Applying a per-row update pass after pass equals walking `rows` in order, which is
    what TensorFlow's sparse kernels do with duplicate indices. As many passes as the
    most repeated row has occurrences.
    """
    order, occurrence = _occurrences(rows)
    if occurrence.size == 0:
        return []
    return [order[occurrence == k] for k in range(int(occurrence.max()) + 1)]


def _occurrences(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(positions of `rows` sorted by row, stably; how many times that position's row
    was named before it)."""
    n = rows.size
    order = np.argsort(rows, kind="stable")
    if n == 0:
        return order, np.zeros(0, np.int64)
    ordered = rows[order]
    starts = np.ones(n, dtype=bool)
    starts[1:] = ordered[1:] != ordered[:-1]
    group_start = np.maximum.accumulate(np.where(starts, np.arange(n), 0))
    return order, np.arange(n) - group_start


def _update_passes(rows: np.ndarray, num_rows: int) -> list[np.ndarray | None]:
    """`sparse_rows_passes(rows)` for a sparse update of a variable of `num_rows` rows
    (every row in range), with `[None]` (one pass over all positions, in order) when
    no row repeats: the usual case, as TF's optimizers sum duplicate rows before
    the update. A flag per row of the variable tells, unless that is many times the
    rows named (then the passes find it, sorting)."""
    if rows.size <= 1:
        return [None] if rows.size else []
    if num_rows <= 64 * rows.size:
        named = np.zeros(num_rows, np.bool_)
        named[rows] = True
        if np.count_nonzero(named) == rows.size:
            return [None]
    return list(sparse_rows_passes(rows))


# Most passes `reduce_rows_at` makes before it leaves the work to `ufunc.at`.
_MAX_PASSES = 16


def reduce_rows_at(ufunc: np.ufunc, output: np.ndarray, ids: np.ndarray, rows: np.ndarray) -> None:
    """output[ids[i]] = ufunc(output[ids[i]], rows[i]) for every i, in order: `ufunc.at`'s
    result bit for bit (each output row sees its rows in the same order).

    `ufunc.at` walks the rows one by one in C (~0.25 us a row). When the ids lie in a
    narrow range (`first_positions`), the first occurrences of the ids go in one
    vectorised pass and the few repeats after them through `ufunc.at`, in order (the
    sum of `Unique`'s duplicates: 1,024 rows of 32, 53 -> ~30 us). Otherwise, when no
    id repeats more than `_MAX_PASSES` times, a few vectorised passes over the distinct
    ids (the k-th occurrences of each, as `sparse_rows_passes`) do the same 3x faster.
    """
    if ids.size == 0:
        return
    first = first_positions(ids)
    if first is not None:
        is_first = first == np.arange(ids.size)
        repeats = np.flatnonzero(~is_first)
        if repeats.size <= _MAX_REPEATS_AT:
            _reduce_distinct_rows(ufunc, output, ids, rows, np.flatnonzero(is_first))
            if repeats.size:
                ufunc.at(output, ids[repeats], rows.take(repeats, axis=0))
            return
    order, occurrence = _occurrences(ids)
    passes = int(occurrence.max()) + 1
    if passes > _MAX_PASSES:
        ufunc.at(output, ids, rows)
        return
    for k in range(passes):
        _reduce_distinct_rows(ufunc, output, ids, rows, order[occurrence == k] if passes > 1 else order)


# Most repeated ids `reduce_rows_at` leaves to `ufunc.at` after the first occurrences.
_MAX_REPEATS_AT = 256


def _reduce_distinct_rows(
    ufunc: np.ufunc, output: np.ndarray, ids: np.ndarray, rows: np.ndarray, positions: np.ndarray
) -> None:
    """output[ids[p]] = ufunc(output[ids[p]], rows[p]) for positions `p` that name distinct ids."""
    picked = ids[positions]
    # (`take`: the rows of fancy indexing, 3x faster on the first axis)
    taken = rows.take(positions, axis=0)
    k = picked.size
    if k and picked[-1] == k - 1 and np.array_equal(picked, np.arange(k)):
        # ids 0, 1, ... in order (`Unique`'s, at their first occurrences): the output's
        # first rows, reduced in place
        ufunc(output[:k], taken, out=output[:k])
    else:
        output[picked] = ufunc(output.take(picked, axis=0), taken)


_Arrays = dict[str, np.ndarray]  # (inputs by name)


class _SparseApplyKernel(_ApplyKernel):
    """A sparse optimizer update: TF's per-row formula for the rows `indices` names.

    `signature` kinds, beyond `_ApplyKernel`'s "var" and "scalar": "grad" (shape
    [N] + var.shape[1:]) and "indices" (a vector of N row numbers, dtype `Tindices`).
    `update` gets the rows of every "var" input, the rows of `grad` and the scalars,
    and returns the new rows of the variables it changes.
    """

    # TF's texts for the scalar inputs it checks beyond "is a scalar".
    scalar_rules: ClassVar[dict[str, tuple[str, str]]] = {}
    # The scalar-shape message of TF's kernel ("lr is not a scalar: [2]").
    scalar_text: ClassVar[str] = "{name} is not a scalar: {shape}"
    # SparseApplyMomentum/RMSProp do not refuse an empty inner dimension.
    check_inner_dim: ClassVar[bool] = True
    # Rows at random places cost more a byte than a dense update's stream: the pool
    # from `executor.OFFLOAD_BYTES`, as for any kernel.
    offload_bytes: ClassVar[int | None] = None

    def __init__(self, node: NodeDef) -> None:
        super().__init__(node)
        self.index_type = attr_type_in(self, "Tindices", INDEX_TYPES)
        self._quiet_update_rows = quiet(self._update_rows)

    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        if len(inputs) != len(self.signature):
            raise kernel_error(self, f"expects {len(self.signature)} inputs, got {len(inputs)}")
        # (the variables through `_resource`: found again without a lookup while their
        # handles are the same arrays, as a VarHandleOp's output is)
        targets = [self._resource(ctx, i, inputs[i]) for i in self._var_indices]
        values: dict[str, np.ndarray] = {}
        grad = indices = None
        for i, ((name, kind), value) in enumerate(zip(self.signature, inputs, strict=True)):
            if kind == "var":
                continue
            if kind == "indices":
                check_input_dtype(self, i, value, self.index_type)
                indices = value
            else:
                check_input_dtype(self, i, value, self.dtype)
                if kind == "grad":
                    grad = value
                else:
                    self._check_scalar(name, value)
                    values[name] = value
        assert grad is not None
        assert indices is not None
        with _locked(targets):
            # Unshared variables get their rows written in place (see `_ApplyKernel`);
            # decided before this kernel takes references to the arrays itself.
            in_place = len({id(v) for v in targets}) == len(targets) and all(v.unshared() for v in targets)
            current = self._current_values(ctx, inputs, targets)
            self._check_shapes(current, grad, indices)
            rows = indices.astype(np.int64, copy=False)
            if in_place:
                updated = current
                for value in updated.values():
                    value.flags.writeable = True
            else:
                updated = {name: np.array(value, copy=True) for name, value in current.items()}
            try:
                self._quiet_update_rows(updated, rows, grad, values)
            finally:
                if in_place:
                    for value in updated.values():
                        value.flags.writeable = False
            if not in_place:
                for variable, name in zip(targets, self._var_names, strict=True):
                    variable.replace(array(updated[name], self.dtype))
            OPTIMIZER_UPDATES.count(in_place)
        return [inputs[0]] if self.on_refs else []

    def _update_rows(
        self,
        updated: dict[str, np.ndarray],
        rows: np.ndarray,
        grad: np.ndarray,
        values: dict[str, np.ndarray],
    ) -> None:
        """Write `update`'s new rows into the arrays `updated` (by input name) for the rows
        `rows` names, with `grad`'s rows and the scalars `values`: in one pass over all of
        them when no row repeats, else in passes that each name a row once."""
        if self.compiled_rows(updated, rows, grad, values):
            return
        for positions in _update_passes(rows, updated["var"].shape[0]):
            picked = rows if positions is None else rows[positions]
            x = {name: updated[name].take(picked, axis=0) for name in updated}
            x.update(values)
            x["grad"] = grad if positions is None else grad[positions]
            for name, new_rows in self.update(**x).items():
                updated[name][picked] = new_rows

    def compiled_rows(self, updated: _Arrays, rows: np.ndarray, grad: np.ndarray, values: _Arrays) -> bool:
        """`_update_rows` by a compiled loop (`_compiled`), and True; or False, having
        changed nothing, for numpy's calls to make it."""
        return False

    def _check_scalar(self, name: str, value: np.ndarray) -> None:
        rule = self.scalar_rules.get(name)
        ok = value.ndim == 0
        if ok and rule is not None:
            scalar = value[()]
            ok = bool({"positive": scalar > 0, "non-negative": scalar >= 0}.get(rule[0], scalar <= 0))
        if not ok:
            if rule is not None:
                raise kernel_error(self, f"{rule[1]} is not a {rule[0]} scalar: {shape_str(value.shape)}")
            raise kernel_error(self, self.scalar_text.format(name=name, shape=shape_str(value.shape)))

    def _current_values(
        self, ctx: KernelContext, inputs: list[Any], targets: list[Any]
    ) -> dict[str, np.ndarray]:
        """The values of the variables `targets` (of the "var" inputs), by input name."""
        current: dict[str, np.ndarray] = {}
        for i, name, variable in zip(self._var_indices, self._var_names, targets, strict=True):
            value = variable.value
            if value is None:
                raise self._no_value(ctx, i, inputs[i])
            if value.dtype != self.dtype:
                check_input_dtype(self, 0, value, self.dtype)
            current[name] = value
        return current

    def _check_shapes(self, current: dict[str, np.ndarray], grad: np.ndarray, indices: np.ndarray) -> None:
        var = current["var"]
        for name, value in current.items():
            if value.shape != var.shape:
                raise kernel_error(
                    self,
                    f"var and {name} do not have the same shape"
                    f"{shape_str(var.shape)} {shape_str(value.shape)}",
                )
        if var.ndim < 1:
            raise kernel_error(self, "var must be at least 1 dimensional")
        if indices.ndim != 1:
            raise kernel_error(self, "indices must be one-dimensional")
        for d in range(1, var.ndim):
            if grad.ndim <= d or grad.shape[d] != var.shape[d]:
                raise kernel_error(self, f"var and grad must match in dimension {d}")
        if grad.ndim != var.ndim:
            raise kernel_error(self, f"var and grad must match in dimension {min(var.ndim, grad.ndim)}")
        n = indices.shape[0]
        if grad.shape[0] != n:
            raise kernel_error(self, "grad must be the same size as indices in the first dimension.")
        if self.check_inner_dim and _math.prod(var.shape[1:]) <= 0:
            raise kernel_error(self, "Inner dimension should be greater than zero.")
        if n and (indices.min() < 0 or indices.max() >= var.shape[0]):  # (two passes, no temporaries)
            i = int(np.flatnonzero((indices < 0) | (indices >= var.shape[0]))[0])
            raise kernel_error(self, f"Index {int(indices[i])} at offset {i} in indices is out of range")

    def update(self, **x: np.ndarray) -> dict[str, Any]:
        """The new rows of the variables it changes, from the rows of every "var" input
        (copies, which it may write into), `grad`'s rows and the scalars."""
        raise NotImplementedError


def _fit_for_rows(
    dtype: np.dtype[Any], grad: np.ndarray, rows: np.ndarray, var: np.ndarray, slot: np.ndarray
) -> bool:
    """Whether a sparse update's compiled loop takes these variable and slot values:
    float matrices of `dtype` alike, with `grad`'s non-empty rows, all C-contiguous (as
    `rows`)."""
    return (
        var.dtype == dtype
        and slot.dtype == dtype
        and var.ndim == 2
        and slot.shape == var.shape
        and grad.shape[1] == var.shape[1]
        and var.shape[1] > 0
        and _compiled.contiguous(var, slot, grad, rows)
    )


def _rsqrt(value: np.ndarray) -> np.ndarray:
    one = np.ones((), dtype=value.dtype)
    return np.asarray(one / np.sqrt(value))


@register_kernel("SparseApplyAdagrad", "ResourceSparseApplyAdagrad")
class SparseApplyAdagradKernel(_SparseApplyKernel):
    """accum[i] += grad^2 (unless `update_slots` is false); var[i] -= lr * grad / sqrt(accum[i])."""

    signature: ClassVar[tuple[tuple[str, str], ...]] = (
        ("var", "var"),
        ("accum", "var"),
        ("lr", "scalar"),
        ("grad", "grad"),
        ("indices", "indices"),
    )

    def __init__(self, node: NodeDef) -> None:
        super().__init__(node)
        self.update_slots = self.attr_bool("update_slots", True)
        self._use_loops = type(self) is SparseApplyAdagradKernel and self.dtype in _compiled.DTYPES
        if self._use_loops:
            _compiled.prepare()
        self._may_go_fast = self._use_loops and not self.on_refs
        self._one = self.dtype.type(1)

    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        # An embedding's update (twice a step for two shards) is nearly always alike: two
        # unshared float matrices, a scalar rate, a gradient row for each row number.
        # That case runs here with the same locks and checks as `_SparseApplyKernel`'s,
        # and the row numbers' range checked by the loop (31 -> 21 us for 982 rows of
        # 32 floats); anything else, errors but that range included, goes the general way.
        return [] if self._took_short_path(ctx, inputs) else super().compute(ctx, inputs)

    def _update_fast(self, ctx: KernelContext, inputs: list[Any]) -> bool:
        """Update in place and return True, or return False having changed nothing."""
        var_input, accum_input, lr, grad, indices = inputs
        dtype = self.dtype
        loops = _compiled.loops()
        if (
            loops is None
            or type(lr) is not np.ndarray
            or type(grad) is not np.ndarray
            or type(indices) is not np.ndarray
            or lr.dtype != dtype
            or grad.dtype != dtype
            or indices.dtype != self.index_type
            or lr.ndim
            or grad.ndim != 2
            or indices.ndim != 1
            or grad.shape[0] != indices.shape[0]
            or not indices.shape[0]  # (nothing to update: the general way does nothing)
        ):
            return False
        var = self._find_input(ctx, var_input)
        accum = self._find_input(ctx, accum_input)
        if var is None or accum is None or var is accum:
            return False
        bad = update_pair_in_place(
            var,
            accum,
            functools.partial(_fit_for_rows, dtype, grad, indices),
            lambda value, slot: loops.sparse_adagrad(
                value, slot, lr[()], grad, indices, self.update_slots, self._one
            ),
        )
        if bad is NOT_IN_PLACE:
            return False
        if bad >= 0:  # (nothing changed: `_check_shapes`'s error)
            raise kernel_error(self, f"Index {int(indices[bad])} at offset {bad} in indices is out of range")
        return True

    def compiled_rows(self, updated: _Arrays, rows: np.ndarray, grad: np.ndarray, values: _Arrays) -> bool:
        loops = _compiled.loops() if self._use_loops else None
        var, accum = updated["var"], updated["accum"]
        if loops is None or not rows.size or not var.size or not _compiled.contiguous(var, accum, grad, rows):
            return False
        loops.sparse_adagrad(  # (the rows in range: `_check_shapes`)
            var.reshape(var.shape[0], -1),
            accum.reshape(var.shape[0], -1),
            values["lr"][()],
            _compiled.read_only(grad, rows.size, -1),
            _compiled.read_only(rows, -1),
            self.update_slots,
            self._one,
        )
        return True

    def update(self, **x: np.ndarray) -> dict[str, Any]:
        grad, accum, var = x["grad"], x["accum"], x["var"]
        if self.update_slots:
            accum += grad * grad
        # var - lr * grad * (1 / sqrt(accum)), into the rows given
        step = x["lr"] * grad
        scale = np.sqrt(accum)
        np.divide(np.ones((), scale.dtype), scale, out=scale)
        step *= scale
        var -= step
        return {"var": var, "accum": accum}


# A sparse update of rows named more than once, as an optimizer writes it for
# IndexedSlices (TF's `_deduplicate_indexed_slices`): the parts' ops, in order.
DEDUPLICATED_SPARSE_UPDATE_OP = "_DistserverDeduplicatedSparseUpdate"
DEDUPLICATED_SPARSE_UPDATE_PARTS = (
    "Unique",
    "Shape",
    "StridedSlice",
    "UnsortedSegmentSum",
    "ResourceSparseApplyAdagrad",
)


@register_kernel(DEDUPLICATED_SPARSE_UPDATE_OP)
class DeduplicatedSparseUpdateKernel(OpKernel):
    """An optimizer's sparse update of rows that may be named more than once, as one
    node (`runtime.fusion.fuse_deduplicated_sparse_updates`):

        unique, position = Unique(indices)
        count = StridedSlice(Shape(unique), begin, end, strides)  # shape(unique)[0]
        summed = UnsortedSegmentSum(values, position, count)
        ResourceSparseApplyAdagrad(var, accum, lr, summed, unique)

    Inputs: indices, values, var, accum, lr, begin, end, strides; the parts' NodeDefs
    in attr `FUSED_NODES_ATTR`, in that order. An embedding's update runs five kernels
    a shard this way, each paying its checks and the step's turn (~75 us a shard in
    a step); one compiled loop (`_loops.deduplicated_sparse_adagrad`) makes the same
    sums and updates, bit for bit. Whatever it does not take (other dtypes, ids in a
    wide range, a shared variable, errors) runs the parts' kernels one after the
    other, which raise what they raise, naming the node (the update's name)."""

    is_stateful = True

    def __init__(self, node: NodeDef) -> None:
        super().__init__(node)
        parts = fused_parts(self)
        if tuple(part.op for part in parts) != DEDUPLICATED_SPARSE_UPDATE_PARTS:
            raise errors.InvalidArgumentError(
                f"Node '{self.name}' ({DEDUPLICATED_SPARSE_UPDATE_OP}) has parts "
                f"{[part.op for part in parts]}: expected {list(DEDUPLICATED_SPARSE_UPDATE_PARTS)}",
                node_name=self.name,
            )
        kernels = [create_kernel(part) for part in parts]
        self._unique, self._shape, self._count, self._sum, self._update = map(
            compute_without_dereference, kernels
        )
        count, update = kernels[2], kernels[4]
        assert isinstance(update, SparseApplyAdagradKernel)
        self.dtype = update.dtype
        self.index_type = update.index_type
        self.update_slots = update.update_slots
        self._one = self.dtype.type(1)
        # The loop makes `count` the number of distinct ids itself: the slice must be
        # shape(unique)[0] (its constants are checked at each call).
        self._may_go_fast = (
            update._may_go_fast
            and kernels[3].dtype == self.dtype  # type: ignore[attr-defined]
            and (count.begin_mask, count.end_mask, count.ellipsis_mask, count.new_axis_mask) == (0, 0, 0, 0)  # type: ignore[attr-defined]
            and count.shrink_axis_mask == 1  # type: ignore[attr-defined]
        )
        self._find_input = update._find_input
        if self._may_go_fast:
            _compiled.prepare()

    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        if len(inputs) != 8:
            raise kernel_error(self, f"expects 8 inputs, got {len(inputs)}")
        if self._may_go_fast and self._update_fast(ctx, inputs):
            OPTIMIZER_UPDATES.count(True)
            return []
        indices, values, var, accum, lr, begin, end, strides = inputs
        unique, position = self._unique(ctx, [indices])
        (shape,) = self._shape(ctx, [unique])
        (count,) = self._count(ctx, [shape, begin, end, strides])
        (summed,) = self._sum(ctx, [values, position, count])
        return self._update(ctx, [var, accum, lr, summed, unique])

    def _update_fast(self, ctx: KernelContext, inputs: list[Any]) -> bool:
        """Update in place and return True, or return False having changed nothing."""
        indices, values, var_input, accum_input, lr, begin, end, strides = inputs
        dtype = self.dtype
        loops = _compiled.loops()
        if (
            loops is None
            or list(map(type, inputs[:2] + inputs[4:])).count(np.ndarray) != 6
            or lr.dtype != dtype
            or values.dtype != dtype
            or indices.dtype != self.index_type
            or lr.ndim
            or values.ndim != 2
            or indices.ndim != 1
            or not indices.size
            or values.shape[0] != indices.shape[0]
            or (begin.shape, end.shape, strides.shape) != ((1,), (1,), (1,))
            or (begin[0], end[0], strides[0]) != (0, 1, 1)
        ):
            return False
        var = self._find_input(ctx, var_input)
        accum = self._find_input(ctx, accum_input)
        if var is None or accum is None or var is accum:
            return False
        n = indices.size
        firsts = np.empty(n, np.int64)
        ranks = np.empty(n, np.int64)
        sums = np.empty(values.shape, dtype)
        bad = update_pair_in_place(
            var,
            accum,
            functools.partial(_fit_for_rows, dtype, values, indices),
            lambda value, slot: loops.deduplicated_sparse_adagrad(
                value,
                slot,
                lr[()],
                values,
                indices,
                min(_TABLE_SPAN_PER_VALUE * n, _MAX_TABLE_ENTRIES),  # (`_narrow_range`)
                self.update_slots,
                self._one,
                firsts,
                ranks,
                sums,
            ),
        )
        if bad is NOT_IN_PLACE or bad == -2:  # (-2: ids over a wide range; nothing changed)
            return False
        if bad >= 0:  # (no variable changed: the update's error, at the distinct id's offset)
            raise kernel_error(
                self, f"Index {int(indices[firsts[bad]])} at offset {bad} in indices is out of range"
            )
        return True


@register_kernel("SparseApplyAdagradV2", "ResourceSparseApplyAdagradV2")
class SparseApplyAdagradV2Kernel(SparseApplyAdagradKernel):
    """Adagrad with epsilon: var[i] -= lr * grad / (sqrt(accum[i]) + epsilon)."""

    signature = (
        ("var", "var"),
        ("accum", "var"),
        ("lr", "scalar"),
        ("epsilon", "scalar"),
        ("grad", "grad"),
        ("indices", "indices"),
    )

    def update(self, **x: np.ndarray) -> dict[str, Any]:
        grad = x["grad"]
        accum = x["accum"] + grad * grad if self.update_slots else x["accum"]
        return {"var": x["var"] - x["lr"] * grad / (np.sqrt(accum) + x["epsilon"]), "accum": accum}


@register_kernel("SparseApplyProximalAdagrad", "ResourceSparseApplyProximalAdagrad")
class SparseApplyProximalAdagradKernel(_SparseApplyKernel):
    """FOBOS with Adagrad's rate: accum[i] += grad^2; rate = lr / sqrt(accum[i]);
    v = var[i] - rate * grad; var[i] = sign(v) * max(|v| - rate * l1, 0) / (1 + rate * l2)."""

    types = frozenset({np.dtype(np.float32), np.dtype(np.float64)})
    signature = (
        ("var", "var"),
        ("accum", "var"),
        ("lr", "scalar"),
        ("l1", "scalar"),
        ("l2", "scalar"),
        ("grad", "grad"),
        ("indices", "indices"),
    )
    scalar_rules = {
        "lr": ("positive", "lr"),
        "l1": ("non-negative", "l1 regularization strength"),
        "l2": ("non-negative", "l2 regularization strength"),
    }

    def update(self, **x: np.ndarray) -> dict[str, Any]:
        grad = x["grad"]
        accum = x["accum"] + grad * grad
        rate = x["lr"] * _rsqrt(accum)
        return {
            "var": proximal_step(x["var"] - grad * rate, rate, x["l1"], x["l2"], self.dtype),
            "accum": accum,
        }


@register_kernel("SparseApplyMomentum", "ResourceSparseApplyMomentum")
class SparseApplyMomentumKernel(_SparseApplyKernel):
    """accum[i] = accum[i] * momentum + grad; var[i] -= lr * accum[i]
    (Nesterov: var[i] -= lr * grad + lr * momentum * accum[i])."""

    signature = (
        ("var", "var"),
        ("accum", "var"),
        ("lr", "scalar"),
        ("grad", "grad"),
        ("indices", "indices"),
        ("momentum", "scalar"),
    )
    check_inner_dim = False

    def _check_scalar(self, name: str, value: np.ndarray) -> None:
        if name == "lr" and value.ndim != 0:  # this kernel's own text
            raise kernel_error(self, f"lr is not a scalar : {shape_str(value.shape)}")
        super()._check_scalar(name, value)

    def update(self, **x: np.ndarray) -> dict[str, Any]:
        grad, lr, momentum = x["grad"], x["lr"], x["momentum"]
        accum = x["accum"] * momentum + grad
        step = lr * grad + lr * momentum * accum if self.use_nesterov else lr * accum
        return {"var": x["var"] - step, "accum": accum}


@register_kernel("SparseApplyRMSProp", "ResourceSparseApplyRMSProp")
class SparseApplyRMSPropKernel(_SparseApplyKernel):
    """ms[i] = ms[i] * rho + grad^2 * (1 - rho);
    mom[i] = mom[i] * momentum + lr * grad / sqrt(ms[i] + epsilon); var[i] -= mom[i]."""

    signature = (
        ("var", "var"),
        ("ms", "var"),
        ("mom", "var"),
        ("lr", "scalar"),
        ("rho", "scalar"),
        ("momentum", "scalar"),
        ("epsilon", "scalar"),
        ("grad", "grad"),
        ("indices", "indices"),
    )
    check_inner_dim = False

    def update(self, **x: np.ndarray) -> dict[str, Any]:
        one = np.ones((), dtype=self.dtype)
        grad, rho = x["grad"], x["rho"]
        ms = x["ms"] * rho + grad * grad * (one - rho)
        mom = x["mom"] * x["momentum"] + _rsqrt(ms + x["epsilon"]) * x["lr"] * grad
        return {"var": x["var"] - mom, "ms": ms, "mom": mom}


@register_kernel("SparseApplyCenteredRMSProp", "ResourceSparseApplyCenteredRMSProp")
class SparseApplyCenteredRMSPropKernel(_SparseApplyKernel):
    """RMSProp normalised by the centred second moment: mg[i] = mg[i] * rho + grad * (1 - rho);
    mom[i] = mom[i] * momentum + lr * grad / sqrt(ms[i] + epsilon - mg[i]^2)."""

    signature = (
        ("var", "var"),
        ("mg", "var"),
        ("ms", "var"),
        ("mom", "var"),
        ("lr", "scalar"),
        ("rho", "scalar"),
        ("momentum", "scalar"),
        ("epsilon", "scalar"),
        ("grad", "grad"),
        ("indices", "indices"),
    )
    check_inner_dim = False

    def update(self, **x: np.ndarray) -> dict[str, Any]:
        one = np.ones((), dtype=self.dtype)
        grad, rho = x["grad"], x["rho"]
        ms = x["ms"] * rho + grad * grad * (one - rho)
        mg = x["mg"] * rho + grad * (one - rho)
        denom = ms + x["epsilon"] - mg * mg
        mom = x["mom"] * x["momentum"] + _rsqrt(denom) * x["lr"] * grad
        return {"var": x["var"] - mom, "mg": mg, "ms": ms, "mom": mom}


@register_kernel("SparseApplyFtrl", "ResourceSparseApplyFtrl")
class SparseApplyFtrlKernel(_SparseApplyKernel):
    """FTRL-proximal on the rows `indices` names (see `kernels.state.ftrl_update`)."""

    types = FLOATS
    signature: ClassVar[tuple[tuple[str, str], ...]] = (
        ("var", "var"),
        ("accum", "var"),
        ("linear", "var"),
        ("grad", "grad"),
        ("indices", "indices"),
        ("lr", "scalar"),
        ("l1", "scalar"),
        ("l2", "scalar"),
        ("lr_power", "scalar"),
    )
    scalar_rules = {
        "lr": ("positive", "lr"),
        "l1": ("non-negative", "l1 regularization strength"),
        "l2": ("non-negative", "l2 regularization strength"),
        "l2_shrinkage": ("non-negative", "l2 shrinkage regularization strength"),
        "lr_power": ("non-positive", "lr_power"),
    }

    def __init__(self, node: NodeDef) -> None:
        super().__init__(node)
        self.multiply_linear_by_lr = self.attr_bool("multiply_linear_by_lr", False)

    def update(self, **x: np.ndarray) -> dict[str, Any]:
        return ftrl_update(x, self.dtype, self.multiply_linear_by_lr)


@register_kernel("SparseApplyFtrlV2", "ResourceSparseApplyFtrlV2")
class SparseApplyFtrlV2Kernel(SparseApplyFtrlKernel):
    """FTRL with L2 shrinkage: the linear term sees grad + 2 * l2_shrinkage * var."""

    signature = (
        ("var", "var"),
        ("accum", "var"),
        ("linear", "var"),
        ("grad", "grad"),
        ("indices", "indices"),
        ("lr", "scalar"),
        ("l1", "scalar"),
        ("l2", "scalar"),
        ("l2_shrinkage", "scalar"),
        ("lr_power", "scalar"),
    )


__all__ = [
    "DEDUPLICATED_SPARSE_UPDATE_OP",
    "ConcatOffsetKernel",
    "DeduplicatedSparseUpdateKernel",
    "DynamicPartitionKernel",
    "SparseApplyAdagradKernel",
    "SparseApplyAdagradV2Kernel",
    "SparseApplyCenteredRMSPropKernel",
    "SparseApplyFtrlKernel",
    "SparseApplyFtrlV2Kernel",
    "SparseApplyMomentumKernel",
    "SparseApplyProximalAdagradKernel",
    "SparseApplyRMSPropKernel",
    "UniqueKernel",
    "UnsortedSegmentReductionKernel",
]
