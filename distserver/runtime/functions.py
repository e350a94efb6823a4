"""Graph functions: FunctionDefs instantiated into graphs, and calls inlined into the graph.

Pure (no I/O, no asyncio). Two entry points:

* `instantiate(library, name, attrs)` turns one FunctionDef of a library into a
  `FunctionBody`: a GraphDef with an `_Arg` node per input, the body's nodes and a
  `_Retval` node per output. FunctionDef inputs name outputs by arg
  (`"node:output_arg:index"`); GraphDef inputs name them by flat position
  (`"node:k"`). The translation takes each op's output args from
  `op_signatures.json` (TensorFlow's OpDefs, `scripts/gen_op_signatures.py`), counting
  list args from the node's attrs (`number_attr`, `type_list_attr`). Attrs of the
  body that are placeholders (`"$T"`) take the call's values.
* `inline_functions(nodes, library)` replaces every call in a graph (`PartitionedCall`,
  `StatefulPartitionedCall`, a node whose op is a library function) by the callee's
  body, lowers `If`/`StatelessIf` and `Case`/`StatelessCase` to `Switch`/`Merge`
  with every branch inlined, and `While`/`StatelessWhile` to a control flow v1 loop
  (`Enter`, `Merge`, `LoopCond`, `Switch`, `NextIteration`, `Exit`) around the
  inlined `cond` and `body`, as TensorFlow does before placement, so a function's
  body, and a loop's, may span tasks.

A library comes from a client and is not trusted: nesting depth, recursion and the
number of nodes inlining makes are bounded, and every fault names the function and
node.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

from distserver import errors
from distserver.devices import DeviceSpec
from distserver.protos.attr_value_pb2 import AttrValue, NameAttrList
from distserver.protos.function_pb2 import FunctionDef, FunctionDefLibrary
from distserver.protos.graph_pb2 import GraphDef
from distserver.protos.node_def_pb2 import NodeDef
from distserver.protos.op_def_pb2 import OpDef
from distserver.protos.types_pb2 import DT_BOOL, DT_INT32, DataType

CALL_OPS = frozenset({"PartitionedCall", "StatefulPartitionedCall"})
IF_OPS = frozenset({"If", "StatelessIf"})
CASE_OPS = frozenset({"Case", "StatelessCase"})
WHILE_OPS = frozenset({"While", "StatelessWhile"})
INLINED_OPS = CALL_OPS | IF_OPS | CASE_OPS | WHILE_OPS
"""Ops that `inline_functions` rewrites away; they have no kernel of their own."""

MAX_NESTING = 32
"""Deepest chain of calls inside calls that is inlined."""
MAX_INLINED_NODES = 500_000
"""Most nodes a graph may have once its calls are inlined."""

_SIGNATURES = Path(__file__).with_name("op_signatures.json")


@cache
def op_signatures() -> dict[str, dict[str, list[list[str | int]]]]:
    """Op name -> {"inputs": [[arg, count]...], "outputs": [...]} (see op_signatures.json)."""
    table: dict[str, dict[str, list[list[str | int]]]] = json.loads(_SIGNATURES.read_text())
    return table


@dataclass
class FunctionBody:
    """One instantiation of a FunctionDef: its graph and where its args and results are."""

    name: str
    graph_def: GraphDef
    """`_Arg` nodes, the body, `_Retval` nodes; inputs in GraphDef syntax."""
    args: list[str]
    """The `_Arg` node of each input, in order."""
    retvals: list[str]
    """The `_Retval` node of each output, in order."""
    arg_types: list[DataType]
    ret_types: list[DataType]
    control_rets: list[str] = field(default_factory=list)
    """Nodes that must run whenever the function runs (side effects)."""


def index_library(library: FunctionDefLibrary | Iterable[FunctionDef]) -> dict[str, FunctionDef]:
    """Function name -> FunctionDef; a name defined twice differently is refused.

    Raises:
        InvalidArgumentError: a nameless function or two different definitions of a name.
    """
    functions = library.function if isinstance(library, FunctionDefLibrary) else library
    index: dict[str, FunctionDef] = {}
    for function in functions:
        name = function.signature.name
        if not name:
            raise errors.InvalidArgumentError("A FunctionDef in the graph's library has no name")
        if name in index and index[name] != function:
            raise errors.InvalidArgumentError(
                f"Cannot add function '{name}' because a different function with the same name "
                "already exists."
            )
        index[name] = function
    return index


def instantiate(
    library: Mapping[str, FunctionDef], name: str, attrs: Mapping[str, AttrValue]
) -> FunctionBody:
    """Instantiate function `name` of `library` with the call's `attrs`.

    Args:
        library: Function name -> FunctionDef (`index_library`).
        name: The function to instantiate.
        attrs: Values of the function's attrs (for placeholders such as `$T` in the
            body and for args typed by an attr); the signature's defaults fill gaps.

    Raises:
        NotFoundError: no function `name`.
        InvalidArgumentError: a malformed body (bad input reference, missing attr).
        UnimplementedError: a body node whose op distserver does not know.
    """
    function = library.get(name)
    if function is None:
        raise errors.NotFoundError(f"Function '{name}' is not defined in the graph's function library")
    signature = function.signature
    values = {attr.name: attr.default_value for attr in signature.attr if attr.HasField("default_value")}
    values.update(attrs)

    graph = GraphDef()
    body_names = {node.name for node in function.node_def}
    arg_nodes: dict[str, str] = {}
    arg_types: list[DataType] = []
    for index, arg in enumerate(signature.input_arg):
        dtype = _arg_type(arg, values, name)
        if arg.name in body_names:
            raise errors.InvalidArgumentError(f"Function '{name}': input '{arg.name}' is also a node's name")
        node = graph.node.add(name=arg.name, op="_Arg")
        node.attr["T"].type = dtype
        node.attr["index"].i = index
        arg_nodes[arg.name] = arg.name
        arg_types.append(dtype)

    outputs: dict[str, dict[str, tuple[int, int]]] = {}
    for body_node in function.node_def:
        node = graph.node.add()
        node.CopyFrom(body_node)
        for key in list(node.attr):
            _substitute(node.attr[key], values, name, node.name)
        outputs[node.name] = _output_ranges(node, library, name)
    for node in graph.node[len(arg_nodes) :]:
        translated = [_translate_input(text, arg_nodes, outputs, name, node.name) for text in node.input]
        del node.input[:]
        node.input.extend(translated)

    retvals: list[str] = []
    ret_types: list[DataType] = []
    taken = body_names | set(arg_nodes)
    for index, arg in enumerate(signature.output_arg):
        dtype = _arg_type(arg, values, name)
        source = function.ret.get(arg.name)
        if source is None:
            raise errors.InvalidArgumentError(
                f"Function '{name}' does not say which tensor is its output '{arg.name}'"
            )
        node_name = _unique(f"{arg.name}_RetVal", taken)
        node = graph.node.add(name=node_name, op="_Retval")
        node.input.append(_translate_input(source, arg_nodes, outputs, name, node_name))
        node.attr["T"].type = dtype
        node.attr["index"].i = index
        retvals.append(node_name)
        ret_types.append(dtype)
    control_rets = []
    for output in signature.control_output:
        target = function.control_ret.get(output, output)
        if target not in body_names:
            raise errors.InvalidArgumentError(f"Function '{name}': control output '{output}' names no node")
        control_rets.append(target)
    return FunctionBody(
        name=name,
        graph_def=graph,
        args=list(arg_nodes.values()),
        retvals=retvals,
        arg_types=arg_types,
        ret_types=ret_types,
        control_rets=control_rets,
    )


def _unique(name: str, taken: set[str]) -> str:
    candidate, n = name, 0
    while candidate in taken:
        n += 1
        candidate = f"{name}_{n}"
    taken.add(candidate)
    return candidate


def _arg_type(arg: OpDef.ArgDef, values: Mapping[str, AttrValue], function: str) -> DataType:
    if arg.number_attr or arg.type_list_attr:
        raise errors.UnimplementedError(
            f"Function '{function}': list-valued argument '{arg.name}' is not supported; "
            "give the function one argument per tensor"
        )
    if arg.type_attr:
        value = values.get(arg.type_attr)
        if value is None or not value.type:
            raise errors.InvalidArgumentError(
                f"Function '{function}': attr '{arg.type_attr}' (the type of '{arg.name}') "
                "is not given by the call"
            )
        return value.type
    return arg.type


def _substitute(value: AttrValue, values: Mapping[str, AttrValue], function: str, node: str) -> None:
    """Replace a placeholder attr ("$T") by the call's value, in nested func attrs too."""
    if value.placeholder:
        replacement = values.get(value.placeholder)
        if replacement is None:
            raise errors.InvalidArgumentError(
                f"Function '{function}', node '{node}': attr placeholder '${value.placeholder}' "
                "is not given by the call"
            )
        value.CopyFrom(replacement)
        return
    funcs: list[NameAttrList] = []
    if value.HasField("func"):
        funcs.append(value.func)
    if value.HasField("list"):
        funcs.extend(value.list.func)
    for func in funcs:
        for key in list(func.attr):
            _substitute(func.attr[key], values, function, node)


