"""A region's element-wise parts as compiled passes (`ElementwisePlan`), for the
inputs it last took.

A region (`regions.FusedRegionKernel`) of small element-wise parts pays a numpy call
for each: a logistic loss and its gradient over 256 values is twenty-one parts,
~45 us hot and ~95 us in a step, nearly all of it the calls. Once a region has run
its parts on inputs of some dtypes and shapes, `ElementwisePlan.build` looks at what
each part made there:

* a part of a simple op (`_OPERATIONS`: arithmetic, comparisons, selects, sums, a
  squeeze) whose operands have its own shape or one element, in one float dtype (its
  flags: bool), becomes an operation of `_loops.elementwise_program`; each run of
  such parts is one call of it over a table with a row for each value (a flag as 0
  or 1; a row is given back after its value's last reader, as the region lets its
  values go), each operation numpy's in that dtype, so the same bits;
* a part whose kernel's value is a numpy ufunc of its inputs in that dtype (Exp,
  Log1p, Tanh, Maximum, ...) calls that ufunc over the rows (`out=` its own row);
* any other part (a reshape by a shape the region reads, an op of other dtypes)
  runs its own kernel on its inputs in their shapes, as the region would.

Later inputs of the same dtypes and shapes run by the plan: the logistic loss takes
two compiled passes with its exponential and log1p between them, ~15 us hot. A part
run by its kernel that makes a value of another dtype or shape than it did (a
reshape by a new shape) ends the plan's call, and the region runs its parts. Only
regions whose values have at most `MAX_ELEMENTS` elements, and six or more parts in
passes, get a plan: there the calls are the cost, and a row for every value is
small.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from distserver.kernels import _compiled
from distserver.kernels._common import quiet
from distserver.kernels.registry import OpKernel
from distserver.protos.node_def_pb2 import NodeDef

# Values of more elements take the parts' calls (each a small share of its work).
MAX_ELEMENTS = 1 << 14
# A plan needs this many parts in compiled passes: it copies its inputs into its rows,
# which costs about what a few calls do (a `small` step's region of four parts over
# 2,048 values: 12.2 us hot as parts, 11.6 planned).
MIN_COMPILED_PARTS = 6

_BOOL = np.dtype(np.bool_)

# The operations of `_loops.elementwise_program`, each a row of its code: (operation,
# result, a, b, c), each a row of its table (the values, a flag as 0 or 1).
COPY, ADD, SUB, MUL, DIV, NEG, SQUARE, SQRT, RSQRT, ABS = range(10)
GREATER, GREATER_EQUAL, LESS, LESS_EQUAL, EQUAL, NOT_EQUAL, SELECT, SQUARED_DIFFERENCE = range(10, 18)

# The ops of one operation, on values of the program's dtype.
_ARITHMETIC = {
    "Add": ADD,
    "AddV2": ADD,
    "Sub": SUB,
    "Mul": MUL,
    "RealDiv": DIV,
    "SquaredDifference": SQUARED_DIFFERENCE,
    "Neg": NEG,
    "Square": SQUARE,
    "Sqrt": SQRT,
    "Abs": ABS,
}
# ... that make flags.
_COMPARISONS = {
    "Greater": GREATER,
    "GreaterEqual": GREATER_EQUAL,
    "Less": LESS,
    "LessEqual": LESS_EQUAL,
    "Equal": EQUAL,
    "NotEqual": NOT_EQUAL,
}
# Ops whose value is another's (a squeeze keeps the elements in order), or a fill.
_COPIES = frozenset({"Squeeze"})
_FILLS = frozenset({"ZerosLike", "OnesLike"})
_OTHERS = frozenset({"Select", "SelectV2", "AddN", "Reciprocal", "Rsqrt"})
_OPERATIONS = frozenset(_ARITHMETIC) | frozenset(_COMPARISONS) | _COPIES | _FILLS | _OTHERS


def may_plan(parts: Sequence[NodeDef]) -> bool:
    """Whether a region of `parts` has enough parts of `_OPERATIONS` for a plan."""
    return sum(part.op in _OPERATIONS for part in parts) >= MIN_COMPILED_PARTS


Signature = tuple[tuple[Any, Any, Any], ...]
# A value's dtype and shape; None for what is not an array.
Made = tuple[np.dtype[Any], tuple[int, ...]] | None


def signature(inputs: Sequence[Any]) -> Signature:
    """What a plan is made for: each input's type, dtype and shape."""
    return tuple((type(v), getattr(v, "dtype", None), getattr(v, "shape", None)) for v in inputs)


