"""The EagerService of a distserver task (TensorFlow 2's remote eager contexts), over real RPCs.

What a TensorFlow 2 coordinator does to a parameter server (see
../shared/reference/tf2-ps-trace): a context, variables made by eager ops, values sent
as `send_tensor` items, reads, decrefs, keep-alives; and what hostile or stale clients
do: unknown contexts and handles, too many handles, tensors that claim more memory
than they carry, stale view ids.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator

import grpc
import grpc.aio
import numpy as np
import pytest

import distserver as ds
from distserver import errors
from distserver.devices import RendezvousKey
from distserver.kernels.registry import _KERNELS
from distserver.protos import eager_service_pb2 as e
from distserver.protos import types_pb2
from distserver.protos.attr_value_pb2 import AttrValue
from distserver.protos.function_pb2 import FunctionDef
from distserver.protos.remote_tensor_handle_pb2 import RemoteTensorHandle
from distserver.protos.services import EAGER_SERVICE
from distserver.protos.tensor_pb2 import TensorProto
from distserver.runtime.eager import ANONYMOUS_NAME, EagerService
from distserver.runtime.names import int64_attr
from distserver.server import AsyncServer
from distserver.tensors import from_tensor_proto, to_tensor_proto
from distserver.transports import Channel, get_transport

CONTEXT = 6406639579264586935
PS = "/job:ps/replica:0/task:0/device:CPU:0"
CLUSTER = {"ps": ["localhost:0"], "worker": ["localhost:1"]}


@pytest.fixture
async def ps() -> AsyncIterator[tuple[AsyncServer, Channel]]:
    async with ds.AsyncServer(CLUSTER, job_name="ps", task_index=0) as server:
        channel = get_transport("grpc").connect(server.target.removeprefix("grpc://"))
        try:
            yield server, channel
        finally:
            await channel.close()


def create_request(
    server: AsyncServer, context_id: int = CONTEXT, keep_alive_secs: int = 600
) -> e.CreateContextRequest:
    request = e.CreateContextRequest(context_id=context_id, keep_alive_secs=keep_alive_secs)
    request.server_def.CopyFrom(server.server_def)
    return request


async def call(channel: Channel, method: str, request):  # type: ignore[no-untyped-def]
    return await channel.call(EAGER_SERVICE, method, request, timeout=30)


def operation(op_id: int, name: str, *inputs: tuple[int, int], **attrs: AttrValue) -> e.QueueItem:
    item = e.QueueItem()
    op = item.operation
    op.id, op.name, op.device = op_id, name, PS
    for source, output in inputs:
        op.op_inputs.add().remote_handle.CopyFrom(
            RemoteTensorHandle(op_id=source, output_num=output, device=PS)
        )
    for key, value in attrs.items():
        op.attrs[key].CopyFrom(value)
    return item


def var_handle(op_id: int, shared_name: str = ANONYMOUS_NAME) -> e.QueueItem:
    return operation(
        op_id, "VarHandleOp", dtype=AttrValue(type=types_pb2.DT_FLOAT), shape=AttrValue(),
        shared_name=AttrValue(s=shared_name.encode()),
    )  # fmt: skip


def send_tensor(op_id: int, *values: np.ndarray) -> e.QueueItem:
    item = e.QueueItem()
    item.send_tensor.op_id = op_id
    item.send_tensor.device_name = PS
    for value in values:
        item.send_tensor.tensors.add().CopyFrom(to_tensor_proto(value))
    return item


def decref(op_id: int, output: int = 0) -> e.QueueItem:
    return e.QueueItem(handle_to_decref=RemoteTensorHandle(op_id=op_id, output_num=output))


def float_dtype() -> AttrValue:
    return AttrValue(type=types_pb2.DT_FLOAT)


async def enqueue(channel: Channel, *items: e.QueueItem, context_id: int = CONTEXT) -> e.EnqueueResponse:
    request = e.EnqueueRequest(context_id=context_id)
    request.queue.extend(items)
    return await call(channel, "Enqueue", request)


async def test_create_context_answers_the_task_devices_and_refuses_a_second_one_with_the_same_id(ps):
    server, channel = ps
    response = await call(channel, "CreateContext", create_request(server))
    assert [d.name for d in response.device_attributes] == [PS]
    assert response.device_attributes[0].incarnation == server.worker.device.incarnation
    with pytest.raises(errors.InvalidArgumentError, match=f"Context id: <{CONTEXT}> already exists"):
        await call(channel, "CreateContext", create_request(server))


async def test_a_variable_made_assigned_and_read_by_eager_ops_as_the_coordinator_does(ps):
    server, channel = ps
    await call(channel, "CreateContext", create_request(server))
    value = np.arange(4, dtype=np.float32).reshape(4, 1)
    made = await enqueue(channel, var_handle(1))
    assert len(made.queue_response[0].shape) == 1  # one output, a scalar handle
    await enqueue(channel, send_tensor(2, value))
    await enqueue(channel, operation(3, "AssignVariableOp", (1, 0), (2, 0), dtype=float_dtype()))
    await enqueue(channel, decref(2))
    read = await enqueue(channel, operation(4, "ReadVariableOp", (1, 0), dtype=float_dtype()))
    assert [d.size for d in read.queue_response[0].shape[0].dim] == [4, 1]
    assert not read.queue_response[0].device  # the client chose the device
    # The value itself, back in the response: an operation without an id (TensorFlow's -1).
    echoed = await enqueue(channel, operation(-1, "Identity", (4, 0), T=float_dtype()))
    np.testing.assert_array_equal(from_tensor_proto(echoed.queue_response[0].tensor[0]), value)
    await call(channel, "WaitQueueDone", e.WaitQueueDoneRequest(context_id=CONTEXT))


async def test_an_anonymous_variable_lives_until_its_last_handle_is_released(ps):
    server, channel = ps
    await call(channel, "CreateContext", create_request(server))
    await enqueue(channel, var_handle(1), send_tensor(2, np.float32(3)))
    await enqueue(channel, operation(3, "AssignVariableOp", (1, 0), (2, 0), dtype=float_dtype()))
    names = server.worker.resources.containers()
    assert names == ["localhost"]
    # Two variables with TensorFlow's anonymous name are two variables.
    await enqueue(
        channel, var_handle(4), operation(5, "AssignVariableOp", (4, 0), (2, 0), dtype=float_dtype())
    )
    assert len(server.worker.resources._containers["localhost"]) == 2
    await enqueue(channel, decref(1))
    assert len(server.worker.resources._containers["localhost"]) == 1
    with pytest.raises(
        errors.InvalidArgumentError, match="Unable to find the relevant tensor remote_handle: Op ID: 1"
    ):
        await enqueue(channel, operation(6, "ReadVariableOp", (1, 0), dtype=float_dtype()))
    await call(channel, "CloseContext", e.CloseContextRequest(context_id=CONTEXT))
    assert server.worker.resources.containers() == []


async def test_a_named_variable_outlives_the_context(ps):
    server, channel = ps
    await call(channel, "CreateContext", create_request(server))
    await enqueue(channel, var_handle(1, "shared_w"), send_tensor(2, np.float32(3)))
    await enqueue(channel, operation(3, "AssignVariableOp", (1, 0), (2, 0), dtype=float_dtype()), decref(1))
    await call(channel, "CloseContext", e.CloseContextRequest(context_id=CONTEXT))
    assert server.worker.resources.lookup("", "shared_w").value == 3


async def test_unknown_contexts_and_functions_get_tensorflow_s_errors(ps):
    server, channel = ps
    with pytest.raises(
        errors.InvalidArgumentError, match=r"Unable to find a context_id matching the specified one \(5\)"
    ):
        await enqueue(channel, var_handle(1), context_id=5)
    with pytest.raises(errors.InvalidArgumentError, match="Unable to find a context_id"):
        await call(channel, "KeepAlive", e.KeepAliveRequest(context_id=5))
    await call(channel, "CloseContext", e.CloseContextRequest(context_id=5))  # swallowed, as in TensorFlow
    await call(channel, "CreateContext", create_request(server))
    run = e.RunComponentFunctionRequest(context_id=CONTEXT)
    run.operation.CopyFrom(operation(1, "__inference_missing_7").operation)
    run.operation.is_component_function = run.operation.is_function = True
    with pytest.raises(
        errors.NotFoundError, match="'__inference_missing_7' is neither a type of a primitive operation"
    ):
        await call(channel, "RunComponentFunction", run)
    with pytest.raises(errors.NotFoundError, match="Op type not registered 'NoSuchOp'"):
        await enqueue(channel, operation(2, "NoSuchOp"))


async def test_keep_alive_and_update_context_follow_the_view_id(ps):
    server, channel = ps
    await call(channel, "CreateContext", create_request(server))
    alive = await call(channel, "KeepAlive", e.KeepAliveRequest(context_id=CONTEXT))
    assert alive.context_view_id == 0
    update = e.UpdateContextRequest(context_id=CONTEXT, context_view_id=1)
    update.server_def.CopyFrom(server.server_def)
    updated = await call(channel, "UpdateContext", update)
    assert [d.name for d in updated.device_attributes] == [PS]
    assert (await call(channel, "KeepAlive", e.KeepAliveRequest(context_id=CONTEXT))).context_view_id == 1
    with pytest.raises(errors.InvalidArgumentError, match="it must be 2"):
        await call(channel, "UpdateContext", e.UpdateContextRequest(context_id=CONTEXT, context_view_id=5))
    # A close for an older view is stale: the context stays.
    await call(channel, "CloseContext", e.CloseContextRequest(context_id=CONTEXT, context_view_id=0))
    await call(channel, "KeepAlive", e.KeepAliveRequest(context_id=CONTEXT))


async def test_a_context_for_another_task_or_another_cluster_is_refused(ps):
    server, channel = ps
    request = create_request(server)
    request.server_def.task_index = 3
    with pytest.raises(errors.InvalidArgumentError, match="is for task /job:ps/replica:0/task:3"):
        await call(channel, "CreateContext", request)
    request = create_request(server)
    worker_job = next(job for job in request.server_def.cluster.job if job.name == "worker")
    worker_job.tasks[0] = "otherhost:7"
    with pytest.raises(
        errors.InvalidArgumentError, match="gives /job:worker/replica:0/task:0 the address otherhost:7"
    ):
        await call(channel, "CreateContext", request)
    # A task our cluster lacks is learned (its address serves RecvTensor from this task).
    request = create_request(server)
    chief = request.server_def.cluster.job.add(name="chief")
    chief.tasks[0] = "localhost:9"
    await call(channel, "CreateContext", request)


async def test_an_idle_context_expires_after_keep_alive_secs(ps):
    server, channel = ps
    await call(channel, "CreateContext", create_request(server, keep_alive_secs=1))
    await enqueue(channel, var_handle(1), send_tensor(2, np.float32(1)))
    await enqueue(channel, operation(3, "AssignVariableOp", (1, 0), (2, 0), dtype=float_dtype()))
    assert server.worker.resources.containers() == ["localhost"]
    for _ in range(200):  # polls for up to 20 s; expiry comes after ~1 s
        if server.eager.num_contexts == 0:
            break
        await asyncio.sleep(0.1)
    assert server.eager.num_contexts == 0
    assert server.worker.resources.containers() == []  # its anonymous variable went with it
    with pytest.raises(errors.InvalidArgumentError, match="Unable to find a context_id"):
        await call(channel, "KeepAlive", e.KeepAliveRequest(context_id=CONTEXT))


async def test_budgets_on_handles_contexts_and_decoded_tensors(ps):
    server, channel = ps
    eager = EagerService(worker=server.worker, max_contexts=1, max_handles=3)
    await eager.create_context(create_request(server))
    with pytest.raises(errors.ResourceExhaustedError, match="the most it keeps"):
        await eager.create_context(create_request(server, context_id=7))
    request = e.EnqueueRequest(context_id=CONTEXT)
    request.queue.append(send_tensor(1, np.float32(1), np.float32(2), np.float32(3)))
    await eager.enqueue(request)
    request = e.EnqueueRequest(context_id=CONTEXT)
    request.queue.append(send_tensor(2, np.float32(4)))
    with pytest.raises(errors.ResourceExhaustedError, match="holds 3 tensor handles"):
        await eager.enqueue(request)
    eager.close()
    # Over RPC: a tensor that claims a terabyte it does not carry.
    await call(channel, "CreateContext", create_request(server))
    claim = TensorProto(dtype=types_pb2.DT_FLOAT)
    claim.tensor_shape.dim.add(size=1 << 40)
    item = e.QueueItem()
    item.send_tensor.op_id = 1
    item.send_tensor.tensors.append(claim)
    with pytest.raises(errors.ResourceExhaustedError, match="in an Enqueue request"):
        await enqueue(channel, item)


async def test_streaming_enqueue_answers_each_request_in_order(ps):
    server, channel = ps
    await call(channel, "CreateContext", create_request(server))
    first = e.EnqueueRequest(context_id=CONTEXT)
    first.queue.extend([var_handle(1), send_tensor(2, np.float32(5))])
    second = e.EnqueueRequest(context_id=CONTEXT)
    second.queue.extend([operation(3, "AssignVariableOp", (1, 0), (2, 0), dtype=float_dtype())])
    third = e.EnqueueRequest(context_id=CONTEXT)
    third.queue.extend([operation(4, "ReadVariableOp", (1, 0), dtype=float_dtype())])
    bad = e.EnqueueRequest(context_id=CONTEXT)
    bad.queue.extend([operation(5, "ReadVariableOp", (99, 0), dtype=float_dtype())])
    async with grpc.aio.insecure_channel(server.target.removeprefix("grpc://")) as raw:
        stream = raw.stream_stream(
            f"/{EAGER_SERVICE}/StreamingEnqueue",
            request_serializer=e.EnqueueRequest.SerializeToString,
            response_deserializer=e.EnqueueResponse.FromString,
        )
        responses: list[e.EnqueueResponse] = []

        async def read_all() -> None:
            async for response in stream(iter([first, second, third, bad])):
                responses.append(response)

        with pytest.raises(grpc.aio.AioRpcError) as failed:
            await read_all()
        assert failed.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "Op ID: 99" in (failed.value.details() or "")
    assert [len(r.queue_response) for r in responses] == [2, 1, 1]
    assert [d.size for d in responses[2].queue_response[0].shape[0].dim] == []


# --------------------------------------------------------------------------- component functions

WORKER = "/job:worker/replica:0/task:0/device:CPU:0"


def send_node(fdef: FunctionDef, name: str, source: str, tensor_name: str, incarnation: int) -> None:
    """A `_Send` to the worker, as a TensorFlow worker's partitioner writes it."""
    node = fdef.node_def.add(name=name, op="_Send", device=PS)
    node.input.append(source)
    node.attr["tensor_name"].s = tensor_name.encode()
    node.attr["send_device"].s = PS.encode()
    node.attr["send_device_incarnation"].i = int64_attr(incarnation)
    node.attr["recv_device"].s = WORKER.encode()
    node.attr["T"].type = types_pb2.DT_FLOAT


