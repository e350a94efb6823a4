"""TensorArrays of control flow v1 (kernels/tensor_arrays.py): TensorFlow's rules and errors.

Through a TensorFlow client, in loops and gradients: tests/interop/test_v1_loops.py."""

from __future__ import annotations

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
