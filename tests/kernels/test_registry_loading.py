"""The kernel registry fills itself once, completely, even when threads ask at the same time."""

from __future__ import annotations

import subprocess
import sys

RACE = """
import threading
from distserver.kernels.registry import has_kernel
answers, start = [], threading.Barrier(16)
def ask():
    start.wait()
    answers.append(has_kernel("Conv2D") and has_kernel("MergeSummary") and has_kernel("Switch"))
threads = [threading.Thread(target=ask) for _ in range(16)]
for t in threads: t.start()
for t in threads: t.join()
print(answers.count(True), len(answers))
"""


def test_threads_that_ask_first_all_see_every_kernel():
    for _ in range(5):  # a fresh process each time: the first use is what races
        result = subprocess.run([sys.executable, "-c", RACE], capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stderr
        assert result.stdout.split() == ["16", "16"]
