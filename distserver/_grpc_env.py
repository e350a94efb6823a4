"""gRPC core settings that only take effect when set before `grpc` is imported.

Quiet C-core logs: gRPC's C core writes its own log lines ("E0000 00:00:... chttp2
...") straight to the process' stderr, past Python's `logging`. distserver reports
every failure it sees as an `OpError` and logs through `logging`, so those lines are
noise in a user's terminal: `GRPC_VERBOSITY=NONE` is set unless the user set
`GRPC_VERBOSITY` (set it to ERROR, INFO or DEBUG to see them again).

Fewer thread hops:

grpcio 1.85 moves every call between its EventEngine threads, its completion-queue
poller thread and the asyncio loop. Turning off the EventEngine client and listener
(the iomgr poller reads the sockets itself) takes one thread hop out of each RPC:
a loopback unary round trip went from ~460 to ~300 µs, and a two-task step from 1.48
to 1.26 ms (`benchmarks/probe_grpc_floor.py`; docs/benchmarks.md).

`distserver` is imported before grpc in our own processes (`distserver serve`,
`LocalCluster` tasks), so there this always applies. In a user's process it applies
only when grpc has not been imported yet, never overrides a `GRPC_EXPERIMENTS` the
user set, and `DISTSERVER_GRPC_TUNING=0` turns it off. Child processes inherit it.
"""

from __future__ import annotations

import os
import sys

GRPC_EXPERIMENTS = "-event_engine_client,-event_engine_listener"


def apply() -> bool:
    """Set `GRPC_EXPERIMENTS` for this process when it is still possible and wanted."""
    if os.environ.get("DISTSERVER_GRPC_TUNING", "1") == "0":
        return False
    if "GRPC_EXPERIMENTS" in os.environ or "grpc" in sys.modules:
        return False
    os.environ["GRPC_EXPERIMENTS"] = GRPC_EXPERIMENTS
    return True


APPLIED = apply()

GRPC_VERBOSITY = "NONE"


def quiet_core_logs() -> bool:
    """Set `GRPC_VERBOSITY=NONE` for this process when it is still possible and not set."""
    if "GRPC_VERBOSITY" in os.environ or "grpc" in sys.modules:
        return False
    os.environ["GRPC_VERBOSITY"] = GRPC_VERBOSITY
    return True


QUIETED = quiet_core_logs()
