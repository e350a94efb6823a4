"""distserver.errors: TensorFlow's error classes, codes and wire format."""

from __future__ import annotations

import pickle
import types

import grpc
import grpc.aio
import pytest

from distserver import errors
from distserver.transports.grpc import error_from_rpc, grpc_status

# (class name in tf.errors, code constant name, value) exactly as in TensorFlow 2.x
# (tensorflow/python/framework/errors_impl.py; checked against TF 2.21).
TF_ERRORS = [
    ("CancelledError", "CANCELLED", 1),
    ("UnknownError", "UNKNOWN", 2),
    ("InvalidArgumentError", "INVALID_ARGUMENT", 3),
    ("DeadlineExceededError", "DEADLINE_EXCEEDED", 4),
    ("NotFoundError", "NOT_FOUND", 5),
    ("AlreadyExistsError", "ALREADY_EXISTS", 6),
    ("PermissionDeniedError", "PERMISSION_DENIED", 7),
    ("ResourceExhaustedError", "RESOURCE_EXHAUSTED", 8),
    ("FailedPreconditionError", "FAILED_PRECONDITION", 9),
    ("AbortedError", "ABORTED", 10),
    ("OutOfRangeError", "OUT_OF_RANGE", 11),
    ("UnimplementedError", "UNIMPLEMENTED", 12),
    ("InternalError", "INTERNAL", 13),
    ("UnavailableError", "UNAVAILABLE", 14),
    ("DataLossError", "DATA_LOSS", 15),
    ("UnauthenticatedError", "UNAUTHENTICATED", 16),
]
CLASSES = [getattr(errors, name) for name, _, _ in TF_ERRORS]
IDS = [name for name, _, _ in TF_ERRORS]


def all_errors():
    return pytest.mark.parametrize(("name", "const", "value"), TF_ERRORS, ids=IDS)


def all_classes():
    return pytest.mark.parametrize("cls", CLASSES, ids=IDS)


# --- classes and codes -------------------------------------------------------------


def test_sixteen_subclasses():
    assert len(TF_ERRORS) == 16
    assert len(set(CLASSES)) == 16
    exported = {name for name in errors.__all__ if name.endswith("Error")}
    assert exported == {name for name, _, _ in TF_ERRORS} | {"OpError"}
    subclasses = {
        cls for cls in vars(errors).values() if isinstance(cls, type) and issubclass(cls, errors.OpError)
    }
    assert subclasses == set(CLASSES) | {errors.OpError}


def test_ok_constant():
    assert errors.OK == 0
    assert "OK" in errors.__all__


@all_errors()
def test_class_name_and_code(name, const, value):
    cls = getattr(errors, name)
    assert cls.__name__ == name
    assert issubclass(cls, errors.OpError)
    assert issubclass(cls, Exception)
    assert getattr(errors, const) == value
    assert const in errors.__all__
    assert name in errors.__all__
    assert cls.status_code == value
    assert cls("boom").error_code == value
    assert cls("boom").code == value


@all_errors()
def test_codes_match_grpc(name, const, value):
    status = grpc_status(value)
    assert isinstance(status, grpc.StatusCode)
    assert status.value[0] == value
    assert status.name == const
    assert getattr(grpc.StatusCode, const).value[0] == getattr(errors, const)


def test_grpc_status_ok_and_unknown_codes():
    assert grpc_status(errors.OK) is grpc.StatusCode.OK
    assert grpc_status(99) is grpc.StatusCode.UNKNOWN
    assert grpc_status(-1) is grpc.StatusCode.UNKNOWN


def test_every_grpc_status_has_a_class():
    for status in grpc.StatusCode:
        code = status.value[0]
        if status is grpc.StatusCode.OK:
            with pytest.raises(KeyError):
                errors.exception_type_from_error_code(code)
            continue
        cls = errors.exception_type_from_error_code(code)
        assert cls.status_code == code
        assert getattr(errors, status.name) == code


def test_deadline_exceeded_is_timeout_error():
    error = errors.DeadlineExceededError("too slow")
    assert isinstance(error, TimeoutError)
    assert isinstance(error, errors.OpError)
    with pytest.raises(TimeoutError, match="too slow"):
        raise error


def test_unavailable_is_connection_error():
    error = errors.UnavailableError("peer down")
    assert isinstance(error, ConnectionError)
    assert isinstance(error, errors.OpError)
    with pytest.raises(ConnectionError, match="peer down"):
        raise error


def test_other_classes_are_not_os_errors():
    for cls in CLASSES:
        if cls in (errors.DeadlineExceededError, errors.UnavailableError):
            continue
        assert not issubclass(cls, OSError), cls


