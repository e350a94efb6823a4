"""Per-step hand-off of tensors between `_Send` and `_Recv` nodes.

Each step of each worker has one `StepRendezvous`, created on first use by
whichever comes first: the step's RunGraph, or a RecvTensor from another task
(which may arrive before this task has even started the step). Keys are
parsed rendezvous keys (`distserver.devices.RendezvousKey`), indexed by their
text. A key is sent once and received once per step; either may come first.

A value whose key names a device of another task is fetched from that task with
RecvTensor (`fetch_remote`); everything else is local.

A step that is not running here is never kept for long: one created by a receive
that no RunGraph claims, a finished one whose values another task never fetched,
and a failed one nobody cleans up are dropped after `idle_seconds` (their pending
receivers get `AbortedError`). Failures are stored without their traceback, so a
failed step pins no request or feed.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from distserver import errors
from distserver.devices import RendezvousKey

# (step_id, key, together) -> (value, is_dead): fetch one value from its sending task
# (`key.src_task`); a future (which the receiver may cancel), or a coroutine, which is
# made a task. `together`: see `StepRendezvous.recv_soon`.
RemoteFetch = Callable[[int, RendezvousKey, bool], Awaitable[tuple[Any, bool]]]


class StepRendezvous:
    """The tensors of one step on one worker."""

    def __init__(self, step_id: int, local_task: str, fetch_remote: RemoteFetch | None) -> None:
        self.step_id = step_id
        self.running = False  # a RunGraph of this step runs here now
        self.expiry: asyncio.TimerHandle | None = None
        self._local_task = local_task
        self._fetch_remote = fetch_remote
        self._slots: dict[str, asyncio.Future[tuple[Any, bool]]] = {}
        self._error: errors.OpError | None = None
        # Keys whose destination is another task; those of them handed over (in a
        # RunGraph response, or served by RecvTensor); whether the RunGraph finished.
        self._for_others: set[str] = set()
        self._handed_over: set[str] = set()
        self.finished = False
        # Key text -> the futures of `wait_for_any` calls waiting for it (some perhaps
        # done already: they are let go of as their keys are sent).
        self._watchers: dict[str, list[asyncio.Future[None]]] = {}

    def _slot(self, key: RendezvousKey) -> asyncio.Future[tuple[Any, bool]]:
        slot = self._slots.get(key.text)
        if slot is None:
            slot = asyncio.get_running_loop().create_future()
            if self._error is not None:
                slot.set_exception(self._error)
            elif key.text in self._handed_over:
                slot.set_exception(
                    errors.InternalError(
                        f"{key.text} was already received in step {self.step_id}: a value is received once"
                    )
                )
                slot.exception()  # (a send of it fails on its own: no receiver needs to see this)
            self._slots[key.text] = slot
            if key.dst_task != self._local_task:
                self._for_others.add(key.text)
        return slot

    def send(self, key: RendezvousKey, value: Any, is_dead: bool = False) -> None:
        """Deliver a value. Sending the same key twice in one step is an error."""
        slot = self._slot(key)
        if slot.done():
            if self._error is not None:
                raise self._error
            raise errors.InternalError(f"Send of an already sent tensor in step {self.step_id}: {key.text}")
        slot.set_result((value, is_dead))
        if self._watchers:
            for woken in self._watchers.pop(key.text, ()):
                if not woken.done():
                    woken.set_result(None)

    async def recv(self, key: RendezvousKey) -> tuple[Any, bool]:
        """Wait for the value of `key`, fetching it from its task when that is remote."""
        return await self.recv_soon(key)

    def recv_soon(self, key: RendezvousKey, together: bool = False) -> asyncio.Future[tuple[Any, bool]]:
        """`recv` as a future the caller owns: cancelling it gives up this receive only.
        (The executor waits on it without a task of its own.) `together`: the
        receiver goes on only once all its receives are in, so a remote value may come
        together with the others (`BatchedReceiver.fetch_soon`)."""
        if key.src_task != self._local_task and self._fetch_remote is not None:
            if self._error is not None:
                failed: asyncio.Future[tuple[Any, bool]] = asyncio.get_running_loop().create_future()
                failed.set_exception(self._error)
                return failed
            return asyncio.ensure_future(self._fetch_remote(self.step_id, key, together))
        return self.recv_local_soon(key)

    async def recv_local(self, key: RendezvousKey) -> tuple[Any, bool]:
        """Wait for a value sent on this task (RecvTensor serves from here)."""
        return await self.recv_local_soon(key)

    def recv_local_soon(self, key: RendezvousKey) -> asyncio.Future[tuple[Any, bool]]:
        """`recv_local` as a future the caller owns."""
        # shield: a cancelled receiver must not cancel the slot another may wait on.
        return asyncio.shield(self._slot(key))

    def slots(self, keys: list[RendezvousKey]) -> list[asyncio.Future[tuple[Any, bool]]]:
        """The futures of values sent on this task, for waiting on many at once
        (`batched_recv.answer`, with `wait_for_any`); never cancel them."""
        return [self._slot(key) for key in keys]

    async def wait_for_any(self, keys: list[RendezvousKey]) -> None:
        """Until one of `keys`, none of whose `slots` is done yet, is sent here, or the
        step fails. One future waits for them all: `asyncio.wait` on their slots would
        have a callback scheduled for each slot a pass of sends fills (a worker's 60
        gradients: ~60 callbacks of ~0.6 us, for one wake-up)."""
        if self._error is not None:  # (then every slot is done)
            return
        woken: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        for key in keys:
            self._watchers.setdefault(key.text, []).append(woken)
        await woken

    def abort(self, error: errors.OpError) -> None:
        """Fail every pending and future receive of this step with (a copy of) `error`.

        The copy has no traceback: the raiser's frames (requests, feeds) stay free.
        """
        error = errors.from_status(error.error_code, error.message, node_name=error.node_name)
        if self._error is None:
            self._error = error
        for slot in self._slots.values():
            if not slot.done():
                slot.set_exception(error)
                # Nobody may be waiting; mark the exception as seen.
                slot.exception()
        for watching in self._watchers.values():
            for woken in watching:
                if not woken.done():
                    woken.set_result(None)
        self._watchers.clear()

    def pending_keys(self) -> list[str]:
        return [key for key, slot in self._slots.items() if not slot.done()]

    def hand_over(self, keys: set[str] | list[str]) -> None:
        """Record values another task has taken (returned in a response, or served), and
        let go of them: a value is received once, and a step that keeps holding what it
        sent keeps a variable's array shared (a ps sends its variables' values early in
        its step and updates them at the end, in place only when nothing holds them)."""
        self._handed_over.update(keys)
        for key in keys:
            self._slots.pop(key, None)

    def needed_elsewhere(self) -> bool:
        """True while another task may still ask for a value of this step from here.

        That is: some key is for a device of another task and was neither handed
        back in the RunGraph response nor served by RecvTensor yet.
        """
        return not self._for_others <= self._handed_over


# How long a step that is not running here is kept (see the module docstring).
IDLE_STEP_SECONDS = 60.0


class RendezvousTable:
    """The step rendezvous of one worker, by step id."""

    def __init__(
        self,
        local_task: str,
        fetch_remote: RemoteFetch | None = None,
        *,
        idle_seconds: float = IDLE_STEP_SECONDS,
    ) -> None:
        self._local_task = local_task
        self._fetch_remote = fetch_remote
        self._idle_seconds = idle_seconds
        self._steps: dict[int, StepRendezvous] = {}

    def find_or_create(self, step_id: int) -> StepRendezvous:
        """The step, made on first use by a receive or a pushed value (then kept only
        `idle_seconds` unless a RunGraph `start`s it)."""
        step = self._steps.get(step_id)
        if step is None:
            step = self._steps[step_id] = StepRendezvous(step_id, self._local_task, self._fetch_remote)
            self._drop_when_idle(step)
        return step

    def start(self, step_id: int) -> StepRendezvous:
        """The step, for its RunGraph: kept while it runs."""
        step = self._steps.get(step_id)
        if step is None:
            step = self._steps[step_id] = StepRendezvous(step_id, self._local_task, self._fetch_remote)
        step.running = True
        if step.expiry is not None:
            step.expiry.cancel()
            step.expiry = None
        return step

    def failed(self, step_id: int, error: errors.OpError) -> None:
        """The step's RunGraph failed: its receivers get `error`; the step goes when idle
        (or at CleanupGraph, whichever comes first)."""
        step = self._steps.get(step_id)
        if step is not None:
            step.abort(error)
            step.running = False
            self._drop_when_idle(step)

    def _drop_when_idle(self, step: StepRendezvous) -> None:
        if step.expiry is None:
            step.expiry = asyncio.get_running_loop().call_later(self._idle_seconds, self._drop_idle, step)

    def _drop_idle(self, step: StepRendezvous) -> None:
        step.expiry = None
        if step.running or self._steps.get(step.step_id) is not step:
            return
        del self._steps[step.step_id]
        step.abort(
            errors.AbortedError(
                f"Step {step.step_id} was dropped on {self._local_task}: no RunGraph ran it or fetched "
                f"its values within {self._idle_seconds:g} s (its master may have failed or restarted)"
            )
        )

    def release_if_done(self, step_id: int, returned: set[str]) -> bool:
        """Mark a step's RunGraph finished; drop the step unless another task still
        needs one of its values (then `served` drops it once they are all taken).

        Saves the CleanupGraph round trip for most steps; see `StepRendezvous.needed_elsewhere`.
        """
        step = self._steps.get(step_id)
        if step is None:
            return False
        step.finished = True
        step.running = False
        step.hand_over(returned)
        if self._release_if_unneeded(step):
            return True
        self._drop_when_idle(step)  # a receiver that never comes must not pin it
        return False

    def served(self, step_id: int, key: RendezvousKey) -> None:
        """RecvTensor handed `key` to another task; a finished step may be dropped now."""
        step = self._steps.get(step_id)
        if step is not None:
            step.hand_over([key.text])
            if step.finished:
                self._release_if_unneeded(step)

    def _release_if_unneeded(self, step: StepRendezvous) -> bool:
        if step.needed_elsewhere():
            return False
        self._drop(step.step_id)
        return True

    def _drop(self, step_id: int) -> StepRendezvous | None:
        step = self._steps.pop(step_id, None)
        if step is not None and step.expiry is not None:
            step.expiry.cancel()
            step.expiry = None
        return step

    def cleanup(self, step_id: int) -> None:
        """Drop a finished step; receivers still waiting on it are cancelled."""
        step = self._drop(step_id)
        if step is not None:
            step.abort(errors.CancelledError(f"Step {step_id} was cleaned up"))

    def abort_all(self, error: errors.OpError) -> None:
        for step_id in list(self._steps):
            step = self._drop(step_id)
            if step is not None:
                step.abort(error)

    def __len__(self) -> int:
        return len(self._steps)