def made(value: Any) -> Made:
    """What a plan knows of a value a region took or made (`Made`)."""
    return (value.dtype, value.shape) if type(value) is np.ndarray else None


class ElementwisePlan:
    """A region's parts as compiled passes and kernel calls, for inputs of one
    `signature` (see the module docstring)."""

    def __init__(
        self,
        made_for: Signature,
        dtype: np.dtype[Any],
        table: tuple[int, int],
        rows: dict[int, int],
        fills: list[tuple[int, float]],
        inputs_to_rows: list[tuple[int, int]],
        steps: list[tuple[Any, ...]],
        outputs: list[int],
        made: list[Made],
    ) -> None:
        self.made_for = made_for
        self._dtype = dtype
        self._table = table  # its rows, and the values' elements
        self._elements = table[1]
        self._rows = rows  # value place -> its row, while the value lives
        self._fills = fills  # (row, value): the rows of zeros and ones
        self._inputs_to_rows = inputs_to_rows  # (input place, row)
        self._steps = steps
        self._outputs = outputs
        self._made = made  # each place's dtype and shape, as the parts made them
        self.largest = max(m[0].itemsize * math.prod(m[1]) for m in made if m is not None)

    @staticmethod
    def build(
        made_for: Signature,
        parts: Sequence[NodeDef],
        steps: Sequence[tuple[OpKernel, Any, Sequence[int]]],
        outputs: Sequence[int],
        made: Sequence[Made],
    ) -> ElementwisePlan | None:
        """The plan for a region whose parts made values like `made` (its inputs', then
        each part's, in place order) from inputs of `made_for`; None when it has none
        (see the module docstring). `steps[p]`: part p's kernel, its compute and the
        places it reads; `outputs`: the places of the region's outputs."""
        count = len(made_for)
        if any(m is None for m in made[count:]):
            return None
        floats = {m[0] for m in made if m is not None and m[0] in _compiled.DTYPES}
        if len(floats) != 1:
            return None
        (dtype,) = floats
        elements = max(math.prod(m[1]) for m in made[count:] if m is not None)
        if elements > MAX_ELEMENTS:
            return None

        def fits(place: int) -> bool:  # a value a row holds
            value = made[place]
            return value is not None and value[0] in (dtype, _BOOL) and math.prod(value[1]) in (1, elements)

        # What runs each part: "pass" (an operation of a compiled pass), "ufunc" (its
        # kernel's numpy function, over rows), or "part" (its kernel).
        kinds = []
        for p, (part, (kernel, _, sources)) in enumerate(zip(parts, steps, strict=True)):
            operands = [made[s] for s in sources]
            if not all(map(fits, (*sources, count + p))):
                kinds.append("part")
            elif part.op in _OPERATIONS and _compiles(part.op, operands, made[count + p], dtype):  # type: ignore[arg-type]
                kinds.append("pass")
            elif _ufunc(kernel, dtype) and _compiles("", operands, made[count + p], dtype):  # type: ignore[arg-type]
                kinds.append("ufunc")
            else:
                kinds.append("part")
        if kinds.count("pass") < MIN_COMPILED_PARTS:
            return None
        # Rows: each value a pass or a ufunc reads or makes (a value a part's kernel
        # makes that one of them reads is written to its row), and the fills. A row is
        # taken when its value is made (the fills' and the inputs' first) and given back
        # after its last reader, if it is no output: the table stays a few rows deep.
        needs = {
            place for p, kind in enumerate(kinds) if kind != "part" for place in (*steps[p][2], count + p)
        }
        last_read = {source: p for p, (_, _, sources) in enumerate(steps) for source in sources}
        kept = set(outputs)
        free: list[int] = []
        depth = 0

        def take() -> int:
            nonlocal depth
            if free:
                return free.pop()
            depth += 1
            return depth - 1

        fills = {value: take() for value in _fills_read(parts, kinds)}
        rows = {place: take() for place in sorted(needs) if place < count}
        inputs_to_rows = list(rows.items())
        plan_steps: list[tuple[Any, ...]] = []
        code: list[tuple[int, ...]] = []
        for p, (part, (kernel, compute, sources), kind) in enumerate(zip(parts, steps, kinds, strict=True)):
            place = count + p
            if place in needs:
                rows[place] = take()
            if kind == "pass":
                code += _operations(part.op, rows, sources, rows[place], fills)
            else:
                if code:
                    plan_steps.append(("pass", _code(code)))
                    code = []
                if kind == "ufunc":
                    ufunc = quiet(kernel.fn)  # type: ignore[attr-defined]
                    plan_steps.append(("ufunc", ufunc, [rows[s] for s in sources], rows[place], place))
                else:
                    plan_steps.append(("part", compute, tuple(sources), made[place], rows.get(place), place))
            for done in {*sources, place}:
                if done in rows and done not in kept and last_read.get(done, -1) <= p:
                    free.append(rows[done])
        if code:
            plan_steps.append(("pass", _code(code)))
        return ElementwisePlan(
            made_for,
            dtype,
            (depth, elements),
            rows,
            [(row, value) for value, row in fills.items()],
            inputs_to_rows,
            plan_steps,
            list(outputs),
            list(made),
        )

    def run(self, ctx: Any, inputs: Sequence[Any]) -> list[Any] | None:
        """The region's outputs for `inputs` (of the plan's `made_for`), or None when a
        part run by its kernel made a value unlike the one it made before."""
        loops = _compiled.loops()
        if loops is None:
            return None
        table = np.empty(self._table, self._dtype)
        for row, value in self._fills:
            table[row] = value
        for place, row in self._inputs_to_rows:
            table[row] = inputs[place].reshape(-1)
        values: dict[int, Any] = {}
        for step in self._steps:
            if step[0] == "pass":
                loops.elementwise_program(step[1], table)
                continue
            if step[0] == "ufunc":
                _, ufunc, operands, out, _ = step
                ufunc(*[table[row] for row in operands], out=table[out])
                continue
            _, compute, sources, (dtype, shape), row, place = step
            args = [self._value(table, inputs, values, source) for source in sources]
            (value,) = compute(ctx, args)
            if type(value) is not np.ndarray or value.dtype != dtype or value.shape != shape:
                return None
            values[place] = value
            if row is not None:
                table[row] = value.reshape(-1)
        return [self._value(table, inputs, values, place, copy=True) for place in self._outputs]

    def _value(
        self, table: np.ndarray, inputs: Sequence[Any], values: dict[int, Any], place: int, copy: bool = False
    ) -> Any:
        """The value at `place`: an input, a part kernel's value, or a row in the shape
        and dtype the parts made it (with `copy`, a value that holds no one's memory: it
        leaves the region, and must not keep the table)."""
        if place < len(inputs):
            return inputs[place]
        value = values.get(place)
        if value is not None:  # (a view a kernel made, of the table perhaps: copied to go out)
            return value.copy() if copy and not value.flags.owndata else value
        dtype, shape = self._made[place]  # type: ignore[misc]
        row = table[self._rows[place]]
        if math.prod(shape) != self._elements:
            row = row[:1]
        if dtype == _BOOL:
            return (row != 0).reshape(shape)
        return (row.copy() if copy else row).reshape(shape)


