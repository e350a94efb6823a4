#!/usr/bin/env python3
"""Probe: how fast can one process fetch a float32 numpy array from another over grpc.aio?

Standalone research script (imports only grpc, numpy, uvloop + stdlib).  It starts a
grpc.aio server process (spawn) that holds pre-made float32 arrays, then client processes
(spawn) that fetch them with several strategies and report median MB/s (10^6 B/s), the
receiver's minor page faults per transfer, CPU per transfer on both sides, and the 4-byte
unary round trip.

Strategies (all generic handlers with identity serializers, i.e. raw ``bytes`` on the wire):
  A   unary; response = hand-assembled TF ``RecvTensorResponse`` (tensor{dtype, shape,
      tensor_content}); receiver parses the tiny header by hand and wraps the content with
      ``np.frombuffer(resp, offset=...)`` (read-only view, no extra copy).
      A-copy: same + copy into a fresh writable array.  A-cached: server returns a pre-built
      response (shows the cost of the sender's own assembly copy).
  B   unary-stream: header message (dtype, shape, nbytes) then raw chunks; receiver copies
      each chunk into a preallocated ``np.empty`` (memoryview slice assignment) -- "into",
      or collects and ``b"".join`` -- "join".  B-fused: header glued to the first chunk.
  C   B with the sender yielding ``memoryview`` / ``bytearray`` slices.  Finding: grpcio 1.85
      rejects them (SendMessageOperation takes exact ``bytes``: "Expected bytes, got
      memoryview"), so the sender must build ``bytes`` (``mv[a:b].tobytes()``).
  D   k concurrent unary calls each fetching a byte range, on 1 channel or k channels.
  E   sync grpc client called from a worker thread (separate process).

Presets (--preset / --sweep-presets): "base" = max message lengths -1, so_reuseport 0;
"mallopt" = base + glibc mallopt(M_MMAP_MAX=0, M_TRIM_THRESHOLD=1 GiB) in both processes;
others add HTTP/2 / TCP channel args, GRPC_EXPERIMENTS or GLIBC_TUNABLES (see PRESETS).

Usage:  python benchmarks/probe_grpc_transfer.py            # default run, base + mallopt (~3 min)
        python benchmarks/probe_grpc_transfer.py --quick    # fewer strategies / sizes
        python benchmarks/probe_grpc_transfer.py --sweep    # channel-option / malloc sweep
        python benchmarks/probe_grpc_transfer.py --json out.json
Everything binds to 127.0.0.1 on an ephemeral port; all loops are bounded; children are
terminated in ``finally``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import resource
import statistics
import struct
import sys
import time

import grpc
import numpy as np

SERVICE = "probe.P"
KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
SIZES = [4 * KiB, 64 * KiB, 1 * MiB, 16 * MiB, 64 * MiB, 256 * MiB]
# Measured repetitions per size (after one validated warm-up call).
REPS = {4 * KiB: 200, 64 * KiB: 120, 1 * MiB: 40, 16 * MiB: 24, 64 * MiB: 10, 256 * MiB: 4}


def reps_for(nbytes: int) -> int:
    return REPS.get(nbytes) or max(3, min(200, (256 * MiB) // nbytes // 8))


BIG = 2 * GiB + 256 * MiB  # the "> 2 GiB" functional check
RPC_TIMEOUT = 120.0  # seconds, every RPC has a deadline
DT_FLOAT = 1  # tensorflow.DataType.DT_FLOAT

# ----------------------------------------------------------------------------------------
# Option presets.  Channel arguments are applied to the server and to every client channel;
# env is applied to both processes before they start (glibc / gRPC read it at start-up).
# ----------------------------------------------------------------------------------------
BASE_OPTS = [
    ("grpc.max_send_message_length", -1),
    ("grpc.max_receive_message_length", -1),
    ("grpc.so_reuseport", 0),
]
PRESETS: dict[str, dict] = {
    "base": {"opts": [], "env": {}},
    "srv_asyncio": {"opts": [], "env": {}, "server_uvloop": False},
    "frame16M": {"opts": [("grpc.http2.max_frame_size", 16 * MiB - 1)], "env": {}},
    "wbuf": {"opts": [("grpc.http2.write_buffer_size", 64 * MiB)], "env": {}},
    "lookahead": {"opts": [("grpc.http2.lookahead_bytes", 64 * MiB)], "env": {}},
    "nobdp": {"opts": [("grpc.http2.bdp_probe", 0)], "env": {}},
    "readchunk": {
        "opts": [
            ("grpc.experimental.tcp_read_chunk_size", 4 * MiB),
            ("grpc.experimental.tcp_min_read_chunk_size", 1 * MiB),
            ("grpc.experimental.tcp_max_read_chunk_size", 16 * MiB),
        ],
        "env": {},
    },
    "rcvbuf": {"opts": [("grpc.tcp_receive_buffer_size", 4 * MiB)], "env": {}},
    "exp_lowat": {"opts": [], "env": {"GRPC_EXPERIMENTS": "tcp_rcv_lowat"}},
    "exp_fst": {"opts": [], "env": {"GRPC_EXPERIMENTS": "tcp_frame_size_tuning"}},
    # glibc malloc: serve big blocks from transparent huge pages (2 MiB faults, not 4 KiB)
    "thp": {"opts": [], "env": {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}},
    # glibc malloc: never mmap, never trim -> freed big blocks are reused, no new faults
    "nommap": {
        "opts": [],
        "env": {"GLIBC_TUNABLES": "glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=4294967296"},
    },
    # the same as "nommap" but set at run time with mallopt() (no environment needed)
    "mallopt": {"opts": [], "env": {"PROBE_MALLOPT": "1"}},
    "thp+nommap": {
        "opts": [],
        "env": {
            "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1:glibc.malloc.mmap_max=0"
            ":glibc.malloc.trim_threshold=4294967296"
        },
    },
}


def preset_opts(names: list[str]) -> tuple[list, dict]:
    opts, env = list(BASE_OPTS), {}
    for n in names:
        p = PRESETS[n]
        opts += p["opts"]
        for k, v in p["env"].items():
            env[k] = (
                (env[k] + ":" + v)
                if k == "GLIBC_TUNABLES" and k in env
                else ((env[k] + "," + v) if k == "GRPC_EXPERIMENTS" and k in env else v)
            )
    return opts, env


# ----------------------------------------------------------------------------------------
# Hand-written protobuf: RecvTensorResponse{ tensor(1): TensorProto{ dtype(1), shape(2),
# tensor_content(4) } }.  The content is the last field so the receiver can use it in place.
# ----------------------------------------------------------------------------------------
def _varint(n: int) -> bytes:
    out = bytearray()
    for _ in range(10):  # a uint64 varint has at most 10 bytes
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)
    raise ValueError("varint too large")


def _read_varint(buf, pos: int) -> tuple[int, int]:
    result = 0
    for shift in range(0, 70, 7):
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
    raise ValueError("bad varint")


def recv_tensor_response_prefix(dtype: int, shape: tuple[int, ...], nbytes: int) -> bytes:
    """Bytes such that ``prefix + raw_content`` is a valid serialized RecvTensorResponse."""
    shape_msg = b"".join(b"\x12" + _varint(len(d)) + d for d in (b"\x08" + _varint(s) for s in shape))
    tensor_prefix = (
        b"\x08" + _varint(dtype) + b"\x12" + _varint(len(shape_msg)) + shape_msg + b"\x22" + _varint(nbytes)
    )
    return b"\x0a" + _varint(len(tensor_prefix) + nbytes) + tensor_prefix


def _skip_field(buf, pos: int, wt: int) -> int:
    if wt == 0:
        return _read_varint(buf, pos)[1]
    if wt == 1:
        return pos + 8
    if wt == 2:
        n, pos = _read_varint(buf, pos)
        return pos + n
    if wt == 5:
        return pos + 4
    raise ValueError(f"unsupported wire type {wt}")


def parse_recv_tensor_response(buf) -> tuple[int, tuple[int, ...], int, int]:
    """Returns (dtype, shape, content_offset, content_len) without copying the content."""
    dtype, shape, off, clen = 0, (), -1, 0
    pos, end = 0, len(buf)
    for _ in range(256):  # outer fields: tensor, is_dead, send_start_micros, ...
        if pos >= end:
            break
        key, pos = _read_varint(buf, pos)
        if key == 0x0A:  # tensor
            tlen, pos = _read_varint(buf, pos)
            tend = pos + tlen
            for _ in range(256):
                if pos >= tend:
                    break
                k, pos = _read_varint(buf, pos)
                if k == 0x08:
                    dtype, pos = _read_varint(buf, pos)
                elif k == 0x12:  # TensorShapeProto
                    slen, pos = _read_varint(buf, pos)
                    send, dims = pos + slen, []
                    for _ in range(64):
                        if pos >= send:
                            break
                        dk, pos = _read_varint(buf, pos)
                        if dk == 0x12:  # Dim
                            dlen, pos = _read_varint(buf, pos)
                            dend, size = pos + dlen, 0
                            for _ in range(8):
                                if pos >= dend:
                                    break
                                fk, pos = _read_varint(buf, pos)
                                if fk == 0x08:
                                    size, pos = _read_varint(buf, pos)
                                else:
                                    pos = _skip_field(buf, pos, fk & 7)
                            dims.append(size)
                        else:
                            pos = _skip_field(buf, pos, dk & 7)
                    shape = tuple(dims)
                elif k == 0x22:  # tensor_content
                    clen, pos = _read_varint(buf, pos)
                    off = pos
                    pos += clen
                else:
                    pos = _skip_field(buf, pos, k & 7)
        else:
            pos = _skip_field(buf, pos, key & 7)
    return dtype, shape, off, clen


# ----------------------------------------------------------------------------------------
# Requests: <Q nbytes-key> <Q offset> <Q length> <I chunk> <B flags>
# ----------------------------------------------------------------------------------------
REQ = struct.Struct("<QQQIB")
F_CACHED, F_MV, F_FUSED, F_BYTEARRAY = 1, 2, 4, 8
STREAM_HDR = struct.Struct("<BBQ")  # dtype, ndim, nbytes, followed by ndim * <q


def stream_header(dtype: int, shape: tuple[int, ...], nbytes: int) -> bytes:
    return STREAM_HDR.pack(dtype, len(shape), nbytes) + struct.pack(f"<{len(shape)}q", *shape)


def parse_stream_header(buf) -> tuple[int, tuple[int, ...], int, int]:
    dtype, ndim, nbytes = STREAM_HDR.unpack_from(buf, 0)
    shape = struct.unpack_from(f"<{ndim}q", buf, STREAM_HDR.size)
    return dtype, shape, nbytes, STREAM_HDR.size + 8 * ndim


def make_array(nbytes: int) -> np.ndarray:
    """float32 array with a[i] == i % 1000 (built in blocks; exact for any size)."""
    n = nbytes // 4
    a = np.empty(n, np.float32)
    pattern = np.arange(1000, dtype=np.float32)
    block = 1000 * 4096
    tile = np.tile(pattern, 4096)
    for start in range(0, n, block):
        m = min(block, n - start)
        a[start : start + m] = tile[:m]
    return a


def apply_mallopt() -> None:
    """If PROBE_MALLOPT=1: glibc mallopt(M_MMAP_MAX, 0) and a 1 GiB M_TRIM_THRESHOLD, i.e. big
    blocks come from the heap and freed ones are kept for reuse (no fresh page faults)."""
    if os.environ.get("PROBE_MALLOPT") != "1":
        return
    import ctypes

    libc = ctypes.CDLL(None)
    m_trim_threshold, m_mmap_max = -1, -4
    if not (libc.mallopt(m_mmap_max, 0) and libc.mallopt(m_trim_threshold, 1 << 30)):
        raise RuntimeError("mallopt failed")


def _rusage() -> bytes:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return struct.pack("<qdd", r.ru_minflt, r.ru_utime, r.ru_stime)


# ----------------------------------------------------------------------------------------
# Server process
# ----------------------------------------------------------------------------------------
def server_main(port_q, stop_ev, opts: list, use_uvloop: bool) -> None:
    import uvloop

    apply_mallopt()
    arrays = {n: make_array(n) for n in SIZES}
    cached = {n: recv_tensor_response_prefix(DT_FLOAT, (n // 4,), n) + arrays[n].tobytes() for n in SIZES}
    big_holder: dict[int, np.ndarray] = {}

    def get_array(key: int) -> np.ndarray:
        if key in arrays:
            return arrays[key]
        if key % 4 or not 0 < key <= BIG:
            raise KeyError(key)
        if key not in big_holder:  # sizes outside SIZES are built on first use (warm-up)
            big_holder[key] = make_array(key)
        return big_holder[key]

    async def ping(req: bytes, ctx) -> bytes:
        return req

    async def rusage(req: bytes, ctx) -> bytes:
        return _rusage()

    async def drop_big(req: bytes, ctx) -> bytes:
        big_holder.clear()
        return b""

    async def unary(req: bytes, ctx) -> bytes:
        key, off, length, _chunk, flags = REQ.unpack(req)
        if flags & F_CACHED:
            if key not in cached:
                cached[key] = (
                    recv_tensor_response_prefix(DT_FLOAT, (key // 4,), key) + get_array(key).tobytes()
                )
            return cached[key]
        mv = memoryview(get_array(key)).cast("B")
        if length == 0:
            length = key - off
        # one copy: the header and the tensor bytes are joined straight into a new bytes
        return b"".join(
            (recv_tensor_response_prefix(DT_FLOAT, (length // 4,), length), mv[off : off + length])
        )

    async def stream(req: bytes, ctx):
        key, off, length, chunk, flags = REQ.unpack(req)
        mv = memoryview(get_array(key)).cast("B")
        if length == 0:
            length = key - off
        hdr = stream_header(DT_FLOAT, (length // 4,), length)
        pos, end = off, off + length
        if flags & F_FUSED:
            first = min(chunk, length)
            yield b"".join((hdr, mv[pos : pos + first]))
            pos += first
        else:
            yield hdr
        for _ in range((length + chunk - 1) // chunk + 1):
            if pos >= end:
                break
            piece = mv[pos : min(pos + chunk, end)]
            if flags & F_MV:
                yield piece  # grpc converts with bytes() itself
            elif flags & F_BYTEARRAY:
                yield bytearray(piece)
            else:
                yield piece.tobytes()
            pos += len(piece)

    async def run() -> None:
        server = grpc.aio.server(options=opts)
        handlers = {
            "Ping": grpc.unary_unary_rpc_method_handler(ping),
            "Rusage": grpc.unary_unary_rpc_method_handler(rusage),
            "DropBig": grpc.unary_unary_rpc_method_handler(drop_big),
            "Unary": grpc.unary_unary_rpc_method_handler(unary),
            "Stream": grpc.unary_stream_rpc_method_handler(stream),
        }
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        port_q.put(port)
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, stop_ev.wait, 3600.0)  # bounded lifetime
        await server.stop(0.5)

    if use_uvloop:
        uvloop.run(run())
    else:
        asyncio.run(run())


# ----------------------------------------------------------------------------------------
# Client helpers
# ----------------------------------------------------------------------------------------
def _usage_now() -> tuple[int, float]:
    """(minor faults, CPU seconds) of this whole process (all threads)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_minflt, r.ru_utime + r.ru_stime


