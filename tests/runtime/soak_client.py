"""One client process of the soak test (`test_soak.py`); not a test module itself.

Runs `--steps` steps, `--concurrency` at a time, each feeding a random-sized tensor
that crosses all three tasks, and checks every fetched value. Like TensorFlow's
MonitoredSession it makes a new session after an AbortedError or UnavailableError
(a task restarted). Prints one JSON line: steps that gave the right value, wrong
values, failures by class, and anything that was not an expected OpError.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import numpy as np

import distserver as ds
from distserver import errors

SIZES = [1, 16, 1024, 65536, 1 << 20]  # float32 elements: 4 B .. 4 MiB
EXPECTED_FAILURES = (
    errors.UnavailableError,
    errors.AbortedError,
    errors.CancelledError,
    errors.DeadlineExceededError,
)


def build_graph() -> tuple[ds.Graph, ds.Tensor, ds.Tensor]:
    with ds.Graph().as_default() as graph:
        with ds.device("/job:worker/task:1"):
            x = ds.placeholder(ds.float32, shape=[None], name="x")
            y = x * 2.0 + 1.0
        with ds.device("/job:ps/task:0"):
            total = ds.reduce_sum(y, name="total")
    return graph, x, total


async def run(target: str, steps: int, concurrency: int, seed: int, seconds: float) -> dict[str, object]:
    graph, x, total = build_graph()
    rng = np.random.default_rng(seed)
    options = ds.RunOptions(timeout_in_ms=10_000)
    report: dict[str, object] = {"ok": 0, "wrong": [], "failures": {}, "unexpected": []}
    failures: dict[str, int] = report["failures"]  # type: ignore[assignment]
    session = ds.AsyncSession(target, graph=graph)
    remaining = steps
    deadline = time.monotonic() + seconds

    async def one_step(session: ds.AsyncSession) -> None:
        size = int(rng.choice(SIZES))
        value = rng.integers(0, 8, size).astype(np.float32)
        expected = float(np.sum(value * 2 + 1, dtype=np.float64))  # exact: integers below 2**24
        got = await session.run(total, feed_dict={x: value}, options=options)
        if float(got) != expected:
            report["wrong"].append([size, float(got), expected])  # type: ignore[attr-defined]
        else:
            report["ok"] += 1  # type: ignore[operator]

    async def lane() -> None:
        nonlocal remaining, session
        while remaining > 0 and time.monotonic() < deadline:
            remaining -= 1
            current = session
            try:
                await one_step(current)
            except EXPECTED_FAILURES as exc:
                failures[type(exc).__name__] = failures.get(type(exc).__name__, 0) + 1
                if current is session:  # the first lane to see it makes the new session
                    session = ds.AsyncSession(target, graph=graph)
                    try:
                        await asyncio.wait_for(current.close(), 10)
                    except (errors.OpError, TimeoutError):
                        pass
            except Exception as exc:
                report["unexpected"].append(repr(exc)[:300])  # type: ignore[attr-defined]

    await asyncio.gather(*(lane() for _ in range(concurrency)))
    try:
        await asyncio.wait_for(session.close(), 10)
    except (errors.OpError, TimeoutError):
        pass
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--target", required=True)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--seconds", type=float, default=120.0, help="stop after this long, done or not")
    args = parser.parse_args()
    report = asyncio.run(run(args.target, args.steps, args.concurrency, args.seed, args.seconds))
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