def input_count(node: NodeDef) -> int | None:
    """How many inputs `node`'s op takes with its attrs (`op_signatures`), or None for
    an op the table does not list.

    Raises:
        errors.InvalidArgumentError: an attr that sizes an input is missing.
    """
    return _signature_count(node, "inputs")


def output_count(node: NodeDef) -> int | None:
    """How many outputs `node`'s op makes with its attrs, as `input_count`."""
    return _signature_count(node, "outputs")


def _signature_count(node: NodeDef, side: str) -> int | None:
    signature = op_signatures().get(node.op)
    if signature is None:
        return None
    return sum(_arg_count(spec, node, f"Operation '{node.name}'") for _, spec in signature[side])


def _arg_count(spec: str | int, node: NodeDef, where: str) -> int:
    """The count of an argument of `spec` (1, an int attr's name, or "list:" and a type
    list attr's name); `where` begins the error (what names `node`)."""
    if spec == 1:
        return 1
    assert isinstance(spec, str)
    attr = spec.removeprefix("list:")
    if attr not in node.attr:
        raise errors.InvalidArgumentError(f"{where}: attr '{attr}' is missing")
    return len(node.attr[attr].list.type) if spec.startswith("list:") else node.attr[attr].i


def _output_ranges(
    node: NodeDef, library: Mapping[str, FunctionDef], function: str
) -> dict[str, tuple[int, int]]:
    """Output arg name -> (first flat index, count) for `node`."""
    callee = library.get(node.op)
    if callee is not None:
        specs: list[tuple[str, str | int]] = [(arg.name, 1) for arg in callee.signature.output_arg]
    else:
        signature = op_signatures().get(node.op)
        if signature is None:
            raise errors.UnimplementedError(
                f"Function '{function}', node '{node.name}': op '{node.op}' is neither a function of the "
                "library nor an op distserver knows (docs/tf-compat.md lists the supported ops)"
            )
        specs = [(str(name), spec) for name, spec in signature["outputs"]]
    ranges: dict[str, tuple[int, int]] = {}
    start = 0
    for name, spec in specs:
        count = _arg_count(spec, node, f"Function '{function}', node '{node.name}'")
        ranges[name] = (start, count)
        start += count
    return ranges


