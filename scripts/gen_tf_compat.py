"""Write the list of supported ops into docs/tf-compat.md, from the kernel registry.

Usage:
    python scripts/gen_tf_compat.py          # rewrite the generated section in place
    python scripts/gen_tf_compat.py --check  # exit 1 if the doc and the registry differ

Only the part between the BEGIN/END markers is generated; tests/test_tf_compat_doc.py
checks that it lists exactly `distserver.kernels.registered_ops()`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from distserver.kernels.registry import _KERNELS, registered_ops  # noqa: E402

DOC = ROOT / "docs" / "tf-compat.md"
BEGIN = "<!-- BEGIN GENERATED OP LIST: scripts/gen_tf_compat.py -->"
END = "<!-- END GENERATED OP LIST -->"
GROUPS = {
    "array": "Arrays, shapes, slicing, gathering",
    "math": "Math (element-wise, reductions, matmul, casts)",
    "nn": "Neural networks and gradients",
    "random": "Random numbers",
    "state": "Resource variables and optimizers",
    "ref_variables": "TF 1.x reference variables",
    "queue": "Queues",
    "accumulators": "Conditional accumulators (SyncReplicasOptimizer)",
    "functional": "Graph functions and loops (control flow v2)",
    "tensor_lists": "TensorLists (control flow v2 loops, TensorArrays, map_fn)",
    "stacks": "Stacks (control flow v1 loop gradients)",
    "tensor_arrays": "TensorArrays of control flow v1",
    "datasets": "tf.data datasets and iterators",
    "optionals": "Optionals (control flow v2 gradients)",
    "sendrecv": "Runtime (inserted by the master)",
    "regions": "Fused regions (made by the executor)",
}


def op_list() -> str:
    """The generated Markdown: one section per kernel module, ops sorted."""
    by_group: dict[str, list[str]] = {}
    for op in registered_ops():
        module = _KERNELS[op].__module__.rsplit(".", 1)[-1]
        by_group.setdefault(module, []).append(op)
    lines = [BEGIN, "", f"{len(registered_ops())} ops.", ""]
    for module, title in GROUPS.items():
        ops = by_group.pop(module, [])
        if ops:
            lines += [f"**{title}** ({len(ops)}): " + ", ".join(f"`{op}`" for op in ops), ""]
    for module, ops in sorted(by_group.items()):
        lines += [f"**{module}** ({len(ops)}): " + ", ".join(f"`{op}`" for op in ops), ""]
    lines.append(END)
    return "\n".join(lines)


def render(text: str) -> str:
    start, stop = text.index(BEGIN), text.index(END) + len(END)
    return text[:start] + op_list() + text[stop:]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if the doc is out of date")
    options = parser.parse_args()
    text = DOC.read_text()
    fresh = render(text)
    if options.check:
        if fresh != text:
            print("docs/tf-compat.md is out of date; run python scripts/gen_tf_compat.py")
            return 1
        print("docs/tf-compat.md lists every registered op")
        return 0
    DOC.write_text(fresh)
    print(f"wrote {DOC.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
