"""`distserver bench`: its options, checks and output (the workloads do the measuring).

    distserver bench --protocols grpc,grpc+verbs --sizes 4KiB,1MiB,64MiB --json out.json --plot out.png

Workloads (``--workload``):

* ``transfer`` (default): `distserver.bench.transfer`.
* ``training``: training steps with a real TensorFlow client and distserver's own
  client against distserver (grpc, grpc+verbs), and the TF client against
  TensorFlow, run by the first importable module of
  `TRAINING_MODULES` (`distserver.bench.training`), which provides
  ``run_cli(args) -> int`` (args: this command's parsed options).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

WORKLOADS = ("transfer", "training")
TRAINING_MODULES = ("distserver.bench.training", "distserver.bench_training")
DEFAULT_PROTOCOLS = "grpc,grpc+verbs,memcpy,grpcio,tensorflow"
DEFAULT_SIZES = "4KiB,64KiB,1MiB,16MiB,64MiB,256MiB,1GiB"


class UsageError(ValueError):
    """A bad option: the message names it and what is valid."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--workload",
        choices=WORKLOADS,
        default="transfer",
        help="transfer: tensor throughput and latency by protocol (default); training: training steps "
        "(MLP, embedding, 60 small variables) against TensorFlow, with a TensorFlow client and "
        "distserver's own client",
    )
    parser.add_argument(
        "--protocols",
        default=DEFAULT_PROTOCOLS,
        help="comma-separated series to measure: grpc, grpc+verbs (distserver), and the baselines memcpy, "
        "grpcio (raw grpcio, unary and streamed) and tensorflow (TensorFlow's runtime, when one is "
        "found: --tf-python) (default: %(default)s)",
    )
    parser.add_argument(
        "--sizes",
        default=DEFAULT_SIZES,
        help="comma-separated tensor sizes, multiples of 4 bytes up to 1GiB, e.g. 4KiB,1MiB,64MiB; sizes "
        "that do not fit in the memory available are skipped, saying so (default: %(default)s)",
    )
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps before timing (default: 2)")
    parser.add_argument(
        "--repeats",
        type=int,
        help="timed steps per size and series (default: 50 up to 1 MiB, 10 up to 64 MiB, 3 above)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="timed steps split into this many blocks that take turns between the series (default: 3)",
    )
    parser.add_argument(
        "--concurrency",
        type=int,
        default=4,
        metavar="N",
        help="concurrent steps 1..N on one session, and 1..N workers pushing to one ps (0: skip; default: 4)",
    )
    parser.add_argument(
        "--concurrency-size",
        default="1MiB",
        help="tensor size of the concurrency measurements (default: %(default)s)",
    )
    parser.add_argument(
        "--cluster",
        help='measure a running cluster instead of starting local ones: JSON with "ps" and "worker" jobs '
        '(e.g. \'{"ps": ["h1:2222"], "worker": ["h2:2222"]}\'); without it, TF_CONFIG\'s cluster is used '
        "when TF_CONFIG is set",
    )
    parser.add_argument(
        "--tf-python",
        metavar="PATH",
        help="a Python that imports tensorflow, for the tensorflow series (default: $DISTSERVER_TF_PYTHON, "
        "else this Python if it has tensorflow)",
    )
    parser.add_argument(
        "--max-seconds", type=float, default=1800.0, help="bound on the whole run (default: %(default)g)"
    )
    parser.add_argument("--json", type=Path, metavar="FILE", help="write every figure and the machine here")
    parser.add_argument(
        "--plot", type=Path, metavar="FILE", help="write a PNG plot here (needs matplotlib: the bench extra)"
    )


def _parse_sizes(text: str, flag: str) -> list[int]:
    from distserver.bench.sides import SizeError, parse_size
    from distserver.bench.transfer import MAX_SIZE

    sizes = []
    for item in text.split(","):
        if not item.strip():
            continue
        try:
            nbytes = parse_size(item)
        except SizeError as exc:
            raise UsageError(f"{flag}: {exc}") from None
        if nbytes > MAX_SIZE:
            raise UsageError(f"{flag}: {item.strip()} is over the largest size, 1GiB")
        if nbytes not in sizes:
            sizes.append(nbytes)
    if not sizes:
        raise UsageError(f"{flag}: give at least one size, e.g. 4KiB,1MiB")
    return sorted(sizes)


def _parse_protocols(text: str) -> list[str]:
    from distserver.bench.transfer import PROTOCOLS

    protocols = [p.strip() for p in text.split(",") if p.strip()]
    unknown = [p for p in protocols if p not in PROTOCOLS]
    if unknown:
        raise UsageError(f"--protocols: unknown {', '.join(unknown)}; valid: {', '.join(PROTOCOLS)}")
    if not protocols:
        raise UsageError(f"--protocols: give at least one of {', '.join(PROTOCOLS)}")
    return list(dict.fromkeys(protocols))


