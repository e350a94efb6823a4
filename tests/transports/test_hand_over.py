"""`TensorHandOver`: a value fetched once can be asked for a second time, briefly."""

from __future__ import annotations

import asyncio

import numpy as np

from distserver.protos.worker_pb2 import RecvTensorRequest
from distserver.transports.base import TensorHandOver


async def test_a_parked_value_is_handed_out_once_then_the_worker_is_asked_again():
    calls = []

    async def fetch(request):
        calls.append(request.rendezvous_key)
        return np.float32(len(calls)), False

    hand_over = TensorHandOver(fetch)
    request = RecvTensorRequest(step_id=7, rendezvous_key="k")
    value, is_dead = await hand_over(request)
    hand_over.park(request, value, is_dead)
    assert await hand_over.fetch(request) == (1.0, False)  # from the parking, not the worker
    assert calls == ["k"]
    assert await hand_over.fetch(request) == (2.0, False)  # parked values are taken once
    assert calls == ["k", "k"]
    other_step = RecvTensorRequest(step_id=8, rendezvous_key="k")
    hand_over.park(request, np.float32(9), True)
    assert await hand_over.fetch(other_step) == (3.0, False)  # keyed by step and key


async def test_a_value_nobody_asks_for_is_dropped_after_a_while():
    async def fetch(request):
        return np.float32(0), False

    hand_over = TensorHandOver(fetch)
    hand_over.PARKED_SECONDS = 0.05
    request = RecvTensorRequest(step_id=1, rendezvous_key="k")
    hand_over.park(request, np.zeros(1 << 20, np.float32), False)
    await asyncio.sleep(0.2)
    assert not hand_over._parked  # the receiver is gone: its value is not kept


def test_of_reuses_an_existing_hand_over():
    async def fetch(request):
        return np.float32(0), False

    hand_over = TensorHandOver(fetch)
    assert TensorHandOver.of(hand_over) is hand_over
    assert TensorHandOver.of(fetch) is not hand_over
