"""Write distserver/runtime/op_signatures.json: the input and output args of every op
distserver has a kernel for (and of the ops function inlining rewrites), from
TensorFlow's own OpDefs.

Usage (needs a TensorFlow install; the interop environment has one):
    python scripts/gen_op_signatures.py [--tf-python /path/to/python] [--check]

Each op maps to {"inputs": [...], "outputs": [...]}, each arg as [name, count], where
count is 1 for a single tensor, "N" (an int attr name, OpDef's number_attr) for that
many tensors, or "list:T" (a list(type) attr name, OpDef's type_list_attr) for one
tensor per listed type. `runtime/functions.py` uses it to turn a FunctionDef input
"node:output_arg:index" into the GraphDef input "node:flat_index";
tests/runtime/test_functions.py checks that it covers every registered kernel.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from distserver.kernels.math import DENSE_STACK_OP, FUSED_MATMUL_GRAD_OP, FUSED_MATMUL_OP  # noqa: E402
from distserver.kernels.regions import FUSED_REGION_OP  # noqa: E402
from distserver.kernels.registry import registered_ops  # noqa: E402
from distserver.kernels.sparse import DEDUPLICATED_SPARSE_UPDATE_OP  # noqa: E402
from distserver.kernels.state import GROUPED_READS_OP, GROUPED_UPDATES_OP  # noqa: E402
from distserver.runtime.functions import INLINED_OPS  # noqa: E402

TABLE = ROOT / "distserver" / "runtime" / "op_signatures.json"
DEFAULT_TF_PYTHON = ROOT.parent / "main" / ".tfenv" / "bin" / "python"
# distserver's own ops (TensorFlow has no OpDef for them), as the table writes them.
OWN_OPS = {
    FUSED_MATMUL_OP: {"inputs": [["a", 1], ["b", 1], ["bias", 1]], "outputs": [["product", 1]]},
    GROUPED_UPDATES_OP: {"inputs": [["inputs", "N"]], "outputs": []},
    GROUPED_READS_OP: {"inputs": [["resources", "N"]], "outputs": [["values", "N"]]},
    FUSED_MATMUL_GRAD_OP: {
        "inputs": [["a", 1], ["b", 1], ["axes", 1], ["shape", 1], ["h", 1], ["w", "N"]],
        "outputs": [["bias", 1], ["weights", 1], ["layer_input", "N"]],
    },
    DENSE_STACK_OP: {"inputs": [["inputs", "N"]], "outputs": [["outputs", "M"]]},
    FUSED_REGION_OP: {"inputs": [["inputs", "N"]], "outputs": [["outputs", "M"]]},
    DEDUPLICATED_SPARSE_UPDATE_OP: {
        "inputs": [
            [name, 1] for name in ("indices", "values", "var", "accum", "lr", "begin", "end", "strides")
        ],
        "outputs": [],
    },
}

# Runs in TensorFlow's interpreter: op names on stdin, JSON on stdout.
_DUMP = r"""
import json, sys
from tensorflow.python.framework import op_def_registry
def arg(a):
    if a.number_attr:
        return [a.name, a.number_attr]
    if a.type_list_attr:
        return [a.name, "list:" + a.type_list_attr]
    return [a.name, 1]
table, missing = {}, []
for name in json.load(sys.stdin):
    op = op_def_registry.get(name)
    if op is None:
        missing.append(name)
        continue
    table[name] = {"inputs": [arg(a) for a in op.input_arg], "outputs": [arg(a) for a in op.output_arg]}
json.dump({"table": table, "missing": missing}, sys.stdout)
"""


def build(tf_python: str) -> str:
    ops = sorted((set(registered_ops()) | INLINED_OPS) - set(OWN_OPS))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["TF_CPP_MIN_LOG_LEVEL"] = "3"
    done = subprocess.run(
        [tf_python, "-c", _DUMP], input=json.dumps(ops), capture_output=True, text=True, env=env, check=True
    )
    result = json.loads(done.stdout)
    if result["missing"]:
        raise SystemExit(f"TensorFlow has no OpDef for: {', '.join(result['missing'])}")
    table = result["table"] | OWN_OPS
    lines = [f"{json.dumps(name)}: {json.dumps(entry)}" for name, entry in sorted(table.items())]
    return "{\n" + ",\n".join(lines) + "\n}\n"  # one op a line: readable diffs


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tf-python", default=os.environ.get("DISTSERVER_TF_PYTHON", str(DEFAULT_TF_PYTHON)))
    parser.add_argument("--check", action="store_true", help="exit 1 if the checked-in table differs")
    args = parser.parse_args()
    text = build(args.tf_python)
    if args.check:
        if TABLE.read_text() != text:
            print(f"{TABLE} is out of date: run scripts/gen_op_signatures.py", file=sys.stderr)
            return 1
        return 0
    TABLE.write_text(text)
    print(f"wrote {TABLE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
