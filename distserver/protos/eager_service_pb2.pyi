from distserver.protos import attr_value_pb2 as _attr_value_pb2
from distserver.protos import device_attributes_pb2 as _device_attributes_pb2
from distserver.protos import function_pb2 as _function_pb2
from distserver.protos import remote_tensor_handle_pb2 as _remote_tensor_handle_pb2
from distserver.protos import tensor_pb2 as _tensor_pb2
from distserver.protos import tensor_shape_pb2 as _tensor_shape_pb2
from distserver.protos import tensorflow_server_pb2 as _tensorflow_server_pb2
from distserver.protos import versions_pb2 as _versions_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Operation(_message.Message):
    __slots__ = ("id", "name", "op_inputs", "control_op_ids", "attrs", "device", "is_component_function", "func_step_id", "is_function")
    class Input(_message.Message):
        __slots__ = ("remote_handle", "tensor")
        REMOTE_HANDLE_FIELD_NUMBER: _ClassVar[int]
        TENSOR_FIELD_NUMBER: _ClassVar[int]
        remote_handle: _remote_tensor_handle_pb2.RemoteTensorHandle
        tensor: _tensor_pb2.TensorProto
        def __init__(self, remote_handle: _Optional[_Union[_remote_tensor_handle_pb2.RemoteTensorHandle, _Mapping]] = ..., tensor: _Optional[_Union[_tensor_pb2.TensorProto, _Mapping]] = ...) -> None: ...
    class AttrsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: _attr_value_pb2.AttrValue
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[_attr_value_pb2.AttrValue, _Mapping]] = ...) -> None: ...
    ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    OP_INPUTS_FIELD_NUMBER: _ClassVar[int]
    CONTROL_OP_IDS_FIELD_NUMBER: _ClassVar[int]
    ATTRS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    IS_COMPONENT_FUNCTION_FIELD_NUMBER: _ClassVar[int]
    FUNC_STEP_ID_FIELD_NUMBER: _ClassVar[int]
    IS_FUNCTION_FIELD_NUMBER: _ClassVar[int]
    id: int
    name: str
    op_inputs: _containers.RepeatedCompositeFieldContainer[Operation.Input]
    control_op_ids: _containers.RepeatedScalarFieldContainer[int]
    attrs: _containers.MessageMap[str, _attr_value_pb2.AttrValue]
    device: str
    is_component_function: bool
    func_step_id: int
    is_function: bool
    def __init__(self, id: _Optional[int] = ..., name: _Optional[str] = ..., op_inputs: _Optional[_Iterable[_Union[Operation.Input, _Mapping]]] = ..., control_op_ids: _Optional[_Iterable[int]] = ..., attrs: _Optional[_Mapping[str, _attr_value_pb2.AttrValue]] = ..., device: _Optional[str] = ..., is_component_function: _Optional[bool] = ..., func_step_id: _Optional[int] = ..., is_function: _Optional[bool] = ...) -> None: ...

class QueueItem(_message.Message):
    __slots__ = ("handle_to_decref", "operation", "send_tensor", "register_function", "cleanup_function", "sync_remote_executor_for_stream", "send_packed_handle", "remove_function")
    HANDLE_TO_DECREF_FIELD_NUMBER: _ClassVar[int]
    OPERATION_FIELD_NUMBER: _ClassVar[int]
    SEND_TENSOR_FIELD_NUMBER: _ClassVar[int]
    REGISTER_FUNCTION_FIELD_NUMBER: _ClassVar[int]
    CLEANUP_FUNCTION_FIELD_NUMBER: _ClassVar[int]
    SYNC_REMOTE_EXECUTOR_FOR_STREAM_FIELD_NUMBER: _ClassVar[int]
    SEND_PACKED_HANDLE_FIELD_NUMBER: _ClassVar[int]
    REMOVE_FUNCTION_FIELD_NUMBER: _ClassVar[int]
    handle_to_decref: _remote_tensor_handle_pb2.RemoteTensorHandle
    operation: Operation
    send_tensor: SendTensorOp
    register_function: RegisterFunctionOp
    cleanup_function: CleanupFunctionOp
    sync_remote_executor_for_stream: SyncRemoteExecutorForStream
    send_packed_handle: SendPackedHandleOp
    remove_function: RemoveFunctionOp
    def __init__(self, handle_to_decref: _Optional[_Union[_remote_tensor_handle_pb2.RemoteTensorHandle, _Mapping]] = ..., operation: _Optional[_Union[Operation, _Mapping]] = ..., send_tensor: _Optional[_Union[SendTensorOp, _Mapping]] = ..., register_function: _Optional[_Union[RegisterFunctionOp, _Mapping]] = ..., cleanup_function: _Optional[_Union[CleanupFunctionOp, _Mapping]] = ..., sync_remote_executor_for_stream: _Optional[_Union[SyncRemoteExecutorForStream, _Mapping]] = ..., send_packed_handle: _Optional[_Union[SendPackedHandleOp, _Mapping]] = ..., remove_function: _Optional[_Union[RemoveFunctionOp, _Mapping]] = ...) -> None: ...

