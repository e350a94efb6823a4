"""glibc malloc thresholds (`distserver._malloc`): a step's large buffers are reused, not
faulted in again every time; applied only when wanted and never over the user's own."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

# 40 rounds of a step's large buffers (a 784 KiB feed, its bytes and its frame, a 1.6 MB
# array), after a first round, and the minor page faults of those 40: with glibc's
# defaults, freed buffers are given back and later ones fault their pages in again.
PROBE = """
import json, os, resource
import distserver, distserver._malloc as m
import numpy as np
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
def step():
    feed = np.ones(200_000, np.float32)
    encoded = feed.tobytes()
    frame = encoded + b"head"
    del feed, encoded, frame
    np.ones((512, 784), np.float32)
step()
before = faults()
for _ in range(40):
    step()
print(json.dumps({"applied": m.APPLIED, "faults": faults() - before}))
"""
PAGES_PER_BUFFER = (784 * 1024) // 4096


def _environment(changes: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    env.pop("DISTSERVER_MALLOC_TUNING", None)
    env.pop("GLIBC_TUNABLES", None)
    env.update(changes)
    return env


def _probe(env_changes: dict[str, str]) -> dict[str, object]:
    result = subprocess.run(
        [sys.executable, "-c", PROBE],
        capture_output=True,
        text=True,
        env=_environment(env_changes),
        timeout=60,
        check=True,
    )
    found: dict[str, object] = json.loads(result.stdout)
    return found


pytestmark = pytest.mark.skipif(
    not hasattr(os, "confstr") or not os.confstr("CS_GNU_LIBC_VERSION"), reason="glibc only"
)


def test_large_buffers_are_reused_instead_of_faulted_in_every_time():
    tuned = _probe({})
    assert tuned["applied"] is True
    assert isinstance(tuned["faults"], int)
    assert tuned["faults"] < PAGES_PER_BUFFER  # 160 buffers, less than one faulted in
    untuned = _probe({"DISTSERVER_MALLOC_TUNING": "0"})
    assert untuned["applied"] is False
    assert isinstance(untuned["faults"], int)
    # (glibc's defaults fault pages in again, 344-475 times in runs here, as its own
    # threshold adjustment and trims go: the probe sees what it is meant to.)
    assert untuned["faults"] > PAGES_PER_BUFFER // 3


@pytest.mark.parametrize(
    "env",
    [
        {"MALLOC_TRIM_THRESHOLD_": "1048576"},
        {"MALLOC_MMAP_THRESHOLD_": "65536"},
        {"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=1"},
    ],
    ids=["trim", "mmap", "tunables"],
)
def test_a_setting_of_the_user_is_left_alone(env):
    assert _probe(env)["applied"] is False


# A task's setting (`distserver serve`): bulk tensors, above the threshold every process
# gets, reuse the heap too.
SERVE_PROBE = """
import json, resource
import distserver._malloc as m
import numpy as np
kept = {keep}
if kept:
    kept = m.keep_freed_memory()
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
np.ones(16 << 20, np.float32)
before = faults()
for _ in range(10):
    np.ones(16 << 20, np.float32)  # 64 MiB
print(json.dumps({{"kept": kept, "faults": faults() - before}}))
"""


def test_a_task_keeps_even_bulk_buffers_for_reuse():
    def probe(keep: bool) -> dict[str, object]:
        result = subprocess.run(
            [sys.executable, "-c", SERVE_PROBE.format(keep=keep)],
            capture_output=True,
            text=True,
            env=_environment({}),
            timeout=60,
            check=True,
        )
        found: dict[str, object] = json.loads(result.stdout)
        return found

    kept = probe(True)
    assert kept["kept"] is True
    assert isinstance(kept["faults"], int)
    assert kept["faults"] < 64  # 10 buffers of 64 MiB (16,384 pages each)
    mapped = probe(False)  # above MMAP_THRESHOLD: mapped and faulted in every time
    assert isinstance(mapped["faults"], int)
    # (transparent huge pages may fault as few as 32 times per buffer, 2 MiB a fault)
    assert mapped["faults"] > 10 * max(kept["faults"], 16)
