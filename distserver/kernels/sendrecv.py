"""`_Send` and `_Recv`: the ends of every edge that leaves a partition.

The master inserts them when it splits a step's graph (and for client feeds and
fetches); their attrs name the sending and receiving devices, the sender's
incarnation and the tensor, which together make the rendezvous key.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import TYPE_CHECKING, Any

import numpy as np

from distserver.devices import RendezvousKey
from distserver.kernels.registry import CARRIES_DEADNESS, DEAD, KernelContext, OpKernel, register_kernel

if TYPE_CHECKING:
    from distserver.protos.node_def_pb2 import NodeDef


# A `_Recv` marked with this attr waits for a value delivered to this task's
# rendezvous instead of fetching it (see `distserver.runtime.push`).
RECV_PUSHED_ATTR = "_recv_pushed"

# A `_Recv` marked with this attr is in a partition whose step may run the nodes that
# need no receive, then wait for all its receives, then run the rest: no receive
# waits, through other tasks, for a node after that wait (see
# `distserver.runtime.plan.mark_receives_first`).
RECEIVES_FIRST_ATTR = "_receives_first"

# What a dead value travels as (RecvTensor's `is_dead` says it is dead; TensorFlow
# sends an empty tensor too).
_DEAD_PAYLOAD = np.zeros(0, np.float32)


class _SendRecvKernel(OpKernel):
    # Both run on the event loop: the rendezvous is loop-bound.
    runs_on_loop = True
    loop_bound = True
    is_stateful = True

    def __init__(self, node: NodeDef) -> None:
        super().__init__(node)
        # Parsed once, here: the rendezvous and the transports take the value as is.
        self.key = RendezvousKey(
            self.attr_str("send_device"),
            self.attr_int("send_device_incarnation"),
            self.attr_str("recv_device"),
            self.attr_str("tensor_name"),
        )
        self.client_terminated = self.attr_bool("client_terminated", False)

    def key_in(self, ctx: KernelContext) -> RendezvousKey:
        """The key of this run: inside a loop it names the frame and the iteration."""
        frame_iter = ctx.frame_iter
        if frame_iter is None:
            return self.key
        return dataclasses.replace(self.key, frame_id=frame_iter[0], iter_id=frame_iter[1], text="")


@register_kernel("_Send", "_HostSend")
class SendKernel(_SendRecvKernel):
    # Synchronous (no task per send) but never sent to the thread pool.
    dead_inputs = CARRIES_DEADNESS

    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        if inputs[0] is DEAD:
            ctx.rendezvous.send(self.key_in(ctx), _DEAD_PAYLOAD, is_dead=True)
        else:
            ctx.rendezvous.send(self.key_in(ctx), inputs[0])
        return []


@register_kernel("_Recv", "_HostRecv")
class RecvKernel(_SendRecvKernel):
    is_async = True
    may_output_dead = True  # the sender's value may be dead
    # Runs even when what it waits on is dead (only loops give a `_Recv` inputs): the
    # sender sends in every iteration, dead or not, and each value must be taken.
    dead_inputs = CARRIES_DEADNESS

    def __init__(self, node: NodeDef) -> None:
        super().__init__(node)
        # Set by the planner when the sender's RunGraph response brings the value
        # (the push protocol, `distserver.runtime.push`).
        self.pushed = self.attr_bool(RECV_PUSHED_ATTR, False)
        self.may_wait_first = self.attr_bool(RECEIVES_FIRST_ATTR, False)

    def receive(self, ctx: KernelContext) -> asyncio.Future[tuple[Any, bool]]:
        """The (value, is_dead) this node receives, as a future the caller owns: the
        executor waits on it without a task of its own."""
        if self.pushed:
            return ctx.rendezvous.recv_local_soon(self.key)
        # A partition the planner marked waits for all its receives before it uses any
        # (`may_wait_first`), so their values may come together.
        return ctx.rendezvous.recv_soon(self.key_in(ctx), together=self.may_wait_first)

    async def compute_async(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        value, is_dead = await self.receive(ctx)
        return [DEAD if is_dead else value]
