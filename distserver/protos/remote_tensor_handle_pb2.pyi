from distserver.protos import tensor_shape_pb2 as _tensor_shape_pb2
from distserver.protos import types_pb2 as _types_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ResourceDtypeAndShape(_message.Message):
    __slots__ = ("dtype", "shape")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    dtype: _types_pb2.DataType
    shape: _tensor_shape_pb2.TensorShapeProto
    def __init__(self, dtype: _Optional[_Union[_types_pb2.DataType, str]] = ..., shape: _Optional[_Union[_tensor_shape_pb2.TensorShapeProto, _Mapping]] = ...) -> None: ...

class RemoteTensorHandle(_message.Message):
    __slots__ = ("op_id", "output_num", "device", "op_device", "dtype", "resource_dtypes_and_shapes")
    OP_ID_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_NUM_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    OP_DEVICE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    RESOURCE_DTYPES_AND_SHAPES_FIELD_NUMBER: _ClassVar[int]
    op_id: int
    output_num: int
    device: str
    op_device: str
    dtype: _types_pb2.DataType
    resource_dtypes_and_shapes: _containers.RepeatedCompositeFieldContainer[ResourceDtypeAndShape]
    def __init__(self, op_id: _Optional[int] = ..., output_num: _Optional[int] = ..., device: _Optional[str] = ..., op_device: _Optional[str] = ..., dtype: _Optional[_Union[_types_pb2.DataType, str]] = ..., resource_dtypes_and_shapes: _Optional[_Iterable[_Union[ResourceDtypeAndShape, _Mapping]]] = ...) -> None: ...
