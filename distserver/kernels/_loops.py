"""The loops `_compiled` hands to kernels, compiled by numba as this module is imported
(explicit signatures: nothing compiles at a call). Only `_compiled`'s background
thread imports it.

Each loop makes, element by element, the numpy operations of the kernel code it
stands in for, in the same order and in the arrays' dtype, so it gives the same bits:
no `fastmath` (no fused multiply-adds, no reassociation, IEEE division and square
root), and numpy's error model (inf and nan, never an exception). The tests compare
the bits of both ways.
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np
from numba import types

from distserver.kernels.region_plans import (
    ABS,
    ADD,
    COPY,
    DIV,
    EQUAL,
    GREATER,
    GREATER_EQUAL,
    LESS,
    LESS_EQUAL,
    MUL,
    NEG,
    NOT_EQUAL,
    RSQRT,
    SELECT,
    SQRT,
    SQUARE,
    SUB,
)

# nogil: the loops run without the GIL, as numpy's calls do; cache: a process after the
# first loads the machine code from `__pycache__` (~0.35 s) instead of compiling (~4.4 s).
_OPTIONS: dict[str, Any] = {"nogil": True, "cache": True, "error_model": "numpy"}

# What a signature's letters stand for: the loop's dtype, scalars of it, C-contiguous
# arrays of it that the loop writes (W: 1-d, WW: 2-d) or only reads (R, RR: read-only
# arrays, as the tensors a task receives are; numba takes a writeable array there too,
# at the same cost, and `_compiled.read_only` gives a read-only view in the loop's
# shape; RRR: 3-d), int64 or int32 row numbers (I, I32), a flag (B), a vector of flags
# the loop writes (FLAGS), an int64 (N), a vector of int64 the loop writes (NW) and a
# read-only matrix of int64 (CODE).
_LETTERS = {
    "WW": lambda t: types.Array(t, 2, "C"),
    "RR": lambda t: types.Array(t, 2, "C", readonly=True),
    "RRR": lambda t: types.Array(t, 3, "C", readonly=True),
    "W": lambda t: types.Array(t, 1, "C"),
    "R": lambda t: types.Array(t, 1, "C", readonly=True),
    "I": lambda t: types.Array(types.int64, 1, "C", readonly=True),
    "I32": lambda t: types.Array(types.int32, 1, "C", readonly=True),
    "B": lambda t: types.boolean,
    "FLAGS": lambda t: types.Array(types.boolean, 1, "C"),
    "N": lambda t: types.int64,
    "NW": lambda t: types.Array(types.int64, 1, "C"),
    "T": lambda t: t,
    "CODE": lambda t: types.Array(types.int64, 2, "C", readonly=True),
}


def _signatures(*arguments: str) -> list[Any]:
    """The loop's signatures for float32 and float64, its arguments in `_LETTERS`."""
    return [types.void(*[_LETTERS[a](t) for a in arguments]) for t in (types.float32, types.float64)]  # type: ignore[no-untyped-call]


def _row_signatures(*arguments: str) -> list[Any]:
    """The signatures of a loop that returns an int64, for float32 and float64 and for
    int64 and int32 row numbers (its argument "ROWS"; the others in `_LETTERS`)."""
    return [
        types.int64(*[_LETTERS[rows if a == "ROWS" else a](t) for a in arguments])  # type: ignore[no-untyped-call]
        for t in (types.float32, types.float64)
        for rows in ("I", "I32")
    ]


@numba.njit(_signatures("W", "W", "W", "R", "T", "T", "T", "T"), **_OPTIONS)
def adam(
    var: np.ndarray,
    m: np.ndarray,
    v: np.ndarray,
    grad: np.ndarray,
    alpha: Any,
    one_minus_beta1: Any,
    one_minus_beta2: Any,
    epsilon: Any,
) -> None:  # pragma: no cover (machine code; the tests call it)
    """`ApplyAdamKernel.update_in_place` without Nesterov, over flat arrays."""
    for i in range(var.size):
        g = grad[i]
        m_i = m[i] + (g - m[i]) * one_minus_beta1
        v_i = v[i] + (g * g - v[i]) * one_minus_beta2
        m[i] = m_i
        v[i] = v_i
        var[i] = var[i] - m_i * alpha / (np.sqrt(v_i) + epsilon)


@numba.njit(_signatures("W", "W", "T", "R", "T"), **_OPTIONS)
def momentum(
    var: np.ndarray, accum: np.ndarray, lr: Any, grad: np.ndarray, momentum: Any
) -> None:  # pragma: no cover
    """`state._momentum_step` (Momentum without Nesterov), over flat arrays."""
    for i in range(var.size):
        a = accum[i] * momentum + grad[i]
        accum[i] = a
        var[i] = var[i] - lr * a