def read_and_send_function(incarnation: int) -> FunctionDef:
    """The ps part of a step: read a variable (argument 0), send it, return its double."""
    fdef = FunctionDef()
    fdef.signature.name = "__inference_step_46_partitioned_1"
    fdef.signature.input_arg.add(name="read_resource", type=types_pb2.DT_RESOURCE)
    fdef.signature.output_arg.add(name="doubled", type=types_pb2.DT_FLOAT)
    read = fdef.node_def.add(name="MatMul/ReadVariableOp", op="ReadVariableOp", device=PS)
    read.input.append("read_resource")
    read.attr["dtype"].type = types_pb2.DT_FLOAT
    send_node(fdef, "MatMul/ReadVariableOp/_1", "MatMul/ReadVariableOp:value:0", "edge_5_read", incarnation)
    double = fdef.node_def.add(name="add", op="AddV2", device=PS)
    double.input.extend(["MatMul/ReadVariableOp:value:0", "MatMul/ReadVariableOp:value:0"])
    double.attr["T"].type = types_pb2.DT_FLOAT
    fdef.ret["doubled"] = "add:z:0"
    return fdef


def run_function_request(fdef: FunctionDef, op_id: int, step_id: int, *inputs: tuple[int, int]):
    request = e.RunComponentFunctionRequest(context_id=CONTEXT)
    request.operation.CopyFrom(operation(op_id, fdef.signature.name, *inputs).operation)
    request.operation.is_function = request.operation.is_component_function = True
    request.operation.func_step_id = step_id
    return request


