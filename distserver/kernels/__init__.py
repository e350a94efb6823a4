"""Numpy kernels for TensorFlow ops, looked up by op name (see `registry`)."""

from distserver.kernels.registry import create_kernel, has_kernel, registered_ops

__all__ = ["create_kernel", "has_kernel", "registered_ops"]