# --- constructors --------------------------------------------------------------------


@all_classes()
def test_constructor_message_only(cls):
    error = cls("something failed")
    assert error.message == "something failed"
    assert str(error) == "something failed"
    assert repr(error) == f"{cls.__name__}('something failed')"
    assert error.args == ("something failed",)
    assert error.node_def is None
    assert error.op is None
    assert error.node_name is None


@all_classes()
def test_constructor_tensorflow_shape(cls):
    error = cls(None, None, "something failed")
    assert type(error) is cls
    assert error.message == "something failed"
    assert str(error) == "something failed"
    assert error.error_code == cls.status_code
    assert error.node_def is None
    assert error.op is None
    assert error.node_name is None


@all_classes()
def test_constructor_keywords(cls):
    error = cls("failed", node_name="layer/MatMul")
    assert error.node_name == "layer/MatMul"
    assert error.message == "failed"
    assert error.error_code == cls.status_code


def test_constructor_node_def_gives_node_name():
    node_def = types.SimpleNamespace(name="a/b")
    op = object()
    error = errors.InvalidArgumentError(node_def, op, "bad")
    assert error.node_def is node_def
    assert error.op is op
    assert error.node_name == "a/b"
    assert str(error) == "bad"
    # An explicit node_name wins; a node_def without a name gives none.
    assert errors.InvalidArgumentError(node_def, None, "bad", node_name="c").node_name == "c"
    assert errors.InvalidArgumentError(types.SimpleNamespace(name=""), None, "bad").node_name is None
    assert errors.InvalidArgumentError(object(), None, "bad").node_name is None


def test_constructor_stringifies_message():
    assert errors.InternalError(42).message == "42"
    assert errors.InternalError(None, None, 42).message == "42"


def test_op_error_with_code():
    error = errors.OpError(None, None, "m", 5)
    assert type(error) is errors.OpError
    assert error.message == "m"
    assert str(error) == "m"
    assert error.error_code == 5
    assert error.code == 5
    keyword = errors.OpError("m", code=errors.ABORTED)
    assert keyword.error_code == errors.ABORTED


def test_op_error_without_code_raises():
    with pytest.raises(TypeError):
        errors.OpError("m")
    with pytest.raises(TypeError):
        errors.OpError(None, None, "m")


def test_unknown_error_accepts_a_code():
    error = errors.UnknownError(None, None, "m", 77)
    assert type(error) is errors.UnknownError
    assert error.error_code == 77
    assert errors.UnknownError(None, None, "m").error_code == errors.UNKNOWN


@pytest.mark.parametrize("cls", [c for c in CLASSES if c is not errors.UnknownError])
def test_specific_classes_reject_a_fourth_argument(cls):
    with pytest.raises(TypeError):
        cls(None, None, "m", 5)


@pytest.mark.parametrize("args", [(), ("a", "b"), ("a", "b", "c", 1, 2)])
def test_wrong_number_of_arguments(args):
    with pytest.raises(TypeError):
        errors.InvalidArgumentError(*args)
    with pytest.raises(TypeError):
        errors.OpError(*args)


# --- pickling ------------------------------------------------------------------------


@all_classes()
@pytest.mark.parametrize("protocol", [0, pickle.HIGHEST_PROTOCOL])
def test_pickle_round_trip(cls, protocol):
    original = cls("it broke", node_name="x/y")
    clone = pickle.loads(pickle.dumps(original, protocol=protocol))
    assert type(clone) is cls
    assert clone.message == "it broke"
    assert str(clone) == "it broke"
    assert clone.error_code == cls.status_code
    assert clone.node_name == "x/y"


@all_classes()
def test_pickle_round_trip_tensorflow_shape_without_node(cls):
    clone = pickle.loads(pickle.dumps(cls(None, None, "it broke")))
    assert type(clone) is cls
    assert clone.message == "it broke"
    assert clone.error_code == cls.status_code
    assert clone.node_name is None


def test_pickle_round_trip_op_error():
    clone = pickle.loads(pickle.dumps(errors.OpError(None, None, "m", 5)))
    assert type(clone) is errors.OpError
    assert clone.message == "m"
    assert clone.error_code == 5
    assert clone.node_name is None


def test_pickle_round_trip_unknown_error_keeps_code():
    clone = pickle.loads(pickle.dumps(errors.UnknownError(None, None, "m", 99)))
    assert type(clone) is errors.UnknownError
    assert clone.error_code == 99


def test_pickle_keeps_node_name_from_node_def():
    error = errors.NotFoundError(types.SimpleNamespace(name="v"), None, "gone")
    clone = pickle.loads(pickle.dumps(error))
    assert clone.node_name == "v"
    assert clone.message == "gone"


