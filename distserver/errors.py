"""Errors raised by distserver, mirroring `tf.errors`.

Every error a step, a session or a server can report is an `OpError` whose subclass
names its canonical status code, exactly as in TensorFlow (and gRPC)::

    OpError
    ├── CancelledError            CANCELLED            1
    ├── UnknownError              UNKNOWN              2
    ├── InvalidArgumentError      INVALID_ARGUMENT     3
    ├── DeadlineExceededError     DEADLINE_EXCEEDED    4   (also a TimeoutError)
    ├── NotFoundError             NOT_FOUND            5
    ├── AlreadyExistsError        ALREADY_EXISTS       6
    ├── PermissionDeniedError     PERMISSION_DENIED    7
    ├── ResourceExhaustedError    RESOURCE_EXHAUSTED   8
    ├── FailedPreconditionError   FAILED_PRECONDITION  9
    ├── AbortedError              ABORTED             10
    ├── OutOfRangeError           OUT_OF_RANGE        11
    ├── UnimplementedError        UNIMPLEMENTED       12
    ├── InternalError             INTERNAL            13
    ├── UnavailableError          UNAVAILABLE         14   (also a ConnectionError)
    ├── DataLossError             DATA_LOSS           15
    └── UnauthenticatedError      UNAUTHENTICATED     16

Errors pickle, cross the wire as a status code plus message (`to_status` /
`from_status`), and may name the graph node that failed (`node_name`).

Misuse of the API (a call in the wrong state, an argument of the wrong type) raises
plain `RuntimeError` / `TypeError` / `ValueError` instead.
"""

from __future__ import annotations

import re
import warnings
from typing import Any, ClassVar

OK = 0
CANCELLED = 1
UNKNOWN = 2
INVALID_ARGUMENT = 3
DEADLINE_EXCEEDED = 4
NOT_FOUND = 5
ALREADY_EXISTS = 6
PERMISSION_DENIED = 7
RESOURCE_EXHAUSTED = 8
FAILED_PRECONDITION = 9
ABORTED = 10
OUT_OF_RANGE = 11
UNIMPLEMENTED = 12
INTERNAL = 13
UNAVAILABLE = 14
DATA_LOSS = 15
UNAUTHENTICATED = 16

# TensorFlow truncates status messages longer than this when it sends them over gRPC.
MAX_WIRE_MESSAGE_LENGTH = 3072


class OpError(Exception):
    """A step, session or server operation failed.

    Args:
        message: What went wrong, for a person to read.
        code: The canonical status code (see the module docstring).
        node_name: Name of the graph node that failed, when one did.

    TensorFlow's constructor shape `(node_def, op, message)` is also accepted, so
    code written against `tf.errors` keeps working: `InvalidArgumentError(None, None, "bad")`.
    """

    # The status code of each subclass (instances report theirs as `error_code`).
    status_code: ClassVar[int] = UNKNOWN

    def __init__(self, *args: Any, code: int | None = None, node_name: str | None = None) -> None:
        node_def: Any = None
        op: Any = None
        if len(args) == 1:
            (message,) = args
        elif len(args) == 3:
            node_def, op, message = args
        elif len(args) == 4 and type(self) in (OpError, UnknownError):
            node_def, op, message, code = args
        else:
            raise TypeError(
                f"{type(self).__name__} takes (message) or (node_def, op, message), got {len(args)} arguments"
            )
        if code is None:
            if type(self) is OpError:
                raise TypeError("OpError needs a status code: OpError(message, code=...)")
            code = type(self).status_code
        if node_name is None and node_def is not None:
            node_name = getattr(node_def, "name", None) or None
        super().__init__(str(message))
        self._message = str(message)
        self._code = int(code)
        self._node_def = node_def
        self._op = op
        self.node_name = node_name

    @property
    def message(self) -> str:
        """The error message, without the node name."""
        return self._message

    @property
    def error_code(self) -> int:
        """The canonical status code of this error."""
        return self._code

    @property
    def code(self) -> int:
        """Alias of `error_code`."""
        return self._code

    @property
    def node_def(self) -> Any:
        """The NodeDef of the failing node, when known (TensorFlow compatibility)."""
        return self._node_def

    @property
    def op(self) -> Any:
        """The failing operation, when known (TensorFlow compatibility)."""
        return self._op

    def __str__(self) -> str:
        return self._message

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._message!r})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (type(self), self._message, self._code, self.node_name))


def _rebuild(cls: type[OpError], message: str, code: int, node_name: str | None) -> OpError:
    if cls is OpError:
        return OpError(message, code=code, node_name=node_name)
    error = cls(message, node_name=node_name)
    error._code = code
    return error


class CancelledError(OpError):
    """An operation or step was cancelled."""

    status_code = CANCELLED


class UnknownError(OpError):
    """An error of no more specific kind."""

    status_code = UNKNOWN


class InvalidArgumentError(OpError):
    """An operation received an invalid argument (bad shape, dtype, value, graph)."""

    status_code = INVALID_ARGUMENT


class DeadlineExceededError(OpError, TimeoutError):
    """A deadline expired before the operation could complete."""

    status_code = DEADLINE_EXCEEDED


class NotFoundError(OpError):
    """A requested entity (op type, session, variable, file) was not found."""

    status_code = NOT_FOUND


class AlreadyExistsError(OpError):
    """An entity that an operation tried to create already exists."""

    status_code = ALREADY_EXISTS


class PermissionDeniedError(OpError):
    """The caller may not run this operation."""

    status_code = PERMISSION_DENIED


class ResourceExhaustedError(OpError):
    """Some resource (memory, a limit, a quota) has been exhausted."""

    status_code = RESOURCE_EXHAUSTED


