"""The push protocol: values that ride RunGraph responses instead of RecvTensor calls.

A value that one task sends to another normally crosses by RecvTensor: the
receiving `_Recv` asks the sending task, whose rendezvous answers once the `_Send`
has run. For values a remote partition sends to the *master's* task, one round trip
can be saved, and this module is where that is decided and described.

1. Planning (`plan_pushes`, pure, called by `plan.build_plan`): a remote partition
   that receives nothing from other tasks finishes on its own, so every value it
   sends to the master's task can come back in its RunGraph response. The master's
   `_Recv` nodes for those keys get the attr `RECV_PUSHED_ATTR`
   (`kernels.sendrecv`), which makes them wait on their own task's rendezvous
   instead of calling RecvTensor. A partition that does receive from other tasks is
   left alone: it might wait, through another task, for a value the master's task
   computes only after receiving from it.
2. The step (`Master._run_partition`): the master lists the pushed keys in the
   RunGraph request's `recv_key` (next to the client's fetches). The worker returns
   each value in the response if it is at most `PUSH_LIMIT_BYTES`
   (`worker_returns`); a larger one is withheld and waits in the worker's
   rendezvous for a RecvTensor, since transports move big tensors better than a
   protobuf response does. The master delivers every pushed value to its own
   worker (`Worker.deliver`), fetching withheld ones with RecvTensor, and
   remembers withheld keys: later steps fetch those with RecvTensor right away,
   alongside the RunGraph, instead of after it.
3. Freeing the step: the worker records every value handed over (returned in the
   response, or served by RecvTensor) and drops the step's rendezvous once its
   RunGraph has finished and nothing another task needs is left
   (`RendezvousTable.release_if_done` / `served`), so no CleanupGraph call is
   needed after a step that succeeded.
"""

from __future__ import annotations

from collections.abc import Mapping

from distserver.devices import task_of_device
from distserver.kernels.sendrecv import RECV_PUSHED_ATTR
from distserver.protos.graph_pb2 import GraphDef
from distserver.runtime.control_loops import LOOP_FRAME_ATTR
from distserver.runtime.names import sendrecv_key

# A value for another task rides in a RunGraph response only up to this size.
PUSH_LIMIT_BYTES = 1 << 20


def worker_returns(nbytes: int) -> bool:
    """Whether a worker returns a value of `nbytes` for another task in its RunGraph
    response (else it waits for a RecvTensor)."""
    return nbytes <= PUSH_LIMIT_BYTES


def plan_pushes(parts: Mapping[str, GraphDef], master_task: str) -> dict[str, set[str]]:
    """Task -> the keys of the values its partition pushes to the master's task.

    Marks the master's `_Recv` nodes for those keys with `RECV_PUSHED_ATTR`
    (changes `parts[master_task]` in place).
    """
    pushed: dict[str, set[str]] = {}
    for task, graph in parts.items():
        if task == master_task:
            continue
        receives = any(n.op == "_Recv" and not n.attr["client_terminated"].b for n in graph.node)
        if receives:
            continue
        keys = {
            sendrecv_key(n)
            for n in graph.node
            if n.op == "_Send"
            and not n.attr["client_terminated"].b
            and not n.attr[LOOP_FRAME_ATTR].s  # its key changes every iteration
            and task_of_device(n.attr["recv_device"].s.decode()) == master_task
        }
        if keys:
            pushed[task] = keys
    local = parts.get(master_task)
    all_pushed = set().union(*pushed.values()) if pushed else set()
    if local is not None and all_pushed:
        for node in local.node:
            if node.op == "_Recv" and sendrecv_key(node) in all_pushed:
                node.attr[RECV_PUSHED_ATTR].b = True
    return pushed