def test_pickle_subclass_special_bases():
    deadline = pickle.loads(pickle.dumps(errors.DeadlineExceededError("late")))
    assert isinstance(deadline, TimeoutError)
    unavailable = pickle.loads(pickle.dumps(errors.UnavailableError("down")))
    assert isinstance(unavailable, ConnectionError)


# --- code <-> class ------------------------------------------------------------------


@all_errors()
def test_exception_type_from_error_code(name, const, value):
    assert errors.exception_type_from_error_code(value) is getattr(errors, name)


@all_errors()
def test_error_code_from_exception_type(name, const, value):
    assert errors.error_code_from_exception_type(getattr(errors, name)) == value


@pytest.mark.parametrize("code", [errors.OK, 17, 99, -1])
def test_exception_type_from_unknown_code_raises_key_error(code):
    with pytest.raises(KeyError):
        errors.exception_type_from_error_code(code)


class CustomError(errors.NotFoundError):
    pass


@pytest.mark.parametrize("cls", [ValueError, errors.OpError, CustomError])
def test_error_code_from_unknown_class_warns(cls):
    with pytest.warns(UserWarning, match="Unknown class exception"):
        assert errors.error_code_from_exception_type(cls) == errors.UNKNOWN


# --- from_status / to_status ---------------------------------------------------------


@all_errors()
def test_from_status(name, const, value):
    error = errors.from_status(value, "wire message")
    assert type(error) is getattr(errors, name)
    assert error.message == "wire message"
    assert error.error_code == value
    assert error.node_name is None
    named = errors.from_status(value, "wire message", node_name="n")
    assert named.node_name == "n"


@pytest.mark.parametrize("code", [errors.OK, 17, 99])
def test_from_status_unknown_code(code):
    with pytest.warns(UserWarning, match=f"Unknown error code: {code}"):
        error = errors.from_status(code, "strange", node_name="n")
    assert type(error) is errors.UnknownError
    assert error.error_code == code
    assert error.message == "strange"
    assert error.node_name == "n"


def test_from_status_accepts_int_like_code():
    error = errors.from_status(grpc.StatusCode.NOT_FOUND.value[0], "m")
    assert type(error) is errors.NotFoundError


@all_classes()
def test_to_status_op_errors(cls):
    assert errors.to_status(cls("msg")) == (cls.status_code, "msg")


@all_classes()
def test_to_status_from_status_round_trip(cls):
    code, message = errors.to_status(cls("round trip"))
    back = errors.from_status(code, message)
    assert type(back) is cls
    assert back.message == "round trip"


def test_to_status_op_error_with_custom_code():
    assert errors.to_status(errors.OpError("m", code=7)) == (7, "m")
    assert errors.to_status(errors.UnknownError(None, None, "m", 42)) == (42, "m")


def test_to_status_timeout_error():
    assert errors.to_status(TimeoutError("took too long")) == (errors.DEADLINE_EXCEEDED, "took too long")
    assert errors.to_status(TimeoutError()) == (errors.DEADLINE_EXCEEDED, "Deadline exceeded")


def test_to_status_generic_exception():
    assert errors.to_status(ValueError("boom")) == (errors.UNKNOWN, "ValueError: boom")
    assert errors.to_status(KeyError("k")) == (errors.UNKNOWN, "KeyError: 'k'")
    assert errors.to_status(RuntimeError()) == (errors.UNKNOWN, "RuntimeError: ")


def test_to_status_does_not_include_node_marker_twice():
    error = errors.with_node(errors.InvalidArgumentError("bad"), "n")
    code, message = errors.to_status(error)
    assert code == errors.INVALID_ARGUMENT
    assert message.count("{{node n}}") == 1


def test_max_wire_message_length():
    assert errors.MAX_WIRE_MESSAGE_LENGTH == 3072


def test_to_status_keeps_message_at_limit():
    message = "x" * 3072
    assert errors.to_status(errors.InternalError(message)) == (errors.INTERNAL, message)


def test_to_status_truncates_long_message():
    message = "".join(chr(ord("a") + i % 26) for i in range(5000))
    code, wire = errors.to_status(errors.InternalError(message))
    assert code == errors.INTERNAL
    # strings::Printf("%.3072s ... [truncated]", msg)
    assert wire == message[:3072] + " ... [truncated]"
    assert len(wire) == 3072 + len(" ... [truncated]")


def test_to_status_truncates_one_over_limit():
    code, wire = errors.to_status(errors.AbortedError("y" * 3073))
    assert code == errors.ABORTED
    assert wire == "y" * 3072 + " ... [truncated]"


