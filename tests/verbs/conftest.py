"""Fixtures for the verbs tests: peer processes, in-process queue pairs, leak probes."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest

from distserver.transports import verbs

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
PEER_SCRIPT = HERE / "verbs_peer.py"


def _load_peer_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("verbs_peer", PEER_SCRIPT)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


peer = _load_peer_module()


class PeerProcess:
    """A `verbs_peer.py` subprocess; its stdout carries JSON lines, its stdin closing means "exit"."""

    def __init__(self, mode: str, args: dict[str, Any]) -> None:
        self._stderr = tempfile.TemporaryFile()  # noqa: SIM115 - lives as long as the process; see close()
        env = dict(os.environ)
        env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
        self.proc = subprocess.Popen(
            [sys.executable, str(PEER_SCRIPT), mode, json.dumps(args)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            env=env,
        )
        assert self.proc.stdout is not None
        self._stdout_fd = self.proc.stdout.fileno()
        os.set_blocking(self._stdout_fd, False)
        self._buffer = b""

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stderr_text(self) -> str:
        self._stderr.seek(0)
        return self._stderr.read().decode(errors="replace")

    def _take_line(self) -> dict[str, Any] | None:
        line, sep, rest = self._buffer.partition(b"\n")
        if not sep:
            return None
        self._buffer = rest
        return dict(json.loads(line))

    def _read_chunk(self) -> None:
        try:
            chunk = os.read(self._stdout_fd, 65536)
        except BlockingIOError:
            return
        if not chunk:
            raise AssertionError(f"the peer exited early (rc={self.proc.poll()}):\n{self.stderr_text()}")
        self._buffer += chunk

    async def read_json(self, timeout: float = 60.0) -> dict[str, Any]:
        """The next JSON line, read without blocking the event loop."""
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(timeout):
            while (line := self._take_line()) is None:
                readable: asyncio.Future[None] = loop.create_future()
                loop.add_reader(self._stdout_fd, _resolve, readable)
                try:
                    await readable
                finally:
                    loop.remove_reader(self._stdout_fd)
                self._read_chunk()
        return line

    def read_json_blocking(self, timeout: float = 60.0) -> dict[str, Any]:
        """The next JSON line, blocking the caller (tests that stall their own loop on purpose)."""
        while (line := self._take_line()) is None:
            ready, _, _ = select.select([self._stdout_fd], [], [], timeout)
            assert ready, f"no line from the peer within {timeout} s:\n{self.stderr_text()}"
            self._read_chunk()
        return line

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)

    def close(self) -> None:
        if self.proc.poll() is None and self.proc.stdin is not None:
            self.proc.stdin.close()  # "exit", in the peer's words
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.kill()
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self.proc.wait(timeout=30)
        self._stderr.close()


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


@pytest.fixture
def spawn_peer() -> Iterator[Callable[..., PeerProcess]]:
    peers: list[PeerProcess] = []

    def spawn(mode: str, **args: Any) -> PeerProcess:
        process = PeerProcess(mode, args)
        peers.append(process)
        return process

    yield spawn
    for process in peers:
        process.close()


@pytest.fixture
async def pd() -> AsyncIterator[verbs.ProtectionDomain]:
    async with verbs.ProtectionDomain() as domain:
        yield domain


@pytest.fixture
async def qp_pair() -> AsyncIterator[tuple[verbs.QueuePair, verbs.QueuePair]]:
    """Two connected queue pairs in this process (two protection domains, real sockets)."""
    async with verbs.ProtectionDomain() as pd_a, verbs.ProtectionDomain() as pd_b:
        listener = await verbs.listen(pd_a)
        connecting = asyncio.ensure_future(verbs.connect(pd_b, listener.address))
        qa = await listener.accept()
        qb = await connecting
        await listener.close()
        yield qa, qb


# -- leak probes --------------------------------------------------------------------


def fd_table() -> dict[int, str]:
    """fd -> what it points at, for this process."""
    table = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            table[int(name)] = os.readlink(f"/proc/self/fd/{name}")
        except FileNotFoundError:  # the directory's own fd, already closed
            pass
    return table


def new_fds(before: dict[int, str]) -> dict[int, str]:
    """fds opened since `before` that are verbs resources (memfds, eventfds, sockets)."""
    after = fd_table()
    return {
        fd: target
        for fd, target in after.items()
        if before.get(fd) != target
        and ("memfd:" in target or "eventfd" in target or target.startswith("socket:"))
    }


def verbs_mappings(pid: int | None = None) -> list[str]:
    """Lines of /proc/self/maps that map verbs memfds (of process `pid`, or of anyone)."""
    needle = f"distserver-verbs-{pid}-" if pid is not None else "distserver-verbs-"
    with open("/proc/self/maps") as maps:
        return [line.strip() for line in maps if needle in line]


def shm_entries() -> set[str]:
    return set(os.listdir("/dev/shm"))


async def poll_until(
    condition: Callable[[], bool], *, timeout: float = 10.0, what: str = "condition"
) -> None:
    """Wait for `condition()` to hold, checking every 10 ms, for at most `timeout` seconds."""
    for _ in range(int(timeout / 0.01)):
        if condition():
            return
        await asyncio.sleep(0.01)
    assert condition(), f"timed out waiting for {what}"


@pytest.fixture
def probes() -> SimpleNamespace:
    """The leak probes and polling helper, for tests (conftest modules are not importable)."""
    return SimpleNamespace(
        fd_table=fd_table,
        new_fds=new_fds,
        verbs_mappings=verbs_mappings,
        shm_entries=shm_entries,
        poll_until=poll_until,
    )


@pytest.fixture
def make_array() -> Callable[[dict[str, Any]], Any]:
    """`verbs_peer.make_array`: the tensor a JSON spec names, as the peer builds it."""
    return peer.make_array  # type: ignore[no-any-return]
