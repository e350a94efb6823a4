"""TensorArrays of control flow v1 (kernels/tensor_arrays.py): TensorFlow's rules and errors.

Through a TensorFlow client, in loops and gradients: tests/interop/test_v1_loops.py."""

from __future__ import annotations

import re

import numpy as np
import pytest

from distserver import errors
from distserver.kernels.tensor_arrays import MAX_ELEMENTS, TensorArray


def array(size: int = 3, **kwargs) -> TensorArray:
    options = {"dynamic_size": False, "clear_after_read": True, "element_shape": None, **kwargs}
    return TensorArray("ta", np.dtype(np.float32), size, **options)


def test_an_element_is_written_once_and_read_once_by_default():
    ta = array()
    ta.write(1, np.float32([1, 2]))
    with pytest.raises(errors.InvalidArgumentError, match="already been written to"):
        ta.write(1, np.float32([3, 4]))
    np.testing.assert_array_equal(ta.read(1), [1, 2])
    with pytest.raises(errors.InvalidArgumentError, match="twice because it was cleared"):
        ta.read(1)
    kept = array(clear_after_read=False)
    kept.write(0, np.float32(5))
    assert kept.read(0) == kept.read(0) == 5


def test_unwritten_elements_read_as_zeros_only_when_their_shape_is_known():
    with pytest.raises(errors.InvalidArgumentError, match="not yet been written to"):
        array().read(0)
    np.testing.assert_array_equal(array(element_shape=(2,)).read(0), [0, 0])
    ta = array()
    ta.write(0, np.float32([1, 2, 3]))  # the first write fixes the element shape
    np.testing.assert_array_equal(ta.read(2), [0, 0, 0])
    with pytest.raises(errors.InvalidArgumentError, match="incompatible"):
        ta.write(1, np.float32([1]))


def test_size_dtype_and_index_are_checked():
    ta = array(2)
    with pytest.raises(errors.InvalidArgumentError, match="not resizeable and size is: 2"):
        ta.write(2, np.float32(1))
    wrong_dtype = "dtype is float32 but Op is trying to write dtype int32"
    with pytest.raises(errors.InvalidArgumentError, match=wrong_dtype):
        ta.write(0, np.int32(1))
    with pytest.raises(errors.InvalidArgumentError, match="index -1"):
        ta.write(-1, np.float32(1))
    growing = array(0, dynamic_size=True)
    growing.write(4, np.float32(1))
    assert len(growing.elements) == 5
    with pytest.raises(errors.InvalidArgumentError, match=f"index {MAX_ELEMENTS}"):
        growing.write(MAX_ELEMENTS, np.float32(1))
    with pytest.raises(errors.InvalidArgumentError, match="array size is: 5"):
        growing.read(5)


def test_gradient_arrays_add_up_writes_to_one_index():
    grad = array(aggregates_writes=True, clear_after_read=False)
    grad.write(0, np.float32([1, 2]))
    grad.write(0, np.float32([10, 20]))
    np.testing.assert_array_equal(grad.read(0), [11, 22])
    with pytest.raises(errors.InvalidArgumentError, match=r"shape is \[3\] which is incompatible .* \[2\]"):
        grad.write(0, np.float32([1, 2, 3]))


def test_a_closed_array_refuses_use():
    ta = array()
    ta.closed = True
    with pytest.raises(errors.InvalidArgumentError, match="already been closed"):
        ta.write(0, np.float32(1))


def new_array(run_op, ctx, size, **attrs):
    handle, _ = run_op("TensorArrayV3", np.int32(size), ctx=ctx, dtype=np.float32, **attrs)
    return handle


def test_split_then_concat_gives_the_value_and_the_lengths(run_op, ctx):
    handle = new_array(run_op, ctx, 3)  # elements of different lengths: shapes not identical
    value = np.arange(12, dtype=np.float32).reshape(6, 2)
    run_op("TensorArraySplitV3", handle, value, np.int64([1, 3, 2]), np.float32(0), ctx=ctx)
    np.testing.assert_array_equal(handle[()].elements[1], value[1:4])
    joined, lengths = run_op("TensorArrayConcatV3", handle, np.float32(0), ctx=ctx, dtype=np.float32)
    np.testing.assert_array_equal(joined, value)
    assert lengths.dtype == np.int64
    assert lengths.tolist() == [1, 3, 2]