class QueueResponse(_message.Message):
    __slots__ = ("shape", "device", "tensor")
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    shape: _containers.RepeatedCompositeFieldContainer[_tensor_shape_pb2.TensorShapeProto]
    device: _containers.RepeatedScalarFieldContainer[str]
    tensor: _containers.RepeatedCompositeFieldContainer[_tensor_pb2.TensorProto]
    def __init__(self, shape: _Optional[_Iterable[_Union[_tensor_shape_pb2.TensorShapeProto, _Mapping]]] = ..., device: _Optional[_Iterable[str]] = ..., tensor: _Optional[_Iterable[_Union[_tensor_pb2.TensorProto, _Mapping]]] = ...) -> None: ...

class CreateContextRequest(_message.Message):
    __slots__ = ("server_def", "keep_alive_secs", "version_def", "cluster_device_attributes", "context_id", "context_view_id", "lazy_copy_remote_function_inputs", "clear_existing_contexts")
    SERVER_DEF_FIELD_NUMBER: _ClassVar[int]
    ASYNC_FIELD_NUMBER: _ClassVar[int]
    KEEP_ALIVE_SECS_FIELD_NUMBER: _ClassVar[int]
    VERSION_DEF_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_DEVICE_ATTRIBUTES_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_ID_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_VIEW_ID_FIELD_NUMBER: _ClassVar[int]
    LAZY_COPY_REMOTE_FUNCTION_INPUTS_FIELD_NUMBER: _ClassVar[int]
    CLEAR_EXISTING_CONTEXTS_FIELD_NUMBER: _ClassVar[int]
    server_def: _tensorflow_server_pb2.ServerDef
    keep_alive_secs: int
    version_def: _versions_pb2.VersionDef
    cluster_device_attributes: _containers.RepeatedCompositeFieldContainer[_device_attributes_pb2.DeviceAttributes]
    context_id: int
    context_view_id: int
    lazy_copy_remote_function_inputs: bool
    clear_existing_contexts: bool
    def __init__(self, server_def: _Optional[_Union[_tensorflow_server_pb2.ServerDef, _Mapping]] = ..., keep_alive_secs: _Optional[int] = ..., version_def: _Optional[_Union[_versions_pb2.VersionDef, _Mapping]] = ..., cluster_device_attributes: _Optional[_Iterable[_Union[_device_attributes_pb2.DeviceAttributes, _Mapping]]] = ..., context_id: _Optional[int] = ..., context_view_id: _Optional[int] = ..., lazy_copy_remote_function_inputs: _Optional[bool] = ..., clear_existing_contexts: _Optional[bool] = ..., **kwargs) -> None: ...

class CreateContextResponse(_message.Message):
    __slots__ = ("device_attributes",)
    DEVICE_ATTRIBUTES_FIELD_NUMBER: _ClassVar[int]
    device_attributes: _containers.RepeatedCompositeFieldContainer[_device_attributes_pb2.DeviceAttributes]
    def __init__(self, device_attributes: _Optional[_Iterable[_Union[_device_attributes_pb2.DeviceAttributes, _Mapping]]] = ...) -> None: ...

