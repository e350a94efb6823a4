"""The wheel built from a clean checkout works in a fresh venv without the dev tools.

"Clean checkout": the files git tracks (as they are in the working tree), copied to an
empty directory, so that nothing built or installed here (.venv, .tfenv, egg-info)
can leak into the wheel. Dependencies come from wherever pip is configured to get
them on this machine (its index, cache or --find-links).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

import distserver

ROOT = Path(__file__).resolve().parent.parent


def _tracked_files() -> list[str]:
    try:
        result = subprocess.run(
            ["git", "-C", str(ROOT), "ls-files", "-z"], capture_output=True, check=True, timeout=60
        )
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: cannot tell which files a clean checkout has")
    return [name for name in result.stdout.decode().split("\0") if name]


def _clean_env() -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.pop("TF_CONFIG", None)
    return env


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_wheel_from_a_clean_checkout_works_without_dev_tools(tmp_path):
    source = tmp_path / "checkout"
    for name in _tracked_files():
        if (ROOT / name).is_file():  # a tracked file deleted in the working tree is not copied
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, source / name)

    dist = tmp_path / "dist"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", str(source), "-w", str(dist)],
        check=True,
        timeout=600,
        env=_clean_env(),
    )
    (wheel,) = dist.glob("distserver-*.whl")
    assert wheel.name.startswith(f"distserver-{distserver.__version__}-")
    names = zipfile.ZipFile(wheel).namelist()
    assert "distserver/protos/master_pb2.py" in names
    assert "distserver/py.typed" in names
    assert "distserver/metrics.py" in names
    assert not [name for name in names if name.startswith(("tests/", "benchmarks/", "scripts/"))]

    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    python = str(env_dir / "bin" / "python")
    env = _clean_env()
    subprocess.run(
        [python, "-m", "pip", "install", "--quiet", "--find-links", str(dist), "distserver"],
        check=True,
        timeout=600,
        env=env,
    )

    def run(*args, timeout=120):
        return subprocess.run(
            list(args), capture_output=True, text=True, cwd=tmp_path, env=env, timeout=timeout, check=False
        )

    version = run(str(env_dir / "bin" / "distserver"), "--version")
    assert version.returncode == 0, version.stderr
    assert version.stdout.strip() == f"distserver {distserver.__version__}"
    imported = run(python, "-c", "import distserver, distserver.metrics; print(distserver.__file__)")
    assert imported.returncode == 0, imported.stderr
    assert str(env_dir) in imported.stdout  # the installed copy, not the checkout
    for dev_tool in ("pytest", "grpc_tools", "mypy"):
        missing = run(python, "-c", f"import {dev_tool}")
        assert missing.returncode != 0, f"{dev_tool} is installed: the wheel pulled in a dev tool"
    cluster = run(
        str(env_dir / "bin" / "distserver"), "local-cluster", "--ps", "1", "--workers", "1", timeout=300
    )
    assert cluster.returncode == 0, cluster.stderr
    assert "2 devices in the cluster:" in cluster.stdout


@pytest.mark.timeout(60)
def test_the_version_is_written_once_and_the_changelog_knows_it():
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert 'dynamic = ["version"]' in pyproject
    assert 'version = { attr = "distserver.__version__" }' in pyproject
    assert "\nversion =" not in pyproject.split("[tool.setuptools.dynamic]")[0]
    changelog = (ROOT / "CHANGELOG.md").read_text()
    assert f"\n## {distserver.__version__}\n" in changelog