@numba.njit(_signatures("W", "W", "T", "R", "B", "B", "T"), **_OPTIONS)
def adagrad(
    var: np.ndarray,
    accum: np.ndarray,
    lr: Any,
    grad: np.ndarray,
    update_slots: bool,
    with_epsilon: bool,
    epsilon: Any,
) -> None:  # pragma: no cover
    """`ApplyAdagradKernel.update_in_place` (`ApplyAdagradV2Kernel`'s `with_epsilon`),
    over flat arrays."""
    for i in range(var.size):
        g = grad[i]
        a = accum[i]
        if update_slots:
            a = a + g * g
            accum[i] = a
        denominator = np.sqrt(a)
        if with_epsilon:
            denominator = denominator + epsilon
        var[i] = var[i] - lr * g / denominator


@numba.njit(_row_signatures("WW", "WW", "T", "RR", "ROWS", "B", "T"), **_OPTIONS)
def sparse_adagrad(
    var: np.ndarray,
    accum: np.ndarray,
    lr: Any,
    grad: np.ndarray,
    rows: np.ndarray,
    update_slots: bool,
    one: Any,
) -> int:  # pragma: no cover
    """`SparseApplyAdagradKernel.update` for the rows `rows` names, one after the other: a
    row named twice is updated twice, in order, as TF's kernel does. Returns -1; or,
    having changed nothing, the offset of the first row number out of range."""
    for k in range(rows.size):
        if rows[k] < 0 or rows[k] >= var.shape[0]:
            return k
    for k in range(rows.size):
        r = rows[k]
        for j in range(var.shape[1]):
            g = grad[k, j]
            if update_slots:
                accum[r, j] = accum[r, j] + g * g
            var[r, j] = var[r, j] - lr * g * (one / np.sqrt(accum[r, j]))
    return -1


@numba.njit(
    [types.UniTuple(types.int64, 2)(_LETTERS[rows](None)) for rows in ("I", "I32")],  # type: ignore[no-untyped-call]
    **_OPTIONS,
)
def bounds(values: np.ndarray) -> tuple[int, int]:  # pragma: no cover
    """The smallest and the largest of `values` (at least one), in one pass."""
    low = high = values[0]
    for k in range(1, values.size):
        v = values[k]
        if v < low:
            low = v
        elif v > high:
            high = v
    return low, high


@numba.njit(_row_signatures("WW", "ROWS", "RR"), **_OPTIONS)
def segment_sum_rows(output: np.ndarray, ids: np.ndarray, rows: np.ndarray) -> int:  # pragma: no cover
    """output = zeros, then output[ids[k]] += rows[k] for every k in order, a negative id
    dropped (`UnsortedSegmentSum`: `np.add.at` into zeros); returns -1, or the position
    of the first id past the output's rows (then the output is not meaningful)."""
    for r in range(output.shape[0]):
        for j in range(output.shape[1]):
            output[r, j] = 0
    for k in range(ids.size):
        r = ids[k]
        if r >= output.shape[0]:
            return k
        if r < 0:
            continue
        for j in range(output.shape[1]):
            output[r, j] = output[r, j] + rows[k, j]
    return -1


@numba.njit(_signatures("WW", "I32", "RR", "FLAGS"), **_OPTIONS)
def set_rows_at(
    output: np.ndarray, ids: np.ndarray, rows: np.ndarray, written: np.ndarray
) -> None:  # pragma: no cover
    """output[ids[k]] = rows[k] for every k, in order (`output[ids] = rows`: a repeated
    id keeps its last row; the ids in range), and written[ids[k]] = True."""
    for k in range(ids.size):
        r = ids[k]
        for j in range(output.shape[1]):
            output[r, j] = rows[k, j]
        written[r] = True


@numba.njit(_signatures("WW", "RRR"), **_OPTIONS)
def sum_middle_axis(output: np.ndarray, x: np.ndarray) -> None:  # pragma: no cover
    """output[r] = 0 + x[r, 0] + x[r, 1] + ... for every row r, added one after the other
    in axis order, as numpy's reduction over a middle axis adds them (`math._sum`;
    from zero: negative zeros sum to zero)."""
    for r in range(x.shape[0]):
        for j in range(x.shape[2]):
            output[r, j] = 0
        for e in range(x.shape[1]):
            for j in range(x.shape[2]):
                output[r, j] = output[r, j] + x[r, e, j]


