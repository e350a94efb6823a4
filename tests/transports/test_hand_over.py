"""`TensorHandOver`: a value fetched once can be asked for a second time, briefly."""

from __future__ import annotations

import asyncio

import numpy as np

from distserver.devices import RendezvousKey
from distserver.transports.grpc import TensorHandOver

SRC = "/job:ps/replica:0/task:0/device:CPU:0"
DST = "/job:worker/replica:0/task:0/device:CPU:0"
KEY = RendezvousKey(SRC, 1, DST, "k")


async def test_a_parked_value_is_handed_out_once_then_the_source_is_asked_again():
    calls = []

    async def source(step_id, key):
        calls.append((step_id, key.tensor_name))
        return np.float32(len(calls)), False

    hand_over = TensorHandOver(source)
    value, is_dead = await hand_over.fetch(7, KEY)
    hand_over.park(7, KEY, value, is_dead)
    assert await hand_over.fetch(7, KEY) == (1.0, False)  # from the parking, not the source
    assert calls == [(7, "k")]
    assert await hand_over.fetch(7, KEY) == (2.0, False)  # parked values are taken once
    assert calls == [(7, "k"), (7, "k")]
    hand_over.park(7, KEY, np.float32(9), True)
    assert await hand_over.fetch(8, KEY) == (3.0, False)  # keyed by step and key
    assert await hand_over.fetch(7, RendezvousKey(SRC, 1, DST, "other")) == (4.0, False)


async def test_a_value_nobody_asks_for_is_dropped_after_a_while():
    async def source(step_id, key):
        return np.float32(0), False

    hand_over = TensorHandOver(source)
    hand_over.PARKED_SECONDS = 0.05
    hand_over.park(1, KEY, np.zeros(1 << 20, np.float32), False)
    assert hand_over._parked
    # The receiver is gone: its value is not kept. A timer drops it; poll for that, bounded.
    async with asyncio.timeout(10):
        while hand_over._parked:  # noqa: ASYNC110 - the drop is a loop timer, no event to wait on
            await asyncio.sleep(0.01)
