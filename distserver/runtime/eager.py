"""TensorFlow 2's EagerService on a distserver task: remote eager contexts.

A TensorFlow 2 client (a `ParameterServerStrategy` coordinator and the TensorFlow
workers it drives) uses a task through `/tensorflow.eager.EagerService/*`:

* `CreateContext` opens a context (a random 64-bit `context_id`) that holds what
  the client builds on this task: tensor *handles*, named `(op_id, output_num)`
  by the client, and a *function library*.
* `Enqueue` carries queue items, run in order: an `operation` (one op, such as
  `VarHandleOp`, `AssignVariableOp`, `ReadVariableOp`; or a function) whose
  outputs become handles `(operation.id, i)`; `send_tensor` (the client's values
  become handles); `register_function` / `remove_function`; `cleanup_function`
  (drop a component function's step); `handle_to_decref` (the client dropped a
  handle).
* `RunComponentFunction` runs a registered function that another task partitioned
  (a TensorFlow worker partitions each step and sends this task its part). Its
  `_Send` and `_Recv` nodes use the step's rendezvous under `func_step_id`, the
  worker's own rendezvous table: TensorFlow workers fetch this task's values with
  `WorkerService/RecvTensor` and this task fetches theirs the same way.
* `KeepAlive` (the context is dropped after `keep_alive_secs` without a call) and
  `CloseContext`.

Variables: an eager `VarHandleOp` whose `shared_name` is TensorFlow's anonymous
name gets a name of its own, unique in the task, and lives until the last handle
that holds it is released (decref, `DestroyResourceOp`, or the context's end), as
TensorFlow's reference-counted anonymous variables do. Other resources live in the
task's resource manager as in graph mode.

Budgets, since peers are hostile: contexts per task, handles and registered
functions per context, and the tensors decoded from each request (`DecodeBudget`).

Every call runs to its end before it answers, also in contexts the client made
`async`: the client's results are the same, later.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import random
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import numpy as np
from google.protobuf.message import Message

from distserver import errors
from distserver.devices import RendezvousKey
from distserver.kernels.registry import DEAD, create_kernel
from distserver.kernels.resources import ResourceManager
from distserver.kernels.sendrecv import RECV_PUSHED_ATTR
from distserver.protos import eager_service_pb2 as e
from distserver.protos.attr_value_pb2 import AttrValue
from distserver.protos.cluster_pb2 import ClusterDef
from distserver.protos.device_attributes_pb2 import DeviceAttributes
from distserver.protos.function_pb2 import FunctionDef, FunctionDefLibrary
from distserver.protos.graph_pb2 import GraphDef
from distserver.protos.node_def_pb2 import NodeDef
from distserver.protos.tensor_pb2 import TensorProto
from distserver.protos.tensorflow_server_pb2 import ServerDef
from distserver.runtime.concurrency import decode_message_tensors
from distserver.runtime.executor import Executor, StepContext, run_kernel
from distserver.runtime.functions import (
    has_function_calls,
    index_library,
    inline_functions,
    input_count,
    instantiate,
)
from distserver.runtime.names import int64_attr
from distserver.runtime.rendezvous import StepRendezvous
from distserver.runtime.worker import Worker
from distserver.tensors import ResourceHandle, shape_to_proto, to_tensor_proto

logger = logging.getLogger(__name__)

# TensorFlow's ResourceHandle::ANONYMOUS_NAME: an eager VarHandleOp with this
# shared_name makes a variable of its own (TensorFlow's anonymous variables).
ANONYMOUS_NAME = "cd2c89b7-88b7-44c8-ad83-06c2a9158347"
# The op id of an operation whose outputs go back in the response instead of
# becoming handles (TensorFlow's kInvalidOpId).
INVALID_OP_ID = -1

DEFAULT_MAX_CONTEXTS = 64
DEFAULT_MAX_HANDLES = 100_000
DEFAULT_MAX_FUNCTIONS = 10_000

# Names of anonymous variables, unique in the process (TensorFlow: "_AnonymousVar<N>").
_anonymous_ids = itertools.count(1)

HandleKey = tuple[int, int]


def _no_context(context_id: int) -> errors.OpError:
    return errors.InvalidArgumentError(
        f"Unable to find a context_id matching the specified one ({context_id}). Perhaps the worker "
        "was restarted, or the context was GC'd?"
    )


def _no_handle(key: HandleKey) -> errors.OpError:
    return errors.InvalidArgumentError(
        f"Unable to find the relevant tensor remote_handle: Op ID: {key[0]}, Output num: {key[1]}. "
        "One possible cause is that the tensor was accessed after deallocation in a distributed "
        "worker setup."
    )


def _resource_of(value: Any) -> ResourceHandle | None:
    """The handle a 0-d DT_RESOURCE value holds, else None."""
    if isinstance(value, np.ndarray) and value.dtype == object and value.ndim == 0:
        held = value[()]
        if isinstance(held, ResourceHandle):
            return held
    return None


@dataclasses.dataclass
class _Registered:
    """A registered function: its definition, the functions it calls, its registrations."""

    definition: FunctionDef
    library: FunctionDefLibrary
    references: int = 1


class EagerContext:
    """What one client built on this task: handles, functions, anonymous variables."""

    def __init__(
        self,
        context_id: int,
        view_id: int,
        keep_alive_secs: int,
        resources: ResourceManager,
        *,
        max_handles: int,
        max_functions: int,
    ) -> None:
        self.context_id = context_id
        self.view_id = view_id
        self.keep_alive_secs = keep_alive_secs
        self.last_access = asyncio.get_running_loop().time()
        self.expiry: asyncio.TimerHandle | None = None
        self.closed = False
        self._resources = resources
        self._max_handles = max_handles
        self._max_functions = max_functions
        self._handles: dict[HandleKey, Any] = {}
        # Anonymous variables of this context -> handles that hold them.
        self._anonymous: dict[str, int] = {}
        self.functions: dict[str, _Registered] = {}
        # Instantiated functions, by name and attrs; dropped with their registration.
        self.instances: dict[tuple[str, bytes], FunctionInstance] = {}

    # -- handles --------------------------------------------------------------------

    def handle(self, key: HandleKey) -> Any:
        try:
            return self._handles[key]
        except KeyError:
            raise _no_handle(key) from None

    def add_handle(self, key: HandleKey, value: Any) -> None:
        if key in self._handles:
            # TensorFlow keeps the first; a client never reuses an id.
            raise errors.InvalidArgumentError(
                f"Operation ID {key[0]} (output {key[1]}) is already in use in context {self.context_id}"
            )
        if len(self._handles) >= self._max_handles:
            raise errors.ResourceExhaustedError(
                f"Context {self.context_id} holds {len(self._handles)} tensor handles, the most a "
                "context may hold on this task: the client is not releasing them (decref), or it "
                "needs a server started with a larger max_eager_handles"
            )
        self._handles[key] = value
        resource = _resource_of(value)
        if resource is not None and resource.name in self._anonymous:
            self._anonymous[resource.name] += 1

    def release_handle(self, key: HandleKey) -> None:
        value = self._handles.pop(key, None)
        if value is None:
            raise _no_handle(key)
        self._release_value(value)

    def new_anonymous_variable(self) -> str:
        name = f"_AnonymousVar{next(_anonymous_ids)}"
        self._anonymous[name] = 0
        return name

    def _release_value(self, value: Any) -> None:
        resource = _resource_of(value)
        if resource is None or resource.name not in self._anonymous:
            return
        self._anonymous[resource.name] -= 1
        if self._anonymous[resource.name] <= 0:
            del self._anonymous[resource.name]
            self._destroy(resource)

    def _destroy(self, resource: ResourceHandle) -> None:
        try:
            self._resources.delete(resource.container, resource.name)
        except errors.NotFoundError:
            pass  # destroyed already (DestroyResourceOp), or never assigned

    @property
    def num_handles(self) -> int:
        return len(self._handles)

    # -- functions ------------------------------------------------------------------

    def register(self, definition: FunctionDef, library: FunctionDefLibrary) -> None:
        name = definition.signature.name
        if not name:
            raise errors.InvalidArgumentError("RegisterFunction got a FunctionDef without a signature name")
        found = self.functions.get(name)
        if found is not None:
            if found.definition != definition:
                raise errors.InvalidArgumentError(
                    f"Cannot add function '{name}' because a different function with the same name "
                    "already exists."
                )
            found.references += 1
            return
        if len(self.functions) >= self._max_functions:
            raise errors.ResourceExhaustedError(
                f"Context {self.context_id} has {len(self.functions)} registered functions, the most a "
                "context may have on this task: the client is not removing the functions it no longer runs"
            )
        self.functions[name] = _Registered(definition, library)

    def library_for(self, name: str) -> dict[str, FunctionDef]:
        """The functions a call of registered function `name` may use: every registered
        one, and the library it was registered with."""
        library = {key: found.definition for key, found in self.functions.items()}
        library.update(index_library(self.functions[name].library))
        return library

    def remove(self, name: str) -> None:
        found = self.functions.get(name)
        if found is None:
            raise errors.InvalidArgumentError(f"Tried to remove non-existent function '{name}'.")
        found.references -= 1
        if found.references <= 0:
            del self.functions[name]
            for key in [key for key in self.instances if key[0] == name]:
                del self.instances[key]

    def close(self) -> None:
        """Release every handle (anonymous variables go with their last one) and function."""
        self.closed = True
        if self.expiry is not None:
            self.expiry.cancel()
            self.expiry = None
        handles, self._handles = self._handles, {}
        for value in handles.values():
            self._release_value(value)
        for name in list(self._anonymous):  # made but never held by a handle
            self._destroy(ResourceHandle("", "", name))
        self._anonymous.clear()
        self.functions.clear()
        self.instances.clear()


class EagerService:
    """The EagerService of one task; every method runs on the server's event loop.

    Args:
        worker: The task's worker: its device, resources, thread pool, and the
            rendezvous table component functions use.
        on_cluster: Called with the cluster of every CreateContext/UpdateContext
            before it is accepted (the server learns the addresses of the tasks
            it will fetch from); raises to refuse it.
        max_contexts, max_handles, max_functions: Budgets (see the module doc).
    """

    def __init__(
        self,
        *,
        worker: Worker,
        on_cluster: Callable[[ClusterDef], None] | None = None,
        max_contexts: int = DEFAULT_MAX_CONTEXTS,
        max_handles: int = DEFAULT_MAX_HANDLES,
        max_functions: int = DEFAULT_MAX_FUNCTIONS,
    ) -> None:
        self._worker = worker
        self._on_cluster = on_cluster
        self._max_contexts = max_contexts
        self._max_handles = max_handles
        self._max_functions = max_functions
        self._contexts: dict[int, EagerContext] = {}
        self._handlers: dict[str, Callable[[Any], Awaitable[Message]]] = {
            "CreateContext": self.create_context,
            "UpdateContext": self.update_context,
            "Enqueue": self.enqueue,
            "WaitQueueDone": self.wait_queue_done,
            "RunComponentFunction": self.run_component_function,
            "KeepAlive": self.keep_alive,
            "CloseContext": self.close_context,
        }

    def service_handlers(self) -> dict[str, Callable[[Any], Awaitable[Message]]]:
        """EagerService method name -> proto-in, proto-out handler, for transports."""
        return dict(self._handlers)

    @property
    def num_contexts(self) -> int:
        return len(self._contexts)

    def close(self) -> None:
        """Close every context (the server is stopping)."""
        for context in list(self._contexts.values()):
            self._drop(context)

    # -- contexts -------------------------------------------------------------------

    def _context(self, context_id: int) -> EagerContext:
        context = self._contexts.get(context_id)
        if context is None:
            raise _no_context(context_id)
        context.last_access = asyncio.get_running_loop().time()
        return context

    def _check_server_def(self, server_def: ServerDef) -> None:
        """The request's ServerDef must name this task; its cluster goes to `on_cluster`."""
        task = f"/job:{server_def.job_name}/replica:{server_def.replica}/task:{server_def.task_index}"
        if server_def.job_name and task != self._worker.task_name:
            raise errors.InvalidArgumentError(
                f"The ServerDef of this eager context is for task {task}, but this server is "
                f"{self._worker.task_name}: the client's cluster does not match the one this server "
                "was started with"
            )
        if self._on_cluster is not None:
            self._on_cluster(server_def.cluster)

    def _arm_expiry(self, context: EagerContext, delay: float) -> None:
        if context.keep_alive_secs > 0 and not context.closed:
            context.expiry = asyncio.get_running_loop().call_later(delay, self._expire, context)

    def _expire(self, context: EagerContext) -> None:
        context.expiry = None
        if self._contexts.get(context.context_id) is not context:
            return
        idle = asyncio.get_running_loop().time() - context.last_access
        if idle < context.keep_alive_secs:
            self._arm_expiry(context, context.keep_alive_secs - idle)
            return
        logger.info(
            "Eager context %d expired: no call for %d s (its keep_alive_secs)",
            context.context_id,
            context.keep_alive_secs,
        )
        self._drop(context)

    def _drop(self, context: EagerContext) -> None:
        if self._contexts.get(context.context_id) is context:
            del self._contexts[context.context_id]
        context.close()

    async def create_context(self, request: e.CreateContextRequest) -> e.CreateContextResponse:
        if request.clear_existing_contexts:
            self.close()
        if request.context_id in self._contexts:
            raise errors.InvalidArgumentError(
                f"EagerService:CreateContext failed. Context id: <{request.context_id}> already exists."
            )
        if len(self._contexts) >= self._max_contexts:
            raise errors.ResourceExhaustedError(
                f"This task has {len(self._contexts)} eager contexts, the most it keeps: close contexts "
                "(CloseContext) or let idle ones expire (keep_alive_secs)"
            )
        if request.keep_alive_secs < 0:
            raise errors.InvalidArgumentError(f"keep_alive_secs must be >= 0, got {request.keep_alive_secs}")
        self._check_server_def(request.server_def)
        context = EagerContext(
            request.context_id,
            request.context_view_id,
            request.keep_alive_secs,
            self._worker.resources,
            max_handles=self._max_handles,
            max_functions=self._max_functions,
        )
        self._contexts[request.context_id] = context
        self._arm_expiry(context, context.keep_alive_secs)
        response = e.CreateContextResponse()
        response.device_attributes.add().CopyFrom(self._worker.device)
        return response

    async def update_context(self, request: e.UpdateContextRequest) -> e.UpdateContextResponse:
        context = self._context(request.context_id)
        if request.context_view_id != context.view_id + 1:
            raise errors.InvalidArgumentError(
                f"EagerService:UpdateContext failed. Context id: <{request.context_id}> is at view "
                f"{context.view_id}, the update is for view {request.context_view_id}; it must be "
                f"{context.view_id + 1}."
            )
        response = e.UpdateContextResponse()
        # An update without a cluster only moves the view on (TensorFlow's "simplified"
        # update, sent when no task of the cluster changed).
        if request.server_def.cluster.job:
            self._check_server_def(request.server_def)
            response.device_attributes.add().CopyFrom(self._worker.device)
        context.view_id = request.context_view_id
        return response

    async def keep_alive(self, request: e.KeepAliveRequest) -> e.KeepAliveResponse:
        context = self._context(request.context_id)
        return e.KeepAliveResponse(context_view_id=context.view_id)

    async def close_context(self, request: e.CloseContextRequest) -> e.CloseContextResponse:
        context = self._contexts.get(request.context_id)
        # An unknown context is fine (TensorFlow swallows that); a close for an older
        # view than the context's is stale (the context was updated since) and ignored.
        if context is not None and request.context_view_id >= context.view_id:
            self._drop(context)
        return e.CloseContextResponse()

    async def wait_queue_done(self, request: e.WaitQueueDoneRequest) -> e.WaitQueueDoneResponse:
        self._context(request.context_id)
        # Every Enqueue has run to its end before it answered: nothing is pending.
        return e.WaitQueueDoneResponse()

    # -- Enqueue --------------------------------------------------------------------

    async def enqueue(self, request: e.EnqueueRequest) -> e.EnqueueResponse:
        context = self._context(request.context_id)
        values = iter(await decode_message_tensors(_tensors_of(request.queue), what="an Enqueue request"))
        response = e.EnqueueResponse()
        for item in request.queue:
            reply = response.queue_response.add()
            kind = item.WhichOneof("item")
            if kind == "operation":
                inline = [next(values) for i in item.operation.op_inputs if i.HasField("tensor")]
                outputs = await self._run_operation(context, item.operation, inline)
                self._answer(context, item.operation.id, outputs, None, reply.shape, reply.tensor)
                if not item.operation.device:
                    # Where an op without a device ran; a client that chose the device
                    # knows it (TensorFlow refuses to be told again).
                    reply.device.extend([self._worker.device.name] * len(reply.shape))
            elif kind == "send_tensor":
                sent = item.send_tensor
                self._check_device(sent.device_name)
                for i in range(len(sent.tensors)):
                    context.add_handle((sent.op_id, i), next(values))
            elif kind == "handle_to_decref":
                context.release_handle((item.handle_to_decref.op_id, item.handle_to_decref.output_num))
            elif kind == "register_function":
                context.register(item.register_function.function_def, item.register_function.library)
            elif kind == "remove_function":
                context.remove(item.remove_function.function_name)
            elif kind == "cleanup_function":
                self._worker.cleanup_step(item.cleanup_function.step_id)
            elif kind == "sync_remote_executor_for_stream":
                pass  # every item has run already
            elif kind == "send_packed_handle":
                raise errors.UnimplementedError(
                    "EagerService: send_packed_handle (packed variables of TPU and multi-device "
                    "strategies) is not supported by distserver"
                )
            else:
                raise errors.InvalidArgumentError("Enqueue got an empty queue item")
        return response

    def _check_device(self, device: str) -> None:
        if device and not _on_task(device, self._worker.task_name):
            raise errors.InvalidArgumentError(
                f"Device {device} is not a device of this task ({self._worker.task_name})"
            )

    def _answer(
        self,
        context: EagerContext,
        op_id: int,
        outputs: Sequence[Any],
        output_nums: Sequence[int] | None,
        shapes: Any,
        tensors: Any,
    ) -> None:
        """Keep an operation's outputs as handles and answer their shapes, or (no op
        id) answer the values themselves."""
        if output_nums and len(output_nums) != len(outputs):
            raise errors.InvalidArgumentError(
                f"The request names {len(output_nums)} output numbers for {len(outputs)} outputs"
            )
        for i, value in enumerate(outputs):
            if op_id == INVALID_OP_ID:
                tensors.add().CopyFrom(to_tensor_proto(value))
                continue
            context.add_handle((op_id, output_nums[i] if output_nums else i), value)
            shapes.add().CopyFrom(shape_to_proto(np.shape(value)))

    def _input(self, context: EagerContext, item: e.Operation.Input, inline: Any) -> Any:
        if item.HasField("tensor"):
            return next(inline)
        handle = item.remote_handle
        return context.handle((handle.op_id, handle.output_num))

    def _step_context(self, step_id: int, rendezvous: StepRendezvous) -> StepContext:
        return self._worker.step_context(step_id, rendezvous, self._worker.resources)

    async def _run_operation(
        self, context: EagerContext, operation: e.Operation, inline_values: list[Any]
    ) -> list[Any]:
        self._check_device(operation.device)
        if operation.is_function or operation.is_component_function or operation.name in context.functions:
            return await self._run_function(context, operation, inline_values)
        inline = iter(inline_values)
        inputs = [self._input(context, item, inline) for item in operation.op_inputs]
        node = NodeDef(name=operation.name, op=operation.name, device=self._worker.device.name)
        for name, value in operation.attrs.items():
            node.attr[name].CopyFrom(value)
        expected = input_count(node)
        if expected is not None and expected != len(inputs):
            raise errors.InvalidArgumentError(
                f"Operation '{operation.name}' takes {expected} inputs with its attrs, got {len(inputs)}",
                node_name=operation.name,
            )
        if operation.name == "VarHandleOp" and node.attr["shared_name"].s.decode() == ANONYMOUS_NAME:
            node.attr["shared_name"].s = context.new_anonymous_variable().encode()
        kernel = create_kernel(node)
        step_id = random.getrandbits(63)
        rendezvous = StepRendezvous(step_id, self._worker.task_name, None)
        outputs = await run_kernel(kernel, self._step_context(step_id, rendezvous), inputs)
        if any(value is DEAD for value in outputs):
            raise errors.InvalidArgumentError(
                f"{operation.name} made a dead value (the untaken branch of a Switch): TensorFlow 1's "
                "control flow ops run in graphs, not eagerly",
                node_name=operation.name,
            )
        return outputs

    # -- functions ------------------------------------------------------------------

    async def run_component_function(
        self, request: e.RunComponentFunctionRequest
    ) -> e.RunComponentFunctionResponse:
        context = self._context(request.context_id)
        operation = request.operation
        self._check_device(operation.device)
        inline = await decode_message_tensors(
            [i.tensor for i in operation.op_inputs if i.HasField("tensor")],
            what="a RunComponentFunction request",
        )
        outputs = await self._run_function(context, operation, inline)
        response = e.RunComponentFunctionResponse()
        self._answer(
            context, operation.id, outputs, list(request.output_num), response.shape, response.tensor
        )
        return response

    async def _run_function(
        self, context: EagerContext, operation: e.Operation, inline_values: list[Any]
    ) -> list[Any]:
        registered = context.functions.get(operation.name)
        if registered is None:
            raise errors.NotFoundError(
                f"'{operation.name}' is neither a type of a primitive operation nor a name of a function "
                f"registered in binary running on {self._worker.task_name}. Make sure the operation or "
                "function is registered in the binary running in this process."
            )
        attrs = _attrs_key(operation)
        instance = context.instances.get((operation.name, attrs))
        if instance is None:
            instance = FunctionInstance(
                operation.name, context.library_for(operation.name), operation.attrs,
                self._worker.device, self._worker.task_name,
            )  # fmt: skip
            if len(context.instances) >= self._max_functions:
                context.instances.clear()  # calls with ever new attrs must not grow it without end
            context.instances[(operation.name, attrs)] = instance
        inline = iter(inline_values)
        args = [self._input(context, item, inline) for item in operation.op_inputs]
        step_id = operation.func_step_id if operation.is_component_function else random.getrandbits(63)
        rendezvous = self._worker.start_step(step_id)
        try:
            outputs = await instance.run(self._step_context(step_id, rendezvous), args)
        except errors.OpError as exc:
            self._worker.step_failed(step_id, exc)
            raise
        except asyncio.CancelledError:
            self._worker.step_failed(step_id, errors.CancelledError("The function call was cancelled"))
            raise
        self._worker.step_finished(step_id)
        return outputs