def _ufunc(kernel: OpKernel, dtype: np.dtype[Any]) -> bool:
    """Whether `kernel` computes its value with a numpy ufunc of its inputs, in `dtype`
    (`math._ElementwiseKernel`'s `fn`: Exp, Log1p, Tanh, Maximum, ...)."""
    fn = getattr(kernel, "fn", None)
    return (
        isinstance(fn, np.ufunc)
        and fn.nout == 1
        and getattr(kernel, "dtype", None) == dtype
        and getattr(kernel, "out_dtype", None) == dtype
        and getattr(kernel, "work_dtype", None) == dtype
    )


def _compiles(
    op: str, operands: Sequence[tuple[np.dtype[Any], tuple[int, ...]]], result: Any, dtype: np.dtype[Any]
) -> bool:
    """Whether a part of `op` that read arrays like `operands` and made one like
    `result` runs as operations of the program (or, `op` "", as its ufunc over rows):
    its operands of the dtypes it takes there (a comparison makes flags, a select reads
    one), each of its value's shape or of one element (a squeeze: any shape)."""
    kind, shape = result
    if op in _COMPARISONS:
        expected, makes = [dtype, dtype], _BOOL
    elif op in ("Select", "SelectV2"):
        expected, makes = [_BOOL, dtype, dtype], dtype
    elif op in _FILLS or op in _COPIES:
        expected, makes = [dtype], dtype
    else:
        expected, makes = [dtype] * len(operands), dtype
    if [operand[0] for operand in operands] != expected or kind != makes:
        return False
    return op in _COPIES or all(s == shape or math.prod(s) == 1 for _, s in operands)


