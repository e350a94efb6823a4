"""Fixtures for kernel tests: NodeDefs from Python values and a real KernelContext.

`make_node(op, inputs=..., **attrs)` encodes each attr by its Python type:

    bool -> b, int -> i, float -> f, str/bytes -> s,
    numpy dtype or scalar type (np.float32, ml_dtypes.bfloat16, object) -> type,
    tuple of ints/None -> shape, TensorShapeProto -> shape (use for unknown rank),
    numpy array / TensorProto -> tensor,
    list -> list of the above (ints, floats, strings, types or shapes).

`run_op(op, *inputs, **attrs)` builds the kernel and runs it once on a fresh context
(or `ctx=` one), returning the outputs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pytest

from distserver.kernels import _compiled
from distserver.kernels.registry import create_kernel
from distserver.kernels.resources import ResourceManager
from distserver.protos.attr_value_pb2 import AttrValue
from distserver.protos.node_def_pb2 import NodeDef
from distserver.protos.tensor_pb2 import TensorProto
from distserver.protos.tensor_shape_pb2 import TensorShapeProto
from distserver.tensors import as_datatype, shape_to_proto, to_tensor_proto

DEVICE = "/job:worker/replica:0/task:0/device:CPU:0"


@dataclasses.dataclass
class Context:
    """A real KernelContext: a step id, a device and a real ResourceManager."""

    step_id: int = 1
    device: str = DEVICE
    device_incarnation: int = 1
    resources: ResourceManager = dataclasses.field(default_factory=ResourceManager)
    rendezvous: Any = None
    checkpoint_root: str | None = None
    frame_iter: tuple[int, int] | None = None


def _is_dtype(value: Any) -> bool:
    return (
        isinstance(value, np.dtype)
        or value is object
        or (isinstance(value, type) and issubclass(value, np.generic))
    )


def _set_list(attr: AttrValue, values: Sequence[Any]) -> None:
    attr.list.SetInParent()  # an empty list is still a list
    for value in values:
        if _is_dtype(value):
            attr.list.type.append(as_datatype(value))  # type: ignore[arg-type]
        elif isinstance(value, tuple | TensorShapeProto):
            shape = value if isinstance(value, TensorShapeProto) else shape_to_proto(value)
            attr.list.shape.add().CopyFrom(shape)
        elif isinstance(value, bool):
            attr.list.b.append(value)
        elif isinstance(value, int):
            attr.list.i.append(value)
        elif isinstance(value, float):
            attr.list.f.append(value)
        elif isinstance(value, str | bytes):
            attr.list.s.append(value.encode() if isinstance(value, str) else value)
        else:
            raise TypeError(f"cannot encode list element {value!r}")


def encode_attr(value: Any) -> AttrValue:
    attr = AttrValue()
    if isinstance(value, bool):
        attr.b = value
    elif isinstance(value, int):
        attr.i = value
    elif isinstance(value, float):
        attr.f = value
    elif isinstance(value, str | bytes):
        attr.s = value.encode() if isinstance(value, str) else value
    elif _is_dtype(value):
        attr.type = as_datatype(value)  # type: ignore[assignment]
    elif isinstance(value, TensorShapeProto):
        attr.shape.CopyFrom(value)
    elif isinstance(value, tuple):
        attr.shape.CopyFrom(shape_to_proto(value))
    elif isinstance(value, TensorProto):
        attr.tensor.CopyFrom(value)
    elif isinstance(value, np.ndarray):
        attr.tensor.CopyFrom(to_tensor_proto(value))
    elif isinstance(value, list):
        _set_list(attr, value)
    else:
        raise TypeError(f"cannot encode attr value {value!r}")
    return attr


def make_node(op: str, inputs: Sequence[str] = (), name: str | None = None, **attrs: Any) -> NodeDef:
    node = NodeDef(name=name or op.lower(), op=op, input=list(inputs))
    for key, value in attrs.items():
        node.attr[key].CopyFrom(encode_attr(value))
    return node


RunOp = Callable[..., list[Any]]


def run_op(
    op: str, *inputs: Any, ctx: Context | None = None, name: str | None = None, **attrs: Any
) -> list[Any]:
    node = make_node(op, [f"input_{i}" for i in range(len(inputs))], name=name, **attrs)
    kernel = create_kernel(node)
    return kernel.compute(ctx or Context(), [np.asarray(x) for x in inputs])


@pytest.fixture(name="make_node", scope="session")
def make_node_fixture() -> Callable[..., NodeDef]:
    return make_node


@pytest.fixture(name="run_op", scope="session")
def run_op_fixture() -> RunOp:
    return run_op


@pytest.fixture(name="new_context", scope="session")
def new_context_fixture() -> Callable[[], Context]:
    return Context


@pytest.fixture
def ctx() -> Context:
    return Context()


@pytest.fixture(params=["numpy", "compiled"])
def loops(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The test runs twice: with numpy's calls, then with the compiled loops
    (`kernels._compiled`; numba comes with the dev extra)."""
    # Compiled first either way, so that the background compilation cannot end during
    # the test and change the path under it.
    ready = _compiled.wait(300)
    if request.param == "numpy":
        monkeypatch.setattr(_compiled, "_loops", None)
    else:
        assert ready, "the compiled loops are not there: numba missing? (pip install -e '.[dev]')"
    return str(request.param)
