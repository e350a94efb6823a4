"""The `distserver` command.

    distserver serve --cluster '{"ps": ["localhost:2222"], "worker": ["localhost:2223"]}' --job ps --task 0
    distserver serve                      # cluster and task from TF_CONFIG
    distserver status grpc://localhost:2222
    distserver local-cluster --ps 1 --workers 2 [--keep]
    distserver bench --protocols grpc,grpc+verbs --sizes 4KiB,1MiB,64MiB --json out.json --plot out.png

`serve` prints the server's target once it is serving and stops gracefully on
SIGINT/SIGTERM. `status` lists the devices of the target's cluster and exits with
status 1 and a one-line reason when the target cannot be reached. `bench` measures
tensor transfer by protocol (`distserver.bench`, docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from google.protobuf.empty_pb2 import Empty

from distserver import __version__, _malloc, errors
from distserver._blas import (
    blas_kernels,
    blas_threads,
    describe_kernels,
    local_tasks,
    set_blas_threads,
    threads_per_local_task,
    user_chose_threads,
)
from distserver._cpus import (
    AwakeBetweenSteps,
    host_tasks,
    pin_event_loop,
    poll_after_sends,
    schedule_as_batch,
    usable_cpus,
)
from distserver._process import die_with_parent, exit_quietly_on_interrupt, managed_by_parent, run
from distserver.bench import command as bench_command
from distserver.cluster import ClusterSpec, TFConfigClusterResolver
from distserver.facade import Session
from distserver.kernels import _intra_op as intra_op
from distserver.metrics import MetricsEndpoint
from distserver.protos.master_pb2 import ListDevicesRequest
from distserver.protos.services import MASTER_SERVICE, STATUS_SERVICE
from distserver.protos.worker_pb2 import GetStatusRequest
from distserver.runtime.clients import RemoteWorker
from distserver.runtime.master import DEFAULT_SESSION_GC_SECONDS
from distserver.security import TOKEN_ENV, Security, from_environment
from distserver.server import AsyncServer
from distserver.testing import LocalCluster
from distserver.transports import available_protocols, get_transport

logger = logging.getLogger(__name__)


class UsageError(Exception):
    """A command-line mistake: reported as one line naming the option, exit status 2."""


# How long a task's event loop polls before it sleeps: after a step (a task alone on
# its host), else after a send to a peer (`--spin-us`).
DEFAULT_SPIN_US = 1000
MAX_SPIN_US = 1_000_000


def _spin_us(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value <= MAX_SPIN_US:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a whole number of microseconds from 0 to {MAX_SPIN_US}"
        )
    return value


def _cluster_and_task(args: argparse.Namespace) -> tuple[ClusterSpec, str, int, str | None]:
    """The cluster, job, task and protocol `serve` was asked for, checked against each other."""
    if args.cluster is not None:
        try:
            cluster = ClusterSpec(json.loads(args.cluster))
        except json.JSONDecodeError as exc:
            raise UsageError(f"--cluster is not valid JSON: {exc}") from None
        except (TypeError, ValueError, AttributeError) as exc:
            raise UsageError(
                f"--cluster must map job names to address lists, e.g. {_EXAMPLE}: {exc}"
            ) from None
        return cluster, *_job_and_task(cluster, args.job, args.task, "--job", "--task"), args.protocol
    resolver = TFConfigClusterResolver()
    try:
        cluster = resolver.cluster_spec()
        job = args.job if args.job is not None else resolver.task_type
        task = args.task if args.task is not None else resolver.task_id
        protocol = args.protocol or resolver.rpc_layer
    except json.JSONDecodeError as exc:
        raise UsageError(f"TF_CONFIG is not valid JSON: {exc}") from None
    except (TypeError, ValueError, AttributeError, KeyError) as exc:
        raise UsageError(
            f'TF_CONFIG must look like {{"cluster": {_EXAMPLE}, "task": '
            f'{{"type": "worker", "index": 0}}}}: {exc!r}'
        ) from None
    if not cluster:
        raise UsageError("give --cluster JSON, or set TF_CONFIG with 'cluster' and 'task'")
    job_source = "--job" if args.job is not None else "TF_CONFIG's task.type"
    task_source = "--task" if args.task is not None else "TF_CONFIG's task.index"
    return cluster, *_job_and_task(cluster, job, task, job_source, task_source), protocol


_EXAMPLE = '{"ps": ["host0:2222"], "worker": ["host1:2222", "host2:2222"]}'


def _job_and_task(
    cluster: ClusterSpec, job: str | None, task: int | None, job_source: str, task_source: str
) -> tuple[str, int]:
    jobs = cluster.jobs
    if job is None:
        if len(jobs) == 1 and cluster.num_tasks(jobs[0]) == 1:
            return jobs[0], 0 if task is None else _checked_task(cluster, jobs[0], task, task_source)
        raise UsageError(
            f"{job_source} is missing: which job is this task in? The cluster's jobs: {', '.join(jobs)}"
        )
    if job not in jobs:
        raise UsageError(f"{job_source} {job!r} is not a job of the cluster; its jobs: {', '.join(jobs)}")
    if task is None:
        if cluster.num_tasks(job) == 1:
            return job, cluster.task_indices(job)[0]
        raise UsageError(f"{task_source} is missing: job {job!r} has tasks {_indices(cluster, job)}")
    return job, _checked_task(cluster, job, task, task_source)


def _checked_task(cluster: ClusterSpec, job: str, task: int, task_source: str) -> int:
    if task not in cluster.task_indices(job):
        raise UsageError(
            f"{task_source} {task} is not a task of job {job!r}; its tasks: {_indices(cluster, job)}"
        )
    return task


def _indices(cluster: ClusterSpec, job: str) -> str:
    return ", ".join(str(i) for i in cluster.task_indices(job))


async def _serve(args: argparse.Namespace) -> int:
    cluster, job, task, protocol = _cluster_and_task(args)
    spec = ClusterSpec(cluster)
    addresses = [address for name in spec.jobs for address in spec.job_tasks(name) if address]
    cpus = usable_cpus()
    helper = False
    if args.blas_threads is not None:
        set_blas_threads(args.blas_threads)
    elif not user_chose_threads():
        threads = threads_per_local_task(addresses, cpus)
        set_blas_threads(threads)
        helper = threads == 1 and cpus > 1
        if helper:
            intra_op.enable()  # a large product takes a second thread of its own
    logger.info(
        "matrix products: %s, %s thread(s) a product%s",
        describe_kernels(blas_kernels(), os.environ.get("OPENBLAS_CORETYPE")),
        blas_threads() or "?",
        ", a large one cut in two with an intra-op helper thread" if helper else "",
    )
    server = AsyncServer(
        cluster,
        job,
        task,
        protocol,
        listen_on_all_interfaces=args.all_interfaces,
        session_gc_seconds=args.session_gc_seconds,
        security=_security(args),
        checkpoint_root=args.checkpoint_root,
    )
    await server.start()
    here = local_tasks(addresses)
    alone = cpus > 1 and here <= 1
    # Polling takes a CPU that nothing else wants: with more tasks working on this
    # host than CPUs there may be none (two workers and a ps training on two CPUs:
    # 2-8% slower steps). With more tasks here than CPUs, the tasks count those of
    # them that ran a graph lately (`_cpus.HostTasks`); without that record, none poll.
    cpu_each = cpus > 1 and here <= cpus
    if args.batch_scheduling and here > cpus and schedule_as_batch():
        # Its threads do not preempt a busy CPU's thread when they wake
        # (`_cpus.schedule_as_batch`).
        logger.info(
            "threads scheduled as batch work (SCHED_BATCH: %d tasks on this host's %d CPU(s); "
            "--no-batch-scheduling leaves them as they are)",
            here,
            cpus,
        )
    working_here = None
    if (args.spin_us or helper) and cpus > 1 and not cpu_each and server.worker is not None:
        working_here = host_tasks(cpus)
        if working_here is not None:
            server.worker.graphs.activity = working_here
            if helper:  # it takes a CPU too: only while the working tasks leave one
                intra_op.share_while(working_here.leave_a_cpu)
    if args.pin_loop and alone:
        # A task alone on its host: its event loop keeps one CPU's caches warm, and the
        # compute pool it starts shares that CPU (`_cpus.pin_event_loop`).
        cpu = pin_event_loop(asyncio.get_running_loop())
        if cpu is not None:
            logger.info(
                "event loop kept on CPU %d (a task alone on its host; --no-pin-loop leaves it free)", cpu
            )
    if args.spin_us and alone and server.master is not None:
        # Its client's next step finds the loop awake (`_cpus.AwakeBetweenSteps`).
        server.master.steps.activity = AwakeBetweenSteps(asyncio.get_running_loop(), args.spin_us / 1e6)
        logger.info(
            "event loop polls for up to %d us after each step (a task alone on its host; --spin-us 0 "
            "sleeps at once)",
            args.spin_us,
        )
    elif args.spin_us and cpu_each:
        # Answers from its peers find the loop awake (`_cpus.AwakeAfterSends`).
        poll_after_sends(asyncio.get_running_loop(), args.spin_us / 1e6)
        logger.info(
            "event loop polls for up to %d us after its sends to peers (a CPU for each task on this "
            "host; --spin-us 0 sleeps at once)",
            args.spin_us,
        )
    elif working_here is not None and args.spin_us:
        poll_after_sends(asyncio.get_running_loop(), args.spin_us / 1e6, working_here.leave_a_cpu)
        logger.info(
            "event loop polls for up to %d us after its sends to peers while the tasks running "
            "graphs on this host number at most its %d CPUs (recorded in %s; --spin-us 0 sleeps "
            "at once)",
            args.spin_us,
            cpus,
            working_here.path,
        )
    metrics = None
    if args.metrics_port is not None:
        host = args.metrics_host or ("0.0.0.0" if args.all_interfaces else "127.0.0.1")
        try:
            metrics = MetricsEndpoint(server, host, args.metrics_port)
        except ValueError:
            await server.stop(grace=0)
            raise
    loop = asyncio.get_running_loop()
    stopping: list[asyncio.Task[None]] = []

    def request_stop(signum: int) -> None:
        if not stopping:
            print(f"distserver: {signal.Signals(signum).name}, stopping {server.task}", file=sys.stderr)
            stopping.append(loop.create_task(server.stop(grace=args.grace)))

    # (A task its parent manages leaves SIGINT, a terminal's Ctrl-C, to that parent.)
    for signum in (signal.SIGTERM,) if managed_by_parent() else (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, request_stop, signum)
    print(f"{server.task} serving at {server.target}", flush=True)
    if metrics is not None:
        print(f"{server.task} metrics at {metrics.url}", flush=True)
    try:
        await server.join()
        for task_ in stopping:
            await task_
    finally:
        if metrics is not None:
            metrics.close()
        if working_here is not None:
            working_here.close()
    return 0


async def _status(args: argparse.Namespace) -> int:
    scheme, sep, address = args.target.partition("://")
    if not sep:
        scheme, address = "grpc", args.target
    protocols = available_protocols()
    if scheme not in protocols:
        valid = ", ".join(f"{p}://" for p in protocols)
        raise UsageError(f"target {args.target!r}: unknown scheme {scheme + '://'!r}; use one of {valid}")
    channel = get_transport(scheme).connect(address, security=from_environment(_security(args)))
    loop = asyncio.get_running_loop()
    deadline = loop.time() + args.timeout
    try:
        # The target itself first: a task that is down fails at once.
        try:
            await RemoteWorker(channel).call("GetStatus", GetStatusRequest(), timeout=args.timeout)
        except (errors.UnavailableError, errors.DeadlineExceededError) as exc:
            raise type(exc)(f"{args.target} does not answer; is it running? {exc.message}") from None
        devices: list[Any] = []
        if not args.only_target:
            # Then its cluster. wait_for_ready makes this a unary gRPC call, whose deadline
            # reaches the server: it answers which task is missing before we give up.
            response: Any = await channel.call(
                MASTER_SERVICE,
                "ListDevices",
                ListDevicesRequest(),
                timeout=max(deadline - loop.time(), 0.0),
                wait_for_ready=True,
            )
            devices = [*response.local_device, *response.remote_device]
        statistics = None
        if args.stats:
            answer: Any = await channel.call(
                STATUS_SERVICE, "GetStatistics", Empty(), timeout=max(deadline - loop.time(), 0.0)
            )
            statistics = json.loads(answer.value)
    finally:
        await channel.close()
    if args.only_target:
        print(f"{args.target} is serving")
    for device in devices:
        print(f"{device.name}\t{device.device_type}\tincarnation={device.incarnation:016x}")
    if statistics is not None:
        print(_statistics_text(statistics), end="")
    return 0


def _statistics_text(stats: dict[str, Any]) -> str:
    """`ServerStatistics.as_dict()` for people: steps, graphs, then one line per peer."""
    lines = [f"statistics of {stats['target']} ({stats['state']}, {stats['sessions']} sessions):"]
    for kind in ("steps", "graphs"):
        counts = stats[kind]
        failed = ", ".join(f"{name} {count}" for name, count in sorted(counts["failed"].items())) or "none"
        finished = counts["succeeded"] + sum(counts["failed"].values())
        mean = f"{counts['latency_sum'] / finished * 1e3:.3g} ms" if finished else "-"
        lines.append(
            f"  {kind}: {counts['succeeded']} ok, {counts['in_flight']} in flight, failed: {failed}; "
            f"mean latency {mean}"
        )
    updates = stats.get("optimizer_updates", {})  # (a server older than the field has none)
    in_place, copied = updates.get("in_place", 0), updates.get("copied", 0)
    lines.append(f"  optimizer updates: {in_place} in place, {copied} into new arrays")
    if stats.get("compiled_kernels"):  # (nor this one)
        lines.append(f"  compiled kernels: {stats['compiled_kernels']}")
    if not stats["peers"]:
        lines.append("  peers: none contacted yet")
    for peer, channel in sorted(stats["peers"].items()):
        lines.append(
            f"  peer {peer} at {channel['target']} via {channel['data_path']}: "
            f"{channel['calls_started']} calls ({channel['calls_failed']} failed), "
            f"{channel['tensors_received']} tensors / {channel['tensor_bytes_received']} bytes received, "
            f"{channel['call_bytes_received']} bytes of responses"
        )
    return "\n".join(lines) + "\n"


def _local_cluster(args: argparse.Namespace) -> int:
    if args.workers < 1:
        raise UsageError(f"--workers must be at least 1 (the client talks to worker 0), not {args.workers}")
    if args.ps < 0:
        raise UsageError(f"--ps must be 0 or more, not {args.ps}")
    if args.protocol not in available_protocols():
        raise UsageError(
            f"--protocol {args.protocol!r} is unknown; use one of {', '.join(available_protocols())}"
        )
    jobs = {"ps": args.ps, "worker": args.workers} if args.ps else {"worker": args.workers}
    with LocalCluster(jobs, protocol=args.protocol) as cluster:
        for task, target in cluster.targets.items():
            print(f"{task} serving at {target} (pid {cluster.pids[task]})")
        session = Session(cluster.target("worker", 0))
        devices = session.list_devices()
        session.close()
        print(f"{len(devices)} devices in the cluster:")
        for device in devices:
            print(f"  {device.name}")
        if args.keep:
            tf_config = {"cluster": cluster.cluster, "rpc_layer": args.protocol}
            print(f"target: {cluster.target('worker', 0)}")
            print(f"export TF_CONFIG='{json.dumps(tf_config)}'")
            print("serving until Ctrl-C", flush=True)
            try:
                _wait_for_interrupt()
            except KeyboardInterrupt:
                print("stopping", flush=True)
    print("cluster stopped")
    return 0


def _wait_for_interrupt() -> None:
    """Sleep until SIGINT (KeyboardInterrupt) or SIGTERM (handled as if it were SIGINT)."""
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    while True:
        signal.pause()


def _add_security_options(parser: argparse.ArgumentParser, *, serving: bool) -> None:
    group = parser.add_argument_group("security (docs/security.md)")
    mine = "this server's" if serving else "the client's"
    group.add_argument("--tls-cert", metavar="FILE", help=f"PEM certificate: {mine} (turns TLS on)")
    group.add_argument("--tls-key", metavar="FILE", help="PEM private key of --tls-cert")
    group.add_argument("--tls-ca", metavar="FILE", help="PEM certificates to trust for peers (turns TLS on)")
    if serving:
        group.add_argument(
            "--require-client-cert",
            action="store_true",
            help="mutual TLS: refuse clients without a certificate signed by --tls-ca",
        )
    group.add_argument(
        "--auth-token-file",
        metavar="FILE",
        help=f"file holding the cluster's shared token, required on every call (or set {TOKEN_ENV})",
    )


def _security(args: argparse.Namespace) -> Security | None:
    """The `Security` the command-line options ask for; None when they ask for nothing."""
    token = None
    if args.auth_token_file:
        try:
            token = Path(args.auth_token_file).read_text().strip()
        except OSError as exc:
            reason = exc.strerror or exc
            raise ValueError(f"--auth-token-file: cannot read {args.auth_token_file}: {reason}") from exc
        if not token:
            raise ValueError(f"--auth-token-file: {args.auth_token_file} is empty")
    require_client_cert = getattr(args, "require_client_cert", False)
    if not (args.tls_cert or args.tls_key or args.tls_ca or require_client_cert or token):
        return None
    return Security(args.tls_cert, args.tls_key, args.tls_ca, require_client_cert, token)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="distserver", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"distserver {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    protocols = ", ".join(available_protocols())

    serve = commands.add_parser(
        "serve",
        help="run one task of a cluster until SIGINT/SIGTERM",
        description="Serve one task of a cluster (TensorFlow's MasterService and WorkerService) until "
        "SIGINT/SIGTERM. The cluster and this task come from --cluster/--job/--task or TF_CONFIG. "
        'Transports: "grpc" (TensorFlow\'s wire protocol) and "grpc+verbs" (gRPC for calls, shared '
        "memory for tensors between tasks on one host; docs/verbs.md).",
    )
    serve.add_argument(
        "--cluster", help=f"the cluster as JSON, e.g. '{_EXAMPLE}' (default: TF_CONFIG's cluster)"
    )
    serve.add_argument("--job", help="this task's job name (default: TF_CONFIG's task.type)")
    serve.add_argument(
        "--task", type=int, help="this task's index in its job (default: TF_CONFIG's task.index)"
    )
    serve.add_argument(
        "--protocol",
        help=f"transport, one of: {protocols} (default: TF_CONFIG's rpc_layer, else grpc)",
    )
    serve.add_argument(
        "--grace", type=float, default=5.0, help="seconds in-flight RPCs get on stop (default: %(default)g)"
    )
    serve.add_argument(
        "--all-interfaces",
        action="store_true",
        help="listen on every interface, not only this task's address",
    )
    serve.add_argument(
        "--session-gc-seconds",
        type=float,
        default=DEFAULT_SESSION_GC_SECONDS,
        help="close master sessions that ran nothing for this long (0: never; default: %(default)g)",
    )
    serve.add_argument(
        "--checkpoint-root",
        metavar="DIR",
        help="directory under which checkpoint ops (tf.compat.v1.train.Saver) may read and write; "
        "without it they are refused (docs/checkpoints.md)",
    )
    serve.add_argument(
        "--blas-threads",
        type=int,
        metavar="N",
        help="threads numpy's BLAS may use per matrix product (default: every CPU for a task alone "
        "on its host, else half of this task's share of the host's CPUs, at least 1; unless "
        "OPENBLAS_NUM_THREADS or OMP_NUM_THREADS is set)",
    )
    serve.add_argument(
        "--no-pin-loop",
        dest="pin_loop",
        action="store_false",
        help="leave the event loop free to move between CPUs (by default a task alone on its host "
        "keeps its event loop and compute threads on one CPU)",
    )
    serve.add_argument(
        "--no-batch-scheduling",
        dest="batch_scheduling",
        action="store_false",
        help="leave the threads' scheduling as it is (by default, where this host's tasks in the cluster "
        "outnumber its CPUs, a task's threads are scheduled as batch work, SCHED_BATCH: a thread that "
        "wakes does not preempt a busy CPU's)",
    )
    serve.add_argument(
        "--spin-us",
        type=_spin_us,
        default=DEFAULT_SPIN_US,
        metavar="US",
        help="microseconds the event loop polls before it sleeps, on a host of two or more CPUs: "
        "after a step, for a task alone on its host, so that the client's next step finds it awake; "
        "else after a send to a peer, while peers usually answer within that time, when the host "
        "has a CPU for each of its tasks, or for each of those running steps "
        f"(default: %(default)s; 0: sleep at once; at most {MAX_SPIN_US})",
    )
    serve.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="what distserver logs to stderr, e.g. 'still waiting for response from worker' "
        "(default: %(default)s)",
    )
    serve.add_argument(
        "--metrics-port",
        type=int,
        metavar="PORT",
        help="serve Prometheus metrics at http://HOST:PORT/metrics (0: any free port; the URL is printed)",
    )
    serve.add_argument(
        "--metrics-host",
        metavar="HOST",
        help="interface for --metrics-port (default: 0.0.0.0 with --all-interfaces, else 127.0.0.1)",
    )
    _add_security_options(serve, serving=True)

    status = commands.add_parser(
        "status",
        help="list the devices of a running cluster",
        description="Ask a task for its cluster's devices. Exits with status 1 and a one-line reason "
        "(which task is missing) when the target or a task of its cluster does not answer in time.",
    )
    status.add_argument(
        "target", help="a task's target, e.g. grpc://localhost:2222 (schemes: " + protocols + ")"
    )
    status.add_argument(
        "--timeout", type=float, default=10.0, help="seconds to wait for an answer (default: %(default)g)"
    )
    status.add_argument(
        "--only-target",
        action="store_true",
        help="check only that the target itself answers, not the rest of its cluster (a readiness probe)",
    )
    status.add_argument(
        "--stats",
        action="store_true",
        help="also print the target's counters: steps, graphs, calls and bytes per peer and data path",
    )
    _add_security_options(status, serving=False)

    local = commands.add_parser(
        "local-cluster",
        help="start a local multi-process cluster, list its devices, stop it (or keep it up with --keep)",
    )
    local.add_argument("--ps", type=int, default=1, help="parameter-server tasks (default: %(default)s)")
    local.add_argument(
        "--workers", type=int, default=2, help="worker tasks, 1 or more (default: %(default)s)"
    )
    local.add_argument(
        "--protocol",
        default="grpc",
        help=f"every task's transport, one of: {protocols} (default: %(default)s)",
    )
    local.add_argument(
        "--keep",
        action="store_true",
        help="keep the cluster up until Ctrl-C, printing its target and a TF_CONFIG to paste",
    )

    bench = commands.add_parser(
        "bench",
        help="measure tensor transfer by protocol: throughput, latency, concurrency (docs/benchmarks.md)",
        description="Start local clusters (one OS process per task), or use --cluster/TF_CONFIG, and "
        "measure RecvTensor and fetch throughput and step latency by size, and concurrency scaling, for "
        "each protocol and baseline; print a table, optionally write JSON and a PNG plot.",
    )
    bench_command.add_arguments(bench)
    return parser


def _configure_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return exit_quietly_on_interrupt(lambda: _run_command(args))


def _run_command(args: argparse.Namespace) -> int:
    try:
        if args.command == "serve":
            die_with_parent()
            if managed_by_parent():
                signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent's to handle
            _malloc.keep_freed_memory()
            _configure_logging(args.log_level)
            return run(_serve(args))
        if args.command == "status":
            return run(_status(args))
        if args.command == "bench":
            return bench_command.main(args)
        return _local_cluster(args)
    except UsageError as exc:
        print(f"distserver {args.command}: {exc}", file=sys.stderr)
        return 2
    except errors.OpError as exc:
        print(f"distserver {args.command}: {type(exc).__name__}: {exc.message}", file=sys.stderr)
        return 1
    except (TypeError, ValueError) as exc:
        print(f"distserver {args.command}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