def test_to_status_truncates_generic_exception_message():
    code, wire = errors.to_status(ValueError("z" * 4000))
    assert code == errors.UNKNOWN
    assert wire == ("ValueError: " + "z" * 4000)[:3072] + " ... [truncated]"


def test_to_status_truncates_timeout_message():
    code, wire = errors.to_status(TimeoutError("t" * 4000))
    assert code == errors.DEADLINE_EXCEEDED
    assert wire == "t" * 3072 + " ... [truncated]"


def test_to_status_limit_counts_utf8_bytes():
    # 2000 two-byte characters are 4000 bytes: over TensorFlow's byte limit.
    message = "é" * 2000
    code, wire = errors.to_status(errors.InternalError(message))
    assert code == errors.INTERNAL
    assert wire == "é" * 1536 + " ... [truncated]"
    # 1536 of them are exactly 3072 bytes: kept whole.
    assert errors.to_status(errors.InternalError("é" * 1536))[1] == "é" * 1536


def test_to_status_drops_a_character_cut_at_the_limit():
    message = "a" + "é" * 2000  # byte 3072 falls inside a character
    wire = errors.to_status(errors.InternalError(message))[1]
    assert wire == "a" + "é" * 1535 + " ... [truncated]"
    assert len(wire.encode()) - len(" ... [truncated]") <= 3072


# --- node names ----------------------------------------------------------------------


def test_with_node_adds_marker():
    error = errors.InvalidArgumentError("Incompatible shapes: [2] vs. [3]")
    named = errors.with_node(error, "add")
    assert type(named) is errors.InvalidArgumentError
    assert named.node_name == "add"
    assert named.message == "Incompatible shapes: [2] vs. [3]\n\t [[{{node add}}]]"
    assert str(named) == named.message
    assert named.error_code == errors.INVALID_ARGUMENT
    # The original is left alone.
    assert error.node_name is None
    assert error.message == "Incompatible shapes: [2] vs. [3]"


def test_with_node_adds_marker_once():
    named = errors.with_node(errors.InvalidArgumentError("bad"), "add")
    again = errors.with_node(named, "add")
    assert again.message.count("[[{{node add}}]]") == 1
    assert again.node_name == "add"
    other = errors.with_node(named, "mul")
    assert "mul" not in other.message
    assert other.node_name == "add"


def test_with_node_keeps_existing_marker_in_message():
    error = errors.NotFoundError("missing\n\t [[{{node add}}]]")
    named = errors.with_node(error, "add")
    assert named.message == "missing\n\t [[{{node add}}]]"
    assert named.node_name == "add"


@all_classes()
def test_with_node_keeps_class_and_code(cls):
    named = errors.with_node(cls("m"), "scope/op")
    assert type(named) is cls
    assert named.error_code == cls.status_code
    assert errors.node_name_from_message(named.message) == "scope/op"


def test_with_node_keeps_custom_code():
    named = errors.with_node(errors.UnknownError(None, None, "m", 42), "n")
    assert named.error_code == 42
    named = errors.with_node(errors.OpError("m", code=9), "n")
    assert type(named) is errors.OpError
    assert named.error_code == 9


@pytest.mark.parametrize(
    ("message", "node"),
    [
        ("bad\n\t [[{{node add}}]]", "add"),
        ("x [[{{node scope/inner/MatMul_1}}]] y", "scope/inner/MatMul_1"),
        ("first [[{{node a}}]] then [[{{node b}}]]", "a"),
        ("no node here", None),
        ("", None),
        ("[[{{node }}]]", None),
    ],
)
def test_node_name_from_message(message, node):
    assert errors.node_name_from_message(message) == node


def test_node_name_survives_the_wire():
    named = errors.with_node(errors.FailedPreconditionError("uninitialized value v"), "v/read")
    code, message = errors.to_status(named)
    back = errors.from_status(code, message, node_name=errors.node_name_from_message(message))
    assert type(back) is errors.FailedPreconditionError
    assert back.node_name == "v/read"
    assert back.message == named.message


# --- gRPC errors ---------------------------------------------------------------------

TARGET = "localhost:2222"
METHOD = "/tensorflow.WorkerService/RunGraph"


def rpc_error(status, details, *, handler=False, extra=()):
    trailing = [*extra]
    if handler:
        trailing.append(("distserver-handler-error", "1"))
    return grpc.aio.AioRpcError(
        status,
        grpc.aio.Metadata(),
        grpc.aio.Metadata(*trailing),
        details=details,
        debug_error_string="debug",
    )