@numba.njit(_row_signatures("WW", "RR", "ROWS"), **_OPTIONS)
def take_rows(output: np.ndarray, params: np.ndarray, ids: np.ndarray) -> int:  # pragma: no cover
    """output[k] = params[ids[k]] for every k (`np.take(params, ids, axis=0)`); returns
    -1, or the position of the first id out of [0, len(params)) (then the rows before
    it are written and the rest is not)."""
    limit = params.shape[0]
    for k in range(ids.size):
        r = ids[k]
        if r < 0 or r >= limit:
            return k
        for j in range(params.shape[1]):
            output[k, j] = params[r, j]
    return -1


# `activation_gradient_with_sums`'s kinds: the gradient op, and its inputs (a, b).
RELU = 0  # ReluGrad(dy, x): dy * (x > 0)
TANH = 1  # TanhGrad(y, dy): dy * (1 - y * y)
SIGMOID = 2  # SigmoidGrad(y, dy): dy * y * (1 - y)


@numba.njit(_signatures("WW", "W", "RR", "RR", "N", "T", "T"), **_OPTIONS)
def activation_gradient_with_sums(
    gradient: np.ndarray, sums: np.ndarray, a: np.ndarray, b: np.ndarray, kind: int, zero: Any, one: Any
) -> None:  # pragma: no cover
    """gradient = the activation's gradient of `kind` (`nn.ActivationGradKernel`), and
    sums = its rows added one after the other to zeros, as `np.add.reduce(gradient,
    axis=0)` adds them when there is more than one column: a dense layer's bias
    gradient, in the same pass. (One difference in bits: where a sum adds a NaN to a
    NaN, the machine code may keep the other NaN than numpy does, so a NaN sum's sign
    bit may differ.)"""
    for j in range(sums.size):
        sums[j] = zero
    for i in range(gradient.shape[0]):
        for j in range(gradient.shape[1]):
            if kind == RELU:
                g = a[i, j] * (one if b[i, j] > zero else zero)
            elif kind == TANH:
                g = b[i, j] * (one - a[i, j] * a[i, j])
            else:
                g = b[i, j] * a[i, j] * (one - a[i, j])
            gradient[i, j] = g
            sums[j] = sums[j] + g


def _index_signatures(result: Any, *arguments: Any) -> list[Any]:
    """A loop's signatures for int32 and int64 read-only vectors as its first argument."""
    return [result(types.Array(t, 1, "C", readonly=True), *arguments) for t in (types.int32, types.int64)]


_INT64S = types.Array(types.int64, 1, "C")


@numba.njit(_index_signatures(types.int64, types.int64, types.int64, _INT64S, _INT64S), **_OPTIONS)
def first_occurrences(
    values: np.ndarray, low: int, span: int, firsts: np.ndarray, inverse: np.ndarray
) -> int:  # pragma: no cover
    """For integers `values` in [low, low + span): the positions where each distinct value
    first appears, in order of appearance, into `firsts`; for every element, the rank of
    its value among those, into `inverse`; returns the number of distinct values. One
    pass through a table of `span` entries (`sparse.first_positions`' range rule keeps
    it small)."""
    rank_of = np.full(span, -1, np.int64)
    distinct = 0
    for i in range(values.size):
        offset = values[i] - low
        rank = rank_of[offset]
        if rank < 0:
            rank = distinct
            rank_of[offset] = rank
            firsts[rank] = i
            distinct += 1
        inverse[i] = rank
    return distinct


@numba.njit(
    types.int64(types.Array(types.int32, 1, "C", readonly=True), types.int64, _INT64S, _INT64S), **_OPTIONS
)
def partition_order(
    partitions: np.ndarray, count: int, order: np.ndarray, sizes: np.ndarray
) -> int:  # pragma: no cover
    """For partition numbers in [0, count): the positions of partition 0's elements in
    order, then partition 1's, ..., into `order`, and each partition's size into `sizes`;
    returns -1, or the position of the first number out of range (then nothing else is
    meaningful)."""
    for p in range(count):
        sizes[p] = 0
    for i in range(partitions.size):
        p = partitions[i]
        if p < 0 or p >= count:
            return i
        sizes[p] += 1
    slot = np.empty(count, np.int64)  # where each partition's next position goes
    start = 0
    for p in range(count):
        slot[p] = start
        start += sizes[p]
    for i in range(partitions.size):
        p = partitions[i]
        order[slot[p]] = i
        slot[p] += 1
    return -1


