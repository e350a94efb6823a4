"""Process-wide setup shared by distserver's processes and threads: the event loop,
dying with the parent process, and a quiet exit on Ctrl-C.

Every distserver process (`distserver serve`, the conformance peer, benchmarks) and the
facade's loop thread get their event loop from `new_event_loop`, so they all run on
uvloop when it is installed, and on asyncio's loop otherwise.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import signal
import sys
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

_uvloop: Any
try:
    import uvloop as _uvloop
except ImportError:  # optional: asyncio's own loop works, more slowly
    _uvloop = None

T = TypeVar("T")

_PR_SET_PDEATHSIG = 1
PARENT_PID_ENV = "DISTSERVER_PARENT_PID"


def new_event_loop() -> asyncio.AbstractEventLoop:
    """A new event loop: uvloop's when installed, else asyncio's."""
    if _uvloop is None:
        return asyncio.new_event_loop()
    loop: asyncio.AbstractEventLoop = _uvloop.new_event_loop()
    return loop


def run(coro: Coroutine[Any, Any, T]) -> T:
    """`asyncio.run(coro)` on a loop from `new_event_loop`."""
    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        return runner.run(coro)


def managed_by_parent() -> bool:
    """Whether the process that started this one manages it (`DISTSERVER_PARENT_PID`):
    see `die_with_parent`. Such a task leaves SIGINT to that parent (`distserver
    serve`): a terminal's Ctrl-C reaches the whole foreground process group, and the
    parent stops its tasks (SIGTERM) once it is done with them, instead of finding
    them gone while it still uses them."""
    return bool(os.environ.get(PARENT_PID_ENV))


def die_with_parent() -> None:
    """Die (SIGKILL) when the process that started this one dies, if it asked to.

    A parent that wants this sets `DISTSERVER_PARENT_PID` to its pid in the child's
    environment (`LocalCluster` and the conformance suite do): a crashed test or
    benchmark then leaves no server behind. Linux only (PR_SET_PDEATHSIG); elsewhere
    a no-op. Called by the child itself: a `preexec_fn` would make Popen fork, which
    breaks gRPC.
    """
    parent = os.environ.get(PARENT_PID_ENV)
    if not parent or not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        return
    if os.getppid() != int(parent):  # the parent died before prctl took effect
        os.kill(os.getpid(), signal.SIGKILL)


INTERRUPTED_EXIT_STATUS = 130  # what a shell reports for a command ended by SIGINT


def exit_quietly_on_interrupt(main: Callable[[], T]) -> T:
    """Run `main()`; on Ctrl-C print one line and exit with status 130, without a traceback.

    For programs (the `distserver` command, the examples) whose Ctrl-C would otherwise
    print a traceback from wherever the main thread was waiting, then asyncio's "Future
    exception was never retrieved" for the calls the interrupt left unanswered. The
    `with` blocks `main` was in have been left (a `LocalCluster` has stopped its tasks)
    when this exits. The exit is immediate (`os._exit`): threads still running a call
    are not waited for, and a second Ctrl-C cannot interrupt the clean-up.

    Python raises the KeyboardInterrupt in whatever the main thread runs: in a
    finalizer (`__del__`, a weakref callback) it is printed and swallowed, and `main`
    goes on, to fail on the tasks the same Ctrl-C stopped (a terminal's Ctrl-C reaches
    the whole process group). So the interrupt is also noted by the handler itself, and
    any error `main` ends with after one counts as the interrupt.
    """
    interrupted = False

    def note_interrupt(signum: int, frame: Any) -> None:
        nonlocal interrupted
        interrupted = True
        raise KeyboardInterrupt

    def quiet_about_interrupts(unraisable: Any) -> None:  # (the swallowed ones)
        if not issubclass(unraisable.exc_type, KeyboardInterrupt):
            unraisable_hook(unraisable)

    # Only in place of Python's own handler (not where SIGINT is ignored or handled).
    noting = signal.getsignal(signal.SIGINT) is signal.default_int_handler
    unraisable_hook = sys.unraisablehook
    if noting:
        signal.signal(signal.SIGINT, note_interrupt)
        sys.unraisablehook = quiet_about_interrupts
    try:
        return main()
    except BaseException as exc:
        if not isinstance(exc, KeyboardInterrupt) and not interrupted:
            raise
        logging.getLogger("asyncio").setLevel(logging.CRITICAL)
        try:
            sys.stdout.flush()
        except (OSError, ValueError):
            pass
        print("\ninterrupted", file=sys.stderr, flush=True)
        os._exit(INTERRUPTED_EXIT_STATUS)
    finally:
        if noting:
            signal.signal(signal.SIGINT, signal.default_int_handler)
            sys.unraisablehook = unraisable_hook
