from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class DebugOptions(_message.Message):
    __slots__ = ("global_step", "reset_disk_byte_usage")
    GLOBAL_STEP_FIELD_NUMBER: _ClassVar[int]
    RESET_DISK_BYTE_USAGE_FIELD_NUMBER: _ClassVar[int]
    global_step: int
    reset_disk_byte_usage: bool
    def __init__(self, global_step: _Optional[int] = ..., reset_disk_byte_usage: _Optional[bool] = ...) -> None: ...

class StepStats(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CostGraphDef(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