async def test_a_component_function_reads_a_variable_sends_it_and_returns_a_handle(ps):
    server, channel = ps
    incarnation = server.worker.device.incarnation
    await call(channel, "CreateContext", create_request(server))
    fdef = read_and_send_function(incarnation)
    register = e.QueueItem()
    register.register_function.function_def.CopyFrom(fdef)
    register.register_function.is_component_function = True
    value = np.array([[1.5], [-2.0]], np.float32)
    await enqueue(channel, var_handle(1), send_tensor(2, value), register)
    await enqueue(channel, operation(3, "AssignVariableOp", (1, 0), (2, 0), dtype=float_dtype()))
    step_id = -6087184663275065486
    key = RendezvousKey(PS, incarnation, WORKER, "edge_5_read")
    # The worker may ask for the value before the function runs (the trace shows it).
    early = asyncio.ensure_future(channel.recv_tensor(step_id, key, timeout=30))
    response = await call(channel, "RunComponentFunction", run_function_request(fdef, 9, step_id, (1, 0)))
    sent, is_dead = await early
    assert not is_dead
    np.testing.assert_array_equal(sent, value)
    assert [d.size for d in response.shape[0].dim] == [2, 1]
    assert not response.tensor  # the output stays here, as handle (9, 0)
    echoed = await enqueue(channel, operation(-1, "Identity", (9, 0), T=float_dtype()))
    np.testing.assert_array_equal(from_tensor_proto(echoed.queue_response[0].tensor[0]), value * 2)
    cleanup = e.QueueItem()
    cleanup.cleanup_function.step_id = step_id
    await enqueue(channel, cleanup)
    # Output numbers chosen by the caller; no op id: the values come back.
    response = await call(channel, "RunComponentFunction", run_function_request(fdef, -1, 11, (1, 0)))
    np.testing.assert_array_equal(from_tensor_proto(response.tensor[0]), value * 2)
    await channel.recv_tensor(11, key, timeout=30)
    request = run_function_request(fdef, 12, 13, (1, 0))
    request.output_num.append(4)
    await call(channel, "RunComponentFunction", request)
    await channel.recv_tensor(13, key, timeout=30)
    await enqueue(channel, decref(12, 4))


