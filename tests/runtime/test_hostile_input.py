"""A live server refuses requests whose tensors claim more memory than they carry, and goes on serving."""

from __future__ import annotations

import asyncio
import logging
import struct

import grpc
import grpc.aio
import numpy as np
import pytest

import distserver as ds
from distserver import errors, tensors
from distserver.protos import master_pb2 as m
from distserver.protos import types_pb2
from distserver.protos import worker_pb2 as w
from distserver.protos.services import MASTER_SERVICE, SERVICES, WORKER_SERVICE
from distserver.protos.tensor_pb2 import TensorProto
from distserver.transports import call_stream, get_transport


def _claims_a_terabyte() -> TensorProto:
    proto = TensorProto(dtype=types_pb2.DT_VARIANT)
    proto.tensor_shape.dim.add(size=1 << 40)
    return proto


async def test_a_tiny_feed_claiming_a_terabyte_is_refused_and_the_task_keeps_serving():
    async with ds.AsyncServer({"local": ["localhost:0"]}) as server:
        with ds.Graph().as_default() as graph:
            x = ds.placeholder(ds.float32, shape=[], name="x")
            y = x * 2.0
        channel = get_transport("grpc").connect(server.target.removeprefix("grpc://"))
        try:
            create = m.CreateSessionRequest(graph_def=graph.as_graph_def())
            created = await channel.call(MASTER_SERVICE, "CreateSession", create, timeout=30)
            step = m.RunStepRequest(session_handle=created.session_handle, fetch=[y.name])
            step.feed.add(name=x.name).tensor.CopyFrom(_claims_a_terabyte())
            assert len(step.feed[0].tensor.SerializeToString()) < 32
            with pytest.raises(errors.ResourceExhaustedError, match="DISTSERVER_DECODE_LIMIT_BYTES"):
                await channel.call(MASTER_SERVICE, "RunStep", step, timeout=30)

            run_graph = w.RunGraphRequest(graph_handle="whatever", step_id=1)
            run_graph.send.add(name="k").tensor.CopyFrom(_claims_a_terabyte())
            with pytest.raises(errors.ResourceExhaustedError, match="DISTSERVER_DECODE_LIMIT_BYTES"):
                await channel.call(WORKER_SERVICE, "RunGraph", run_graph, timeout=30)
        finally:
            await channel.close()
        async with ds.AsyncSession(server.target, graph=graph) as session:
            assert await session.run(y, feed_dict={x: np.float32(3)}) == 6.0


async def test_malformed_requests_are_invalid_argument_on_every_method_and_log_nothing(caplog):
    garbage = b"\xff\xff\xff\xff\x0f"  # a varint that never ends: no message parses from it
    async with ds.AsyncServer({"local": ["localhost:0"]}) as server:
        address = server.target.removeprefix("grpc://")
        with caplog.at_level(logging.WARNING):
            async with grpc.aio.insecure_channel(address) as channel:
                for service, methods in SERVICES.items():
                    for method in methods:
                        call = channel.unary_unary(f"/{service}/{method}")
                        with pytest.raises(grpc.aio.AioRpcError) as info:
                            await call(garbage, timeout=10)
                        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (method, info.value)
                        assert "Could not parse" in (info.value.details() or "")
                # The same bytes framed as a call on distserver's call stream.
                stream = channel.stream_stream(call_stream.METHOD)()
                path = f"/{WORKER_SERVICE}/GetStatus".encode()
                await stream.write(struct.pack("<QBH", 1, 0, len(path)) + path + garbage)
                async with asyncio.timeout(10):
                    answer = await stream.read()
                call_id, kind, code = struct.unpack_from("<QBi", answer)
                assert kind == 1  # an error frame
                assert (call_id, code) == (1, errors.INVALID_ARGUMENT)
                # A frame that is not a frame ends that stream, and only that stream.
                await stream.write(b"\x01")
                async with asyncio.timeout(10):
                    assert await stream.read() is grpc.aio.EOF
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.records
        async with ds.AsyncSession(server.target) as session:
            assert len(await session.list_devices()) == 1


def _padded_floats(count: int) -> TensorProto:
    proto = TensorProto(dtype=types_pb2.DT_FLOAT, float_val=[1.0])
    proto.tensor_shape.dim.add(size=count)
    return proto


async def test_the_budget_covers_all_the_tensors_of_a_message(monkeypatch):
    """Each feed fits the padding limit; together they do not."""
    monkeypatch.setattr(tensors, "DEFAULT_PADDING_LIMIT_BYTES", 1000)
    async with ds.AsyncServer({"local": ["localhost:0"]}) as server:
        with ds.Graph().as_default() as graph:
            x = ds.placeholder(ds.float32, shape=[200], name="x")
            y = ds.placeholder(ds.float32, shape=[200], name="y")
            total = ds.reduce_sum(x + y)
        channel = get_transport("grpc").connect(server.target.removeprefix("grpc://"))
        try:
            create = m.CreateSessionRequest(graph_def=graph.as_graph_def())
            created = await channel.call(MASTER_SERVICE, "CreateSession", create, timeout=30)
            step = m.RunStepRequest(session_handle=created.session_handle, fetch=[total.name])
            step.feed.add(name=x.name).tensor.CopyFrom(_padded_floats(200))  # 796 bytes of padding
            step.feed.add(name=y.name).tensor.CopyFrom(_padded_floats(2))
            with pytest.raises(errors.InvalidArgumentError, match="shape"):  # fits; wrong shape
                await channel.call(MASTER_SERVICE, "RunStep", step, timeout=30)
            step.feed[1].tensor.CopyFrom(_padded_floats(200))
            with pytest.raises(errors.ResourceExhaustedError, match=r"in a RunStep request.*padding"):
                await channel.call(MASTER_SERVICE, "RunStep", step, timeout=30)
        finally:
            await channel.close()


async def test_a_large_feed_is_decoded_while_the_task_keeps_answering():
    async with ds.AsyncServer({"local": ["localhost:0"]}) as server:
        with ds.Graph().as_default() as graph:
            x = ds.placeholder(ds.float32, shape=[None], name="x")
            total = ds.reduce_sum(x)
        channel = get_transport("grpc").connect(server.target.removeprefix("grpc://"))
        try:
            create = m.CreateSessionRequest(graph_def=graph.as_graph_def())
            created = await channel.call(MASTER_SERVICE, "CreateSession", create, timeout=30)
            step = m.RunStepRequest(session_handle=created.session_handle, fetch=[total.name])
            feed = step.feed.add(name=x.name).tensor
            feed.dtype = types_pb2.DT_FLOAT
            feed.tensor_shape.dim.add(size=1 << 22)
            feed.float_val.extend(np.ones(1 << 22, np.float32))  # typed values: decoded one by one
            run = asyncio.ensure_future(channel.call(MASTER_SERVICE, "RunStep", step, timeout=60))
            answered = 0
            while not run.done():
                await channel.call(MASTER_SERVICE, "ListDevices", m.ListDevicesRequest(), timeout=30)
                answered += 1
            assert tensors.from_tensor_proto((await run).tensor[0].tensor) == float(1 << 22)
            assert answered > 1
        finally:
            await channel.close()
