"""The gRPC core setting distserver applies when it is imported before grpc."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from distserver import _grpc_env

PRINT = "import os; {first}import distserver; print(os.environ.get('GRPC_EXPERIMENTS'))"


def _run(env_changes: dict[str, str | None], first: str = "") -> str:
    env = dict(os.environ)
    env.pop("GRPC_EXPERIMENTS", None)
    env.pop("DISTSERVER_GRPC_TUNING", None)
    for key, value in env_changes.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    result = subprocess.run(
        [sys.executable, "-c", PRINT.format(first=first)],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=True,
    )
    return result.stdout.strip()


@pytest.mark.parametrize(
    ("env", "first", "expected"),
    [
        ({}, "", _grpc_env.GRPC_EXPERIMENTS),
        ({"DISTSERVER_GRPC_TUNING": "0"}, "", "None"),
        ({"GRPC_EXPERIMENTS": "-event_engine_dns"}, "", "-event_engine_dns"),
        ({}, "import grpc; ", "None"),  # too late to take effect: left alone
    ],
    ids=["applied", "opted-out", "user-setting-kept", "grpc-imported-first"],
)
def test_the_setting_is_applied_only_when_it_can_take_effect_and_is_wanted(env, first, expected):
    assert _run(env, first) == expected


@pytest.mark.parametrize("value", ["abc", "0", "-5"])
def test_a_bad_keepalive_setting_is_refused_naming_it(value):
    env = {**os.environ, "DISTSERVER_KEEPALIVE_MS": value}
    result = subprocess.run(
        [sys.executable, "-c", "import distserver.transports.grpc"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert result.returncode != 0
    assert (
        f"DISTSERVER_KEEPALIVE_MS must be a whole number of milliseconds above 0, got '{value}'"
        in result.stderr
    )


VERBOSITY = "import os; {first}import distserver; print(os.environ.get('GRPC_VERBOSITY'))"


@pytest.mark.parametrize(
    ("env", "first", "expected"),
    [
        ({}, "", "NONE"),
        ({"GRPC_VERBOSITY": "DEBUG"}, "", "DEBUG"),
        ({}, "import grpc; ", "None"),
    ],
    ids=["quieted", "user-setting-kept", "grpc-imported-first"],
)
def test_grpc_core_logs_are_quiet_unless_asked_for(env, first, expected):
    environment = {key: value for key, value in os.environ.items() if key != "GRPC_VERBOSITY"}
    environment.update(env)
    result = subprocess.run(
        [sys.executable, "-c", VERBOSITY.format(first=first)],
        capture_output=True,
        text=True,
        env=environment,
        timeout=60,
        check=True,
    )
    assert result.stdout.strip() == expected