async def test_function_registration_is_counted_and_a_different_body_is_refused(ps):
    server, channel = ps
    await call(channel, "CreateContext", create_request(server))
    fdef = read_and_send_function(server.worker.device.incarnation)
    register = e.QueueItem()
    register.register_function.function_def.CopyFrom(fdef)
    await enqueue(channel, register, register)
    other = e.QueueItem()
    other.register_function.function_def.CopyFrom(fdef)
    other.register_function.function_def.ret["doubled"] = "MatMul/ReadVariableOp:value:0"
    with pytest.raises(
        errors.InvalidArgumentError, match="a different function with the same name already exists"
    ):
        await enqueue(channel, other)
    remove = e.QueueItem()
    remove.remove_function.function_name = fdef.signature.name
    await enqueue(channel, remove)
    await enqueue(channel, var_handle(1))
    await enqueue(channel, remove)  # the second registration
    with pytest.raises(errors.NotFoundError, match="is neither a type of a primitive operation"):
        await call(channel, "RunComponentFunction", run_function_request(fdef, 2, 3, (1, 0)))
    with pytest.raises(errors.InvalidArgumentError, match="Tried to remove non-existent function"):
        await enqueue(channel, remove)


async def test_a_failing_component_function_fails_its_receivers_and_names_the_node(ps):
    server, channel = ps
    incarnation = server.worker.device.incarnation
    await call(channel, "CreateContext", create_request(server))
    fdef = read_and_send_function(incarnation)
    register = e.QueueItem()
    register.register_function.function_def.CopyFrom(fdef)
    await enqueue(channel, var_handle(1), register)  # a variable never assigned
    key = RendezvousKey(PS, incarnation, WORKER, "edge_5_read")
    waiting = asyncio.ensure_future(channel.recv_tensor(21, key, timeout=30))
    with pytest.raises(errors.FailedPreconditionError, match="MatMul/ReadVariableOp"):
        await call(channel, "RunComponentFunction", run_function_request(fdef, 2, 21, (1, 0)))
    with pytest.raises(errors.FailedPreconditionError):
        await waiting


