"""Interoperability tests: real TensorFlow clients, as separate processes, against distserver.

`tf_client` provides a Python with TensorFlow 2.21 (built once by `scripts/interop-setup`
into `.tfenv/`, or `$DISTSERVER_TF_PYTHON`); the tests skip, saying why, only when pip
cannot install TensorFlow on this machine. Each test module starts its own cluster
(`LocalCluster`, one OS process per task) and runs one client script that batches
its checks (importing TensorFlow takes seconds); the tests then assert on the JSON
the script printed.

Fixture setup (installing TensorFlow, starting clusters, running client scripts) is
bounded by subprocess timeouts, not by pytest-timeout: the modules mark their tests
with `timeout(func_only=True)`.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from distserver import _grpc_env

ROOT = Path(__file__).resolve().parents[2]
CLIENTS = Path(__file__).resolve().parent / "clients"
SETUP = ROOT / "scripts" / "interop-setup"
EXIT_CANNOT_INSTALL = 3  # scripts/interop-setup: pip cannot install TensorFlow here
SETUP_TIMEOUT = 1800.0
CLIENT_TIMEOUT = 240.0


@dataclass
class TFClient:
    """Runs the client scripts of tests/interop/clients with TensorFlow's Python."""

    python: str

    def run(self, script: str, arguments: dict[str, Any], timeout: float = CLIENT_TIMEOUT) -> dict[str, Any]:
        """Run `clients/<script>` with `arguments` (JSON); returns the JSON it printed last."""
        env = dict(os.environ)
        env["PYTHONPATH"] = str(ROOT)  # the clients that build distserver servers import it
        env.pop("TF_CONFIG", None)
        if _grpc_env.APPLIED:
            env.pop("GRPC_EXPERIMENTS", None)  # TensorFlow runs with gRPC's defaults
        env["TF_CPP_MIN_LOG_LEVEL"] = "3"
        try:
            result = subprocess.run(
                [self.python, str(CLIENTS / script), json.dumps(arguments)],
                capture_output=True,
                text=True,
                env=env,
                timeout=timeout,
                check=False,
            )
        except subprocess.TimeoutExpired as exc:
            pytest.fail(f"{script} did not finish within {timeout} s:\n{_tail(exc.stderr)}")
        lines = result.stdout.strip().splitlines()
        if result.returncode != 0 or not lines:
            pytest.fail(f"{script} exited with status {result.returncode}:\n{_tail(result.stderr)}")
        parsed: dict[str, Any] = json.loads(lines[-1])
        return parsed


def _tail(text: str | bytes | None, limit: int = 6000) -> str:
    if isinstance(text, bytes):
        text = text.decode("utf-8", "replace")
    return (text or "")[-limit:]


@pytest.fixture(scope="session")
def tf_client(pytestconfig: pytest.Config) -> TFClient:
    """A TensorFlow client runner; builds `.tfenv/` on first use (a few minutes).

    scripts/interop-setup's progress lines ("installing tensorflow-cpu...") go straight
    to the terminal as they come, past pytest's output capture: a first run that spends
    minutes installing TensorFlow says so.
    """
    stderr_lines: list[str] = []
    stdout_chunks: list[str] = []
    with subprocess.Popen(
        [sys.executable, str(SETUP)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    ) as proc:

        def read_stdout() -> None:
            assert proc.stdout is not None
            stdout_chunks.append(proc.stdout.read())

        readers = [
            threading.Thread(target=_echo_lines, args=(proc.stderr, stderr_lines, pytestconfig), daemon=True),
            threading.Thread(target=read_stdout, daemon=True),
        ]
        for reader in readers:
            reader.start()
        timed_out = False
        try:
            proc.wait(timeout=SETUP_TIMEOUT)
        except subprocess.TimeoutExpired:
            timed_out = True
            proc.kill()
            proc.wait()
        for reader in readers:
            reader.join()
    if timed_out:
        pytest.fail(
            f"scripts/interop-setup did not finish within {SETUP_TIMEOUT} s:\n{_tail(''.join(stderr_lines))}"
        )
    stdout = "".join(stdout_chunks)
    stderr = "".join(stderr_lines)
    if proc.returncode == EXIT_CANNOT_INSTALL:
        pytest.skip(f"TensorFlow cannot be installed on this machine:\n{_tail(stderr, 1500)}")
    if proc.returncode != 0:
        pytest.fail(f"scripts/interop-setup failed ({proc.returncode}):\n{_tail(stderr)}")
    return TFClient(stdout.strip().splitlines()[-1])


def _echo_lines(stream: Any, lines: list[str], config: pytest.Config) -> None:
    """Keep every line of `stream`; show interop-setup's own progress lines on the terminal."""
    capture = config.pluginmanager.getplugin("capturemanager")
    for line in stream:
        lines.append(line)
        if line.startswith("interop-setup:"):
            with capture.global_and_fixture_disabled():
                sys.stderr.write(f"\n{line}")
                sys.stderr.flush()


def _check(results: dict[str, Any], name: str) -> Any:
    entry = results["checks"][name]
    if "error" in entry:
        pytest.fail(f"{name}: {entry['error']}: {entry['message']}\n{entry.get('traceback', '')}")
    return entry["value"]


def _check_error(results: dict[str, Any], name: str) -> tuple[str, str]:
    entry = results["checks"][name]
    if "error" not in entry:
        pytest.fail(f"{name} did not raise; it returned {entry['value']!r}")
    return entry["error"], entry["message"]


@pytest.fixture(scope="session")
def check() -> Callable[[dict[str, Any], str], Any]:
    """`check(results, name)`: the value a client check returned; fails with its error if it raised."""
    return _check


@pytest.fixture(scope="session")
def check_error() -> Callable[[dict[str, Any], str], tuple[str, str]]:
    """`check_error(results, name)`: (tf.errors class name, message) of a check that must raise."""
    return _check_error


# --------------------------------------------------------------------------- a recording proxy


@dataclass
class RecordedCall:
    method: str  # e.g. "/tensorflow.MasterService/RunStep"
    request: bytes
    response: bytes | None
    status: str  # grpc.StatusCode name


@dataclass
class RecordingProxy:
    """A `recording_proxy.py` process forwarding to `upstream` and logging each call."""

    upstream: str
    log: Path
    process: subprocess.Popen[str] = field(init=False)
    port: int = field(init=False)

    def __post_init__(self) -> None:
        self.process = subprocess.Popen(
            [sys.executable, str(Path(__file__).parent / "recording_proxy.py"), self.upstream, str(self.log)],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.process.stdout is not None
        self.port = int(self.process.stdout.readline())

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def calls(self) -> list[RecordedCall]:
        calls = []
        for line in self.log.read_text().splitlines():
            entry = json.loads(line)
            response = entry["response"]
            calls.append(
                RecordedCall(
                    entry["method"],
                    base64.b64decode(entry["request"]),
                    None if response is None else base64.b64decode(response),
                    entry["status"],
                )
            )
        return calls

    def methods(self) -> set[str]:
        return {call.method.rsplit("/", 1)[-1] for call in self.calls}

    def close(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        if self.process.stdout is not None:
            self.process.stdout.close()


@pytest.fixture(scope="module")
def recording_proxy(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[[str], RecordingProxy]]:
    """`recording_proxy(upstream)` starts a `RecordingProxy`; all are stopped after the module."""
    made: list[RecordingProxy] = []

    def make(upstream: str) -> RecordingProxy:
        proxy = RecordingProxy(upstream, tmp_path_factory.mktemp("proxy") / "calls.jsonl")
        made.append(proxy)
        return proxy

    yield make
    for proxy in made:
        proxy.close()