class FailedPreconditionError(OpError):
    """The system is not in a state that allows the operation (e.g. uninitialized variable)."""

    status_code = FAILED_PRECONDITION


class AbortedError(OpError):
    """The operation was aborted, typically by a concurrency conflict or a restarted peer."""

    status_code = ABORTED


class OutOfRangeError(OpError):
    """The operation went past the valid range (e.g. a closed, empty queue)."""

    status_code = OUT_OF_RANGE


class UnimplementedError(OpError):
    """The operation is not implemented or not supported."""

    status_code = UNIMPLEMENTED


class InternalError(OpError):
    """An internal invariant broke."""

    status_code = INTERNAL


class UnavailableError(OpError, ConnectionError):
    """A peer or the service is unavailable (down, unreachable, shutting down)."""

    status_code = UNAVAILABLE


class DataLossError(OpError):
    """Unrecoverable data loss or corruption."""

    status_code = DATA_LOSS


class UnauthenticatedError(OpError):
    """The request has no valid credentials."""

    status_code = UNAUTHENTICATED


_CODE_TO_EXCEPTION: dict[int, type[OpError]] = {
    cls.status_code: cls
    for cls in (
        CancelledError,
        UnknownError,
        InvalidArgumentError,
        DeadlineExceededError,
        NotFoundError,
        AlreadyExistsError,
        PermissionDeniedError,
        ResourceExhaustedError,
        FailedPreconditionError,
        AbortedError,
        OutOfRangeError,
        UnimplementedError,
        InternalError,
        UnavailableError,
        DataLossError,
        UnauthenticatedError,
    )
}
_EXCEPTION_CLASS_TO_CODE = {cls: code for code, cls in _CODE_TO_EXCEPTION.items()}


def exception_type_from_error_code(error_code: int) -> type[OpError]:
    """The `OpError` subclass for a status code. Raises KeyError for OK or an unknown code."""
    return _CODE_TO_EXCEPTION[error_code]


def error_code_from_exception_type(cls: type[OpError]) -> int:
    """The status code of an `OpError` subclass; warns and returns UNKNOWN for others."""
    try:
        return _EXCEPTION_CLASS_TO_CODE[cls]
    except KeyError:
        warnings.warn(f"Unknown class exception: {cls!r}", stacklevel=2)
        return UNKNOWN


def from_status(code: int, message: str, *, node_name: str | None = None) -> OpError:
    """Build the most specific `OpError` for a status code and message.

    An unknown code gives an `UnknownError` that keeps the original code.
    """
    cls = _CODE_TO_EXCEPTION.get(int(code))
    if cls is None:
        warnings.warn(f"Unknown error code: {int(code)}", stacklevel=2)
        return UnknownError(message, code=int(code), node_name=node_name)
    return cls(message, node_name=node_name)


def to_status(error: BaseException) -> tuple[int, str]:
    """The (code, message) pair that reports `error` on the wire.

    `OpError`s keep their code; a Python `TimeoutError` becomes DEADLINE_EXCEEDED and
    anything else becomes UNKNOWN with the exception's type in the message. Messages
    longer than TensorFlow's limit are truncated the way TensorFlow does.
    """
    if isinstance(error, OpError):
        code, message = error.error_code, error.message
    elif isinstance(error, TimeoutError):
        code, message = DEADLINE_EXCEEDED, str(error) or "Deadline exceeded"
    else:
        code, message = UNKNOWN, f"{type(error).__name__}: {error}"
    encoded = message.encode("utf-8", "surrogatepass")
    if len(encoded) > MAX_WIRE_MESSAGE_LENGTH:
        # Like TensorFlow's "%.3072s ... [truncated]": the limit counts UTF-8 bytes; a
        # character cut in half at the limit is dropped.
        message = encoded[:MAX_WIRE_MESSAGE_LENGTH].decode("utf-8", "ignore") + " ... [truncated]"
    return code, message


_NODE_IN_MESSAGE = re.compile(r"\[\[\{\{node ([^}]+)\}\}")


def node_name_from_message(message: str) -> str | None:
    """The node name that TensorFlow-style messages carry as `[[{{node NAME}}]]`."""
    match = _NODE_IN_MESSAGE.search(message)
    return match.group(1) if match else None


def with_node(error: OpError, node_name: str) -> OpError:
    """A copy of `error` that names `node_name`, in TensorFlow's `[[{{node X}}]]` style."""
    if error.node_name is not None:
        return error
    message = error.message
    if "{{node " not in message:
        message = f"{message}\n\t [[{{{{node {node_name}}}}}]]"
    clone = _rebuild(type(error), message, error.error_code, node_name)
    return clone


__all__ = [
    "ABORTED",
    "ALREADY_EXISTS",
    "CANCELLED",
    "DATA_LOSS",
    "DEADLINE_EXCEEDED",
    "FAILED_PRECONDITION",
    "INTERNAL",
    "INVALID_ARGUMENT",
    "NOT_FOUND",
    "OK",
    "OUT_OF_RANGE",
    "PERMISSION_DENIED",
    "RESOURCE_EXHAUSTED",
    "UNAUTHENTICATED",
    "UNAVAILABLE",
    "UNIMPLEMENTED",
    "UNKNOWN",
    "AbortedError",
    "AlreadyExistsError",
    "CancelledError",
    "DataLossError",
    "DeadlineExceededError",
    "FailedPreconditionError",
    "InternalError",
    "InvalidArgumentError",
    "NotFoundError",
    "OpError",
    "OutOfRangeError",
    "PermissionDeniedError",
    "ResourceExhaustedError",
    "UnauthenticatedError",
    "UnavailableError",
    "UnimplementedError",
    "UnknownError",
    "error_code_from_exception_type",
    "exception_type_from_error_code",
    "from_status",
    "node_name_from_message",
    "to_status",
    "with_node",
]