def _translate_input(
    text: str,
    args: Mapping[str, str],
    outputs: Mapping[str, Mapping[str, tuple[int, int]]],
    function: str,
    node: str,
) -> str:
    """A FunctionDef input ("x", "n:out:2", "^n") in GraphDef syntax ("x:0", "n:5", "^n")."""
    if text.startswith("^"):
        target = text[1:]
        if target not in outputs and target not in args:
            raise errors.InvalidArgumentError(
                f"Function '{function}', node '{node}': control input '{text}' names no node"
            )
        return text
    parts = text.split(":")
    if len(parts) == 1:
        if text not in args:
            raise errors.InvalidArgumentError(
                f"Function '{function}', node '{node}': input '{text}' is not an argument of the function"
            )
        return f"{args[text]}:0"
    if parts[0] in args and len(parts) == 2 and parts[1] == "0":
        return f"{args[parts[0]]}:0"
    source = outputs.get(parts[0])
    if source is None or len(parts) > 3:
        raise errors.InvalidArgumentError(
            f"Function '{function}', node '{node}': input '{text}' names no node output"
        )
    arg = source.get(parts[1])
    if arg is None:
        raise errors.InvalidArgumentError(
            f"Function '{function}', node '{node}': input '{text}': "
            f"node '{parts[0]}' has no output '{parts[1]}'"
        )
    index = int(parts[2]) if len(parts) == 3 and parts[2].isdigit() else 0 if len(parts) == 2 else -1
    start, count = arg
    if not 0 <= index < count:
        raise errors.InvalidArgumentError(
            f"Function '{function}', node '{node}': input '{text}': output '{parts[1]}' has {count} tensors"
        )
    return f"{parts[0]}:{start + index}"


