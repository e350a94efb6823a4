"""Kernels of `tf.compat.v1.train.Saver`: V2 checkpoints, and the string ops around them.

`SaveV2`, `RestoreV2` and `MergeV2Checkpoints` read and write TensorFlow's own V2
format (`kernels.tensor_bundle`), so checkpoints move freely between distserver and
TensorFlow. `ShardedFilename`, `ShardedFilespec`, `StringJoin` and
`StaticRegexFullMatch` are the ops a sharded `Saver` builds to name its files.

These ops take file paths from clients, so a server touches files only under its
checkpoint root (`KernelContext.checkpoint_root`: `AsyncServer(...,
checkpoint_root=DIR)`, `distserver serve --checkpoint-root DIR`):

* a server without one refuses every checkpoint op (`PermissionDeniedError` saying
  how to enable them);
* a relative path is taken relative to the root;
* every path is resolved (`os.path.realpath`: symlinks and `..`) before use and
  must then lie inside the root, else `PermissionDeniedError`; files are opened by
  their resolved path, and files read are resolved again (a symlink planted next to
  a checkpoint cannot lead out of the root);
* `MergeV2Checkpoints(delete_old_dirs=True)` removes only empty directories inside
  the root, never the root itself.

The root guards against clients, not against local users who can change the tree
while a kernel runs (a directory swapped for a symlink between the check and the
open); keep the root writable by the server alone.
"""

from __future__ import annotations

import contextlib
import os
import re
from typing import TYPE_CHECKING, Any

import numpy as np

from distserver import errors
from distserver.kernels import tensor_bundle
from distserver.kernels._common import OBJECT, attr_type_list, int_scalar, kernel_error, shape_str, type_name
from distserver.kernels.registry import KernelContext, OpKernel, register_kernel
from distserver.tensors import datatype_name

if TYPE_CHECKING:
    from distserver.protos.node_def_pb2 import NodeDef
    from distserver.protos.tensor_bundle_pb2 import BundleEntryProto

ROOT_OPTION = "checkpoint_root"
ROOT_FLAG = "--checkpoint-root"


# --------------------------------------------------------------------------- paths


def _text(value: Any) -> str:
    if isinstance(value, bytes):
        return value.decode("utf-8", "surrogateescape")
    return str(value)


def resolve_path(kernel: OpKernel, root: str | None, path: str, *, verb: str) -> str:
    """`path` resolved, if it lies inside the checkpoint `root`; else PermissionDeniedError.

    Args:
        kernel: The kernel asking (named in errors).
        root: The server's checkpoint root, already resolved; None: checkpoints disabled.
        path: A client's path; relative paths are relative to `root`.
        verb: "read", "write" or "delete", for the error.
    """
    if root is None:
        raise kernel_error(
            kernel,
            f"{kernel.op} refused to {verb} '{path}': this distserver server has no checkpoint root, so "
            f"checkpoint ops are disabled. Start the server with {ROOT_OPTION}=DIR "
            f"(AsyncServer/Server) or `distserver serve {ROOT_FLAG} DIR` to allow reading and writing "
            "checkpoints under DIR.",
            errors.PermissionDeniedError,
        )
    if not path or "\0" in path:
        raise kernel_error(kernel, f"{kernel.op}: invalid checkpoint path {path!r}")
    resolved = os.path.realpath(os.path.join(root, path))
    if not _strictly_inside(resolved, root):
        raise kernel_error(
            kernel,
            f"{kernel.op} refused to {verb} '{path}': it is outside this server's checkpoint root "
            f"'{root}' ({ROOT_OPTION} / {ROOT_FLAG}); checkpoint ops read and write only under that "
            "directory (paths are resolved, symlinks and '..' included).",
            errors.PermissionDeniedError,
        )
    return resolved


def _strictly_inside(resolved: str, root: str) -> bool:
    return resolved != root and os.path.commonpath([resolved, root]) == root


def _readable(kernel: OpKernel, root: str | None, path: str) -> str:
    """A file about to be read, resolved again (it may be a symlink)."""
    return resolve_path(kernel, root, path, verb="read")


def _scalar_string(kernel: OpKernel, value: Any, what: str) -> str:
    value = np.asarray(value)
    if value.dtype != OBJECT or value.size != 1:
        raise kernel_error(
            kernel,
            f"Input {what} should be a scalar string (a single element), got shape {shape_str(value.shape)}",
        )
    return _text(value.reshape(-1)[0])


