"""TensorFlow's V2 checkpoint format ("tensor bundle"), read and written with numpy.

A checkpoint `<prefix>` is:

* `<prefix>.data-NNNNN-of-MMMMM` (`data_filename`): the tensors' bytes, one tensor
  after another. A numeric tensor is its little-endian row-major buffer; a string
  tensor is the varint64 length of each element, a masked CRC-32C of those lengths
  (each taken as a little-endian uint32, uint64 beyond 4 GiB), then the elements'
  bytes.
* `<prefix>.index` (`index_filename`): a sorted table (`write_table`/`read_table`,
  LevelDB's SSTable layout, as TensorFlow's `table::TableBuilder` writes it) whose
  entry under the empty key is a `BundleHeaderProto` (number of data files, byte
  order, format version) and whose other entries map each tensor's name to a
  `BundleEntryProto`: dtype, shape, data file, offset, size and the masked CRC-32C
  of the bytes.

A partitioned variable is saved in slices (`SavedTensor.slice`, TensorFlow's
`BundleWriter::AddSlice`): the tensor's own entry holds its dtype, full shape and a
`TensorSliceProto` per slice (no data), and each slice is an ordinary entry under
`encode_slice_key(name, slice)` (TensorFlow's `EncodeTensorNameSlice`, an
`OrderedCode` key that starts with a 0 byte). `BundleReader.read_slice` assembles
any slice (the whole tensor included) from the stored slices that intersect it.

A bundle written by one `write_bundle` has one data file; `merge_bundles` joins the
bundles of a sharded save (one per device) into one index over their data files,
renamed after the merged prefix, as TensorFlow's `MergeV2Checkpoints` does.

This module knows files, not policy: callers (the checkpoint kernels) decide which
paths may be touched and pass resolved ones.

Table layout (all integers little-endian; varints are LEB128):

* data blocks (~256 KiB): entries `varint32 shared, varint32 unshared, varint32
  value_length, key[shared:], value`, where `shared` is the length of the prefix the
  key shares with the previous key, reset to 0 every 16 entries (a restart point);
  then the restart offsets (fixed32 each) and their count (fixed32);
* each block is followed by a trailer: 1 byte compression type (0, none) and the
  masked CRC-32C (fixed32) of the block and that byte;
* a metaindex block (empty), an index block (one entry per data block: a short key
  >= the block's last key and < the next block's first, chosen as LevelDB does, so
  that our index files are byte for byte TensorFlow's; it maps to the block's handle
  `varint64 offset, varint64 size`; a restart at every entry);
* a 48-byte footer: the metaindex and index handles, zero padded to 40 bytes, then
  the magic number 0xdb4775248b80fb57 (fixed64).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import struct
import uuid
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, BinaryIO

import numpy as np

from distserver import crc32c, errors
from distserver.protos import types_pb2
from distserver.protos.tensor_bundle_pb2 import BundleEntryProto, BundleHeaderProto
from distserver.protos.tensor_slice_pb2 import TensorSliceProto
from distserver.tensors import as_numpy_dtype, datatype_name, shape_from_proto, shape_to_proto

# The bundle format's version: what TensorFlow writes and accepts.
BUNDLE_VERSION = 1
BUNDLE_MIN_PRODUCER = 0
BUNDLE_MIN_CONSUMER = 0
HEADER_KEY = b""

TABLE_MAGIC = 0xDB4775248B80FB57
FOOTER_SIZE = 48
BLOCK_TRAILER_SIZE = 5
BLOCK_SIZE = 256 * 1024
RESTART_INTERVAL = 16
_MAX_HANDLE_SIZE = 20  # two varint64s

# Types whose elements are bytes in the data file, not a memcpy of a buffer.
_NOT_MEMCPY = frozenset({types_pb2.DT_STRING, types_pb2.DT_RESOURCE, types_pb2.DT_VARIANT})


def index_filename(prefix: str) -> str:
    return f"{prefix}.index"


def data_filename(prefix: str, shard: int, num_shards: int) -> str:
    return f"{prefix}.data-{shard:05d}-of-{num_shards:05d}"


# --------------------------------------------------------------------------- varints


def put_varint(out: bytearray, value: int) -> None:
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)


def get_varint(data: bytes | memoryview, pos: int, limit: int | None = None) -> tuple[int, int]:
    """The varint64 at `data[pos:]` and the position after it; DataLossError if malformed."""
    end = len(data) if limit is None else limit
    result = shift = 0
    while pos < end and shift <= 63:
        byte = data[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7
    raise errors.DataLossError("corrupted varint in a checkpoint file")


# --------------------------------------------------------------------------- the table


class _BlockBuilder:
    def __init__(self, restart_interval: int) -> None:
        self.restart_interval = restart_interval
        self.buffer = bytearray()
        self.restarts = [0]
        self.counter = 0
        self.last_key = b""
        self.entries = 0

    def add(self, key: bytes, value: bytes) -> None:
        shared = 0
        if self.counter < self.restart_interval:
            limit = min(len(key), len(self.last_key))
            while shared < limit and key[shared] == self.last_key[shared]:
                shared += 1
        else:
            self.restarts.append(len(self.buffer))
            self.counter = 0
        put_varint(self.buffer, shared)
        put_varint(self.buffer, len(key) - shared)
        put_varint(self.buffer, len(value))
        self.buffer += key[shared:]
        self.buffer += value
        self.last_key = key
        self.counter += 1
        self.entries += 1

    def size_estimate(self) -> int:
        return len(self.buffer) + 4 * len(self.restarts) + 4

    def finish(self) -> bytes:
        tail = struct.pack(f"<{len(self.restarts) + 1}I", *self.restarts, len(self.restarts))
        return bytes(self.buffer) + tail


def _handle(offset: int, size: int) -> bytes:
    out = bytearray()
    put_varint(out, offset)
    put_varint(out, size)
    return bytes(out)


def _separator(start: bytes, limit: bytes) -> bytes:
    """A short key in [start, limit) (LevelDB's bytewise FindShortestSeparator), for the index."""
    common = 0
    while common < min(len(start), len(limit)) and start[common] == limit[common]:
        common += 1
    if common < min(len(start), len(limit)):
        byte = start[common]
        if byte < 0xFF and byte + 1 < limit[common]:
            return start[:common] + bytes([byte + 1])
    return start


def _successor(key: bytes) -> bytes:
    """A short key >= `key` (LevelDB's bytewise FindShortSuccessor), for the last index entry."""
    for i, byte in enumerate(key):
        if byte != 0xFF:
            return key[:i] + bytes([byte + 1])
    return key


def write_table(
    file: BinaryIO,
    items: Iterable[tuple[bytes, bytes]],
    *,
    block_size: int = BLOCK_SIZE,
    restart_interval: int = RESTART_INTERVAL,
) -> None:
    """Write `items` (keys strictly increasing) as a table to `file`.

    Raises:
        ValueError: the keys are not strictly increasing.
    """
    offset = 0

    def write_block(contents: bytes) -> tuple[int, int]:
        nonlocal offset
        block_type = b"\x00"
        checksum = crc32c.mask(crc32c.extend(crc32c.value(contents), block_type))
        file.write(contents)
        file.write(block_type + struct.pack("<I", checksum))
        start = offset
        offset += len(contents) + BLOCK_TRAILER_SIZE
        return start, len(contents)

    index = _BlockBuilder(restart_interval=1)
    block = _BlockBuilder(restart_interval)
    last: bytes | None = None
    pending: bytes | None = None  # handle of the last block written, indexed once the next key is known
    for key, value in items:
        if last is not None and key <= last:
            raise ValueError(f"table keys must be strictly increasing: {key!r} after {last!r}")
        if pending is not None:
            assert last is not None
            index.add(_separator(last, key), pending)
            pending = None
        last = key
        block.add(key, value)
        if block.size_estimate() >= block_size:
            pending = _handle(*write_block(block.finish()))
            block = _BlockBuilder(restart_interval)
    if block.entries:
        pending = _handle(*write_block(block.finish()))
    if pending is not None:
        assert last is not None
        index.add(_successor(last), pending)
    metaindex = write_block(_BlockBuilder(restart_interval).finish())
    index_handle = write_block(index.finish())
    footer = (_handle(*metaindex) + _handle(*index_handle)).ljust(2 * _MAX_HANDLE_SIZE, b"\x00")
    file.write(footer + struct.pack("<II", TABLE_MAGIC & 0xFFFFFFFF, TABLE_MAGIC >> 32))


def _read_block(data: bytes, handle: bytes, pos: int = 0) -> bytes:
    offset, pos = get_varint(handle, pos)
    size, _ = get_varint(handle, pos)
    end = offset + size
    if end + BLOCK_TRAILER_SIZE > len(data):
        raise errors.DataLossError("truncated block read")
    contents = data[offset:end]
    block_type = data[end : end + 1]
    (stored,) = struct.unpack_from("<I", data, end + 1)
    if crc32c.unmask(stored) != crc32c.extend(crc32c.value(contents), block_type):
        raise errors.DataLossError("block checksum mismatch")
    if block_type != b"\x00":
        raise errors.DataLossError(f"unsupported block compression type {block_type[0]} (only none)")
    return contents


def _block_entries(block: bytes) -> Iterator[tuple[bytes, bytes]]:
    if len(block) < 4:
        raise errors.DataLossError("bad block contents")
    (num_restarts,) = struct.unpack_from("<I", block, len(block) - 4)
    limit = len(block) - 4 * (num_restarts + 1)
    if limit < 0:
        raise errors.DataLossError("bad block contents")
    pos = 0
    key = b""
    while pos < limit:
        shared, pos = get_varint(block, pos, limit)
        unshared, pos = get_varint(block, pos, limit)
        value_length, pos = get_varint(block, pos, limit)
        if shared > len(key) or pos + unshared + value_length > limit:
            raise errors.DataLossError("bad entry in block")
        key = key[:shared] + block[pos : pos + unshared]
        pos += unshared
        yield key, block[pos : pos + value_length]
        pos += value_length


def read_table(data: bytes) -> list[tuple[bytes, bytes]]:
    """Every (key, value) of the table `data`, in order.

    Raises:
        DataLossError: `data` is not a table, or a block fails its checksum.
    """
    if len(data) < FOOTER_SIZE:
        raise errors.DataLossError("file is too short to be an sstable")
    footer = data[-FOOTER_SIZE:]
    low, high = struct.unpack_from("<II", footer, FOOTER_SIZE - 8)
    if (high << 32) | low != TABLE_MAGIC:
        raise errors.DataLossError("not an sstable (bad magic number)")
    _, pos = get_varint(footer, 0)  # metaindex handle: offset
    _, pos = get_varint(footer, pos)  # metaindex handle: size
    index = _read_block(data, footer, pos)
    items: list[tuple[bytes, bytes]] = []
    for _, handle in _block_entries(index):
        items.extend(_block_entries(_read_block(data, handle)))
    return items


# --------------------------------------------------------------------------- slices

FULL_EXTENT = -1  # TensorFlow's TensorSlice::kFullExtent: a length meaning "the whole dimension"


@dataclasses.dataclass(frozen=True)
class TensorSlice:
    """A slice of a tensor (TensorFlow's `TensorSlice`): per dimension `(start, length)`.

    `(0, FULL_EXTENT)` is the whole dimension, written "-" in a spec; an explicit
    `(0, size)` covers it too but is kept as written, because it is part of the
    slice's key in a checkpoint.
    """

    extents: tuple[tuple[int, int], ...]

    @classmethod
    def full(cls, rank: int) -> TensorSlice:
        return cls(((0, FULL_EXTENT),) * rank)

    @classmethod
    def parse(cls, text: str) -> TensorSlice:
        """TensorFlow's slice syntax: "start,length" or "-" per dimension, joined by ":"."""
        extents = []
        for item in (part for part in text.split(":") if part):
            if item == "-":
                extents.append((0, FULL_EXTENT))
                continue
            numbers = [part for part in item.split(",") if part]
            try:
                start, length = (int(n) for n in numbers)
            except ValueError:
                raise errors.InvalidArgumentError(
                    f"Expected a pair of numbers or '-' but got '{item}': string = {text}"
                ) from None
            if start < 0 or length <= 0:
                raise errors.InvalidArgumentError(
                    f"Expected non-negative start and positive length but got start = {start}, "
                    f"length = {length}: string = {text}"
                )
            extents.append((start, length))
        return cls(tuple(extents))

    @classmethod
    def from_proto(cls, proto: TensorSliceProto) -> TensorSlice:
        return cls(
            tuple((e.start, e.length) if e.HasField("length") else (0, FULL_EXTENT) for e in proto.extent)
        )

    def to_proto(self) -> TensorSliceProto:
        proto = TensorSliceProto()
        for start, length in self.extents:
            extent = proto.extent.add()
            if length != FULL_EXTENT:  # TensorFlow records only explicit extents
                extent.start = start
                extent.length = length
        return proto

    @property
    def rank(self) -> int:
        return len(self.extents)

    def bounds(self, full_shape: Sequence[int]) -> list[tuple[int, int]]:
        """`[start, stop)` per dimension within a tensor of `full_shape`."""
        return [
            (start, size if length == FULL_EXTENT else start + length)
            for (start, length), size in zip(self.extents, full_shape, strict=True)
        ]

    def shape_in(self, full_shape: Sequence[int]) -> tuple[int, ...]:
        """The shape of this slice of a tensor of `full_shape`.

        Raises:
            InvalidArgumentError: the ranks differ or an extent lies outside the tensor
                (TensorFlow's texts).
        """
        if len(full_shape) != self.rank:
            raise errors.InvalidArgumentError(
                f"Mismatching ranks: shape = {_shape_text(full_shape)}, slice = {self}"
            )
        shape = []
        for d, ((start, length), size) in enumerate(zip(self.extents, full_shape, strict=True)):
            if length == FULL_EXTENT:
                shape.append(size)
            elif start + length > size:
                raise errors.InvalidArgumentError(
                    f"Extent in dimension {d} out of bounds: shape = {_shape_text(full_shape)}, "
                    f"slice = {self}"
                )
            else:
                shape.append(length)
        return tuple(shape)

    def covers(self, full_shape: Sequence[int]) -> bool:
        return self.shape_in(full_shape) == tuple(full_shape)

    def __str__(self) -> str:  # TensorFlow's TensorSlice::DebugString
        return ":".join(
            "-" if length == FULL_EXTENT and start == 0 else f"{start},{length}"
            for start, length in self.extents
        )


def _shape_text(shape: Sequence[int]) -> str:
    return "[" + ",".join(str(d) for d in shape) + "]"


def _ordered_string(out: bytearray, text: bytes) -> None:
    # OrderedCode::WriteString: 0x00 is escaped as 00 ff, 0xff as ff 00; then the separator 00 01.
    for byte in text:
        if byte == 0x00:
            out += b"\x00\xff"
        elif byte == 0xFF:
            out += b"\xff\x00"
        else:
            out.append(byte)
    out += b"\x00\x01"


def _ordered_unsigned(out: bytearray, value: int) -> None:
    # OrderedCode::WriteNumIncreasing: a length byte, then the big-endian bytes without leading zeros.
    body = value.to_bytes((value.bit_length() + 7) // 8, "big")
    out.append(len(body))
    out += body


# OrderedCode::WriteSignedNumIncreasing: header bits of the first two bytes, by encoded length.
_SIGNED_HEADER = {1: (0x80, 0), 2: (0xC0, 0), 3: (0xE0, 0), 4: (0xF0, 0), 5: (0xF8, 0), 6: (0xFC, 0),
                  7: (0xFE, 0), 8: (0xFF, 0), 9: (0xFF, 0x80), 10: (0xFF, 0xC0)}  # fmt: skip


def _ordered_signed(out: bytearray, value: int) -> None:
    magnitude = ~value if value < 0 else value
    if magnitude < 64:
        out.append((0x80 ^ value) & 0xFF)
        return
    length = magnitude.bit_length() // 7 + 1
    raw = bytearray(value.to_bytes(10, "big", signed=True)[10 - length :])
    first, second = _SIGNED_HEADER[length]
    raw[0] ^= first
    raw[1] ^= second
    out += raw


def encode_slice_key(name: str, tensor_slice: TensorSlice) -> bytes:
    """The index key of one slice of tensor `name` (TensorFlow's `EncodeTensorNameSlice`)."""
    out = bytearray()
    _ordered_unsigned(out, 0)  # every slice key starts with a 0, before any tensor name
    _ordered_string(out, name.encode())
    _ordered_unsigned(out, tensor_slice.rank)
    for start, length in tensor_slice.extents:
        _ordered_signed(out, start)
        _ordered_signed(out, length)
    return bytes(out)


# --------------------------------------------------------------------------- bundles


@dataclasses.dataclass
class _Shard:
    """The data file being written."""

    file: BinaryIO
    size: int = 0


def _encode_tensor(value: np.ndarray, datatype: int) -> tuple[list[bytes | memoryview], int, int]:
    """The pieces to write for `value`, their total size and their (unmasked) CRC-32C."""
    if datatype == types_pb2.DT_STRING:
        elements = [_as_bytes(item) for item in value.reshape(-1)]
        lengths = bytearray()
        crc = 0
        for item in elements:
            put_varint(lengths, len(item))
            crc = crc32c.extend(crc, struct.pack("<I" if len(item) <= 0xFFFFFFFF else "<Q", len(item)))
        length_checksum = struct.pack("<I", crc32c.mask(crc))
        crc = crc32c.extend(crc, length_checksum)
        for item in elements:
            crc = crc32c.extend(crc, item)
        pieces: list[bytes | memoryview] = [bytes(lengths), length_checksum, *elements]
        return pieces, sum(len(p) for p in pieces), crc
    if datatype in _NOT_MEMCPY:
        raise errors.UnimplementedError(
            f"distserver does not save tensors of type {datatype_name(datatype)} in checkpoints"
        )
    dtype = as_numpy_dtype(datatype)
    buffer = np.ascontiguousarray(value, dtype.newbyteorder("<"))
    raw = buffer.reshape(-1).view(np.uint8).data
    return [raw], buffer.nbytes, crc32c.value(buffer)


def _as_bytes(item: Any) -> bytes:
    if isinstance(item, bytes):
        return item
    if isinstance(item, str):
        return item.encode()
    raise errors.InvalidArgumentError(f"a DT_STRING tensor holds a {type(item).__name__}, not bytes")


def _temp_name(path: str) -> str:
    return f"{path}.tempstate{uuid.uuid4().int >> 64}"


@contextlib.contextmanager
def _atomic_file(path: str) -> Iterator[BinaryIO]:
    """A file written under a temporary name and renamed to `path` once complete."""
    temp = _temp_name(path)
    try:
        with open(temp, "wb") as file:
            yield file
        os.replace(temp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise


def _header(num_shards: int) -> BundleHeaderProto:
    header = BundleHeaderProto(num_shards=num_shards, endianness=BundleHeaderProto.LITTLE)
    header.version.producer = BUNDLE_VERSION
    header.version.min_consumer = BUNDLE_MIN_CONSUMER
    return header


def _write_index(prefix: str, header: BundleHeaderProto, entries: dict[bytes, BundleEntryProto]) -> None:
    items = [(HEADER_KEY, header.SerializeToString())]
    items += [(key, entries[key].SerializeToString()) for key in sorted(entries)]
    with _atomic_file(index_filename(prefix)) as file:
        write_table(file, items)


@dataclasses.dataclass
class SavedTensor:
    """One tensor for `write_bundle`; with `slice`, `value` is that slice of a `full_shape` tensor."""

    name: str
    datatype: int
    value: np.ndarray
    full_shape: tuple[int, ...] | None = None
    slice: TensorSlice | None = None


def write_bundle(prefix: str, tensors: Sequence[tuple[str, int, np.ndarray] | SavedTensor]) -> None:
    """Write `tensors` ((name, DataType, value) triples or `SavedTensor`s) as the one-shard bundle `prefix`.

    Several slices of one tensor may be given (a partitioned variable); a slice that
    covers its whole tensor is saved as the whole tensor, as TensorFlow does.

    The data file and the index are written under temporary names and renamed into
    place, the index last, so a reader never sees a half-written checkpoint.

    Raises:
        InvalidArgumentError: two tensors (or two equal slices) have the same name, the
            slices of one name disagree on dtype or full shape, or a slice does not fit.
        UnimplementedError: a tensor's type cannot be saved (resources, variants).
        OSError: the files cannot be written.
    """
    entries: dict[bytes, BundleEntryProto] = {}
    with _atomic_file(data_filename(prefix, 0, 1)) as file:
        shard = _Shard(file)
        for item in tensors:
            tensor = item if isinstance(item, SavedTensor) else SavedTensor(*item)
            key = tensor.name.encode()
            if tensor.slice is not None and tensor.full_shape is not None:
                if tensor.slice.shape_in(tensor.full_shape) != tensor.value.shape:
                    raise errors.InvalidArgumentError(
                        f"Slice {tensor.slice} of {tensor.name} {_shape_text(tensor.full_shape)} does not "
                        f"match the shape of the tensor to save: {_shape_text(tensor.value.shape)}"
                    )
                if not tensor.slice.covers(tensor.full_shape):
                    _add_slice_entry(entries, tensor)
                    key = encode_slice_key(tensor.name, tensor.slice)
            if key in entries:
                raise errors.InvalidArgumentError(f"Adding duplicate key: {tensor.name}")
            pieces, size, crc = _encode_tensor(tensor.value, tensor.datatype)
            entry = BundleEntryProto(dtype=tensor.datatype, shard_id=0, offset=shard.size, size=size)  # type: ignore[arg-type]
            entry.shape.CopyFrom(shape_to_proto(tensor.value.shape))
            entry.crc32c = crc32c.mask(crc)
            for piece in pieces:
                file.write(piece)
            shard.size += size
            entries[key] = entry
    _write_index(prefix, _header(1), entries)


def _add_slice_entry(entries: dict[bytes, BundleEntryProto], tensor: SavedTensor) -> None:
    """Record `tensor.slice` in the entry of the whole tensor (dtype, full shape, slices; no data)."""
    assert tensor.slice is not None
    assert tensor.full_shape is not None
    key = tensor.name.encode()
    entry = entries.get(key)
    if entry is None:
        entry = entries[key] = BundleEntryProto(dtype=tensor.datatype)  # type: ignore[arg-type]
        entry.shape.CopyFrom(shape_to_proto(tensor.full_shape))
    elif not entry.slices:
        raise errors.InvalidArgumentError(f"Adding duplicate key: {tensor.name}")
    elif entry.dtype != tensor.datatype or tuple(d.size for d in entry.shape.dim) != tensor.full_shape:
        raise errors.InvalidArgumentError(
            f"The slices of {tensor.name} disagree: {datatype_name(entry.dtype)} "
            f"{_shape_text([d.size for d in entry.shape.dim])} and {datatype_name(tensor.datatype)} "
            f"{_shape_text(tensor.full_shape)}"
        )
    entry.slices.append(tensor.slice.to_proto())


class BundleReader:
    """Reads tensors from the bundle `prefix`.

    Raises (from the constructor):
        NotFoundError: there is no `<prefix>.index`.
        DataLossError: the index is corrupt.
        InvalidArgumentError: the bundle's format version or byte order is not supported.
    """

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        path = index_filename(prefix)
        try:
            with open(path, "rb") as file:
                data = file.read()
        except FileNotFoundError:
            raise errors.NotFoundError(
                f"Unsuccessful TensorSliceReader constructor: Failed to find any matching files for {prefix}"
            ) from None
        items = read_table(data)
        if not items or items[0][0] != HEADER_KEY:
            raise errors.DataLossError(
                f"Unable to read file ({path}). Perhaps the file is corrupt or was produced by a newer "
                "version of TensorFlow with format changes (failed to seek to header entry)"
            )
        self.header = _parse(BundleHeaderProto, items[0][1], path, "header")
        if self.header.endianness != BundleHeaderProto.LITTLE:
            raise errors.UnimplementedError(f"{path}: big-endian checkpoints are not supported by distserver")
        version = self.header.version
        if version.producer < BUNDLE_MIN_PRODUCER or version.min_consumer > BUNDLE_VERSION:
            raise errors.InvalidArgumentError(
                f"Checkpoint {prefix} has producer version {version.producer} and min consumer version "
                f"{version.min_consumer}; distserver reads version {BUNDLE_VERSION}"
            )
        if BUNDLE_VERSION in version.bad_consumers:
            raise errors.InvalidArgumentError(
                f"Checkpoint {prefix} disallows consumer version {BUNDLE_VERSION}"
            )
        self._entries = dict(items[1:])
        self._files: dict[int, str] = {}

    def keys(self) -> list[str]:
        """Names of the tensors in the bundle, sorted (slices' own entries included)."""
        return [key.decode("utf-8", "replace") for key in self._entries]

    def entry(self, name: str) -> BundleEntryProto:
        """The index entry of `name`; NotFoundError when there is none."""
        return self.entry_for_key(name.encode(), name)

    def entry_for_key(self, key: bytes, name: str) -> BundleEntryProto:
        """The index entry under `key` (a tensor's name, or a slice's key); `name` is for messages."""
        raw = self._entries.get(key)
        if raw is None:
            raise errors.NotFoundError(f"Key {name} not found in checkpoint")
        entry: BundleEntryProto = _parse(BundleEntryProto, raw, index_filename(self.prefix), f"entry {name}")
        if shape_from_proto(entry.shape) is None or any(d.size < 0 for d in entry.shape.dim):
            raise errors.DataLossError(f"Invalid tensor shape: {name}")
        return entry

    def data_file(self, shard: int) -> str:
        return data_filename(self.prefix, shard, self.header.num_shards)

    def read(self, name: str) -> np.ndarray:
        """The whole tensor saved as `name` (put together from its slices if it was saved in slices)."""
        entry = self.entry(name)
        if entry.slices:
            return self.read_slice(name, entry, TensorSlice.full(len(entry.shape.dim)))
        return self.read_entry(name, entry)

    def read_slice(self, name: str, entry: BundleEntryProto, wanted: TensorSlice) -> np.ndarray:
        """The slice `wanted` of tensor `name` (whose entry is `entry`), from whatever slices were saved.

        Raises:
            InvalidArgumentError: the saved slices do not cover `wanted` (TensorFlow's
                "Does not have sufficient slices" text), or `wanted` does not fit the tensor.
            DataLossError: the saved slices are inconsistent (overlapping, outside the tensor).
        """
        full_shape = tuple(d.size for d in entry.shape.dim)
        shape = wanted.shape_in(full_shape)
        window = wanted.bounds(full_shape)
        # Saved slices and, for a tensor saved whole, its entry (slices' entries are read later).
        stored: list[tuple[TensorSlice, BundleEntryProto | None]] = []
        if not entry.slices:
            stored.append((TensorSlice.full(len(full_shape)), entry))
        else:
            for proto in entry.slices:
                saved = TensorSlice.from_proto(proto)
                try:
                    saved.shape_in(full_shape)
                except errors.InvalidArgumentError as exc:
                    raise errors.DataLossError(
                        f"{name}: a saved slice does not fit the tensor: {exc.message}"
                    ) from None
                stored.append((saved, None))
        pieces: list[tuple[TensorSlice, BundleEntryProto | None, list[tuple[int, int]]]] = []
        covered = 0
        for saved, saved_entry in stored:
            overlap = _intersect(window, saved.bounds(full_shape))
            if overlap is None:
                continue
            for other, _, earlier in pieces:
                if _intersect(earlier, saved.bounds(full_shape)) is not None:
                    raise errors.DataLossError(f"{name}: overlapping saved slices {other} and {saved}")
            covered += math.prod(stop - start for start, stop in overlap)
            pieces.append((saved, saved_entry, saved.bounds(full_shape)))
        if covered != math.prod(shape):
            raise errors.InvalidArgumentError(
                f"Does not have sufficient slices for partitioned tensor {name} to restore in "
                f"slice_spec: {wanted}"
            )
        if len(pieces) == 1 and pieces[0][2] == window:  # exactly one saved slice: no copy
            saved, saved_entry, _ = pieces[0]
            return self._read_saved_slice(name, saved, saved_entry, shape)
        out = np.empty(
            shape, dtype=as_numpy_dtype(entry.dtype) if entry.dtype != types_pb2.DT_STRING else object
        )
        for saved, saved_entry, bounds in pieces:
            value = self._read_saved_slice(
                name, saved, saved_entry, tuple(stop - start for start, stop in bounds)
            )
            overlap = _intersect(window, bounds)
            assert overlap is not None
            target = tuple(slice(lo - w0, hi - w0) for (lo, hi), (w0, _) in zip(overlap, window, strict=True))
            source = tuple(slice(lo - b0, hi - b0) for (lo, hi), (b0, _) in zip(overlap, bounds, strict=True))
            out[target] = value[source]
        return out

    def _read_saved_slice(
        self, name: str, saved: TensorSlice, saved_entry: BundleEntryProto | None, shape: tuple[int, ...]
    ) -> np.ndarray:
        if saved_entry is None:
            saved_entry = self.entry_for_key(encode_slice_key(name, saved), f"{name} (slice {saved})")
        value = self.read_entry(name, saved_entry)
        if value.shape != shape:
            raise errors.DataLossError(
                f"{name}: slice {saved} holds shape {_shape_text(value.shape)}, expected {_shape_text(shape)}"
            )
        return value

    def read_entry(self, name: str, entry: BundleEntryProto) -> np.ndarray:
        shape = tuple(d.size for d in entry.shape.dim)
        count = int(np.prod(shape, dtype=np.int64))
        if not 0 <= entry.shard_id < self.header.num_shards:
            raise errors.DataLossError(f"{name}: shard {entry.shard_id} of {self.header.num_shards}")
        path = self.data_file(entry.shard_id)
        with open(path, "rb") as file:
            file.seek(entry.offset)
            data = file.read(entry.size)
        if len(data) != entry.size:
            raise errors.DataLossError(f"{path}: {name} is truncated ({len(data)} of {entry.size} bytes)")
        if entry.dtype == types_pb2.DT_STRING:
            value, crc = _decode_strings(data, count, name)
        elif entry.dtype in _NOT_MEMCPY:
            raise errors.UnimplementedError(
                f"{name} has type {datatype_name(entry.dtype)}, which distserver does not restore"
            )
        else:
            dtype = as_numpy_dtype(entry.dtype)
            if entry.size != count * dtype.itemsize:
                raise errors.DataLossError(
                    f"Invalid size in bundle entry: key {name}; stored size {entry.size}; "
                    f"expected size {count * dtype.itemsize}"
                )
            crc = crc32c.value(data)
            value = np.frombuffer(data, dtype.newbyteorder("<")).astype(dtype, copy=True)
        if crc32c.unmask(entry.crc32c) != crc:
            raise errors.DataLossError(
                f"TensorBundle at {self.prefix} shard {entry.shard_id} ({entry.size} bytes): Checksum "
                f"does not match: stored {crc32c.unmask(entry.crc32c):08d} vs. calculated on the restored "
                f"bytes {crc}"
            )
        return value.reshape(shape)


def _intersect(a: Sequence[tuple[int, int]], b: Sequence[tuple[int, int]]) -> list[tuple[int, int]] | None:
    """The common part of two boxes of `[start, stop)` bounds; None when it is empty."""
    common = [(max(a0, b0), min(a1, b1)) for (a0, a1), (b0, b1) in zip(a, b, strict=True)]
    if any(start >= stop for start, stop in common):
        return None
    return common


def _decode_strings(data: bytes, count: int, name: str) -> tuple[np.ndarray, int]:
    value = np.empty(count, dtype=object)
    if count == 0:
        return value, 0
    lengths = []
    pos = 0
    crc = 0
    for _ in range(count):
        length, pos = get_varint(data, pos)
        lengths.append(length)
        crc = crc32c.extend(crc, struct.pack("<I" if length <= 0xFFFFFFFF else "<Q", length))
    if pos + 4 > len(data):
        raise errors.DataLossError(f"String lengths of {name} longer than its entry")
    (stored,) = struct.unpack_from("<I", data, pos)
    if crc32c.unmask(stored) != crc:
        raise errors.DataLossError(
            f"The length checksum does not match: expected {crc32c.unmask(stored):08d} but actual is "
            f"{crc:08d}"
        )
    crc = crc32c.extend(crc, data[pos : pos + 4])
    pos += 4
    if pos + sum(lengths) != len(data):
        raise errors.DataLossError(f"The strings of {name} do not fill its entry")
    for i, length in enumerate(lengths):
        value[i] = data[pos : pos + length]
        pos += length
    crc = crc32c.extend(crc, data[pos - sum(lengths) : pos])
    return value, crc


def _parse(cls: Any, raw: bytes, path: str, what: str) -> Any:
    message = cls()
    try:
        message.ParseFromString(raw)
    except Exception:  # protobuf's DecodeError and friends
        raise errors.DataLossError(f"{path}: {what} is not parseable") from None
    return message


@dataclasses.dataclass
class MergePlan:
    """What `merge_bundles` will do: the files it renames and the index it writes."""

    renames: list[tuple[str, str]]  # (data file of an input bundle, its merged name)
    header: BundleHeaderProto
    entries: dict[bytes, BundleEntryProto]
    inputs: list[str]  # the input prefixes that exist


def plan_merge(
    prefixes: Sequence[str], merged_prefix: str, *, allow_missing_files: bool = False
) -> MergePlan:
    """Read the input bundles' indexes and decide the merged bundle (no file changes)."""
    entries: dict[bytes, BundleEntryProto] = {}
    shard_ids: dict[str, int] = {}
    num_shards = 0
    first: BundleHeaderProto | None = None
    inputs = []
    for prefix in prefixes:
        try:
            reader = BundleReader(prefix)
        except errors.NotFoundError:
            if allow_missing_files:
                continue
            raise
        inputs.append(prefix)
        header = reader.header
        if first is None:
            first = header
        elif header.endianness != first.endianness:
            raise errors.InvalidArgumentError(
                "Merging bundles with conflicting endianness; inputs corrupted?"
            )
        elif header.version.SerializeToString() != first.version.SerializeToString():
            raise errors.InvalidArgumentError("Merging bundles with different format versions")
        num_shards += header.num_shards
        for raw_key in reader._entries:
            name = raw_key.decode("utf-8", "replace")
            entry = reader.entry_for_key(raw_key, name)
            existing = entries.get(raw_key)
            if existing is not None:
                if not existing.slices or not entry.slices:
                    raise errors.InvalidArgumentError(
                        f"Duplicate tensor keyed by {name} encountered, when merging prefix: {prefix}"
                    )
                existing.slices.extend(entry.slices)
                continue
            data_file = reader.data_file(entry.shard_id)
            entry.shard_id = shard_ids.setdefault(data_file, len(shard_ids))
            entries[raw_key] = entry
    if first is None:
        if prefixes:
            raise errors.InvalidArgumentError(
                f"MergeV2Checkpoints found none of its {len(prefixes)} input checkpoints"
            )
        first = _header(0)
    header = BundleHeaderProto()
    header.CopyFrom(first)
    header.num_shards = num_shards
    renames = [
        (path, data_filename(merged_prefix, shard, len(shard_ids)))
        for path, shard in sorted(shard_ids.items(), key=lambda item: item[1])
    ]
    return MergePlan(renames, header, entries, inputs)


def merge_bundles(prefixes: Sequence[str], merged_prefix: str, *, allow_missing_files: bool = False) -> None:
    """Merge the bundles `prefixes` into `merged_prefix`: their data files are renamed,
    one index is written over them, and the inputs' index files are deleted."""
    plan = plan_merge(prefixes, merged_prefix, allow_missing_files=allow_missing_files)
    commit_merge(plan, merged_prefix)


def commit_merge(plan: MergePlan, merged_prefix: str) -> None:
    """Carry out `plan` (see `plan_merge`)."""
    os.makedirs(os.path.dirname(merged_prefix) or ".", exist_ok=True)
    for source, target in plan.renames:
        os.replace(source, target)
    _write_index(merged_prefix, plan.header, plan.entries)
    for prefix in plan.inputs:
        with contextlib.suppress(OSError):
            os.unlink(index_filename(prefix))


__all__ = [
    "BUNDLE_VERSION",
    "FULL_EXTENT",
    "BundleReader",
    "MergePlan",
    "SavedTensor",
    "TensorSlice",
    "commit_merge",
    "data_filename",
    "encode_slice_key",
    "index_filename",
    "merge_bundles",
    "plan_merge",
    "read_table",
    "write_bundle",
    "write_table",
]