# --------------------------------------------------------------------------- inlining


def has_function_calls(nodes: Iterable[NodeDef], library: Mapping[str, FunctionDef]) -> bool:
    """Whether any node is a call `inline_functions` would rewrite."""
    return any(node.op in INLINED_OPS or node.op in library for node in nodes)


def inline_functions(nodes: Sequence[NodeDef], library: Mapping[str, FunctionDef]) -> list[NodeDef]:
    """`nodes` with every function call replaced by the callee's body (recursively).

    A call node `c` becomes: an `Identity` `c/<arg>` per input (waiting for the call's
    control inputs, as do the body's nodes without inputs), the body's nodes renamed
    `c/<node>`, and an `IdentityN` named `c` whose outputs are the function's results
    and whose control inputs are its control outputs, so `c:k` and `^c` keep meaning
    what they meant. A body node without a device gets the call's; a partial one is
    completed from the call's. `If`/`StatelessIf` become a `Switch` per input, both
    branches inlined, and a `Merge` per output.

    Raises:
        InvalidArgumentError: recursion, nesting deeper than MAX_NESTING, more than
            MAX_INLINED_NODES nodes, a call with the wrong number of inputs, and the
            faults `instantiate` finds.
        NotFoundError: a call of a function the library does not have.
    """
    inliner = _Inliner(library)
    out: list[NodeDef] = []
    inliner.expand(nodes, out, depth=0, stack=())
    return out