def _string_vector(kernel: OpKernel, value: Any, what: str) -> list[str]:
    value = np.asarray(value)
    if value.dtype != OBJECT or value.ndim != 1:
        raise kernel_error(
            kernel, f"Input {what} should be a 1-D string tensor, got shape {shape_str(value.shape)}"
        )
    return [_text(item) for item in value]


# --------------------------------------------------------------------------- slices


def parse_shape_and_slice(
    kernel: OpKernel, spec: str
) -> tuple[tuple[int, ...], tensor_bundle.TensorSlice] | None:
    """TensorFlow's `"d0 d1 ... <slice>"` (slice: "start,length" or "-" per dimension, ":"-joined)
    as (full shape, slice); None for "" (the whole tensor).

    Raises:
        InvalidArgumentError: with TensorFlow's texts, naming the node.
    """
    if not spec:
        return None
    parts = spec.split(" ")
    if len(parts) < 2:
        raise kernel_error(kernel, f"Need least two elements in shape_and_slice specification: {spec}")
    try:
        tensor_slice = tensor_bundle.TensorSlice.parse(parts[-1])
        try:
            shape = tuple(int(part) for part in parts[:-1])
        except ValueError:
            raise errors.InvalidArgumentError(f"Non numerical dimension in shape_and_slice: {spec}") from None
        if any(d < 0 for d in shape):
            raise errors.InvalidArgumentError(f"Negative dimension in shape_and_slice: {spec}")
        tensor_slice.shape_in(shape)
    except errors.OpError as exc:
        raise errors.with_node(exc, kernel.name) from None
    return shape, tensor_slice


# --------------------------------------------------------------------------- save / restore


class _CheckpointKernel(OpKernel):
    is_stateful = True
    does_io = True


@register_kernel("SaveV2")
class SaveV2Kernel(_CheckpointKernel):
    """Writes `tensors` as the V2 checkpoint `prefix` (one data file).

    Inputs: prefix (scalar string), tensor_names (N strings), shape_and_slices (N
    strings: "" for whole tensors), then the N tensors (types in attr `dtypes`).
    """

    def __init__(self, node: NodeDef) -> None:
        super().__init__(node)
        self.dtypes = attr_type_list(self, "dtypes")
        self.raw_types = list(self._attr("dtypes").list.type)

    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        if len(inputs) < 3:
            raise kernel_error(
                self, f"SaveV2 takes prefix, tensor_names and shape_and_slices, got {len(inputs)} inputs"
            )
        prefix = _scalar_string(self, inputs[0], "prefix")
        names = _string_vector(self, inputs[1], "tensor_names")
        specs = _string_vector(self, inputs[2], "shape_and_slices")
        tensors = inputs[3:]
        if not len(names) == len(specs) == len(tensors) == len(self.raw_types):
            raise kernel_error(
                self,
                f"Expected {len(names)} tensor_names, shape_and_slices and tensors to save; got "
                f"{len(specs)} shape_and_slices, {len(tensors)} tensors and {len(self.raw_types)} dtypes",
            )
        entries = []
        for i, (name, spec, value, datatype) in enumerate(
            zip(names, specs, tensors, self.raw_types, strict=True)
        ):
            value = np.asarray(value)
            if value.dtype != self.dtypes[i]:
                raise kernel_error(
                    self,
                    f"SaveV2 tensor {i} ({name}) has type {type_name(value.dtype)}, "
                    f"expected {datatype_name(datatype)}",
                )
            parsed = parse_shape_and_slice(self, spec)
            if parsed is None:
                entries.append(tensor_bundle.SavedTensor(name, datatype, value))
                continue
            full_shape, tensor_slice = parsed
            if tensor_slice.shape_in(full_shape) != value.shape:
                raise kernel_error(
                    self,
                    "Slice in shape_and_slice specification does not match the shape of the tensor to  "
                    f"save: {spec}, tensor: {shape_str(value.shape)}",
                )
            entries.append(tensor_bundle.SavedTensor(name, datatype, value, full_shape, tensor_slice))
        path = resolve_path(self, ctx.checkpoint_root, prefix, verb="write")
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            tensor_bundle.write_bundle(path, entries)
        except errors.OpError as exc:
            raise errors.with_node(exc, self.name) from None
        except OSError as exc:
            raise kernel_error(
                self, f"SaveV2 cannot write {prefix}: {exc.strerror or exc}", errors.UnknownError
            ) from exc
        return []


