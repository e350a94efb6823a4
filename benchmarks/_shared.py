"""The benchmarks' graphs, timing loop and /proc readers: `distserver.bench.timing`.

Kept under this name for `scripts/trace_step.py` and `scripts/ab_trees.py`.
"""

from distserver.bench.timing import *  # noqa: F403