# -- component functions ---------------------------------------------------------------
# A call's arguments and results travel through the step's rendezvous under keys local
# to this device: each `_Arg` of the instantiated body becomes a `_Recv` of argument i,
# each `_Retval` a `_Send` of result i. The executor then runs the body like a graph
# partition, and the values the function exchanges with other tasks use the same
# rendezvous.

_ARG_TENSOR = "__distserver_arg_{}"
_RETVAL_TENSOR = "__distserver_retval_{}"


class FunctionInstance:
    """A registered function instantiated for one set of attrs, ready to run many times.

    Raises (from the constructor):
        UnimplementedError: a node placed on another task (TensorFlow partitions a
            multi-device function on the caller), or an op distserver lacks.
        InvalidArgumentError: a malformed FunctionDef (`functions.instantiate`).
    """

    def __init__(
        self,
        name: str,
        library: Mapping[str, FunctionDef],
        attrs: Mapping[str, AttrValue],
        device: DeviceAttributes,
        task: str,
    ) -> None:
        self.name = name
        body = instantiate(library, name, attrs)
        nodes: Sequence[NodeDef] = body.graph_def.node
        if has_function_calls(nodes, library):
            nodes = inline_functions(nodes, library)
        graph = GraphDef()
        self._arg_keys: list[RendezvousKey] = []
        self._ret_keys: list[RendezvousKey] = []
        for node in nodes:
            if node.device and not _on_task(node.device, task):
                raise errors.UnimplementedError(
                    f"Function '{name}' places node '{node.name}' on {node.device}: distserver runs "
                    f"functions whose nodes are all on this task ({task}); TensorFlow partitions "
                    "multi-device functions on the caller"
                )
            if node.op == "_Arg":
                key = _local_key(device, _ARG_TENSOR.format(node.attr["index"].i))
                graph.node.append(_arg_as_recv(node, key, device.incarnation))
                self._arg_keys.append(key)
            elif node.op == "_Retval":
                key = _local_key(device, _RETVAL_TENSOR.format(node.attr["index"].i))
                graph.node.append(_retval_as_send(node, key, device.incarnation))
                self._ret_keys.append(key)
            else:
                graph.node.append(node)
        self._executor = Executor(graph)

    async def run(self, ctx: StepContext, args: list[Any]) -> list[Any]:
        """Run one call in `ctx`'s step: bind `args`, run the body, return the results."""
        if len(args) != len(self._arg_keys):
            raise errors.InvalidArgumentError(
                f"Function '{self.name}' takes {len(self._arg_keys)} arguments, the call gives {len(args)}"
            )
        for key, value in zip(self._arg_keys, args, strict=True):
            ctx.rendezvous.send(key, value)
        await self._executor.run(ctx)
        results = []
        for i, key in enumerate(self._ret_keys):
            value, is_dead = await ctx.rendezvous.recv_local(key)
            if is_dead:
                raise errors.InvalidArgumentError(f"Function '{self.name}': Retval[{i}] does not have value")
            results.append(value)
        return results