async def test_a_function_with_nodes_on_another_task_is_refused(ps):
    server, channel = ps
    await call(channel, "CreateContext", create_request(server))
    fdef = read_and_send_function(server.worker.device.incarnation)
    fdef.node_def[0].device = WORKER
    register = e.QueueItem()
    register.register_function.function_def.CopyFrom(fdef)
    await enqueue(channel, var_handle(1), register)
    with pytest.raises(errors.UnimplementedError, match="places node 'MatMul/ReadVariableOp' on /job:worker"):
        await call(channel, "RunComponentFunction", run_function_request(fdef, 2, 3, (1, 0)))


async def test_ops_a_client_gets_wrong_are_refused_by_name_not_answered_as_bugs(ps):
    # Found by fuzzing Enqueue: each was a Python error answered as UnknownError.
    server, channel = ps
    await call(channel, "CreateContext", create_request(server))
    await enqueue(channel, send_tensor(1, np.float32(2)), send_tensor(2, np.array([2, 3], np.int32)))
    await enqueue(channel, send_tensor(3, np.array(True)))
    with pytest.raises(
        errors.InvalidArgumentError, match="'BroadcastTo' takes 2 inputs with its attrs, got 1"
    ):
        await enqueue(
            channel,
            operation(4, "BroadcastTo", (1, 0), T=float_dtype(), Tidx=AttrValue(type=types_pb2.DT_INT32)),
        )
    with pytest.raises(
        errors.InvalidArgumentError, match="Value for attr 'N' of 0 must be at least minimum 1"
    ):
        await enqueue(channel, operation(5, "DynamicStitch", N=AttrValue(i=0), T=float_dtype()))
    with pytest.raises(errors.InvalidArgumentError, match="Switch made a dead value"):
        await enqueue(channel, operation(6, "Switch", (1, 0), (3, 0), T=float_dtype()))
    # The context goes on.
    done = await enqueue(
        channel,
        operation(
            -1, "BroadcastTo", (1, 0), (2, 0), T=float_dtype(), Tidx=AttrValue(type=types_pb2.DT_INT32)
        ),
    )
    np.testing.assert_array_equal(
        from_tensor_proto(done.queue_response[0].tensor[0]), np.full((2, 3), 2, np.float32)
    )