@numba.njit(_row_signatures("WW", "WW", "T", "RR", "ROWS", "N", "B", "T", "NW", "NW", "WW"), **_OPTIONS)
def deduplicated_sparse_adagrad(
    var: np.ndarray,
    accum: np.ndarray,
    lr: Any,
    grad: np.ndarray,
    ids: np.ndarray,
    max_span: int,
    update_slots: bool,
    one: Any,
    firsts: np.ndarray,
    ranks: np.ndarray,
    sums: np.ndarray,
) -> int:  # pragma: no cover
    """An optimizer's sparse Adagrad update of rows named more than once, as TF's graph
    makes it (`kernels.sparse.DeduplicatedSparseUpdateKernel`), by the loops of its
    parts in one call: the distinct ids (at least one) in order of first appearance
    (`first_occurrences` over the ids' range: their first positions into `firsts`,
    each id's rank into `ranks`), the gradient rows of each summed from zeros in order
    (`segment_sum_rows`, into the first rows of `sums`), then `sparse_adagrad` of
    those sums at those rows. Returns -1; or, having changed no variable, the rank of
    the first distinct id out of range, or -2 when the ids span `max_span` values or
    more (for numpy's ways)."""
    low, high = bounds(ids)
    if high - low >= max_span:
        return -2
    distinct = first_occurrences(ids, low, high - low + 1, firsts, ranks)
    summed = sums[:distinct]
    if segment_sum_rows(summed, ranks, grad) >= 0:  # (never: every rank is in range)
        return -2
    return sparse_adagrad(var, accum, lr, summed, ids[firsts[:distinct]], update_slots, one)


# Below this magnitude an id, and an id less a constant, converts to float64 exactly,
# and its product by a divisor's float reciprocal is within 1 / (2 * divisor) of the
# true quotient (two roundings of relative error 2**-53 each): the product's floor is
# the quotient's, or, when the quotient is a whole number, one less. Never more: the
# next whole number is at least 1 / divisor away.
_HALF_EXACT = 1 << 50


@numba.njit(inline="always")
def _floor_divide(a: Any, divisor: Any, reciprocal: float) -> tuple[Any, Any]:  # pragma: no cover
    """numpy's `floor_divide` and `remainder` (TensorFlow's FloorDiv and FloorMod) of
    int64 |a| < 2**51 by a positive `divisor`, `reciprocal` its float64 1 / divisor:
    the float quotient (a multiplication where the CPU's integer division takes ~15
    cycles, and one that vectorizes), one more when its floor is one short."""
    quotient = np.int64(np.floor(np.float64(a) * reciprocal))
    remainder = a - quotient * divisor
    if remainder >= divisor:
        return quotient + 1, remainder - divisor
    return quotient, remainder


@numba.njit(inline="always")
def _below_half_exact(ids: np.ndarray, constant: Any, other_constant: Any) -> bool:  # pragma: no cover
    """Whether every id and both constants are in (-2**50, 2**50): ids less a
    constant are then in (-2**51, 2**51), where `_floor_divide` is exact."""
    if not (-_HALF_EXACT < constant < _HALF_EXACT and -_HALF_EXACT < other_constant < _HALF_EXACT):
        return False
    for i in range(ids.size):  # noqa: SIM110 (a loop numba compiles; not a generator)
        if not -_HALF_EXACT < ids[i] < _HALF_EXACT:
            return False
    return True


_IDS = types.Array(types.int64, 1, "C", readonly=True)
_SHARDS = types.Array(types.int32, 1, "C")