def _usage_since(u0: tuple[int, float]) -> tuple[int, float]:
    u1 = _usage_now()
    return u1[0] - u0[0], u1[1] - u0[1]


def _check(arr: np.ndarray, nbytes: int, off: int = 0) -> None:
    n = nbytes // 4
    if arr.dtype != np.float32 or arr.size != n:
        raise AssertionError(f"bad array {arr.dtype} {arr.shape} vs {n}")
    start = off // 4
    idx = np.unique(np.linspace(0, n - 1, num=min(n, 4097)).astype(np.int64))
    exp = ((idx + start) % 1000).astype(np.float32)
    if not np.array_equal(arr[idx], exp):
        raise AssertionError("content mismatch")


class AioClient:
    def __init__(self, port: int, opts: list, nchan: int = 4):
        self.target = f"127.0.0.1:{port}"
        # distinct channel args -> distinct subchannels -> distinct TCP connections
        self.chans = [
            grpc.aio.insecure_channel(self.target, options=[*opts, ("probe.chan", i)]) for i in range(nchan)
        ]
        self.unary = [c.unary_unary(f"/{SERVICE}/Unary") for c in self.chans]
        self.stream = [c.unary_stream(f"/{SERVICE}/Stream") for c in self.chans]
        self.ping = self.chans[0].unary_unary(f"/{SERVICE}/Ping")
        self.ping_reg = self.chans[0].unary_unary(f"/{SERVICE}/Ping", _registered_method=True)
        self.srv_rusage = self.chans[0].unary_unary(f"/{SERVICE}/Rusage")
        self.drop_big = self.chans[0].unary_unary(f"/{SERVICE}/DropBig")

    async def ready(self) -> None:
        for c in self.chans:
            await asyncio.wait_for(c.channel_ready(), 30)

    async def close(self) -> None:
        for c in self.chans:
            await c.close()

    # ---- A: unary RecvTensorResponse -------------------------------------------------
    async def fetch_unary(self, key: int, copy: bool, cached: bool = False, ch: int = 0):
        resp = await self.unary[ch](REQ.pack(key, 0, 0, 0, F_CACHED if cached else 0), timeout=RPC_TIMEOUT)
        _dtype, shape, off, clen = parse_recv_tensor_response(resp)
        arr = np.frombuffer(resp, dtype=np.float32, count=clen // 4, offset=off).reshape(shape)
        if copy:
            out = np.empty(shape, np.float32)
            np.copyto(out, arr)
            return out
        return arr

    # ---- D: k parallel unary ranges ------------------------------------------------------
    async def fetch_par(self, key: int, k: int, multi_chan: bool):
        out = np.empty(key // 4, np.float32)
        omv = memoryview(out).cast("B")
        per = ((key // k + 4095) // 4096) * 4096

        async def part(i: int) -> None:
            off = i * per
            ln = min(per, key - off)
            if ln <= 0:
                return
            ch = i % len(self.chans) if multi_chan else 0
            resp = await self.unary[ch](REQ.pack(key, off, ln, 0, 0), timeout=RPC_TIMEOUT)
            _dt, _sh, coff, clen = parse_recv_tensor_response(resp)
            omv[off : off + clen] = memoryview(resp)[coff : coff + clen]

        await asyncio.gather(*(part(i) for i in range(k)))
        return out

    # ---- B / C: unary-stream -------------------------------------------------------------
    async def fetch_stream(
        self,
        key: int,
        chunk: int,
        flags: int,
        join: bool,
        ch: int = 0,
        off: int = 0,
        length: int = 0,
        out_mv=None,
    ):
        call = self.stream[ch](REQ.pack(key, off, length, chunk, flags), timeout=RPC_TIMEOUT)
        first = await call.read()
        _dt, shape, nbytes, hlen = parse_stream_header(first)
        nmsg = (nbytes + chunk - 1) // chunk + 2
        if join:
            parts = [memoryview(first)[hlen:]] if len(first) > hlen else []
            for _ in range(nmsg):
                m = await call.read()
                if m is grpc.aio.EOF:
                    break
                parts.append(m)
            data = b"".join(parts)
            if len(data) != nbytes:
                raise AssertionError("short stream")
            return np.frombuffer(data, np.float32).reshape(shape)
        if out_mv is None:
            out = np.empty(shape, np.float32)
            mv = memoryview(out).cast("B")
        else:
            out, mv = None, out_mv
        pos = 0
        if len(first) > hlen:
            n = len(first) - hlen
            mv[0:n] = memoryview(first)[hlen:]
            pos = n
        for _ in range(nmsg):
            m = await call.read()
            if m is grpc.aio.EOF:
                break
            n = len(m)
            mv[pos : pos + n] = m
            pos += n
        if pos != nbytes:
            raise AssertionError(f"short stream {pos} != {nbytes}")
        return out

    async def fetch_par_stream(self, key: int, k: int, chunk: int):
        out = np.empty(key // 4, np.float32)
        omv = memoryview(out).cast("B")
        per = ((key // k + 4095) // 4096) * 4096
        coros = []
        for i in range(k):
            off = i * per
            ln = min(per, key - off)
            if ln > 0:
                coros.append(
                    self.fetch_stream(
                        key,
                        chunk,
                        F_FUSED,
                        False,
                        ch=i % len(self.chans),
                        off=off,
                        length=ln,
                        out_mv=omv[off : off + ln],
                    )
                )
        await asyncio.gather(*coros)
        return out


async def _srv_usage(cli: AioClient) -> tuple[int, float]:
    minflt, ut, st = struct.unpack("<qdd", await cli.srv_rusage(b"", timeout=RPC_TIMEOUT))
    return minflt, ut + st


async def measure_async(cli: AioClient, cases: list, sizes: list, reps_scale: float, results: list) -> None:
    """cases: [(name, fn(nbytes) -> ndarray, sizes)].  For each size all cases are warmed up
    and validated, then timed round-robin (one call of each case per round) so that machine
    drift hits every case alike."""
    for nbytes in sizes:
        live = []
        for name, fn, szs in cases:
            if nbytes not in szs:
                continue
            try:
                arr = await fn(nbytes)  # warm-up + validation
                _check(arr, nbytes)
                del arr
                live.append([name, fn, [], [], [], [], []])
            except Exception as e:
                results.append(dict(strategy=name, nbytes=nbytes, error=f"{type(e).__name__}: {e}"[:300]))
        reps = max(2, int(reps_for(nbytes) * reps_scale))
        for _ in range(reps):
            for case in live:
                if case[6]:  # failed earlier
                    continue
                name, fn, times, faults, cpus, srv = case[:6]
                try:
                    s0 = await _srv_usage(cli)
                    f = _usage_now()
                    t0 = time.perf_counter()
                    arr = await fn(nbytes)
                    dt = time.perf_counter() - t0
                    fl, cpu = _usage_since(f)
                    del arr
                    s1 = await _srv_usage(cli)
                    times.append(dt)
                    faults.append(fl)
                    cpus.append(cpu)
                    srv.append((s1[0] - s0[0], s1[1] - s0[1]))
                except Exception as e:
                    case[6].append(f"{type(e).__name__}: {e}"[:300])
        for name, _fn, times, faults, cpus, srv, err in live:
            if err:
                results.append(dict(strategy=name, nbytes=nbytes, error=err[0]))
                continue
            med = statistics.median(times)
            results.append(
                dict(
                    strategy=name,
                    nbytes=nbytes,
                    reps=len(times),
                    median_s=med,
                    mbps=nbytes / med / 1e6,
                    best_mbps=nbytes / min(times) / 1e6,
                    cli_faults=statistics.median(faults),
                    cli_cpu_ms=1e3 * statistics.fmean(cpus),
                    srv_faults=statistics.median(x[0] for x in srv),
                    srv_cpu_ms=1e3 * statistics.fmean(x[1] for x in srv),
                )
            )


async def ping_latency(cli: AioClient, n: int, fn=None) -> dict:
    req = b"\x00\x01\x02\x03"
    if fn is None:

        def fn():
            return cli.ping(req, timeout=RPC_TIMEOUT)

    for _ in range(50):
        await fn()
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        await fn()
        ts.append(time.perf_counter() - t0)
    ts.sort()
    return dict(
        median_us=1e6 * statistics.median(ts),
        p10_us=1e6 * ts[len(ts) // 10],
        p90_us=1e6 * ts[(9 * len(ts)) // 10],
        n=n,
    )


def plan_strategies(cli: AioClient, quick: bool, sizes: list) -> list[tuple[str, object, list]]:
    """(name, fn(nbytes) -> awaitable ndarray, sizes)."""
    extra = [s for s in sizes if s not in SIZES]  # --sizes outside the default list
    big = [s for s in SIZES if s >= 1 * MiB] + extra

    def unary(copy: bool, cached: bool = False):
        return lambda n: cli.fetch_unary(n, copy, cached=cached)

    def stream(chunk: int, flags: int, join: bool):
        return lambda n: cli.fetch_stream(n, chunk, flags, join)

    def par(k: int, multi_chan: bool):
        return lambda n: cli.fetch_par(n, k, multi_chan)

    def par_stream(k: int, chunk: int):
        return lambda n: cli.fetch_par_stream(n, k, chunk)

    plan = [
        ("A view", unary(False), SIZES + extra),
        ("A copy", unary(True), SIZES),
        ("A cached-srv view", unary(False, cached=True), SIZES),
    ]
    chunks = [1 * MiB, 4 * MiB] if quick else [256 * KiB, 1 * MiB, 4 * MiB, 16 * MiB]
    plan += [(f"B {c // KiB}K into", stream(c, 0, False), SIZES) for c in chunks]
    for c in [1 * MiB] if quick else [1 * MiB, 4 * MiB]:
        plan.append((f"B {c // KiB}K fused-hdr into", stream(c, F_FUSED, False), SIZES + extra))
        plan.append((f"B {c // KiB}K join", stream(c, 0, True), big))
    # C: can the aio response serializer hand grpc a memoryview / bytearray?  (1 MiB only)
    plan.append(("C 1024K mv-src into", stream(MiB, F_MV, False), [1 * MiB]))
    plan.append(("C 1024K bytearray-src into", stream(MiB, F_BYTEARRAY, False), [1 * MiB]))
    for k in [2] if quick else [2, 4]:
        plan.append((f"D {k}x unary 1ch", par(k, False), big))
        plan.append((f"D {k}x unary {k}ch", par(k, True), big))
        plan.append((f"D {k}x stream1M {k}ch", par_stream(k, 1 * MiB), big))
    return plan


def client_main(
    port: int,
    opts: list,
    use_uvloop: bool,
    mode: str,
    quick: bool,
    only: str,
    sizes: list,
    reps_scale: float,
    out_q,
) -> None:
    import uvloop

    apply_mallopt()

    async def run() -> dict:
        cli = AioClient(port, opts)
        await cli.ready()
        res: dict = {"loop": "uvloop" if use_uvloop else "asyncio", "results": []}
        try:
            res["ping"] = await ping_latency(cli, 1000)
            if mode == "ping":
                # other small-call variants, medians in us, two alternating rounds
                lat: dict[str, list] = {}
                variants = {
                    "ping": None,
                    "ping registered": lambda: cli.ping_reg(b"abcd", timeout=RPC_TIMEOUT),
                    "A 4K view": lambda: cli.fetch_unary(4 * KiB, False),
                    "B 4K fused stream": lambda: cli.fetch_stream(4 * KiB, MiB, F_FUSED, False),
                }
                for _ in range(2):
                    for name, fn in variants.items():
                        lat.setdefault(name, []).append(
                            round((await ping_latency(cli, 500, fn))["median_us"])
                        )
                res["small_call_us"] = lat
                return res
            cases = [
                (name, fn, szs)
                for name, fn, szs in plan_strategies(cli, quick, sizes)
                if not only or any(name.startswith(o) for o in only.split(","))
            ]
            await measure_async(cli, cases, sizes, reps_scale, res["results"])
            if mode == "full":
                res["big"] = await big_check(cli)
        finally:
            await cli.close()
        return res

    try:
        res = uvloop.run(run()) if use_uvloop else asyncio.run(run())
        out_q.put(res)
    except Exception as e:
        out_q.put({"error": f"{type(e).__name__}: {e}"})


async def big_check(cli: AioClient) -> dict:
    """> 2 GiB: stream with 4 MiB chunks into one preallocated array, and one unary call."""
    out: dict = {"nbytes": BIG}
    try:
        arr = await cli.fetch_stream(BIG, 4 * MiB, F_FUSED, False)  # includes server's lazy build
        _check(arr, BIG)
        del arr
        out["stream_ok"] = True
        mbps, faults = [], []
        for _ in range(2):
            f = _usage_now()
            t0 = time.perf_counter()
            arr = await cli.fetch_stream(BIG, 4 * MiB, F_FUSED, False)
            mbps.append(round(BIG / (time.perf_counter() - t0) / 1e6))
            faults.append(_usage_since(f)[0])
            del arr
        out["stream_mbps"], out["stream_cli_faults"] = mbps, faults
    except Exception as e:
        out["stream_error"] = f"{type(e).__name__}: {e}"[:300]
    try:
        f = _usage_now()
        t0 = time.perf_counter()
        arr = await cli.fetch_unary(BIG, False)
        out["unary_mbps"] = round(BIG / (time.perf_counter() - t0) / 1e6)
        out["unary_cli_faults"] = _usage_since(f)[0]
        _check(arr, BIG)
        out["unary_ok"] = True
        del arr
    except Exception as e:
        out["unary_error"] = f"{type(e).__name__}: {e}"[:300]
    await cli.drop_big(b"", timeout=RPC_TIMEOUT)
    return out


# ---- E: sync grpc client in a worker thread ---------------------------------------------
def sync_client_main(port: int, opts: list, sizes: list, reps_scale: float, out_q) -> None:
    from concurrent.futures import ThreadPoolExecutor

    apply_mallopt()

    def work() -> dict:
        ch = grpc.insecure_channel(f"127.0.0.1:{port}", options=opts)
        grpc.channel_ready_future(ch).result(timeout=30)
        unary = ch.unary_unary(f"/{SERVICE}/Unary")
        stream = ch.unary_stream(f"/{SERVICE}/Stream")
        ping = ch.unary_unary(f"/{SERVICE}/Ping")
        srv = ch.unary_unary(f"/{SERVICE}/Rusage")
        res: dict = {"loop": "sync-thread", "results": []}

        def f_unary(n: int, copy: bool):
            resp = unary(REQ.pack(n, 0, 0, 0, 0), timeout=RPC_TIMEOUT)
            _d, shape, off, clen = parse_recv_tensor_response(resp)
            arr = np.frombuffer(resp, np.float32, count=clen // 4, offset=off).reshape(shape)
            return arr.copy() if copy else arr

        def f_stream(n: int, chunk: int):
            it = stream(REQ.pack(n, 0, 0, chunk, F_FUSED), timeout=RPC_TIMEOUT)
            first = next(it)
            _d, shape, nbytes, hlen = parse_stream_header(first)
            out = np.empty(shape, np.float32)
            mv = memoryview(out).cast("B")
            pos = len(first) - hlen
            mv[0:pos] = memoryview(first)[hlen:]
            for _, m in zip(range(nbytes // chunk + 2), it, strict=False):
                mv[pos : pos + len(m)] = m
                pos += len(m)
            if pos != nbytes:
                raise AssertionError("short")
            return out

        ts = []
        for i in range(1050):
            t0 = time.perf_counter()
            ping(b"\x00\x01\x02\x03", timeout=RPC_TIMEOUT)
            if i >= 50:
                ts.append(time.perf_counter() - t0)
        res["ping"] = dict(median_us=1e6 * statistics.median(ts), n=len(ts))
        cases = [
            ("E sync unary view", lambda n: f_unary(n, False)),
            ("E sync unary copy", lambda n: f_unary(n, True)),
            ("E sync stream 1024K into", lambda n: f_stream(n, 1 * MiB)),
            ("E sync stream 4096K into", lambda n: f_stream(n, 4 * MiB)),
        ]
        for name, fn in cases:
            for nbytes in sizes:
                reps = max(2, int(reps_for(nbytes) * reps_scale))
                try:
                    _check(fn(nbytes), nbytes)
                    s0 = struct.unpack("<qdd", srv(b"", timeout=RPC_TIMEOUT))
                    times, faults = [], []
                    for _ in range(reps):
                        f = _usage_now()
                        t0 = time.perf_counter()
                        arr = fn(nbytes)
                        times.append(time.perf_counter() - t0)
                        faults.append(_usage_since(f)[0])
                        del arr
                    s1 = struct.unpack("<qdd", srv(b"", timeout=RPC_TIMEOUT))
                    med = statistics.median(times)
                    res["results"].append(
                        dict(
                            strategy=name,
                            nbytes=nbytes,
                            reps=reps,
                            median_s=med,
                            mbps=nbytes / med / 1e6,
                            best_mbps=nbytes / min(times) / 1e6,
                            cli_faults=statistics.median(faults),
                            cli_cpu_ms=float("nan"),
                            srv_faults=(s1[0] - s0[0]) / reps,
                            srv_cpu_ms=1e3 * (s1[1] + s1[2] - s0[1] - s0[2]) / reps,
                        )
                    )
                except Exception as e:
                    res["results"].append(
                        dict(strategy=name, nbytes=nbytes, error=f"{type(e).__name__}: {e}"[:300])
                    )
        ch.close()
        return res

    try:
        with ThreadPoolExecutor(1) as ex:
            out_q.put(ex.submit(work).result(timeout=600))
    except Exception as e:
        out_q.put({"error": f"{type(e).__name__}: {e}"})


# ----------------------------------------------------------------------------------------
# Orchestration
# ----------------------------------------------------------------------------------------
def _fmt_size(n: int) -> str:
    return f"{n // MiB}M" if n >= MiB else f"{n // KiB}K"


def run_session(preset_names: list[str], jobs: list[tuple], timeout: float = 900.0) -> list[dict]:
    """Start a server with the preset, run the client jobs one after another, stop it.

    jobs: ("aio", use_uvloop, mode, quick, only, sizes, reps_scale) or ("sync", sizes, reps_scale)
    """
    opts, env = preset_opts(preset_names)
    server_uvloop = all(PRESETS[n].get("server_uvloop", True) for n in preset_names)
    ctx = mp.get_context("spawn")
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # children inherit the environment at spawn time
    procs, outs = [], []
    try:
        port_q, stop_ev = ctx.Queue(), ctx.Event()
        srv = ctx.Process(target=server_main, args=(port_q, stop_ev, opts, server_uvloop), daemon=True)
        srv.start()
        procs.append(srv)
        port = port_q.get(timeout=60)
        for job in jobs:
            q = ctx.Queue()
            if job[0] == "aio":
                p = ctx.Process(target=client_main, args=(port, opts, *job[1:], q), daemon=True)
            else:
                p = ctx.Process(target=sync_client_main, args=(port, opts, *job[1:], q), daemon=True)
            p.start()
            procs.append(p)
            try:
                res = q.get(timeout=timeout)
            except Exception as e:
                res = {"error": f"client timeout/crash: {type(e).__name__} exitcode={p.exitcode}"}
            p.join(10)
            res["preset"] = "+".join(preset_names) or "base"
            outs.append(res)
        stop_ev.set()
        srv.join(10)
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(5)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return outs


def print_table(outs: list[dict], sizes: list[int]) -> None:
    for res in outs:
        print(f"\n## preset={res.get('preset')} client={res.get('loop')}")
        if "error" in res:
            print("  ERROR:", res["error"])
            continue
        if "ping" in res:
            p = res["ping"]
            print(
                f"  4-byte unary round trip: median {p['median_us']:.0f} us"
                + (f" (p10 {p['p10_us']:.0f}, p90 {p['p90_us']:.0f}, n={p['n']})" if "p10_us" in p else "")
            )
        if "big" in res:
            print("  >2 GiB check:", json.dumps(res["big"]))
        rows: dict[str, dict[int, dict]] = {}
        for r in res.get("results", []):
            rows.setdefault(r["strategy"], {})[r["nbytes"]] = r
        if not rows:
            continue
        hdr = "| strategy | " + " | ".join(_fmt_size(s) for s in sizes) + " |"
        print("\nMB/s (median)\n" + hdr + "\n|---|" + "---:|" * len(sizes))
        for name, by in rows.items():
            cells = []
            for s in sizes:
                r = by.get(s)
                cells.append("" if r is None else ("ERR" if "error" in r else f"{r['mbps']:,.0f}"))
            print(f"| {name} | " + " | ".join(cells) + " |")
        print(
            "\nminor faults per transfer, client / server; CPU ms per transfer client / server (sizes >= 16M)"
        )
        for name, by in rows.items():
            cells = []
            for s in sizes:
                r = by.get(s)
                if s < 16 * MiB or r is None:
                    continue
                if "error" in r:
                    cells.append(f"{_fmt_size(s)}: ERR")
                else:
                    cells.append(
                        f"{_fmt_size(s)}: {r['cli_faults']:.0f}/{r['srv_faults']:.0f} f, "
                        f"{r['cli_cpu_ms']:.0f}/{r['srv_cpu_ms']:.0f} ms"
                    )
            if cells:
                print(f"  {name:28s} " + " | ".join(cells))
        errs = [r for by in rows.values() for r in by.values() if "error" in r]
        for r in errs:
            print(f"  error {r['strategy']} {_fmt_size(r['nbytes'])}: {' '.join(r['error'].split())[:200]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--preset",
        default="base,mallopt",
        help="comma-separated list of '+'-joined presets, one session each: " + ", ".join(PRESETS),
    )
    ap.add_argument("--quick", action="store_true", help="fewer strategies, reps x0.5")
    ap.add_argument("--sweep", action="store_true", help="compare option presets on a few strategies")
    ap.add_argument(
        "--sweep-presets",
        default="base,srv_asyncio,frame16M,wbuf,lookahead,nobdp,"
        "readchunk,rcvbuf,exp_lowat,exp_fst,thp,nommap,mallopt,thp+nommap",
    )
    ap.add_argument("--only", default="", help="comma-separated strategy-name prefixes")
    ap.add_argument("--sizes", default="", help="comma-separated sizes in KiB (default all)")
    ap.add_argument("--no-sync", action="store_true", help="skip E (sync client)")
    ap.add_argument("--no-big", action="store_true", help="skip the > 2 GiB check")
    ap.add_argument("--reps-scale", type=float, default=0.0, help="multiply repetitions")
    ap.add_argument("--json", default="", help="write raw results here")
    a = ap.parse_args()
    sizes = [int(s) * KiB for s in a.sizes.split(",")] if a.sizes else list(SIZES)
    scale = a.reps_scale or (0.5 if a.quick else 1.0)
    t0 = time.time()
    outs: list[dict] = []
    if a.sweep:
        only = a.only or "A view,A copy,B 1024K into,B 4096K into,D 2x stream1M"
        ssizes = [s for s in sizes if s >= 16 * MiB] if not a.sizes else sizes
        for pn in a.sweep_presets.split(","):
            outs += run_session(
                pn.split("+"), [("aio", True, "sweep", True, only, ssizes, a.reps_scale or 0.7)]
            )
            print_table(outs[-1:], ssizes)
            sys.stdout.flush()
    else:
        presets = a.preset.split(",")
        for i, pn in enumerate(presets):
            last = i == len(presets) - 1
            jobs = [("aio", True, "full" if last and not a.no_big else "main", a.quick, a.only, sizes, scale)]
            # 4-byte latency, uvloop vs default asyncio loop, alternated to share machine drift
            jobs += [
                ("aio", use_uv, "ping", a.quick, a.only, sizes, scale)
                for _ in range(2)
                for use_uv in (False, True)
            ]
            if not a.no_sync:
                jobs.append(("sync", [s for s in sizes if s <= 64 * MiB], scale))
            res = run_session(pn.split("+"), jobs)
            print_table([r for r in res if r.get("results") or "error" in r], sizes)
            pings: dict[str, list] = {}
            for r in res:
                if "ping" in r:
                    pings.setdefault(r["loop"], []).append(round(r["ping"]["median_us"]))
            print(f"\n4-byte unary round trip, median per client process (us): {pings}")
            for r in res:
                if "small_call_us" in r:
                    print(f"  {r['loop']:8s} small calls, median us per round: {r['small_call_us']}")
            sys.stdout.flush()
            outs += res
    print(f"\ntotal wall time {time.time() - t0:.0f} s")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(outs, f, indent=1, default=str)


if __name__ == "__main__":
    main()
