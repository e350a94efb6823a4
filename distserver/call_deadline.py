"""The deadline of the RPC being served, for handlers that wait on other tasks.

A transport that knows how long its caller will wait (gRPC sends it with every unary
call) records it with `set_from_timeout` in the task that runs the handler. A handler
that waits on other tasks (the master's ListDevices and CreateSession wait for every
task to come up) reads `time_left()` and gives up a little before its caller does, so
the caller gets the handler's own answer ("task X did not answer") instead of a bare
DeadlineExceededError. No I/O.
"""

from __future__ import annotations

import asyncio
import contextvars

# The event-loop time by which the caller of the RPC being served stops waiting.
_deadline: contextvars.ContextVar[float | None] = contextvars.ContextVar(
    "distserver_call_deadline", default=None
)
# How much sooner than its caller a handler gives up: a fifth of the time, at most one
# second, so that the answer has time to travel back.
_ANSWER_MARGIN_FRACTION = 0.2
_ANSWER_MARGIN_MAX = 1.0


def set_from_timeout(seconds: float | None) -> None:
    """Record that the caller of the current handler waits `seconds` more (None: forever)."""
    if seconds is None:
        return
    _deadline.set(asyncio.get_running_loop().time() + max(seconds, 0.0))


def time_left() -> float | None:
    """Seconds the current handler has to answer before its caller gives up; None: no deadline."""
    deadline = _deadline.get()
    if deadline is None:
        return None
    left = deadline - asyncio.get_running_loop().time()
    return max(left - min(left * _ANSWER_MARGIN_FRACTION, _ANSWER_MARGIN_MAX), 0.0)
