"""Regions run by their element-wise plans against their parts (`kernels/region_plans.py`).

    .venv/bin/python benchmarks/bench_region_plans.py [--workload embedding] [--blocks 30] [--steps 40]

In one process, on a one-task server (distserver's own client, the workloads of
`bench_training.py`: `distserver/bench/ds_side.py`):

1. the step, in blocks of steps with the plans on and off, paired (each pair's two
   blocks back to back, in alternating order): the host's slow spells fall on both
   sides of a pair, so the paired difference is steadier than two medians apart;
2. each planned region's call, hot, on the inputs of its last call in a step: by its
   plan, then by its parts.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import distserver as ds
from distserver.bench import ds_side
from distserver.kernels import _compiled
from distserver.kernels.regions import FUSED_REGION_OP, FusedRegionKernel


def _microseconds(call: Callable[[], Any], repeat: int = 2000) -> float:
    for _ in range(repeat // 10):
        call()
    started = time.perf_counter()
    for _ in range(repeat):
        call()
    return (time.perf_counter() - started) / repeat * 1e6


def _planned_regions(server: ds.Server) -> list[FusedRegionKernel]:
    worker = server.async_server.worker
    assert worker is not None
    return [
        node.kernel
        for session in worker._sessions.values()
        for executor in session.graphs.values()
        for node in executor._nodes
        if node.kernel.op == FUSED_REGION_OP and node.kernel._may_plan  # type: ignore[attr-defined]
    ]


def run(workload: str, blocks: int, steps: int) -> dict[str, Any]:
    """The figures (see the module docstring), also printed."""
    if not _compiled.wait(300):
        raise SystemExit("no compiled loops (pip install -e '.[compiled]'): nothing to compare")
    server = ds.Server.create_local_server()
    trainer = ds_side.prepare(server.target, workload, "one", 50)
    try:
        regions = _planned_regions(server)
        planned = [region for region in regions if region._plan is not None]
        print(f"{workload}: {len(planned)} of {len(regions)} regions that may plan have a plan")
        if not planned:
            return {"regions": []}
        by_way: dict[bool, list[float]] = {True: [], False: []}
        for block in range(blocks):
            for on in (True, False) if block % 2 else (False, True):
                for region in regions:
                    region._may_plan = on
                by_way[on].append(statistics.median(trainer.block(steps)["times"]) * 1e3)
        for region in regions:
            region._may_plan = True
        differences = [(a - b) * 1e3 for a, b in zip(by_way[True], by_way[False], strict=True)]
        step = {
            "plans_ms": statistics.median(by_way[True]),
            "parts_ms": statistics.median(by_way[False]),
            "paired_difference_us": statistics.median(differences),
            "pairs_faster": sum(d < 0 for d in differences),
            "pairs": len(differences),
        }
        print(
            f"step (median of {blocks} blocks of {steps}): plans {step['plans_ms']:.3f} ms, "
            f"parts {step['parts_ms']:.3f} ms; paired difference {step['paired_difference_us']:+.1f} us, "
            f"plans faster in {step['pairs_faster']} of {step['pairs']} pairs"
        )
        return {"step": step, "regions": [_region_figures(region, trainer) for region in planned]}
    finally:
        trainer.close()
        server.stop()


def _region_figures(region: FusedRegionKernel, trainer: Any) -> dict[str, Any]:
    """The region's call, hot, by its plan and by its parts, on its inputs in a step."""
    plan = region._plan
    assert plan is not None
    taken: list[list[Any]] = []
    run = plan.run

    def recording(ctx: Any, inputs: list[Any]) -> Any:
        taken.append(list(inputs))
        return run(ctx, inputs)

    plan.run = recording  # type: ignore[method-assign]
    try:
        trainer.block(1)
    finally:
        del plan.run
    inputs = taken[-1]
    planned_us = _microseconds(lambda: region.compute(None, inputs))
    region._may_plan = False
    try:
        parts_us = _microseconds(lambda: region.compute(None, inputs))
    finally:
        region._may_plan = True
    kinds = [step[0] for step in plan._steps]
    figures = {"name": region.name, "parts": len(region.parts), "steps": kinds}
    figures |= {"plan_us": planned_us, "parts_us": parts_us}
    print(
        f"  {region.name}: {len(region.parts)} parts as {kinds}; hot {parts_us:.1f} us by its parts, "
        f"{planned_us:.1f} us by its plan"
    )
    return figures


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="embedding", choices=ds_side.train_side.WORKLOADS)
    parser.add_argument("--blocks", type=int, default=30, help="pairs of blocks (30)")
    parser.add_argument("--steps", type=int, default=40, help="steps a block (40)")
    args = parser.parse_args(argv)
    run(args.workload, args.blocks, args.steps)


if __name__ == "__main__":
    main()
