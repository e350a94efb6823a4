"""CRC-32C (Castagnoli), as TensorFlow checksums its checkpoints and tables, in numpy.

`value(data)` is the standard CRC-32C (reflected polynomial 0x82F63B78, initial
value and final xor 0xFFFFFFFF); `extend(crc, data)` continues a checksum over
more bytes, so `extend(value(a), b) == value(a + b)`. `mask`/`unmask` are
TensorFlow's (and LevelDB's) masking of a CRC stored next to the data it covers.

Short inputs go through a byte table in Python. Long inputs are cut into equal
chunks whose CRCs are computed side by side (one numpy operation per byte
position, over all chunks at once); the chunk CRCs are then folded pairwise, using
that a CRC without pre/post conditioning is linear over GF(2):
`crc(A + B) = shift_|B|(crc(A)) ^ crc(B)`, where `shift_n` (feeding n zero bytes)
is a 32x32 bit matrix applied as four byte-indexed tables. No C extension needed.
"""

from __future__ import annotations

import functools

import numpy as np

_POLY = 0x82F63B78
_MASK_DELTA = 0xA282EAD8
# Below this many bytes the Python byte loop is faster than setting up numpy.
_SMALL = 4096


def _make_table() -> np.ndarray:
    table = np.zeros(256, np.uint32)
    for i in range(256):
        crc = i
        for _ in range(8):
            crc = (crc >> 1) ^ _POLY if crc & 1 else crc >> 1
        table[i] = crc
    return table


_TABLE = _make_table()
_TABLE_LIST = [int(x) for x in _TABLE]


def _raw_python(crc: int, data: bytes | memoryview) -> int:
    """CRC register after feeding `data` to register `crc` (no conditioning)."""
    table = _TABLE_LIST
    for byte in bytes(data):
        crc = table[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc


def _apply(tables: np.ndarray, values: np.ndarray) -> np.ndarray:
    """The linear map given by four byte tables, applied to each uint32 of `values`."""
    result: np.ndarray = (
        tables[0][values & 0xFF]
        ^ tables[1][(values >> 8) & 0xFF]
        ^ tables[2][(values >> 16) & 0xFF]
        ^ tables[3][values >> 24]
    )
    return result


@functools.lru_cache(maxsize=64)
def _shift_tables(nbytes: int) -> np.ndarray:
    """Byte tables of `shift_nbytes`: the register after feeding `nbytes` zero bytes."""
    if nbytes == 1:
        basis = (
            np.arange(256, dtype=np.uint32)[None, :] << (8 * np.arange(4, dtype=np.uint32))[:, None]
        ).astype(np.uint32)
        return np.asarray(_TABLE[basis & 0xFF] ^ (basis >> 8), np.uint32)
    half = _shift_tables(nbytes // 2)
    tables = np.stack([_apply(half, half[k]) for k in range(4)])
    if nbytes % 2:
        one = _shift_tables(1)
        tables = np.stack([_apply(one, tables[k]) for k in range(4)])
    return tables


def _raw_numpy(crc: int, data: np.ndarray) -> int:
    """`_raw_python` for long inputs (see the module docstring)."""
    n = len(data)
    chunk = 1 << max(8, (n.bit_length() + 1) // 2)  # ~sqrt(n) bytes per chunk, at least 256
    head = n % chunk
    crc = _raw_python(crc, data[:head].tobytes())
    rows = data[head:].reshape(-1, chunk)
    count = len(rows)
    # The first chunk starts from the running register, the others from 0.
    regs = np.zeros(count, np.uint32)
    regs[0] = crc
    columns = np.ascontiguousarray(rows.T)
    table = _TABLE
    for column in columns:
        regs = table[(regs ^ column) & 0xFF] ^ (regs >> 8)
    # Fold pairwise: crc(left + right) = shift_len(right)(crc(left)) ^ crc(right).
    # Leading zero registers (empty chunks) change nothing, so pad to a power of two.
    width = 1 << (count - 1).bit_length()
    if width != count:
        regs = np.concatenate([np.zeros(width - count, np.uint32), regs])
    length = chunk
    while len(regs) > 1:
        regs = _apply(_shift_tables(length), regs[0::2]) ^ regs[1::2]
        length *= 2
    return int(regs[0])


def extend(crc: int, data: bytes | bytearray | memoryview | np.ndarray) -> int:
    """The CRC-32C of the bytes checksummed by `crc` followed by `data`."""
    flat = _bytes_of(data)
    start = crc ^ 0xFFFFFFFF
    register = _raw_python(start, flat.tobytes()) if flat.size < _SMALL else _raw_numpy(start, flat)
    return register ^ 0xFFFFFFFF


def _bytes_of(data: bytes | bytearray | memoryview | np.ndarray) -> np.ndarray:
    """The bytes of `data` as a flat uint8 array (no copy when contiguous)."""
    if isinstance(data, np.ndarray):
        return np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    return np.frombuffer(data, np.uint8)


def value(data: bytes | bytearray | memoryview | np.ndarray) -> int:
    """The CRC-32C of `data` (bytes-like, or a numpy array's buffer)."""
    return extend(0, data)


def mask(crc: int) -> int:
    """TensorFlow's masked form of a CRC stored with the data it covers."""
    return ((((crc >> 15) | (crc << 17)) & 0xFFFFFFFF) + _MASK_DELTA) & 0xFFFFFFFF


def unmask(masked: int) -> int:
    """The CRC that `mask` turned into `masked`."""
    rotated = (masked - _MASK_DELTA) & 0xFFFFFFFF
    return ((rotated >> 17) | (rotated << 15)) & 0xFFFFFFFF


__all__ = ["extend", "mask", "unmask", "value"]