class _Inliner:
    def __init__(self, library: Mapping[str, FunctionDef]) -> None:
        self.library = library
        self.count = 0

    def emit(self, out: list[NodeDef], node: NodeDef) -> None:
        self.count += 1
        if self.count > MAX_INLINED_NODES:
            raise errors.InvalidArgumentError(
                f"Inlining the graph's functions makes more than {MAX_INLINED_NODES} nodes; "
                "the function library is too large (or calls itself through many functions)"
            )
        out.append(node)

    def expand(
        self, nodes: Iterable[NodeDef], out: list[NodeDef], depth: int, stack: tuple[str, ...]
    ) -> None:
        for node in nodes:
            if node.op in CALL_OPS:
                self.inline_call(node, node.attr["f"].func.name, node.attr["f"].func.attr, out, depth, stack)
            elif node.op in self.library:
                self.inline_call(node, node.op, node.attr, out, depth, stack)
            elif node.op in IF_OPS:
                self.lower_if(node, out, depth, stack)
            elif node.op in CASE_OPS:
                self.lower_case(node, out, depth, stack)
            elif node.op in WHILE_OPS:
                self.lower_while(node, out, depth, stack)
            else:
                self.emit(out, node)

    def instantiate_for(self, call: NodeDef, name: str, attrs: Mapping[str, AttrValue]) -> FunctionBody:
        """`instantiate`, its errors naming the node that calls the function."""
        try:
            return instantiate(self.library, name, attrs)
        except errors.OpError as error:
            raise type(error)(
                f"{error.message} (called by node '{call.name}')", node_name=call.name
            ) from None

    def inline_call(
        self,
        call: NodeDef,
        name: str,
        attrs: Mapping[str, AttrValue],
        out: list[NodeDef],
        depth: int,
        stack: tuple[str, ...],
    ) -> None:
        if not name:
            raise errors.InvalidArgumentError(f"Node '{call.name}' ({call.op}) names no function in attr 'f'")
        if name in stack:
            raise errors.InvalidArgumentError(
                f"Function '{name}' calls itself ({' -> '.join((*stack, name))}); "
                "recursive functions are not supported",
                node_name=call.name,
            )
        if depth >= MAX_NESTING:
            raise errors.InvalidArgumentError(
                f"Function calls nest deeper than {MAX_NESTING} ({' -> '.join(stack[:5])} -> ...)",
                node_name=call.name,
            )
        body = self.instantiate_for(call, name, attrs)
        data_inputs = [text for text in call.input if not text.startswith("^")]
        controls = [text for text in call.input if text.startswith("^")]
        if len(data_inputs) != len(body.args):
            raise errors.InvalidArgumentError(
                f"Node '{call.name}' calls function '{name}' with {len(data_inputs)} inputs; "
                f"it takes {len(body.args)}",
                node_name=call.name,
            )
        prefix = f"{call.name}/"
        caller_device = DeviceSpec.from_string(call.device) if call.device else None
        made: list[NodeDef] = []
        control_node = None
        if controls:
            control_node = NodeDef(name=f"{prefix}input_control_node", op="NoOp", device=call.device)
            control_node.input.extend(controls)
            made.append(control_node)
        arg_inputs = dict(zip(body.args, data_inputs, strict=True))
        retval_sources: list[str] = []
        for node in body.graph_def.node:
            if node.op == "_Retval":
                retval_sources.append(_prefixed(node.input[0], prefix))
                continue
            copy = NodeDef()
            if node.op == "_Arg":
                copy.name = prefix + node.name
                copy.op = "Identity"
                copy.device = call.device
                copy.input.append(arg_inputs[node.name])
                copy.attr["T"].CopyFrom(node.attr["T"])
            else:
                copy.CopyFrom(node)
                copy.name = prefix + node.name
                del copy.input[:]
                copy.input.extend(_prefixed(text, prefix) for text in node.input)
                copy.device = _merged_device(node.device, caller_device)
            if control_node is not None and (node.op == "_Arg" or not len(node.input)):
                copy.input.append(f"^{control_node.name}")
            made.append(copy)
        result = NodeDef(name=call.name, device=call.device)
        if body.ret_types:
            result.op = "IdentityN"
            result.input.extend(retval_sources)
            result.attr["T"].list.type.extend(body.ret_types)
        else:
            result.op = "NoOp"
        result.input.extend(f"^{prefix}{target}" for target in body.control_rets)
        made.append(result)
        self.expand(made, out, depth + 1, (*stack, name))

    def lower_if(self, node: NodeDef, out: list[NodeDef], depth: int, stack: tuple[str, ...]) -> None:
        data_inputs = [text for text in node.input if not text.startswith("^")]
        controls = [text for text in node.input if text.startswith("^")]
        if not data_inputs:
            raise errors.InvalidArgumentError(
                f"Node '{node.name}' ({node.op}) has no condition input", node_name=node.name
            )
        cond, args = data_inputs[0], data_inputs[1:]
        prefix = f"{node.name}/"
        device = node.device
        in_types = list(node.attr["Tin"].list.type)
        out_types = list(node.attr["Tout"].list.type)
        if len(in_types) != len(args):
            raise errors.InvalidArgumentError(
                f"Node '{node.name}' ({node.op}) has {len(args)} inputs besides the condition; "
                f"Tin lists {len(in_types)}",
                node_name=node.name,
            )
        lowering = _Lowering(node)
        made, add = lowering.nodes, lowering.add

        switch_pred = add("switch_pred", "Switch", [cond, cond, *controls], T=DT_BOOL)
        pivot_false = add("pivot_f", "Identity", [f"{switch_pred.name}:0"], T=DT_BOOL)
        pivot_true = add("pivot_t", "Identity", [f"{switch_pred.name}:1"], T=DT_BOOL)
        switches = [
            add(f"input_{i}", "Switch", [arg, cond], T=dtype)
            for i, (arg, dtype) in enumerate(zip(args, in_types, strict=True))
        ]
        branches = []
        for label, attr, port, pivot in (
            ("then", "then_branch", 1, pivot_true),
            ("else", "else_branch", 0, pivot_false),
        ):
            call = lowering.call(
                label,
                node.attr[attr].func,
                [f"{switch.name}:{port}" for switch in switches] + [f"^{pivot.name}"],
            )
            # Carries the branch's liveness, for control edges from the If.
            branches.append(add(f"{label}_done", "Identity", [f"{pivot.name}:0", f"^{call.name}"], T=DT_BOOL))
        executed = add("branch_executed", "Merge", [branch.name for branch in branches], T=DT_BOOL)
        executed.attr["N"].i = 2
        merges = []
        for i, dtype in enumerate(out_types):
            merge = add(f"output_{i}", "Merge", [f"{prefix}then:{i}", f"{prefix}else:{i}"], T=dtype)
            merge.attr["N"].i = 2
            merges.append(merge)
        result = NodeDef(name=node.name, op="IdentityN", device=device)
        result.input.extend([f"{merge.name}:0" for merge in merges] + [f"^{executed.name}"])
        result.attr["T"].list.type.extend(out_types)
        if not out_types:
            result.op = "NoOp"
            del result.attr["T"]
        made.append(result)
        # The branch calls are inlined at this depth: lowering is not a call of its own.
        self.expand(made, out, depth, stack)

    def lower_case(self, node: NodeDef, out: list[NodeDef], depth: int, stack: tuple[str, ...]) -> None:
        """`Case(branch_index, args)`: branch k runs when the index is k; an index out of
        range runs the last branch, as in TensorFlow. Each branch gets a predicate, a
        `Switch` per input on it and an inlined call; a `Merge` per output joins them."""
        data_inputs = [text for text in node.input if not text.startswith("^")]
        controls = [text for text in node.input if text.startswith("^")]
        branches = list(node.attr["branches"].list.func)
        if not data_inputs or not branches:
            raise errors.InvalidArgumentError(
                f"Node '{node.name}' ({node.op}) needs a branch index and at least one branch",
                node_name=node.name,
            )
        index, args = data_inputs[0], data_inputs[1:]
        in_types = list(node.attr["Tin"].list.type)
        out_types = list(node.attr["Tout"].list.type)
        if len(in_types) != len(args):
            raise errors.InvalidArgumentError(
                f"Node '{node.name}' ({node.op}) has {len(args)} inputs besides the index; "
                f"Tin lists {len(in_types)}",
                node_name=node.name,
            )
        prefix = f"{node.name}/"
        device = node.device
        lowering = _Lowering(node)
        made, add = lowering.nodes, lowering.add

        def constant(name: str, value: int) -> str:
            new = add(name, "Const", controls, dtype=DT_INT32)
            new.attr["value"].tensor.dtype = DT_INT32
            new.attr["value"].tensor.int_val.append(value)
            return new.name

        last = len(branches) - 1
        predicates = [
            add(f"is_{k}", "Equal", [index, constant(f"index_{k}", k)], T=DT_INT32).name for k in range(last)
        ]
        if last:
            at_least = add("at_least_0", "GreaterEqual", [index, constant("zero", 0)], T=DT_INT32)
            below = add("below_last", "Less", [index, constant("last", last)], T=DT_INT32)
            in_range = add("not_last", "LogicalAnd", [at_least.name, below.name])
            predicates.append(add(f"is_{last}", "LogicalNot", [in_range.name]).name)
        else:
            predicates.append(add("always", "Const", controls, dtype=DT_BOOL).name)
            made[-1].attr["value"].tensor.dtype = DT_BOOL
            made[-1].attr["value"].tensor.bool_val.append(True)
        done = []
        for k, (branch, predicate) in enumerate(zip(branches, predicates, strict=True)):
            switch_pred = add(f"switch_pred_{k}", "Switch", [predicate, predicate, *controls], T=DT_BOOL)
            pivot = add(f"pivot_{k}", "Identity", [f"{switch_pred.name}:1"], T=DT_BOOL)
            switches = [
                add(f"input_{k}_{i}", "Switch", [arg, predicate], T=dtype)
                for i, (arg, dtype) in enumerate(zip(args, in_types, strict=True))
            ]
            call = lowering.call(
                f"branch_{k}", branch, [f"{switch.name}:1" for switch in switches] + [f"^{pivot.name}"]
            )
            done.append(add(f"branch_{k}_done", "Identity", [f"{pivot.name}:0", f"^{call.name}"], T=DT_BOOL))
        executed = add("branch_executed", "Merge", [branch.name for branch in done], T=DT_BOOL)
        executed.attr["N"].i = len(done)
        merges = []
        for i, dtype in enumerate(out_types):
            merge = add(
                f"output_{i}", "Merge", [f"{prefix}branch_{k}:{i}" for k in range(len(branches))], T=dtype
            )
            merge.attr["N"].i = len(branches)
            merges.append(merge)
        result = NodeDef(name=node.name, op="IdentityN" if out_types else "NoOp", device=device)
        result.input.extend([f"{merge.name}:0" for merge in merges] + [f"^{executed.name}"])
        if out_types:
            result.attr["T"].list.type.extend(out_types)
        made.append(result)
        self.expand(made, out, depth, stack)

    def lower_while(self, node: NodeDef, out: list[NodeDef], depth: int, stack: tuple[str, ...]) -> None:
        """`While(loop variables)`: a v1 loop named after the node (its frame), with
        `parallel_iterations` iterations alive at most. Per loop variable k: `Enter` ->
        `Merge` (with `NextIteration`), `Switch` on the inlined `cond`'s result (through
        `ToBool` unless it is a bool), `Exit` on the false port, the `Identity` of the
        true port into the inlined `body`, whose result k feeds `NextIteration`. The
        body's control outputs (its side effects) come before the next iteration; the
        node's outputs and control edges are its `Exit`s'."""
        data_inputs = [text for text in node.input if not text.startswith("^")]
        controls = [text for text in node.input if text.startswith("^")]
        types = list(node.attr["T"].list.type)
        functions = {}
        for attr in ("cond", "body"):
            functions[attr] = node.attr[attr].func
            if not functions[attr].name:
                raise errors.InvalidArgumentError(
                    f"Node '{node.name}' ({node.op}) has no '{attr}' function", node_name=node.name
                )
        if not data_inputs or len(types) != len(data_inputs):
            raise errors.InvalidArgumentError(
                f"Node '{node.name}' ({node.op}) has {len(data_inputs)} loop variables; "
                f"its attr T lists {len(types)}",
                node_name=node.name,
            )
        parallel = node.attr["parallel_iterations"].i if "parallel_iterations" in node.attr else 10
        prefix = f"{node.name}/"
        device = node.device
        lowering = _Lowering(node)
        made, add = lowering.nodes, lowering.add

        def call(name: str, function: NameAttrList, inputs: Sequence[str]) -> str:
            return lowering.call(name, function, inputs, op="StatefulPartitionedCall").name

        merges = []
        for k, (value, dtype) in enumerate(zip(data_inputs, types, strict=True)):
            enter = add(f"enter_{k}", "Enter", [value, *controls], T=dtype)
            enter.attr["frame_name"].s = node.name.encode()
            enter.attr["is_constant"].b = False
            enter.attr["parallel_iterations"].i = parallel
            merge = add(f"merge_{k}", "Merge", [enter.name, f"{prefix}next_{k}"], T=dtype)
            merge.attr["N"].i = 2
            merges.append(merge.name)
        # The calls' nodes without inputs wait on their first argument: they run in
        # the loop's frame, once per iteration.
        predicate = f"{call('cond', functions['cond'], [*merges, f'^{merges[0]}'])}:0"
        cond_types, body_types = (
            list(self.instantiate_for(node, functions[attr].name, functions[attr].attr).ret_types)
            for attr in ("cond", "body")
        )
        if len(cond_types) != 1:
            raise errors.InvalidArgumentError(
                f"While cond '{functions['cond'].name}' returns {len(cond_types)} values; it must return one",
                node_name=node.name,
            )
        if body_types != types:
            raise errors.InvalidArgumentError(
                f"While body '{functions['body'].name}' does not return the loop variables' types "
                f"({len(types)} values)",
                node_name=node.name,
            )
        if cond_types[0] != DT_BOOL:
            predicate = add("to_bool", "ToBool", [predicate], T=cond_types[0]).name
        loop_cond = add("loop_cond", "LoopCond", [predicate])
        pivots = []
        exits = []
        for k, (merged, dtype) in enumerate(zip(merges, types, strict=True)):
            switch = add(f"switch_{k}", "Switch", [merged, loop_cond.name], T=dtype)
            exits.append(add(f"exit_{k}", "Exit", [f"{switch.name}:0"], T=dtype).name)
            pivots.append(add(f"body_in_{k}", "Identity", [f"{switch.name}:1"], T=dtype).name)
        body = call("body", functions["body"], [*pivots, f"^{pivots[0]}"])
        for k, dtype in enumerate(types):
            add(f"next_{k}", "NextIteration", [f"{body}:{k}"], T=dtype)
        result = NodeDef(name=node.name, op="IdentityN", device=device)
        result.input.extend(exits)
        result.attr["T"].list.type.extend(types)
        made.append(result)
        self.expand(made, out, depth, stack)