@register_kernel("RestoreV2")
class RestoreV2Kernel(_CheckpointKernel):
    """Reads `tensor_names` from the V2 checkpoint `prefix`, one output per name.

    A non-empty shape_and_slice reads that slice; a tensor saved in slices (a
    partitioned variable) is put together from the saved slices that intersect the
    one asked for, which must cover it.
    """

    def __init__(self, node: NodeDef) -> None:
        super().__init__(node)
        self.raw_types = list(self._attr("dtypes").list.type)

    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        if len(inputs) != 3:
            raise kernel_error(self, f"RestoreV2 takes 3 inputs, got {len(inputs)}")
        prefix = _scalar_string(self, inputs[0], "prefix")
        names = _string_vector(self, inputs[1], "tensor_names")
        specs = _string_vector(self, inputs[2], "shape_and_slices")
        if not len(names) == len(specs) == len(self.raw_types):
            raise kernel_error(
                self,
                f"Expected tensor_names, shape_and_slices and dtypes to have the same number of elements; "
                f"got {len(names)}, {len(specs)} and {len(self.raw_types)}",
            )
        root = ctx.checkpoint_root
        path = resolve_path(self, root, prefix, verb="read")
        try:
            reader = _ResolvingReader(self, root, path)
            outputs = []
            for name, spec, datatype in zip(names, specs, self.raw_types, strict=True):
                entry = reader.entry(name)
                if entry.dtype != datatype:
                    raise kernel_error(
                        self,
                        f"tensor_name = {name}; expected dtype {_tf_type_name(datatype)} does not equal "
                        f"restored dtype {_tf_type_name(entry.dtype)}",
                    )
                outputs.append(self._read(reader, name, spec, entry))
            return outputs
        except errors.OpError as exc:
            raise errors.with_node(exc, self.name) from None
        except OSError as exc:
            raise kernel_error(
                self, f"RestoreV2 cannot read {prefix}: {exc.strerror or exc}", errors.UnknownError
            ) from exc

    def _read(
        self, reader: tensor_bundle.BundleReader, name: str, spec: str, entry: BundleEntryProto
    ) -> np.ndarray:
        parsed = parse_shape_and_slice(self, spec)
        if parsed is None:
            if entry.slices:
                return reader.read(name)
            return reader.read_entry(name, entry)
        shape, tensor_slice = parsed
        stored = tuple(d.size for d in entry.shape.dim)
        if stored != shape:
            raise kernel_error(
                self,
                f"tensor_name = {name}; shape in shape_and_slice spec {shape_str(shape)} does not match the "
                f"shape stored in checkpoint: {shape_str(stored)}",
            )
        return reader.read_slice(name, entry, tensor_slice)


def _tf_type_name(datatype: int) -> str:
    """TensorFlow's short name of a DataType: DT_FLOAT -> float."""
    return datatype_name(datatype).removeprefix("DT_").lower()


class _ResolvingReader(tensor_bundle.BundleReader):
    """A BundleReader that resolves (and checks) every file it opens."""

    def __init__(self, kernel: OpKernel, root: str | None, prefix: str) -> None:
        self._kernel = kernel
        self._root = root
        _readable(kernel, root, tensor_bundle.index_filename(prefix))
        super().__init__(prefix)

    def data_file(self, shard: int) -> str:
        return _readable(self._kernel, self._root, super().data_file(shard))