# -- Enqueue fuzzed: random ops of the kernel registry, with random attrs and inputs ----

FUZZ_REQUESTS = 3000  # (~1 s)
FUZZ_DTYPES = [types_pb2.DT_FLOAT, types_pb2.DT_DOUBLE, types_pb2.DT_INT32, types_pb2.DT_INT64,
               types_pb2.DT_BOOL, types_pb2.DT_STRING, types_pb2.DT_INVALID, 99]  # fmt: skip
FUZZ_ATTR_NAMES = ["T", "dtype", "shape", "N", "Tidx", "axis", "keep_dims", "transpose_a", "value",
                   "out_type", "Tshape", "num_split", "shared_name", "dtypes", "Tindices", "Tparams",
                   "padding", "strides", "Tout", "Tin", "seed", "begin_mask", "perm", "Index"]  # fmt: skip


def _fuzz_attr(rng: random.Random) -> AttrValue:
    kind = rng.randrange(7)
    value = AttrValue()
    if kind == 0:
        value.type = rng.choice(FUZZ_DTYPES)
    elif kind == 1:
        for _ in range(rng.randrange(4)):
            value.shape.dim.add(size=rng.choice([-1, 0, 1, 3, 1 << 40]))
    elif kind == 2:
        value.i = rng.choice([0, 1, -1, 7, 1 << 62])
    elif kind == 3:
        value.s = rng.choice([b"", b"x", b"SAME", b"VALID"])
    elif kind == 4:
        value.b = rng.random() < 0.5
    elif kind == 5:
        value.list.i.extend(rng.choice([-1, 0, 1, 2]) for _ in range(rng.randrange(5)))
    else:
        value.list.type.extend(rng.choice(FUZZ_DTYPES) for _ in range(rng.randrange(3)))
    return value


