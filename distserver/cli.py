"""The `distserver` command.

    distserver serve --cluster '{"ps": ["localhost:2222"], "worker": ["localhost:2223"]}' --job ps --task 0
    distserver serve                      # cluster and task from TF_CONFIG
    distserver status grpc://localhost:2222
    distserver local-cluster --ps 1 --workers 2
    distserver bench --protocols grpc,grpc+verbs --sizes 4KiB,1MiB,64MiB --json out.json --plot out.png

`serve` prints the server's target once it is serving and stops gracefully on
SIGINT/SIGTERM. `status` lists the devices of the target's cluster and exits with
status 1 and a one-line reason when the target cannot be reached. `bench` measures
tensor transfer by protocol (`distserver.bench`, docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import json
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from distserver import errors
from distserver._blas import set_blas_threads, threads_per_local_task, user_chose_threads
from distserver._process import die_with_parent, run
from distserver.bench import command as bench_command
from distserver.cluster import ClusterSpec, TFConfigClusterResolver
from distserver.facade import Session
from distserver.protos.master_pb2 import ListDevicesRequest
from distserver.runtime.clients import RemoteMaster
from distserver.runtime.master import DEFAULT_SESSION_GC_SECONDS
from distserver.security import TOKEN_ENV, Security, from_environment
from distserver.server import AsyncServer
from distserver.testing import LocalCluster
from distserver.transports import get_transport


def _cluster_and_task(args: argparse.Namespace) -> tuple[Any, str | None, int | None, str | None]:
    if args.cluster is not None:
        try:
            cluster = json.loads(args.cluster)
        except json.JSONDecodeError as exc:
            raise SystemExit(f"distserver serve: --cluster is not valid JSON: {exc}") from None
        return cluster, args.job, args.task, args.protocol
    resolver = TFConfigClusterResolver()
    spec = resolver.cluster_spec()
    if not spec:
        raise SystemExit(
            "distserver serve: give --cluster JSON or set TF_CONFIG (with 'cluster' and 'task')."
        )
    job = args.job if args.job is not None else resolver.task_type
    task = args.task if args.task is not None else resolver.task_id
    return spec, job, task, args.protocol or resolver.rpc_layer


def _keep_freed_memory() -> bool:
    """Make glibc reuse freed heap memory instead of mapping fresh pages per big buffer.

    Every large tensor buffer the transport allocates would otherwise be a new
    `mmap`, zero-filled and faulted in 4 KiB at a time (~16k faults per 64 MiB); with
    this, a 64 MiB RecvTensor went from ~0.4 to ~1.4 GB/s (docs/benchmarks.md, "the gRPC
    transfer probe").
    The cost: the process keeps its peak heap instead of returning it to the OS.
    Opt out with DISTSERVER_MALLOC_TUNING=0.
    """
    if os.environ.get("DISTSERVER_MALLOC_TUNING", "1") == "0" or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None)
        return bool(libc.mallopt(_M_MMAP_MAX, 0)) and bool(libc.mallopt(_M_TRIM_THRESHOLD, 1 << 30))
    except (OSError, AttributeError):
        return False


_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4


async def _serve(args: argparse.Namespace) -> int:
    cluster, job, task, protocol = _cluster_and_task(args)
    if args.blas_threads is not None:
        set_blas_threads(args.blas_threads)
    elif not user_chose_threads():
        spec = ClusterSpec(cluster)
        addresses = [address for name in spec.jobs for address in spec.job_tasks(name) if address]
        set_blas_threads(threads_per_local_task(addresses, os.cpu_count() or 1))
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
    loop = asyncio.get_running_loop()
    stopping: list[asyncio.Task[None]] = []

    def request_stop(signum: int) -> None:
        if not stopping:
            print(f"distserver: {signal.Signals(signum).name}, stopping {server.task}", file=sys.stderr)
            stopping.append(loop.create_task(server.stop(grace=args.grace)))

    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, request_stop, signum)
    print(f"{server.task} serving at {server.target}", flush=True)
    await server.join()
    for task_ in stopping:
        await task_
    return 0


async def _status(args: argparse.Namespace) -> int:
    scheme, sep, address = args.target.partition("://")
    if not sep:
        scheme, address = "grpc", args.target
    channel = get_transport(scheme).connect(address, security=from_environment(_security(args)))
    try:
        response = await RemoteMaster(channel).call("ListDevices", ListDevicesRequest(), timeout=args.timeout)
    finally:
        await channel.close()
    for device in [*response.local_device, *response.remote_device]:
        print(f"{device.name}\t{device.device_type}\tincarnation={device.incarnation:016x}")
    return 0


def _local_cluster(args: argparse.Namespace) -> int:
    with LocalCluster({"ps": args.ps, "worker": args.workers}, protocol=args.protocol) as cluster:
        for task, target in cluster.targets.items():
            print(f"{task} serving at {target} (pid {cluster.pids[task]})")
        session = Session(cluster.target("worker", 0))
        devices = session.list_devices()
        session.close()
        print(f"{len(devices)} devices in the cluster:")
        for device in devices:
            print(f"  {device.name}")
    print("cluster stopped")
    return 0


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
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="run one task of a cluster until SIGINT/SIGTERM")
    serve.add_argument("--cluster", help='cluster as JSON, e.g. \'{"worker": ["localhost:2222"]}\'')
    serve.add_argument("--job", help="this task's job name")
    serve.add_argument("--task", type=int, help="this task's index in its job")
    serve.add_argument("--protocol", help='transport, "grpc" by default')
    serve.add_argument("--grace", type=float, default=5.0, help="seconds in-flight RPCs get on stop")
    serve.add_argument("--all-interfaces", action="store_true", help="listen on every interface")
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
        help="threads numpy's BLAS may use per matrix product (default: half of this task's "
        "share of the host's CPUs, at least 1, unless OPENBLAS_NUM_THREADS or OMP_NUM_THREADS is set)",
    )
    _add_security_options(serve, serving=True)

    status = commands.add_parser("status", help="list the devices of a running cluster")
    status.add_argument("target", help="a task's target, e.g. grpc://localhost:2222")
    status.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for an answer")
    _add_security_options(status, serving=False)

    local = commands.add_parser("local-cluster", help="start a local multi-process cluster, list it, stop it")
    local.add_argument("--ps", type=int, default=1)
    local.add_argument("--workers", type=int, default=2)
    local.add_argument("--protocol", default="grpc")

    bench = commands.add_parser(
        "bench",
        help="measure tensor transfer by protocol: throughput, latency, concurrency (docs/benchmarks.md)",
        description="Start local clusters (one OS process per task), or use --cluster/TF_CONFIG, and "
        "measure RecvTensor and fetch throughput and step latency by size, and concurrency scaling, for "
        "each protocol and baseline; print a table, optionally write JSON and a PNG plot.",
    )
    bench_command.add_arguments(bench)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "serve":
            die_with_parent()
            _keep_freed_memory()
            return run(_serve(args))
        if args.command == "status":
            return run(_status(args))
        if args.command == "bench":
            return bench_command.main(args)
        return _local_cluster(args)
    except errors.OpError as exc:
        print(f"distserver {args.command}: {type(exc).__name__}: {exc.message}", file=sys.stderr)
        return 1
    except (TypeError, ValueError) as exc:
        print(f"distserver {args.command}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
