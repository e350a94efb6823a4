from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FullTypeDef(_message.Message):
    __slots__ = ("type_id", "args", "s", "i")
    TYPE_ID_FIELD_NUMBER: _ClassVar[int]
    ARGS_FIELD_NUMBER: _ClassVar[int]
    S_FIELD_NUMBER: _ClassVar[int]
    I_FIELD_NUMBER: _ClassVar[int]
    type_id: int
    args: _containers.RepeatedCompositeFieldContainer[FullTypeDef]
    s: str
    i: int
    def __init__(self, type_id: _Optional[int] = ..., args: _Optional[_Iterable[_Union[FullTypeDef, _Mapping]]] = ..., s: _Optional[str] = ..., i: _Optional[int] = ...) -> None: ...
