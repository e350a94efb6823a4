"""Find, or create, a Python environment with TensorFlow for the benchmarks' TF side.

`find_or_create` (the `benchmarks/` scripts), in order:
  1. ``$DISTSERVER_TF_PYTHON``, if set (an interpreter that imports tensorflow);
  2. ``<repo>/.tfenv/bin/python``, if it imports tensorflow;
  3. otherwise create ``<repo>/.tfenv`` (``python3 -m venv``) and
     ``pip install tensorflow-cpu==2.21.0`` into it, printing pip's progress.

`find_installed` (`distserver bench`, which never installs anything): ``--tf-python``,
else ``$DISTSERVER_TF_PYTHON``, else this interpreter if it can import tensorflow.

TensorFlow never goes into our own ``.venv``: distserver must not depend on it.

    python benchmarks/_tfenv.py            # find or create; print the interpreter
    python benchmarks/_tfenv.py --no-create
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from distserver import _grpc_env

TF_REQUIREMENT = "tensorflow-cpu==2.21.0"
ENV_VAR = "DISTSERVER_TF_PYTHON"
IMPORT_TIMEOUT_S = 180.0
VENV_TIMEOUT_S = 300.0
PIP_TIMEOUT_S = 1800.0

_PROBE = (
    "import platform, numpy, tensorflow as tf; "
    "print(tf.__version__, numpy.__version__, platform.python_version())"
)


class TFUnavailable(RuntimeError):
    """No TensorFlow environment could be found or made; the message says why."""


@dataclass(frozen=True)
class TFEnv:
    python: str
    tensorflow: str
    numpy: str
    python_version: str
    source: str  # how it was found: "$DISTSERVER_TF_PYTHON", "<repo>/.tfenv", "created"


def quiet_tf_env() -> dict[str, str]:
    """The environment for TensorFlow processes: fewer C++ log lines on stderr.

    TensorFlow runs with gRPC's and glibc's defaults: the `GRPC_EXPERIMENTS` that
    importing distserver set for our own processes (`distserver._grpc_env`) is not
    passed on, and the TF side's scripts, which import distserver's benchmark code,
    leave malloc's thresholds alone (`distserver._malloc`).
    """
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONUNBUFFERED": "1"}
    env["DISTSERVER_MALLOC_TUNING"] = "0"
    if _grpc_env.APPLIED:
        env.pop("GRPC_EXPERIMENTS", None)
    if _grpc_env.QUIETED:
        env.pop("GRPC_VERBOSITY", None)
    return env


def probe(python: str) -> TFEnv | str:
    """A `TFEnv` if `python` imports tensorflow, else the reason it does not. A relative
    path (`.tfenv/bin/python`) is made absolute: the benchmarks start it from other
    directories."""
    if os.sep in python:
        python = os.path.abspath(python)
    if not os.path.exists(python):
        return f"{python} does not exist"
    try:
        proc = subprocess.run(
            [python, "-c", _PROBE],
            capture_output=True,
            text=True,
            timeout=IMPORT_TIMEOUT_S,
            env=quiet_tf_env(),
            check=False,
        )
    except subprocess.TimeoutExpired:
        return f"{python} took over {IMPORT_TIMEOUT_S:.0f} s to import tensorflow"
    except OSError as exc:
        return f"cannot run {python}: {exc}"
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        return f"{python} cannot import tensorflow: {tail}"
    tf_version, np_version, py_version = lines[-1].split()
    return TFEnv(python, tf_version, np_version, py_version, source="")


def find_installed(tf_python: str | None) -> TFEnv:
    """The TF environment `distserver bench` uses (see the module docstring); raises
    `TFUnavailable` saying what was tried."""
    if tf_python:
        found = probe(tf_python)
        if isinstance(found, str):
            raise TFUnavailable(f"--tf-python {tf_python}: {found}")
        return _with_source(found, "--tf-python")
    explicit = os.environ.get(ENV_VAR)
    if explicit:
        found = probe(explicit)
        if isinstance(found, str):
            raise TFUnavailable(f"${ENV_VAR} is set but unusable: {found}")
        return _with_source(found, f"${ENV_VAR}")
    if importlib.util.find_spec("tensorflow") is None:
        raise TFUnavailable(f"no --tf-python given, ${ENV_VAR} unset, and {sys.executable} has no tensorflow")
    found = probe(sys.executable)
    if isinstance(found, str):
        raise TFUnavailable(found)
    return _with_source(found, "this Python")


def find_or_create(repo: Path, *, create: bool = True, log: Callable[[str], None] = print) -> TFEnv:
    """The TF environment to use (see the module docstring); raises `TFUnavailable`."""
    explicit = os.environ.get(ENV_VAR)
    if explicit:
        found = probe(explicit)
        if isinstance(found, str):
            raise TFUnavailable(f"${ENV_VAR} is set but unusable: {found}")
        return _with_source(found, f"${ENV_VAR}")

    python = repo / ".tfenv" / "bin" / "python"
    if python.exists():
        found = probe(str(python))
        if isinstance(found, TFEnv):
            return _with_source(found, "<repo>/.tfenv")
        log(f"[tfenv] {found}; reinstalling")
    if not create:
        raise TFUnavailable(f"no TensorFlow environment (set ${ENV_VAR} or create {repo / '.tfenv'})")
    return _create(repo / ".tfenv", log)


def _with_source(env: TFEnv, source: str) -> TFEnv:
    return TFEnv(env.python, env.tensorflow, env.numpy, env.python_version, source)


def _create(venv: Path, log: Callable[[str], None]) -> TFEnv:
    base = shutil.which("python3") or sys.executable
    python = venv / "bin" / "python"
    if not python.exists():
        log(f"[tfenv] creating {venv} with {base} -m venv")
        _run([base, "-m", "venv", str(venv)], VENV_TIMEOUT_S, log)
    log(f"[tfenv] pip install {TF_REQUIREMENT} into {venv} (one-time, several hundred MB)")
    _run(
        [str(python), "-m", "pip", "install", "--progress-bar", "off", "--upgrade", "pip", TF_REQUIREMENT],
        PIP_TIMEOUT_S,
        log,
    )
    found = probe(str(python))
    if isinstance(found, str):
        raise TFUnavailable(f"installed {TF_REQUIREMENT} but {found}")
    return _with_source(found, "created")


def _run(command: list[str], timeout: float, log: Callable[[str], None]) -> None:
    """Run `command`, echoing its output lines; killed after `timeout` seconds."""
    try:
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    except OSError as exc:
        raise TFUnavailable(f"cannot run {command[0]}: {exc}") from exc
    assert proc.stdout is not None
    timed_out = threading.Event()

    def kill() -> None:
        timed_out.set()
        proc.kill()

    watchdog = threading.Timer(timeout, kill)
    watchdog.start()
    last = ""
    try:
        for line in proc.stdout:  # ends when the process exits (or is killed)
            line = line.rstrip()
            if line:
                last = line
                log(f"[tfenv]   {line}")
        code = proc.wait()
    finally:
        watchdog.cancel()
        proc.stdout.close()
    what = " ".join(command[:5]) + " ..."
    if timed_out.is_set():
        raise TFUnavailable(f"{what} took over {timeout:.0f} s and was stopped")
    if code != 0:
        raise TFUnavailable(f"{what} failed (exit {code}): {last}")