class UpdateContextRequest(_message.Message):
    __slots__ = ("server_def", "cluster_device_attributes", "context_id", "context_view_id")
    SERVER_DEF_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_DEVICE_ATTRIBUTES_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_ID_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_VIEW_ID_FIELD_NUMBER: _ClassVar[int]
    server_def: _tensorflow_server_pb2.ServerDef
    cluster_device_attributes: _containers.RepeatedCompositeFieldContainer[_device_attributes_pb2.DeviceAttributes]
    context_id: int
    context_view_id: int
    def __init__(self, server_def: _Optional[_Union[_tensorflow_server_pb2.ServerDef, _Mapping]] = ..., cluster_device_attributes: _Optional[_Iterable[_Union[_device_attributes_pb2.DeviceAttributes, _Mapping]]] = ..., context_id: _Optional[int] = ..., context_view_id: _Optional[int] = ...) -> None: ...

class UpdateContextResponse(_message.Message):
    __slots__ = ("device_attributes",)
    DEVICE_ATTRIBUTES_FIELD_NUMBER: _ClassVar[int]
    device_attributes: _containers.RepeatedCompositeFieldContainer[_device_attributes_pb2.DeviceAttributes]
    def __init__(self, device_attributes: _Optional[_Iterable[_Union[_device_attributes_pb2.DeviceAttributes, _Mapping]]] = ...) -> None: ...

class EnqueueRequest(_message.Message):
    __slots__ = ("context_id", "queue")
    CONTEXT_ID_FIELD_NUMBER: _ClassVar[int]
    QUEUE_FIELD_NUMBER: _ClassVar[int]
    context_id: int
    queue: _containers.RepeatedCompositeFieldContainer[QueueItem]
    def __init__(self, context_id: _Optional[int] = ..., queue: _Optional[_Iterable[_Union[QueueItem, _Mapping]]] = ...) -> None: ...

class EnqueueResponse(_message.Message):
    __slots__ = ("queue_response",)
    QUEUE_RESPONSE_FIELD_NUMBER: _ClassVar[int]
    queue_response: _containers.RepeatedCompositeFieldContainer[QueueResponse]
    def __init__(self, queue_response: _Optional[_Iterable[_Union[QueueResponse, _Mapping]]] = ...) -> None: ...

class WaitQueueDoneRequest(_message.Message):
    __slots__ = ("context_id", "op_id")
    CONTEXT_ID_FIELD_NUMBER: _ClassVar[int]
    OP_ID_FIELD_NUMBER: _ClassVar[int]
    context_id: int
    op_id: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, context_id: _Optional[int] = ..., op_id: _Optional[_Iterable[int]] = ...) -> None: ...

class WaitQueueDoneResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RunComponentFunctionRequest(_message.Message):
    __slots__ = ("context_id", "operation", "output_num")
    CONTEXT_ID_FIELD_NUMBER: _ClassVar[int]
    OPERATION_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_NUM_FIELD_NUMBER: _ClassVar[int]
    context_id: int
    operation: Operation
    output_num: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, context_id: _Optional[int] = ..., operation: _Optional[_Union[Operation, _Mapping]] = ..., output_num: _Optional[_Iterable[int]] = ...) -> None: ...

class RunComponentFunctionResponse(_message.Message):
    __slots__ = ("shape", "tensor")
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    shape: _containers.RepeatedCompositeFieldContainer[_tensor_shape_pb2.TensorShapeProto]
    tensor: _containers.RepeatedCompositeFieldContainer[_tensor_pb2.TensorProto]
    def __init__(self, shape: _Optional[_Iterable[_Union[_tensor_shape_pb2.TensorShapeProto, _Mapping]]] = ..., tensor: _Optional[_Iterable[_Union[_tensor_pb2.TensorProto, _Mapping]]] = ...) -> None: ...

class KeepAliveRequest(_message.Message):
    __slots__ = ("context_id",)
    CONTEXT_ID_FIELD_NUMBER: _ClassVar[int]
    context_id: int
    def __init__(self, context_id: _Optional[int] = ...) -> None: ...

