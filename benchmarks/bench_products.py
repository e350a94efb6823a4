"""A large matrix product three ways: one BLAS thread, one thread with the intra-op
helper's split into two row blocks (`kernels/_intra_op.py`), and OpenBLAS's own
threads on every usable CPU (`distserver._blas`): what `distserver serve` chooses
between for a task that shares its host and one that is alone on it.

The products are a dense layer's, 256x784 @ 784x512 (the training benchmark's `mlp`),
each through the MatMul kernel's `_matmul`; the best of `--rounds` blocks of
`--calls` calls is reported (after a warm-up block), and each way's result is
compared bit for bit with one thread's.

    .venv/bin/python benchmarks/bench_products.py [--calls 200] [--rounds 5]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import numpy as np

from distserver._blas import set_blas_threads
from distserver._cpus import usable_cpus
from distserver.kernels import _intra_op
from distserver.kernels.math import _matmul

BATCH, INPUTS, UNITS = 256, 784, 512


def best_us(call: Callable[[], object], calls: int, rounds: int) -> float:
    for _ in range(calls // 10 + 1):
        call()
    times = []
    for _ in range(rounds):
        started = time.perf_counter()
        for _ in range(calls):
            call()
        times.append((time.perf_counter() - started) / calls * 1e6)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    if args.calls < 1 or args.rounds < 1:
        parser.error("--calls and --rounds must be at least 1")
    rng = np.random.default_rng(0)
    x = rng.standard_normal((BATCH, INPUTS), dtype=np.float32)
    w = rng.standard_normal((INPUTS, UNITS), dtype=np.float32)
    g = rng.standard_normal((BATCH, UNITS), dtype=np.float32)
    products = {
        "x @ w (forward)": (x, w),
        "x.T @ g (weights' gradient)": (x.T, g),
        "g @ w.T (input's gradient)": (g, w.T),
    }
    cpus = usable_cpus()
    ways = {
        "one BLAS thread": (1, False),
        "one thread + split": (1, True),
        f"{cpus} BLAS threads": (cpus, False),
    }
    results: dict[str, dict[str, float]] = {}
    answers: dict[str, list[np.ndarray]] = {}
    for way, (threads, split) in ways.items():
        if not set_blas_threads(threads):
            raise SystemExit("bench_products: numpy's BLAS is not OpenBLAS; nothing to set")
        if split:
            _intra_op.enable()
        try:
            for name, (lhs, rhs) in products.items():
                results.setdefault(name, {})[way] = best_us(
                    lambda lhs=lhs, rhs=rhs: _matmul(lhs, rhs), args.calls, args.rounds
                )
                answers.setdefault(name, []).append(_matmul(lhs, rhs))
        finally:
            _intra_op.disable()
    print(
        f"{BATCH}x{INPUTS}x{UNITS} float32 products, best of {args.rounds} x {args.calls} calls, "
        f"{cpus} usable CPUs\n"
    )
    print("| product | " + " | ".join(ways) + " |")
    print("|---|" + "---:|" * len(ways))
    for name, by_way in results.items():
        first, *others = answers[name]
        marks = [""] + ["" if np.array_equal(first, other) else " (other bits)" for other in others]
        cells = " | ".join(f"{by_way[way]:,.0f} us{mark}" for way, mark in zip(ways, marks, strict=True))
        print(f"| {name} | {cells} |")
    print("\n(other bits): not bit for bit what one BLAS thread computes")


if __name__ == "__main__":
    main()