@register_kernel("MergeV2Checkpoints")
class MergeV2CheckpointsKernel(_CheckpointKernel):
    """Merges the V2 checkpoints `checkpoint_prefixes` (one per shard) into `destination_prefix`.

    Their data files are renamed after the destination and one index is written
    over them; the inputs' index files are deleted, and with `delete_old_dirs` their
    directories too when empty (inside the checkpoint root only).
    """

    def __init__(self, node: NodeDef) -> None:
        super().__init__(node)
        self.delete_old_dirs = self.attr_bool("delete_old_dirs", True)
        self.allow_missing_files = self.attr_bool("allow_missing_files", False)

    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        prefixes = _string_vector(self, inputs[0], "checkpoint_prefixes")
        destination = _scalar_string(self, inputs[1], "destination_prefix")
        root = ctx.checkpoint_root
        merged = resolve_path(self, root, destination, verb="write")
        resolved = [resolve_path(self, root, prefix, verb="read") for prefix in prefixes]
        try:
            for prefix in resolved:
                _readable(self, root, tensor_bundle.index_filename(prefix))
            plan = tensor_bundle.plan_merge(resolved, merged, allow_missing_files=self.allow_missing_files)
            plan.renames = [
                (_readable(self, root, source), resolve_path(self, root, target, verb="write"))
                for source, target in plan.renames
            ]
            tensor_bundle.commit_merge(plan, merged)
        except errors.OpError as exc:
            raise errors.with_node(exc, self.name) from None
        except OSError as exc:
            raise kernel_error(
                self,
                f"MergeV2Checkpoints cannot merge into {destination}: {exc.strerror or exc}",
                errors.UnknownError,
            ) from exc
        if self.delete_old_dirs:
            merged_dir = os.path.dirname(merged)
            for prefix in resolved:
                directory = os.path.dirname(prefix)
                if directory == merged_dir or not _strictly_inside(directory, str(root)):
                    continue
                with contextlib.suppress(OSError):  # not empty, or gone already: TF ignores both
                    os.rmdir(directory)
        return []


# --------------------------------------------------------------------------- file names and strings


@register_kernel("ShardedFilename")
class ShardedFilenameKernel(OpKernel):
    """`"<basename>-<shard:05d>-of-<num_shards:05d>"`."""

    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        basename = _scalar_string(self, inputs[0], "basename")
        shard = int_scalar(self, inputs[1], "shard")
        num_shards = int_scalar(self, inputs[2], "num_shards")
        return [np.array(f"{basename}-{shard:05d}-of-{num_shards:05d}".encode(), dtype=object)]


@register_kernel("ShardedFilespec")
class ShardedFilespecKernel(OpKernel):
    """`"<basename>-?????-of-<num_shards:05d>"`, the glob of a sharded file's shards."""

    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        basename = _scalar_string(self, inputs[0], "basename")
        num_shards = int_scalar(self, inputs[1], "num_shards")
        return [np.array(f"{basename}-?????-of-{num_shards:05d}".encode(), dtype=object)]


@register_kernel("StringJoin")
class StringJoinKernel(OpKernel):
    """Joins its N string inputs elementwise with `separator`; scalars broadcast."""

    def __init__(self, node: NodeDef) -> None:
        super().__init__(node)
        self.separator = self._attr("separator").s if self.has_attr("separator") else b""

    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        values = [np.asarray(value) for value in inputs]
        for i, value in enumerate(values):
            if value.dtype != OBJECT:
                raise kernel_error(self, f"StringJoin input {i} is not a string tensor")
        shapes = {value.shape for value in values if value.ndim}
        if len(shapes) > 1:
            raise kernel_error(
                self,
                "Input shapes do not match: " + " vs. ".join(shape_str(s) for s in sorted(shapes)),
            )
        shape = shapes.pop() if shapes else ()
        flat = [np.broadcast_to(value, shape).reshape(-1) for value in values]
        count = int(np.prod(shape, dtype=np.int64))
        out = np.empty(count, dtype=object)
        for i in range(count):
            out[i] = self.separator.join(_as_bytes(column[i]) for column in flat)
        return [out.reshape(shape)]


def _as_bytes(item: Any) -> bytes:
    return item if isinstance(item, bytes) else str(item).encode()


@register_kernel("StaticRegexFullMatch")
class StaticRegexFullMatchKernel(OpKernel):
    """Whether each string fully matches `pattern` (Python's `re`, RE2's syntax mostly)."""

    def __init__(self, node: NodeDef) -> None:
        super().__init__(node)
        pattern = self._attr("pattern").s
        try:
            self.pattern = re.compile(pattern, re.DOTALL)
        except re.error as exc:
            raise kernel_error(self, f"Invalid pattern: {pattern!r}, error: {exc}") from None

    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        value = np.asarray(inputs[0])
        if value.dtype != OBJECT:
            raise kernel_error(self, "StaticRegexFullMatch input is not a string tensor")
        matches = [self.pattern.fullmatch(_as_bytes(item)) is not None for item in value.reshape(-1)]
        return [np.array(matches, dtype=np.bool_).reshape(value.shape)]


__all__ = [
    "MergeV2CheckpointsKernel",
    "RestoreV2Kernel",
    "SaveV2Kernel",
    "ShardedFilenameKernel",
    "ShardedFilespecKernel",
    "StaticRegexFullMatchKernel",
    "StringJoinKernel",
    "resolve_path",
]