def _local_key(device: DeviceAttributes, tensor_name: str) -> RendezvousKey:
    return RendezvousKey(device.name, device.incarnation, device.name, tensor_name)


def _sendrecv_attrs(node: NodeDef, key: RendezvousKey, incarnation: int) -> None:
    node.attr["send_device"].s = key.src_device.encode()
    node.attr["recv_device"].s = key.dst_device.encode()
    node.attr["send_device_incarnation"].i = int64_attr(incarnation)
    node.attr["tensor_name"].s = key.tensor_name.encode()


def _arg_as_recv(arg: NodeDef, key: RendezvousKey, incarnation: int) -> NodeDef:
    node = NodeDef(name=arg.name, op="_Recv", device=key.dst_device)
    node.attr["tensor_type"].CopyFrom(arg.attr["T"])
    _sendrecv_attrs(node, key, incarnation)
    node.attr[RECV_PUSHED_ATTR].b = True  # the call delivers it; never fetched from elsewhere
    return node


def _retval_as_send(retval: NodeDef, key: RendezvousKey, incarnation: int) -> NodeDef:
    node = NodeDef(name=retval.name, op="_Send", device=key.src_device)
    node.input.extend(retval.input)
    node.attr["T"].CopyFrom(retval.attr["T"])
    _sendrecv_attrs(node, key, incarnation)
    return node


def _tensors_of(queue: Sequence[e.QueueItem]) -> list[TensorProto]:
    """The TensorProtos of a request's items, in the order `enqueue` takes them."""
    protos: list[TensorProto] = []
    for item in queue:
        kind = item.WhichOneof("item")
        if kind == "operation":
            protos.extend(i.tensor for i in item.operation.op_inputs if i.HasField("tensor"))
        elif kind == "send_tensor":
            protos.extend(item.send_tensor.tensors)
    return protos


def _attrs_key(operation: e.Operation) -> bytes:
    """The operation's attrs, canonically serialized (the instance cache's key)."""
    return b"".join(
        name.encode() + b"\0" + operation.attrs[name].SerializeToString(deterministic=True)
        for name in sorted(operation.attrs)
    )


def _on_task(device: str, task: str) -> bool:
    """Whether full or partial device name `device` is on `task` (`/job:ps/replica:0/task:0`)."""
    return device == task or device.startswith(task + "/")