def _operations(
    op: str, rows: dict[int, int], sources: Sequence[int], out: int, fills: dict[float, int]
) -> list[tuple[int, ...]]:
    """A compiled part's operations in the program: (operation, result, a, b, c) rows."""
    operands = [rows[s] for s in sources]
    a, b, c = (*operands, out, out, out)[:3]
    if op in _ARITHMETIC:
        return [(_ARITHMETIC[op], out, a, b, c)]
    if op in _COMPARISONS:
        return [(_COMPARISONS[op], out, a, b, c)]
    if op in ("Select", "SelectV2"):
        return [(SELECT, out, a, b, c)]
    if op in _COPIES:
        return [(COPY, out, operands[0], out, out)]
    if op in _FILLS:
        return [(COPY, out, fills[0.0 if op == "ZerosLike" else 1.0], out, out)]
    if op == "Reciprocal":  # (1 / x: `_reciprocal`)
        return [(DIV, out, fills[1.0], operands[0], out)]
    if op == "Rsqrt":  # (1 / sqrt(x): `_rsqrt`)
        return [(RSQRT, out, operands[0], fills[1.0], out)]
    # AddN: the first, then each other added in turn (`AddNKernel`)
    return [(COPY, out, operands[0], out, out), *((ADD, out, out, other, out) for other in operands[1:])]


def _fills_read(parts: Sequence[NodeDef], kinds: Sequence[str]) -> list[float]:
    """The constant rows the passes read: zeros, ones."""
    ops = {part.op for part, kind in zip(parts, kinds, strict=True) if kind == "pass"}
    return [
        value
        for value, readers in ((0.0, {"ZerosLike"}), (1.0, {"OnesLike", "Reciprocal", "Rsqrt"}))
        if ops & readers
    ]


def _code(code: list[tuple[int, ...]]) -> np.ndarray:
    array = np.array(code, np.int64).reshape(-1, 5)
    array.flags.writeable = False
    return array


__all__ = ["MAX_ELEMENTS", "ElementwisePlan", "may_plan", "signature"]
