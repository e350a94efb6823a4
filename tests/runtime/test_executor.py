"""The executor, on its own: what a step keeps alive while it runs."""

from __future__ import annotations

import concurrent.futures
import tracemalloc

import numpy as np
import pytest

import distserver as ds
from distserver.kernels.resources import ResourceManager
from distserver.runtime.executor import Executor, StepContext
from distserver.runtime.rendezvous import StepRendezvous

TASK = "/job:localhost/replica:0/task:0"
DEVICE = f"{TASK}/device:CPU:0"
MiB = 1 << 20


def _chain(length: int, elements: int) -> ds.Graph:
    """fill -> negative x length -> a reduction, the tensor `elements` float32 long."""
    with ds.Graph().as_default() as graph:
        x = ds.fill([elements], np.float32(1.0))
        for _ in range(length):
            x = ds.negative(x)
        ds.reduce_sum(x, name="total")
    return graph


@pytest.mark.parametrize("offload", [True, False], ids=["thread-pool", "inline"])
async def test_a_chain_holds_a_few_intermediates_not_one_per_node(offload):
    nbytes = 4 * MiB
    executor = Executor(_chain(40, nbytes // 4).as_graph_def())
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        ctx = StepContext(
            step_id=1,
            device=DEVICE,
            device_incarnation=1,
            rendezvous=StepRendezvous(1, TASK, None),
            resources=ResourceManager(),
            pool=pool if offload else None,
        )
        tracemalloc.start()
        try:
            await executor.run(ctx)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    # Kept: the node running, its input and perhaps the one just produced. Keeping
    # every output until the step ends would be 41 tensors.
    assert peak < 6 * nbytes, f"peak {peak / MiB:.0f} MiB for a chain of 4 MiB tensors"