def test_split_checks_lengths_value_and_size_with_tensorflows_texts(run_op, ctx):
    value = np.zeros((4, 2), np.float32)
    cases = [
        (3, value, np.int64([[4]]), "Expected lengths to be a vector, received shape: [1,1]"),
        (3, np.float32(1), np.int64([1]), "Expected value to be at least a vector, but received shape: []"),
        (3, value, np.int64([1, 1, 1]), "sum of lengths is 3 and value's shape is: [4,2]"),
        (2, value, np.int64([1, 1, 2]), "TensorArray's size is not equal to the size of lengths (2 vs. 3)"),
    ]
    for size, split, lengths, message in cases:
        handle = new_array(run_op, ctx, size)
        with pytest.raises(errors.InvalidArgumentError, match=re.escape(message)):
            run_op("TensorArraySplitV3", handle, split, lengths, np.float32(0), ctx=ctx)
    growing = new_array(run_op, ctx, 0, dynamic_size=True)
    run_op("TensorArraySplitV3", growing, value, np.int64([2, 2]), np.float32(0), ctx=ctx)
    assert len(growing[()].elements) == 2


def test_concat_refuses_scalars_and_mixed_shapes_and_an_empty_array_of_unknown_shape(run_op, ctx):
    scalars = new_array(run_op, ctx, 1)
    run_op("TensorArrayWriteV3", scalars, np.int32(0), np.float32(1), np.float32(0), ctx=ctx)
    with pytest.raises(errors.InvalidArgumentError, match="Concat saw a scalar shape at index 0"):
        run_op("TensorArrayConcatV3", scalars, np.float32(0), ctx=ctx, dtype=np.float32)
    mixed = new_array(run_op, ctx, 2)
    run_op("TensorArrayWriteV3", mixed, np.int32(0), np.zeros((1, 2), np.float32), np.float32(0), ctx=ctx)
    run_op("TensorArrayWriteV3", mixed, np.int32(1), np.zeros((1, 3), np.float32), np.float32(0), ctx=ctx)
    inconsistent = (
        "Index 0 has (excepting dimension 0) shape: [2] but index 1 has (excepting dimension 0) shape: [3]"
    )
    with pytest.raises(errors.InvalidArgumentError, match=re.escape(inconsistent)):
        run_op("TensorArrayConcatV3", mixed, np.float32(0), ctx=ctx, dtype=np.float32)
    empty = new_array(run_op, ctx, 0)
    with pytest.raises(errors.InvalidArgumentError, match="size zero, but element_shape_except0"):
        run_op("TensorArrayConcatV3", empty, np.float32(0), ctx=ctx, dtype=np.float32)
    joined, lengths = run_op(
        "TensorArrayConcatV3", empty, np.float32(0), ctx=ctx, dtype=np.float32, element_shape_except0=(3,)
    )
    assert joined.shape == (0, 3)
    assert lengths.shape == (0,)


def test_a_gradient_array_with_shape_prepends_to_the_element_shape(run_op, ctx):
    handle = new_array(run_op, ctx, 2, element_shape=(3,), identical_element_shapes=True)
    grad, _ = run_op(
        "TensorArrayGradWithShape", handle, np.float32(0), np.int32([4]), ctx=ctx, source="gradients"
    )
    assert grad[()].element_shape == (4, 3)
    assert len(grad[()].elements) == 2
    np.testing.assert_array_equal(grad[()].read(1), np.zeros((4, 3)))  # unwritten: zeros of that shape
    (again, _) = run_op("TensorArrayGradV3", handle, np.float32(0), ctx=ctx, source="gradients")
    assert again[()] is grad[()]  # one gradient array per source
    with pytest.raises(errors.InvalidArgumentError, match="must be a vector"):
        run_op("TensorArrayGradWithShape", handle, np.float32(0), np.int32(4), ctx=ctx, source="other")


def test_identical_element_shapes_fix_the_shape_at_the_first_write(run_op, ctx):
    fixed = new_array(run_op, ctx, 2, identical_element_shapes=True)
    run_op("TensorArrayWriteV3", fixed, np.int32(0), np.zeros(2, np.float32), np.float32(0), ctx=ctx)
    with pytest.raises(errors.InvalidArgumentError, match="consider setting infer_shape=False"):
        run_op("TensorArrayWriteV3", fixed, np.int32(1), np.zeros(3, np.float32), np.float32(0), ctx=ctx)
    free = new_array(run_op, ctx, 2)
    run_op("TensorArrayWriteV3", free, np.int32(0), np.zeros(2, np.float32), np.float32(0), ctx=ctx)
    run_op("TensorArrayWriteV3", free, np.int32(1), np.zeros(3, np.float32), np.float32(0), ctx=ctx)