@all_errors()
def test_error_from_rpc_handler_error(name, const, value):
    exc = rpc_error(getattr(grpc.StatusCode, const), "handler says no", handler=True)
    error = error_from_rpc(exc, target=TARGET, method=METHOD)
    assert type(error) is getattr(errors, name)
    assert error.message == "handler says no"
    assert error.error_code == value


def test_error_from_rpc_handler_error_among_other_metadata():
    exc = rpc_error(grpc.StatusCode.NOT_FOUND, "gone", handler=True, extra=[("x-other", "v")])
    error = error_from_rpc(exc, target=TARGET, method=METHOD)
    assert type(error) is errors.NotFoundError
    assert error.message == "gone"


def test_error_from_rpc_handler_error_round_trip_of_to_status():
    original = errors.with_node(errors.InvalidArgumentError("x" * 5000), "n")
    code, message = errors.to_status(original)
    exc = rpc_error(grpc_status(code), message, handler=True)
    error = error_from_rpc(exc, target=TARGET, method=METHOD)
    assert type(error) is errors.InvalidArgumentError
    assert error.message == "x" * 3072 + " ... [truncated]"


def test_error_from_rpc_handler_unknown_stream_removed_is_kept():
    exc = rpc_error(grpc.StatusCode.UNKNOWN, "Stream removed", handler=True)
    error = error_from_rpc(exc, target=TARGET, method=METHOD)
    assert type(error) is errors.UnknownError
    assert error.message == "Stream removed"


@pytest.mark.parametrize(
    ("status", "cls"),
    [
        (grpc.StatusCode.UNAVAILABLE, errors.UnavailableError),
        (grpc.StatusCode.DEADLINE_EXCEEDED, errors.DeadlineExceededError),
        (grpc.StatusCode.CANCELLED, errors.CancelledError),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, errors.ResourceExhaustedError),
        (grpc.StatusCode.UNIMPLEMENTED, errors.UnimplementedError),
        (grpc.StatusCode.INTERNAL, errors.InternalError),
        (grpc.StatusCode.UNKNOWN, errors.UnknownError),
    ],
)
def test_error_from_rpc_transport_error(status, cls):
    exc = rpc_error(status, "failed to connect to all addresses")
    error = error_from_rpc(exc, target=TARGET, method=METHOD)
    assert type(error) is cls
    assert error.message == f"{METHOD} to {TARGET} failed: failed to connect to all addresses"
    assert error.error_code == status.value[0]


def test_error_from_rpc_transport_error_without_details():
    exc = grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, None, None, details=None, debug_error_string=None)
    error = error_from_rpc(exc, target=TARGET, method=METHOD)
    assert type(error) is errors.UnavailableError
    assert error.message == f"{METHOD} to {TARGET} failed: "


def test_error_from_rpc_stream_removed_is_unavailable():
    exc = rpc_error(grpc.StatusCode.UNKNOWN, "Stream removed")
    error = error_from_rpc(exc, target=TARGET, method=METHOD)
    assert type(error) is errors.UnavailableError
    assert isinstance(error, ConnectionError)
    assert error.error_code == errors.UNAVAILABLE
    assert error.message == f"{METHOD} to {TARGET} failed: Stream removed"


@pytest.mark.parametrize(
    "details", ["Stream removed.", "stream removed", "Stream removed ", "x Stream removed"]
)
def test_error_from_rpc_only_exact_stream_removed_is_mapped(details):
    error = error_from_rpc(rpc_error(grpc.StatusCode.UNKNOWN, details), target=TARGET, method=METHOD)
    assert type(error) is errors.UnknownError


@pytest.mark.parametrize(
    ("status", "details"),
    [
        (grpc.StatusCode.INTERNAL, "Internal error from Core"),
        (grpc.StatusCode.INTERNAL, "Received RST_STREAM with error code 2"),
    ],
)
def test_error_from_rpc_a_connection_lost_mid_call_is_unavailable(status, details):
    # Seen when a peer was killed while a RunGraph was in flight (the soak test).
    error = error_from_rpc(rpc_error(status, details), target=TARGET, method=METHOD)
    assert type(error) is errors.UnavailableError
    assert error.message == f"{METHOD} to {TARGET} failed: {details}"
    assert type(error_from_rpc(rpc_error(status, details, handler=True), target=TARGET, method=METHOD)) is (
        errors.InternalError
    )


def test_error_from_rpc_stream_removed_needs_unknown_code():
    exc = rpc_error(grpc.StatusCode.INTERNAL, "Stream removed")
    error = error_from_rpc(exc, target=TARGET, method=METHOD)
    assert type(error) is errors.InternalError
