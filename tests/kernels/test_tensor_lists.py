"""TensorList kernels (kernels/tensor_lists.py), VariableShape and StridedSliceGrad."""

from __future__ import annotations

import numpy as np
import pytest

from distserver import errors
from distserver.kernels.registry import create_kernel
from distserver.kernels.tensor_lists import TensorList
from distserver.protos.node_def_pb2 import NodeDef
from distserver.protos.tensor_pb2 import VariantTensorDataProto
from distserver.protos.types_pb2 import DT_FLOAT, DT_INT32
from distserver.tensors import from_tensor_proto, to_tensor_proto

# TensorFlow 2.21's encoding of TensorListReserve(element_shape=[2, -1], 3, float32)
# with item 1 set to [[1, 2], [3, 4]] (tf.io.serialize_tensor's variant, unwrapped).
TF_LIST = (
    b"\n\026tensorflow::TensorList\022\037\002\000\002\001\377\377\377\377\377\377\377\377\377\001"
    b"\022\002\010\002\022\013\010\377\377\377\377\377\377\377\377\377\001\032\036\010\001\022\010"
    b"\022\002\010\002\022\002\010\002*\020\000\000\200?\000\000\000@\000\000@@\000\000\200@"
)


def run(op, inputs, **attrs):
    node = NodeDef(name=op.lower(), op=op)
    for key, value in attrs.items():
        if isinstance(value, int) and key in ("element_dtype", "T", "Index", "shape_type"):
            node.attr[key].type = value
        else:
            node.attr[key].i = value
    return create_kernel(node).compute(None, inputs)


def shape(*dims):
    return np.array(dims, dtype=np.int32)


def test_push_pop_and_stack_leave_their_inputs_alone():
    (empty,) = run("EmptyTensorList", [shape(2), np.int32(-1)], element_dtype=DT_FLOAT)
    (one,) = run("TensorListPushBack", [empty, np.array([1, 2], np.float32)], element_dtype=DT_FLOAT)
    (two,) = run("TensorListPushBack", [one, np.array([3, 4], np.float32)], element_dtype=DT_FLOAT)
    assert run("TensorListLength", [one]) == [1]
    np.testing.assert_array_equal(
        run("TensorListStack", [two, shape(2)], element_dtype=DT_FLOAT)[0], [[1, 2], [3, 4]]
    )
    rest, last = run("TensorListPopBack", [two, shape(2)], element_dtype=DT_FLOAT)
    np.testing.assert_array_equal(last, [3, 4])
    assert run("TensorListLength", [rest]) == [1]
    assert run("TensorListLength", [two]) == [2]
    np.testing.assert_array_equal(run("TensorListElementShape", [two], shape_type=DT_INT32)[0], [2])
    with pytest.raises(errors.InvalidArgumentError, match="pop from an empty list"):
        run("TensorListPopBack", [empty, shape(2)], element_dtype=DT_FLOAT)
    with pytest.raises(errors.InvalidArgumentError, match="Invalid data types"):
        run("TensorListPushBack", [empty, np.array([1], np.int32)], element_dtype=DT_FLOAT)


def test_reserve_set_get_and_unset_elements_read_as_zeros():
    (items,) = run("TensorListReserve", [shape(2), np.int32(3)], element_dtype=DT_FLOAT)
    (items,) = run(
        "TensorListSetItem", [items, np.int32(1), np.array([5, 6], np.float32)], element_dtype=DT_FLOAT
    )
    np.testing.assert_array_equal(
        run("TensorListGetItem", [items, np.int32(1), shape(2)], element_dtype=DT_FLOAT)[0], [5, 6]
    )
    np.testing.assert_array_equal(
        run("TensorListGetItem", [items, np.int32(0), shape(2)], element_dtype=DT_FLOAT)[0], [0, 0]
    )
    stacked = run("TensorListStack", [items, shape(2)], element_dtype=DT_FLOAT, num_elements=3)[0]
    np.testing.assert_array_equal(stacked, [[0, 0], [5, 6], [0, 0]])
    with pytest.raises(errors.InvalidArgumentError, match="element 3 in a list with 3"):
        run("TensorListGetItem", [items, np.int32(3), shape(2)], element_dtype=DT_FLOAT)
    with pytest.raises(errors.InvalidArgumentError, match="num_elements must be between"):
        run("TensorListReserve", [shape(2), np.int32(1 << 30)], element_dtype=DT_FLOAT)


def test_from_tensor_and_back():
    value = np.arange(6, dtype=np.float32).reshape(3, 2)
    (items,) = run("TensorListFromTensor", [value, np.int32(-1)], element_dtype=DT_FLOAT)
    np.testing.assert_array_equal(
        run("TensorListStack", [items, np.int32(-1)], element_dtype=DT_FLOAT)[0], value
    )


def test_lists_cross_tasks_in_tensorflows_encoding():
    (items,) = run("TensorListReserve", [shape(2, -1), np.int32(3)], element_dtype=DT_FLOAT)
    (items,) = run(
        "TensorListSetItem",
        [items, np.int32(1), np.array([[1, 2], [3, 4]], np.float32)],
        element_dtype=DT_FLOAT,
    )
    proto = to_tensor_proto(items)
    ours, theirs = proto.variant_val[0], VariantTensorDataProto.FromString(TF_LIST)
    assert ours.type_name == theirs.type_name
    assert ours.metadata == theirs.metadata  # unset indices, dtype, max elements, element shape
    # TensorFlow writes the element as float_val, distserver as tensor_content: same values.
    np.testing.assert_array_equal(from_tensor_proto(ours.tensors[0]), from_tensor_proto(theirs.tensors[0]))
    decoded = TensorList.from_variant_proto(theirs)
    assert decoded.element_shape == (2, -1)
    assert decoded.elements[0] is None
    np.testing.assert_array_equal(decoded.elements[1], [[1, 2], [3, 4]])
    # A kernel takes the received form directly.
    received = from_tensor_proto(proto)
    assert run("TensorListLength", [received]) == [3]


def test_strided_slice_grad_puts_dy_where_the_slice_read():
    begin, end, strides = np.array([1], np.int32), np.array([2], np.int32), np.array([1], np.int32)
    node = NodeDef(name="g", op="StridedSliceGrad")
    node.attr["T"].type = DT_FLOAT
    node.attr["Index"].type = DT_INT32
    node.attr["shrink_axis_mask"].i = 1
    (grad,) = create_kernel(node).compute(
        None, [shape(3, 2), begin, end, strides, np.array([7, 8], np.float32)]
    )
    np.testing.assert_array_equal(grad, [[0, 0], [7, 8], [0, 0]])