class KeepAliveResponse(_message.Message):
    __slots__ = ("context_view_id",)
    CONTEXT_VIEW_ID_FIELD_NUMBER: _ClassVar[int]
    context_view_id: int
    def __init__(self, context_view_id: _Optional[int] = ...) -> None: ...

class CloseContextRequest(_message.Message):
    __slots__ = ("context_id", "context_view_id")
    CONTEXT_ID_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_VIEW_ID_FIELD_NUMBER: _ClassVar[int]
    context_id: int
    context_view_id: int
    def __init__(self, context_id: _Optional[int] = ..., context_view_id: _Optional[int] = ...) -> None: ...

class CloseContextResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RegisterFunctionOp(_message.Message):
    __slots__ = ("function_def", "is_component_function", "library")
    FUNCTION_DEF_FIELD_NUMBER: _ClassVar[int]
    IS_COMPONENT_FUNCTION_FIELD_NUMBER: _ClassVar[int]
    LIBRARY_FIELD_NUMBER: _ClassVar[int]
    function_def: _function_pb2.FunctionDef
    is_component_function: bool
    library: _function_pb2.FunctionDefLibrary
    def __init__(self, function_def: _Optional[_Union[_function_pb2.FunctionDef, _Mapping]] = ..., is_component_function: _Optional[bool] = ..., library: _Optional[_Union[_function_pb2.FunctionDefLibrary, _Mapping]] = ...) -> None: ...

class RemoveFunctionOp(_message.Message):
    __slots__ = ("function_name",)
    FUNCTION_NAME_FIELD_NUMBER: _ClassVar[int]
    function_name: str
    def __init__(self, function_name: _Optional[str] = ...) -> None: ...

class CleanupFunctionOp(_message.Message):
    __slots__ = ("step_id",)
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    def __init__(self, step_id: _Optional[int] = ...) -> None: ...

class SyncRemoteExecutorForStream(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SendTensorOp(_message.Message):
    __slots__ = ("op_id", "tensors", "device_name")
    OP_ID_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_NAME_FIELD_NUMBER: _ClassVar[int]
    op_id: int
    tensors: _containers.RepeatedCompositeFieldContainer[_tensor_pb2.TensorProto]
    device_name: str
    def __init__(self, op_id: _Optional[int] = ..., tensors: _Optional[_Iterable[_Union[_tensor_pb2.TensorProto, _Mapping]]] = ..., device_name: _Optional[str] = ...) -> None: ...

class SendPackedHandleOp(_message.Message):
    __slots__ = ("op_id", "handles", "device_name")
    class LocalTensorHandle(_message.Message):
        __slots__ = ("tensor", "device")
        TENSOR_FIELD_NUMBER: _ClassVar[int]
        DEVICE_FIELD_NUMBER: _ClassVar[int]
        tensor: _tensor_pb2.TensorProto
        device: str
        def __init__(self, tensor: _Optional[_Union[_tensor_pb2.TensorProto, _Mapping]] = ..., device: _Optional[str] = ...) -> None: ...
    class Handle(_message.Message):
        __slots__ = ("local_handle", "remote_handle")
        LOCAL_HANDLE_FIELD_NUMBER: _ClassVar[int]
        REMOTE_HANDLE_FIELD_NUMBER: _ClassVar[int]
        local_handle: SendPackedHandleOp.LocalTensorHandle
        remote_handle: _remote_tensor_handle_pb2.RemoteTensorHandle
        def __init__(self, local_handle: _Optional[_Union[SendPackedHandleOp.LocalTensorHandle, _Mapping]] = ..., remote_handle: _Optional[_Union[_remote_tensor_handle_pb2.RemoteTensorHandle, _Mapping]] = ...) -> None: ...
    OP_ID_FIELD_NUMBER: _ClassVar[int]
    HANDLES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_NAME_FIELD_NUMBER: _ClassVar[int]
    op_id: int
    handles: _containers.RepeatedCompositeFieldContainer[SendPackedHandleOp.Handle]
    device_name: str
    def __init__(self, op_id: _Optional[int] = ..., handles: _Optional[_Iterable[_Union[SendPackedHandleOp.Handle, _Mapping]]] = ..., device_name: _Optional[str] = ...) -> None: ...