class _Lowering:
    """The nodes a lowered `If`, `Case` or `While` becomes: named under the node's name,
    on its device."""

    def __init__(self, node: NodeDef) -> None:
        self.prefix = f"{node.name}/"
        self.device = node.device
        self.nodes: list[NodeDef] = []

    def add(self, name: str, op: str, inputs: Sequence[str], **type_attrs: DataType) -> NodeDef:
        new = NodeDef(name=self.prefix + name, op=op, device=self.device)
        new.input.extend(inputs)
        for key, dtype in type_attrs.items():
            new.attr[key].type = dtype
        self.nodes.append(new)
        return new

    def call(
        self, name: str, function: NameAttrList, inputs: Sequence[str], op: str = "PartitionedCall"
    ) -> NodeDef:
        new = self.add(name, op, inputs)
        new.attr["f"].func.CopyFrom(function)
        return new


def _prefixed(text: str, prefix: str) -> str:
    return f"^{prefix}{text[1:]}" if text.startswith("^") else prefix + text


def _merged_device(device: str, caller: DeviceSpec | None) -> str:
    if caller is None:
        return device
    if not device:
        return caller.to_string()
    return caller.make_merged_spec(device).to_string()


def function_attrs(node: NodeDef) -> list[NameAttrList]:
    """The functions a node's attrs name (a loop's cond and body, a dataset's map function, ...)."""
    found = []
    for value in node.attr.values():
        if value.HasField("func"):
            found.append(value.func)
        elif value.HasField("list"):
            found.extend(value.list.func)
    return found


def runtime_functions(
    nodes: Iterable[NodeDef], library: Mapping[str, FunctionDef]
) -> dict[str, list[NodeDef]]:
    """The functions that nodes left after inlining call at run time (`MapDataset`'s
    function, `OneShotIterator`'s dataset factory, and those they call in turn), each
    instantiated and inlined: function name -> its nodes.

    The master runs it when a graph arrives, so that a body that is malformed or uses
    an op without a kernel is refused before any step.

    Raises:
        The errors of `instantiate` and `inline_functions`.
    """
    found: dict[str, list[NodeDef]] = {}
    pending = [function for node in nodes for function in function_attrs(node)]
    while pending:
        function = pending.pop()
        if function.name in found:
            continue
        body = instantiate(library, function.name, function.attr)
        found[function.name] = inline_functions(body.graph_def.node, library)
        pending.extend(called for node in found[function.name] for called in function_attrs(node))
    return found
