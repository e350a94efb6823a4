"""How long callers see stale "connection refused" after a task comes back.

A ps + worker `LocalCluster`; a session runs a step that touches the ps. The ps is
killed and kept down for `--down` seconds while the session keeps trying (so its
channel backs off, as a real caller's would), then restarted. From the moment the
ps serves again, the step is retried every 10 ms until the answer is not
`UnavailableError` (it is `AbortedError`: the session's state on the ps is gone).
Prints that stale window per trial.

    .venv/bin/python scripts/measure_restart.py [--trials 3] [--down 5]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import distserver as ds
from distserver.testing import LocalCluster


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--down", type=float, default=5.0, help="seconds the ps stays down")
    args = parser.parse_args()
    graph = ds.Graph()
    with graph.as_default():
        with ds.device("/job:ps/task:0"):
            on_ps = ds.constant(np.arange(4, dtype=np.float32)) * 2.0
        total = ds.reduce_sum(on_ps)
    with LocalCluster({"ps": 1, "worker": 1}) as cluster:
        for trial in range(args.trials):
            with ds.Session(cluster.target("worker"), graph=graph) as session:
                session.run(total)
                cluster.kill("ps")
                back_up = time.monotonic() + args.down
                while time.monotonic() < back_up:
                    try:
                        session.run(total)
                    except ds.errors.OpError:
                        time.sleep(0.2)
                cluster.restart("ps")
                serving = time.monotonic()
                stale = 0
                for _ in range(1000):  # bounded: 10 s of retries at most
                    try:
                        session.run(total)
                        answer = "a value"
                    except ds.errors.UnavailableError:
                        stale += 1
                        time.sleep(0.01)
                        continue
                    except ds.errors.AbortedError:
                        answer = "AbortedError"
                    break
                else:
                    answer = "still UnavailableError after 1000 tries"
                waited = time.monotonic() - serving
                print(f"trial {trial + 1}: {answer} after {waited:.3f} s ({stale} stale UnavailableError)")


if __name__ == "__main__":
    main()