@numba.njit(types.void(_IDS, *[types.int64] * 7, _SHARDS, _INT64S), **_OPTIONS)
def split_ids_by_blocks(
    ids: np.ndarray,
    block_rows: int,
    extras: int,
    block_rows_again: int,
    extras_again: int,
    rows: int,
    rows_again: int,
    extras_bound: int,
    shards: np.ndarray,
    rows_in_shard: np.ndarray,
) -> None:  # pragma: no cover
    """An embedding lookup's ids split by shard the "div" way (shards of consecutive
    rows, the first `extras` one row longer), as TensorFlow's graph writes it, from its
    constants in the order its nodes take them (positive divisors, checked by the
    caller): each id's shard, max(id // block_rows, (id - extras) // rows), as int32
    (numpy's cast: the low 32 bits) into `shards`, and its row there into
    `rows_in_shard`: id % block_rows_again when that shard is below `extras_bound`,
    else (id - extras_again) % rows_again. The bits of the nodes' numpy calls."""
    if not _below_half_exact(ids, extras, extras_again):
        for i in range(ids.size):
            a = ids[i]
            shard = max(a // block_rows, (a - extras) // rows)
            shards[i] = np.int32(shard)
            in_block, beyond = a % block_rows_again, (a - extras_again) % rows_again
            rows_in_shard[i] = in_block if shard < extras_bound else beyond
        return
    to_block = 1.0 / block_rows
    to_block_again = 1.0 / block_rows_again
    to_rows = 1.0 / rows
    to_rows_again = 1.0 / rows_again
    for i in range(ids.size):
        a = ids[i]
        shard = max(_floor_divide(a, block_rows, to_block)[0], _floor_divide(a - extras, rows, to_rows)[0])
        shards[i] = np.int32(shard)
        # (both rows, then one: a select, which vectorizes)
        in_block = _floor_divide(a, block_rows_again, to_block_again)[1]
        beyond = _floor_divide(a - extras_again, rows_again, to_rows_again)[1]
        rows_in_shard[i] = in_block if shard < extras_bound else beyond


@numba.njit(types.void(_IDS, types.int64, types.int64, _SHARDS, _INT64S), **_OPTIONS)
def split_ids_by_remainder(
    ids: np.ndarray, count: int, count_again: int, shards: np.ndarray, rows_in_shard: np.ndarray
) -> None:  # pragma: no cover
    """An embedding lookup's ids split by shard the "mod" way (id i in shard i % count,
    row i // count there), from the graph's two constants (positive, checked by the
    caller): id % count as int32 (the low 32 bits) into `shards`, id // count_again
    into `rows_in_shard`. The bits of the nodes' numpy calls."""
    if not _below_half_exact(ids, 0, 0):
        for i in range(ids.size):
            shards[i] = np.int32(ids[i] % count)
            rows_in_shard[i] = ids[i] // count_again
        return
    to_count = 1.0 / count
    to_count_again = 1.0 / count_again
    for i in range(ids.size):
        a = ids[i]
        shards[i] = np.int32(_floor_divide(a, count, to_count)[1])
        rows_in_shard[i] = _floor_divide(a, count_again, to_count_again)[0]


@numba.njit(_signatures("CODE", "WW"), **_OPTIONS)
def elementwise_program(code: np.ndarray, rows: np.ndarray) -> None:  # pragma: no cover
    """Run `code`'s operations in order (`region_plans`' codes), each over every element
    of its rows (a region's element-wise parts). Each is numpy's operation in the rows' dtype:
    `RSQRT` is 1 / sqrt(a) with `b` a row of ones, as `Rsqrt`'s kernel divides; a
    comparison writes 1 or 0; `SELECT` takes `b` where `a` is not 0, else `c`."""
    n = rows.shape[1]
    for k in range(code.shape[0]):
        op = code[k, 0]
        out = rows[code[k, 1]]
        a = rows[code[k, 2]]
        b = rows[code[k, 3]]
        c = rows[code[k, 4]]
        if op == COPY:
            for i in range(n):
                out[i] = a[i]
        elif op == ADD:
            for i in range(n):
                out[i] = a[i] + b[i]
        elif op == SUB:
            for i in range(n):
                out[i] = a[i] - b[i]
        elif op == MUL:
            for i in range(n):
                out[i] = a[i] * b[i]
        elif op == DIV:
            for i in range(n):
                out[i] = a[i] / b[i]
        elif op == NEG:
            for i in range(n):
                out[i] = -a[i]
        elif op == SQUARE:
            for i in range(n):
                out[i] = a[i] * a[i]
        elif op == SQRT:
            for i in range(n):
                out[i] = np.sqrt(a[i])
        elif op == RSQRT:
            for i in range(n):
                out[i] = b[i] / np.sqrt(a[i])
        elif op == ABS:
            for i in range(n):
                out[i] = abs(a[i])
        elif op == GREATER:
            for i in range(n):
                out[i] = 1 if a[i] > b[i] else 0
        elif op == GREATER_EQUAL:
            for i in range(n):
                out[i] = 1 if a[i] >= b[i] else 0
        elif op == LESS:
            for i in range(n):
                out[i] = 1 if a[i] < b[i] else 0
        elif op == LESS_EQUAL:
            for i in range(n):
                out[i] = 1 if a[i] <= b[i] else 0
        elif op == EQUAL:
            for i in range(n):
                out[i] = 1 if a[i] == b[i] else 0
        elif op == NOT_EQUAL:
            for i in range(n):
                out[i] = 1 if a[i] != b[i] else 0
        elif op == SELECT:
            for i in range(n):
                out[i] = b[i] if a[i] != 0 else c[i]
        else:  # SQUARED_DIFFERENCE
            for i in range(n):
                d = a[i] - b[i]
                out[i] = d * d
