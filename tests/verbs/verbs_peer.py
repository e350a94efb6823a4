"""The other process of the cross-process verbs tests.

Run as `python verbs_peer.py MODE ARGS_JSON`. It prints one JSON line when it is
ready, serves until its stdin closes (the test's way to say "exit"), and exits 0.

Modes:
    tensor-server  A `TensorServer` whose source builds tensors from JSON request
                   headers (see `make_array` and `source`); prints {"address", "pid"}.
    rdma-client    Connects to ARGS["address"], registers and exposes a region of
                   ARGS["nbytes"] bytes filled with ARGS["fill"], announces it with a
                   JSON message on the queue pair, then obeys JSON commands that
                   arrive as queue-pair messages (see `obey`).
    connect-as     Drops to ARGS["uid"] and tries to connect to ARGS["address"];
                   prints the error class name (or "connected").
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import sys
from typing import Any

import numpy as np

from distserver import errors
from distserver.transports import verbs


def make_array(spec: dict[str, Any]) -> np.ndarray:
    """The tensor a spec names; the tests build the same one to compare."""
    dtype = verbs._wire.dtype_from_token(spec["dtype"])
    shape = tuple(spec["shape"])
    count = int(np.prod(shape, dtype=np.int64))
    if spec.get("pattern") == "arange":
        flat = np.arange(count, dtype=np.uint64).view(np.uint8)[: count * dtype.itemsize]
        if flat.nbytes < count * dtype.itemsize:
            flat = np.resize(flat, count * dtype.itemsize)
    else:
        rng = np.random.default_rng(spec.get("seed", 0))
        flat = rng.integers(0, 256, size=count * dtype.itemsize, dtype=np.uint8)
    array = flat.view(dtype).reshape(shape)
    order = spec.get("order", "C")
    if order == "F":
        array = np.asfortranarray(array)
    elif order == "strided":
        array = np.repeat(array, 2, axis=-1)[..., ::2] if array.ndim else array
    return array


_cache: dict[bytes, np.ndarray] = {}


async def source(header: bytes) -> np.ndarray | verbs.TensorReply:
    spec = json.loads(header)
    if "error" in spec:
        code, message = spec["error"]
        if code == 0:
            raise ValueError(message)
        raise errors.from_status(code, message)
    if spec.get("hang"):
        await asyncio.Event().wait()
    if spec.get("object"):
        return np.array([object()], dtype=object)
    if spec.get("cache"):  # benchmarks: serve the same array again without rebuilding it
        if header not in _cache:
            _cache[header] = make_array(spec)
        array = _cache[header]
    else:
        array = make_array(spec)
    if "meta" in spec:
        return verbs.TensorReply(array, spec["meta"].encode())
    return array


def say(**fields: Any) -> None:
    print(json.dumps(fields), flush=True)


async def until_stdin_closes() -> None:
    loop = asyncio.get_running_loop()
    closed = loop.create_future()

    def readable() -> None:
        if not os.read(0, 4096) and not closed.done():
            closed.set_result(None)

    loop.add_reader(0, readable)
    try:
        await closed
    finally:
        loop.remove_reader(0)


async def tensor_server(args: dict[str, Any]) -> None:
    async with verbs.ProtectionDomain() as pd:
        options = {k: args[k] for k in ("max_bytes_in_flight", "inline_limit") if k in args}
        server = await verbs.TensorServer.start(pd, source, **options)
        say(address=server.address, pid=os.getpid())
        await until_stdin_closes()
        await server.close()


async def obey(qp: verbs.QueuePair, region: verbs.MemoryRegion, command: dict[str, Any]) -> dict[str, Any]:
    op = command["op"]
    key = bytes.fromhex(command.get("key", ""))
    if op == "write":
        data = bytes([command["fill"]]) * command["nbytes"]
        wc = await qp.write(
            command["region"], key, command["offset"], data, wr_id=command["wr_id"], imm_data=command["imm"]
        )
        return {"wc": [wc.wr_id, int(wc.opcode), int(wc.status), wc.byte_len, wc.imm_data]}
    if op == "write_many":
        for i in range(command["count"]):
            await qp.write(command["region"], key, 0, b"x", wr_id=i, imm_data=i)
        say(done=command["count"])  # on stdout, for a test whose loop is blocked
        return {"written": command["count"]}
    if op == "read":
        into = bytearray(command["length"])
        await qp.read(command["region"], key, command["offset"], command["length"], into)
        return {"sha256": hashlib.sha256(into).hexdigest()}
    if op == "poll":
        completions = [await qp.cq.poll() for _ in range(command["n"])]
        return {"wcs": [[c.wr_id, int(c.opcode), int(c.status), c.byte_len, c.imm_data] for c in completions]}
    if op == "digest":
        view = region.view(command["offset"], command["length"])
        try:
            return {"sha256": hashlib.sha256(view).hexdigest()}
        finally:
            view.release()
    raise ValueError(f"unknown op {op!r}")


async def rdma_client(args: dict[str, Any]) -> None:
    async with verbs.ProtectionDomain() as pd:
        qp = await verbs.connect(pd, args["address"])
        region = pd.register(args["nbytes"])
        region.view()[:] = bytes([args["fill"]]) * region.nbytes
        await qp.expose(region)
        await qp.send(
            json.dumps({"region": region.id, "key": region.key.hex(), "nbytes": region.nbytes}).encode()
        )
        say(pid=os.getpid())
        stdin_closed = asyncio.ensure_future(until_stdin_closes())
        while not stdin_closed.done():
            receiving = asyncio.ensure_future(qp.recv())
            await asyncio.wait([receiving, stdin_closed], return_when=asyncio.FIRST_COMPLETED)
            if not receiving.done():
                receiving.cancel()
                break
            try:
                command = json.loads(receiving.result())
            except errors.UnavailableError:
                break
            if command["op"] == "exit":
                break
            try:
                reply = await obey(qp, region, command)
            except errors.OpError as exc:
                reply = {"error": [type(exc).__name__, exc.message]}
            await qp.send(json.dumps(reply).encode())
        stdin_closed.cancel()
        await qp.close()


async def connect_as(args: dict[str, Any]) -> None:
    # Imports are done; from here on this process needs no file access as `uid`.
    os.setgid(args["uid"])
    os.setuid(args["uid"])
    pd = verbs.ProtectionDomain()
    try:
        qp = await verbs.connect(pd, args["address"], timeout=10)
    except errors.OpError as exc:
        say(result=type(exc).__name__, message=exc.message)
    else:
        say(result="connected")
        await qp.close()
    await pd.close()


def main() -> None:
    mode, raw = sys.argv[1], sys.argv[2]
    args = json.loads(raw)
    runner = {"tensor-server": tensor_server, "rdma-client": rdma_client, "connect-as": connect_as}[mode]
    asyncio.run(runner(args))


if __name__ == "__main__":
    main()