def _fuzz_tensor(rng: random.Random) -> TensorProto:
    kind = rng.randrange(4)
    if kind == 0:
        return to_tensor_proto(np.asarray(rng.choice([-1, 0, 1, 2, 3]), np.int32))
    if kind == 1:
        return to_tensor_proto(np.arange(rng.randrange(7), dtype=np.float32))
    if kind == 2:
        return to_tensor_proto(
            np.asarray([rng.choice([-1, 0, 1, 2]) for _ in range(rng.randrange(4))], np.int64)
        )
    return to_tensor_proto(np.ones((2, 3), np.float32))


def _fuzz_request(rng: random.Random, ops: list[str], next_id: int) -> tuple[e.EnqueueRequest, int]:
    request = e.EnqueueRequest(context_id=CONTEXT)
    for _ in range(rng.randrange(1, 4)):
        item = request.queue.add()
        if rng.random() < 0.3:
            item.send_tensor.op_id, item.send_tensor.device_name = next_id, PS
            item.send_tensor.tensors.extend(_fuzz_tensor(rng) for _ in range(rng.randrange(1, 3)))
        else:
            op = item.operation
            op.id = next_id if rng.random() < 0.9 else -1
            op.name, op.device = rng.choice(ops), PS
            for _ in range(rng.randrange(4)):
                source = RemoteTensorHandle(
                    op_id=rng.randrange(1, next_id + 1), output_num=rng.choice([0, 0, 1])
                )
                source.device = PS
                op.op_inputs.add().remote_handle.CopyFrom(source)
            for _ in range(rng.randrange(5)):
                op.attrs[rng.choice(FUZZ_ATTR_NAMES)].CopyFrom(_fuzz_attr(rng))
        next_id += 1
    return request, next_id


async def test_random_ops_in_an_eager_context_are_answered_or_refused_by_name_never_as_bugs(ps, caplog):
    # Every kernel distserver has, with random attrs, inputs (some of them handles that
    # do not exist) and sent tensors: each request is answered, or refused with an
    # OpError that is not Unknown or Internal; nothing is logged as a bug, and the
    # context goes on. Seeded: the same requests every run.
    server, channel = ps
    await call(channel, "CreateContext", create_request(server))
    ops = sorted(_KERNELS)
    rng = random.Random(2)
    next_id = 1
    bugs = []
    for _ in range(FUZZ_REQUESTS):
        request, next_id = _fuzz_request(rng, ops, next_id)
        try:
            await call(channel, "Enqueue", request)
        except (errors.UnknownError, errors.InternalError) as exc:
            bugs.append(f"{[item.operation.name for item in request.queue]}: {exc.message[:200]}")
        except errors.OpError:
            pass
    assert not bugs, bugs[:5]
    assert not [record for record in caplog.records if "unexpected error" in record.getMessage()]
    echoed = await enqueue(channel, send_tensor(next_id, np.float32(5)))
    assert not echoed.queue_response[0].tensor
