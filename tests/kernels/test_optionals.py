"""Optionals (kernels/optionals.py): what control flow v2's cond gradients pass between branches."""

from __future__ import annotations

import numpy as np
import pytest

from distserver import errors
from distserver.kernels.registry import create_kernel
from distserver.protos.node_def_pb2 import NodeDef
from distserver.protos.types_pb2 import DT_FLOAT, DT_INT32


def run(op, inputs, **list_types):
    node = NodeDef(name=op.lower(), op=op)
    for key, types in list_types.items():
        node.attr[key].list.type.extend(types)
    return create_kernel(node).compute(None, inputs)


def test_an_optional_gives_back_what_it_holds():
    values = [np.arange(3, dtype=np.float32), np.int32(7)]
    (optional,) = run("OptionalFromValue", values, Toutput_types=[DT_FLOAT, DT_INT32])
    assert optional.shape == ()
    assert run("OptionalHasValue", [optional]) == [True]
    got = run("OptionalGetValue", [optional], output_types=[DT_FLOAT, DT_INT32])
    np.testing.assert_array_equal(got[0], values[0])
    assert got[1] == 7


def test_an_empty_optional_has_no_value_to_get():
    (empty,) = run("OptionalNone", [])
    assert run("OptionalHasValue", [empty]) == [False]
    with pytest.raises(errors.InvalidArgumentError, match="does not have a value"):
        run("OptionalGetValue", [empty], output_types=[DT_FLOAT])


def test_a_tensor_that_is_not_an_optional_is_refused():
    with pytest.raises(errors.InvalidArgumentError, match="holding an optional"):
        run("OptionalHasValue", [np.float32(1)])
    (optional,) = run("OptionalFromValue", [np.float32(1)], Toutput_types=[DT_FLOAT])
    with pytest.raises(errors.InvalidArgumentError, match="holds 1 tensors; output_types lists 2"):
        run("OptionalGetValue", [optional], output_types=[DT_FLOAT, DT_FLOAT])
