"""`distserver bench`, driven through the real command line in subprocesses.

The small run starts real clusters (one OS process per task) and a real grpcio
server process; only the sizes and repeats are small. No test checks a timing.
"""

from __future__ import annotations

import json
import struct
import subprocess
import sys
import zlib

import pytest

from distserver.testing import LocalCluster

RESULT_FIELDS = {"median_s", "min_s", "max_s", "q1_s", "q3_s", "mb_per_s", "repeat", "times_s"}


def bench(args, env, timeout=240):
    return subprocess.run(
        [sys.executable, "-m", "distserver", "bench", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def png_chunks(data: bytes) -> list[tuple[bytes, bytes]]:
    """The chunks of a PNG, each CRC checked; fails on anything that is not a PNG."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "no PNG signature"
    chunks, offset = [], 8
    while offset < len(data):
        length, kind = struct.unpack(">I4s", data[offset : offset + 8])
        body = data[offset + 8 : offset + 8 + length]
        (crc,) = struct.unpack(">I", data[offset + 8 + length : offset + 12 + length])
        assert zlib.crc32(kind + body) == crc, f"bad CRC in chunk {kind!r}"
        chunks.append((kind, body))
        offset += 12 + length
    return chunks


def check_result(result, nbytes, repeats):
    assert "error" not in result, result
    assert set(result) >= RESULT_FIELDS
    assert result["repeat"] == repeats == len(result["times_s"])
    assert result["min_s"] <= result["q1_s"] <= result["median_s"] <= result["q3_s"] <= result["max_s"]
    assert result["mb_per_s"] == pytest.approx(nbytes / 1e6 / result["median_s"])


@pytest.mark.slow
def test_small_run_writes_the_table_json_and_png(python_env, tmp_path):
    out_json, out_png = tmp_path / "out" / "bench.json", tmp_path / "out" / "bench.png"
    args = [
        "--protocols", "grpc,memcpy", "--sizes", "4KiB,16KiB", "--repeats", "1", "--warmup", "0",
        "--rounds", "1", "--concurrency", "2", "--concurrency-size", "4KiB",
        "--json", str(out_json), "--plot", str(out_png),
    ]  # fmt: skip
    result = bench(args, python_env)
    assert result.returncode == 0, result.stderr

    assert "### RecvTensor ps -> worker" in result.stdout
    assert "| 16 KiB | 1 |" in result.stdout
    assert "[bench] [" in result.stderr  # the plain progress lines (stderr is not a terminal)

    data = json.loads(out_json.read_text())
    assert data["workload"] == "transfer"
    assert data["command"].startswith("distserver bench --protocols grpc,memcpy")
    assert data["errors"] == []
    assert data["skipped"] == []
    machine = data["machine"]
    assert machine["cpu_count"] >= 1
    assert 0 < machine["memory_available"] <= machine["memory_total"]
    assert machine["python"].count(".") == 2
    assert machine["versions"]["distserver"]
    assert machine["versions"]["grpcio"]
    assert data["params"]["sizes"] == [4096, 16384]
    assert set(data["series"]) == {"grpc", "memcpy"}
    assert data["series"]["grpc"]["protocol"] == "grpc"
    for series in ("grpc", "memcpy"):
        assert set(data["recv"][series]) == {"4096", "16384"}
        for key, result_ in data["recv"][series].items():
            check_result(result_, int(key), 1)
    for kind in ("fetch", "feed"):
        assert set(data[kind]) == {"grpc"}  # the baselines have no client to fetch to or feed from
        assert set(data[kind]["grpc"]) == {"4096", "16384"}
        for key, result_ in data[kind]["grpc"].items():
            check_result(result_, int(key), 1)
    concurrent = data["concurrent_steps"]["grpc"]
    assert set(concurrent) == {"1", "2"}
    assert concurrent["2"]["steps"] == 2
    assert concurrent["2"]["concurrency"] == 2
    pushed = data["push_to_ps"]["grpc"]
    assert set(pushed) == {"1", "2"}
    assert pushed["2"]["workers"] == 2
    assert pushed["2"]["nbytes"] == 2 * 4096  # per step, from both workers together

    chunks = png_chunks(out_png.read_bytes())
    kinds = [kind for kind, _ in chunks]
    assert kinds[0] == b"IHDR"
    assert kinds[-1] == b"IEND"
    assert b"IDAT" in kinds
    width, height = struct.unpack(">II", chunks[0][1][:8])
    assert width >= 600
    assert height >= 400


@pytest.mark.slow
def test_a_running_cluster_from_the_command_line_is_measured_instead_of_local_ones(python_env, tmp_path):
    out_json = tmp_path / "bench.json"
    with LocalCluster({"ps": 1, "worker": 1}) as cluster:
        result = bench(
            [
                "--cluster",
                json.dumps(cluster.cluster),
                "--protocols",
                "grpc,grpc+verbs",
                "--sizes",
                "4KiB",
                "--repeats",
                "1",
                "--warmup",
                "0",
                "--concurrency",
                "2",
                "--json",
                str(out_json),
            ],
            python_env,
        )
    assert result.returncode == 0, result.stderr
    data = json.loads(out_json.read_text())
    assert set(data["series"]) == {"cluster"}
    check_result(data["recv"]["cluster"]["4096"], 4096, 1)
    assert set(data["push_to_ps"]["cluster"]) == {"1"}  # the cluster has one worker
    assert any("grpc+verbs: no local cluster" in reason for reason in data["skipped"])
    assert any("the cluster has 1 workers, not 2" in reason for reason in data["skipped"])


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--protocols", "grpc,udp"],
            "--protocols: unknown udp; valid: grpc, grpc+verbs, memcpy, grpcio, tensorflow",
        ),
        (["--sizes", "4KiB,3B"], "--sizes: size '3B' must be a positive multiple of 4 bytes"),
        (["--sizes", "lots"], "--sizes: size 'LOTS' is not a number of bytes"),
        (["--sizes", "2GiB"], "--sizes: 2GiB is over the largest size, 1GiB"),
        (["--repeats", "0"], "--repeats must be 1 or more"),
        (["--cluster", "{"], "--cluster is not valid JSON"),
        (["--cluster", '{"worker": ["localhost:1"]}'], '--cluster: the benchmarks need a "ps" job'),
        (
            ["--workload", "training", "--protocols", "memcpy"],
            "--workload training measures grpc, grpc+verbs",
        ),
        (["--workload", "training", "--protocols", "grpc,udp"], "--protocols: unknown udp"),
    ],
)
def test_bad_options_exit_2_naming_the_option(python_env, args, message):
    result = bench(args, python_env, timeout=60)
    assert result.returncode == 2
    assert message in result.stderr
    assert "Traceback" not in result.stderr


def test_a_bad_tf_config_is_named(python_env):
    result = bench(["--sizes", "4KiB"], {**python_env, "TF_CONFIG": "[1, 2]"}, timeout=60)
    assert result.returncode == 2
    assert "TF_CONFIG is not a JSON object" in result.stderr


def test_series_that_do_not_fit_in_memory_together_are_measured_in_turn_or_skipped():
    from distserver.bench.sides import ClusterSide, MemcpySide
    from distserver.bench.transfer import GiB, memory_groups, memory_shortfall

    grpc, verbs, memcpy = ClusterSide("grpc", "grpc"), ClusterSide("grpc+verbs", "grpc+verbs"), MemcpySide()
    series = [grpc, verbs, memcpy]
    assert memory_shortfall(GiB, series, available=16 * GiB) is None
    assert memory_groups(GiB, series, available=16 * GiB) == ([series], [])
    reason = memory_shortfall(GiB, series, available=8 * GiB)
    assert reason == "needs about 12.0 GiB (12 copies of 1 GiB across 3 series), 8.0 GiB available"
    # 9 GiB: 80% holds one cluster (5 copies) plus memcpy (2), not two clusters.
    assert memory_groups(GiB, series, available=9 * GiB) == ([[grpc], [verbs, memcpy]], [])
    # 4 GiB: a cluster does not fit even alone; memcpy does.
    assert memory_groups(GiB, series, available=4 * GiB) == ([[memcpy]], [grpc, verbs])
    # A running cluster's memory is not ours to count: only the client's copy.
    external = ClusterSide("cluster", "external", target="grpc://h:1", ps_target="grpc://h:2")
    assert memory_shortfall(GiB, [external], available=2 * GiB) is None


def test_progress_is_plain_lines_off_a_terminal_and_a_bar_on_one():
    import io

    from distserver.bench.progress import Progress

    plain = io.StringIO()
    progress = Progress(2, plain)
    assert not progress.live
    progress.start("RecvTensor 4 KiB")
    progress.done()
    progress.write("starting grpc")
    progress.close()
    lines = plain.getvalue().splitlines()
    assert lines[0].startswith("[bench] [1/2] RecvTensor 4 KiB (")
    assert lines[1] == "[bench] starting grpc"

    pytest.importorskip("tqdm")  # the bench extra
    terminal = io.StringIO()
    progress = Progress(2, terminal, live=True)
    assert progress.live
    progress.start("fetch 1 MiB")
    progress.done()
    progress.close()
    assert "fetch 1 MiB" in terminal.getvalue()
    assert "1/2" in terminal.getvalue()


def test_the_grpcio_baseline_server_refuses_a_bad_size_and_serves_a_good_one():
    import grpc

    from distserver.bench.grpcio_baseline import MAX_BYTES, STREAM, UNARY, GrpcioSide

    side = GrpcioSide("grpcio unary", "unary")
    side.start()
    try:
        assert side.channel is not None
        unary = side.channel.unary_unary(UNARY)
        for request in (b"abc", (0).to_bytes(8, "little"), (MAX_BYTES + 1).to_bytes(8, "little")):
            with pytest.raises(grpc.RpcError) as failure:
                unary(request, timeout=30)
            assert failure.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert unary((4096).to_bytes(8, "little"), timeout=30) == b"\x01" * 4096
        chunks = list(side.channel.unary_stream(STREAM)(((1 << 20) + 4).to_bytes(8, "little"), timeout=30))
        assert [len(chunk) for chunk in chunks] == [1 << 20, 4]
    finally:
        side.stop()
    assert side.proc is None