def _cluster(text: str | None) -> tuple[dict[str, list[str]] | None, str]:
    """The running cluster to measure (from --cluster, else TF_CONFIG), and where it came from."""
    if text is not None:
        source, raw = "--cluster", text
        try:
            cluster = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise UsageError(f"--cluster is not valid JSON: {exc}") from None
    elif os.environ.get("TF_CONFIG"):
        source = "TF_CONFIG"
        try:
            cluster = json.loads(os.environ["TF_CONFIG"]).get("cluster")
        except (json.JSONDecodeError, AttributeError) as exc:
            raise UsageError(f"TF_CONFIG is not a JSON object: {exc}") from None
        if cluster is None:
            raise UsageError("TF_CONFIG has no 'cluster'; unset TF_CONFIG to start local clusters")
    else:
        return None, ""
    if not isinstance(cluster, dict):
        raise UsageError(f"{source}: the cluster must be a JSON object of job -> list of addresses")
    for job in ("ps", "worker"):
        addresses = cluster.get(job)
        if not (isinstance(addresses, list) and addresses and all(isinstance(a, str) for a in addresses)):
            jobs = ", ".join(sorted(map(str, cluster))) or "none"
            raise UsageError(
                f'{source}: the benchmarks need a "{job}" job (a list of "host:port"); '
                f"the cluster has: {jobs}"
            )
    return {job: list(cluster[job]) for job in ("ps", "worker")}, source


def _options(args: argparse.Namespace) -> Any:
    from distserver.bench.transfer import Options

    if args.warmup < 0:
        raise UsageError("--warmup must be 0 or more")
    if args.repeats is not None and args.repeats < 1:
        raise UsageError("--repeats must be 1 or more")
    if args.rounds < 1:
        raise UsageError("--rounds must be 1 or more")
    if args.concurrency < 0:
        raise UsageError("--concurrency must be 0 (skip) or more")
    if args.max_seconds <= 0:
        raise UsageError("--max-seconds must be positive")
    if args.plot is not None and importlib.util.find_spec("matplotlib") is None:
        raise UsageError(
            "--plot needs matplotlib, which is not installed: pip install 'distserver[bench]' (or matplotlib)"
        )
    cluster, source = _cluster(args.cluster)
    [concurrency_size] = _parse_sizes(args.concurrency_size, "--concurrency-size")
    return Options(
        protocols=_parse_protocols(args.protocols),
        sizes=_parse_sizes(args.sizes, "--sizes"),
        warmup=args.warmup,
        repeats=args.repeats,
        rounds=args.rounds,
        concurrency=args.concurrency,
        concurrency_size=concurrency_size,
        cluster=cluster,
        cluster_source=source,
        tf_python=args.tf_python,
        max_seconds=args.max_seconds,
        command=" ".join(["distserver", *sys.argv[1:]]) if sys.argv[1:2] == ["bench"] else "distserver bench",
    )


def _training(args: argparse.Namespace) -> int:
    for name in TRAINING_MODULES:
        try:
            found = importlib.util.find_spec(name) is not None
        except ModuleNotFoundError:
            found = False
        if found:
            module = importlib.import_module(name)
            code: int = module.run_cli(args)
            return code
    print(
        "distserver bench: --workload training is not available yet (this installation has no "
        f"{' or '.join(TRAINING_MODULES)}); use --workload transfer",
        file=sys.stderr,
    )
    return 2


def _terminate(signum: int, frame: Any) -> None:
    raise SystemExit(f"distserver bench: stopped by signal {signum}")


def main(args: argparse.Namespace) -> int:
    """Run `distserver bench`; the exit status (1: some measurement failed, 2: bad options)."""
    if args.workload == "training":
        return _training(args)
    try:
        options = _options(args)
    except UsageError as exc:
        print(f"distserver bench: {exc}", file=sys.stderr)
        return 2
    from distserver.bench import transfer

    for path in (args.json, args.plot):
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)  # now, not after the run
    if options.cluster is not None:
        print(f"distserver bench: measuring the running cluster of {options.cluster_source}", file=sys.stderr)
    # SIGTERM unwinds like Ctrl-C, so every process started is stopped on the way out.
    signal.signal(signal.SIGTERM, _terminate)
    try:
        data = transfer.run(options)
    except KeyboardInterrupt:
        print("distserver bench: interrupted", file=sys.stderr)
        return 130
    print(transfer.tables(data))
    print(f"\n(whole run: {data['wall_s']:.0f} s)")
    if args.json is not None:
        args.json.write_text(json.dumps(data, indent=1))
        print(f"distserver bench: wrote {args.json}", file=sys.stderr)
    if args.plot is not None:
        transfer.plot(data, args.plot)
        print(f"distserver bench: wrote {args.plot}", file=sys.stderr)
    return 1 if data["errors"] else 0
