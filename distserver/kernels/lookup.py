"""Hash tables: HashTableV2 and the ops that fill, query and size it.

What `tf.compat.v1.lookup.StaticHashTable` with a `KeyValueTensorInitializer` (and the
vocabulary tables of feature columns) build. A table is a resource of the task that
holds it; a table without a shared name is private to its kernel, like a queue (see
`queue.py`).
"""

from __future__ import annotations

import itertools
import threading
from typing import TYPE_CHECKING, Any

import numpy as np

from distserver import errors
from distserver.kernels._common import INT64, handle_input, handle_output, kernel_error, shape_str
from distserver.kernels.registry import KernelContext, OpKernel, register_kernel
from distserver.kernels.resources import DEFAULT_CONTAINER
from distserver.tensors import ResourceHandle

if TYPE_CHECKING:
    from distserver.protos.node_def_pb2 import NodeDef

_anonymous_ids = itertools.count()


class HashTable:
    """Keys -> values of fixed dtypes (scalar keys, values of one shape)."""

    def __init__(self, name: str, key_dtype: np.dtype[Any], value_dtype: np.dtype[Any]) -> None:
        self.name = name
        self.key_dtype = key_dtype
        self.value_dtype = value_dtype
        self.lock = threading.Lock()
        self.entries: dict[Any, Any] = {}
        self.value_shape: tuple[int, ...] = ()
        self.initialized = False


def _key(value: Any) -> Any:
    return value.item() if isinstance(value, np.generic) else value


@register_kernel("HashTableV2")
class HashTableV2Kernel(OpKernel):
    is_stateful = True

    def __init__(self, node: NodeDef) -> None:
        super().__init__(node)
        self.container = self.attr_str("container", "") or DEFAULT_CONTAINER
        shared = self.attr_str("shared_name", "")
        if not shared and self.attr_bool("use_node_name_sharing", False):
            shared = self.name
        self.table_name = shared or f"_{next(_anonymous_ids)}_{self.name}"
        self.key_dtype = self.attr_type("key_dtype")
        self.value_dtype = self.attr_type("value_dtype")

    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        table = ctx.resources.lookup_or_create(
            self.container,
            self.table_name,
            lambda: HashTable(self.table_name, self.key_dtype, self.value_dtype),
        )
        if not isinstance(table, HashTable):
            raise kernel_error(self, f"Resource {self.container}/{self.table_name} exists and is not a table")
        if (table.key_dtype, table.value_dtype) != (self.key_dtype, self.value_dtype):
            raise kernel_error(
                self,
                f"Shared table '{self.table_name}' has key and value types {table.key_dtype.name} -> "
                f"{table.value_dtype.name}, not {self.key_dtype.name} -> {self.value_dtype.name}",
            )
        return [handle_output(ResourceHandle(ctx.device, self.container, self.table_name))]


class _TableKernel(OpKernel):
    def _table(self, ctx: KernelContext, value: Any) -> HashTable:
        handle = handle_input(self, value)
        try:
            table = ctx.resources.lookup(handle.container, handle.name)
        except errors.NotFoundError:
            raise kernel_error(self, f"Table {handle.name} does not exist", errors.NotFoundError) from None
        if not isinstance(table, HashTable):
            raise kernel_error(self, f"Resource {handle.name} is not a lookup table")
        return table

    def _check(self, table: HashTable, keys: np.ndarray, values: np.ndarray | None = None) -> None:
        if keys.dtype != table.key_dtype:
            raise kernel_error(self, f"Key must be type {table.key_dtype.name} but got {keys.dtype.name}")
        if values is not None and values.dtype != table.value_dtype:
            raise kernel_error(
                self, f"Value must be type {table.value_dtype.name} but got {values.dtype.name}"
            )


@register_kernel("LookupTableImportV2", "InitializeTableV2")
class LookupTableImportKernel(_TableKernel):
    """`(table, keys, values)`: the table holds exactly these entries from now on."""

    is_stateful = True

    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        table = self._table(ctx, inputs[0])
        keys, values = np.asarray(inputs[1]), np.asarray(inputs[2])
        self._check(table, keys, values)
        if keys.ndim != 1 or values.ndim < 1 or values.shape[0] != keys.shape[0]:
            raise kernel_error(
                self,
                f"Expected shape {shape_str(keys.shape)} for value, got {shape_str(values.shape)}",
            )
        entries = {_key(k): v for k, v in zip(keys.tolist(), values, strict=True)}
        with table.lock:
            table.entries = entries
            table.value_shape = tuple(values.shape[1:])
            table.initialized = True
        return []


@register_kernel("LookupTableFindV2")
class LookupTableFindKernel(_TableKernel):
    """`(table, keys, default_value)` -> the value of each key, the default for missing keys."""

    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        table = self._table(ctx, inputs[0])
        keys, default = np.asarray(inputs[1]), np.asarray(inputs[2], dtype=table.value_dtype)
        self._check(table, keys)
        with table.lock:
            if not table.initialized:
                raise kernel_error(self, "Table not initialized.", errors.FailedPreconditionError)
            entries, value_shape = table.entries, table.value_shape
        out = np.empty(keys.shape + value_shape, dtype=table.value_dtype)
        flat_out = out.reshape((-1, *value_shape))
        fallback = np.broadcast_to(default, value_shape) if default.ndim <= len(value_shape) else None
        for i, key in enumerate(keys.reshape(-1).tolist()):
            value = entries.get(key)
            if value is None:
                if fallback is None:
                    raise kernel_error(
                        self,
                        f"Expected shape {shape_str(value_shape)} for default value, "
                        f"got {shape_str(default.shape)}",
                    )
                value = fallback
            flat_out[i] = value
        return [out]


@register_kernel("LookupTableSizeV2")
class LookupTableSizeKernel(_TableKernel):
    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        table = self._table(ctx, inputs[0])
        with table.lock:
            return [np.array(len(table.entries), dtype=INT64)]
