"""HPACK (RFC 7541), as much as a gRPC server needs: decode request headers, encode plain ones.

The decoder takes everything a client may send: indexed fields, literals with or
without indexing, Huffman-coded strings, dynamic table size updates. It treats the
block as hostile: every integer, string and the whole list are bounded before
anything is built, and any malformed block raises `HpackError` (a connection error
for HTTP/2: the decoder's table can no longer be trusted).

The encoder writes literals without indexing and without Huffman: our response
headers are few and short, and a server that never adds to the client's table has no
table state to keep in step.
"""

from __future__ import annotations

from collections import deque

# RFC 7541, Appendix A.
STATIC_TABLE: tuple[tuple[bytes, bytes], ...] = (
    (b":authority", b""),
    (b":method", b"GET"),
    (b":method", b"POST"),
    (b":path", b"/"),
    (b":path", b"/index.html"),
    (b":scheme", b"http"),
    (b":scheme", b"https"),
    (b":status", b"200"),
    (b":status", b"204"),
    (b":status", b"206"),
    (b":status", b"304"),
    (b":status", b"400"),
    (b":status", b"404"),
    (b":status", b"500"),
    (b"accept-charset", b""),
    (b"accept-encoding", b"gzip, deflate"),
    (b"accept-language", b""),
    (b"accept-ranges", b""),
    (b"accept", b""),
    (b"access-control-allow-origin", b""),
    (b"age", b""),
    (b"allow", b""),
    (b"authorization", b""),
    (b"cache-control", b""),
    (b"content-disposition", b""),
    (b"content-encoding", b""),
    (b"content-language", b""),
    (b"content-length", b""),
    (b"content-location", b""),
    (b"content-range", b""),
    (b"content-type", b""),
    (b"cookie", b""),
    (b"date", b""),
    (b"etag", b""),
    (b"expect", b""),
    (b"expires", b""),
    (b"from", b""),
    (b"host", b""),
    (b"if-match", b""),
    (b"if-modified-since", b""),
    (b"if-none-match", b""),
    (b"if-range", b""),
    (b"if-unmodified-since", b""),
    (b"last-modified", b""),
    (b"link", b""),
    (b"location", b""),
    (b"max-forwards", b""),
    (b"proxy-authenticate", b""),
    (b"proxy-authorization", b""),
    (b"range", b""),
    (b"referer", b""),
    (b"refresh", b""),
    (b"retry-after", b""),
    (b"server", b""),
    (b"set-cookie", b""),
    (b"strict-transport-security", b""),
    (b"transfer-encoding", b""),
    (b"user-agent", b""),
    (b"vary", b""),
    (b"via", b""),
    (b"www-authenticate", b""),
)

# RFC 7541, Appendix B: the length in bits of each symbol's code (0-255, then EOS).
# The code is canonical (codes of one length are consecutive, in symbol order, after
# the shorter ones), so the lengths are all it takes to rebuild it.
_HUFFMAN_CODE_LENGTHS = (
    13, 23, 28, 28, 28, 28, 28, 28, 28, 24, 30, 28, 28, 30, 28, 28, 28, 28, 28, 28, 28, 28, 30, 28,
    28, 28, 28, 28, 28, 28, 28, 28, 6, 10, 10, 12, 13, 6, 8, 11, 10, 10, 8, 11, 8, 6, 6, 6,
    5, 5, 5, 6, 6, 6, 6, 6, 6, 6, 7, 8, 15, 6, 12, 10, 13, 6, 7, 7, 7, 7, 7, 7,
    7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 8, 7, 8, 13, 19, 13, 14, 6,
    15, 5, 6, 5, 6, 5, 6, 6, 6, 5, 7, 7, 6, 6, 6, 5, 6, 7, 6, 5, 5, 6, 7, 7,
    7, 7, 7, 15, 11, 14, 13, 28, 20, 22, 20, 20, 22, 22, 22, 23, 22, 23, 23, 23, 23, 23, 24, 23,
    24, 24, 22, 23, 24, 23, 23, 23, 23, 21, 22, 23, 22, 23, 23, 24, 22, 21, 20, 22, 22, 23, 23, 21,
    23, 22, 22, 24, 21, 22, 23, 23, 21, 21, 22, 21, 23, 22, 23, 23, 20, 22, 22, 22, 23, 22, 22, 23,
    26, 26, 20, 19, 22, 23, 22, 25, 26, 26, 26, 27, 27, 26, 24, 25, 19, 21, 26, 27, 27, 26, 27, 24,
    21, 21, 26, 26, 28, 27, 27, 27, 20, 24, 20, 21, 22, 21, 21, 23, 22, 22, 25, 25, 24, 24, 26, 23,
    26, 27, 26, 26, 27, 27, 27, 27, 27, 28, 27, 27, 27, 27, 27, 26, 30,
)  # fmt: skip
_EOS = 256


def _huffman_codes() -> dict[tuple[int, int], int]:
    """(length, code) -> symbol, the canonical code built from the lengths."""
    codes: dict[tuple[int, int], int] = {}
    code, previous = -1, 0
    for symbol in sorted(range(257), key=lambda s: (_HUFFMAN_CODE_LENGTHS[s], s)):
        length = _HUFFMAN_CODE_LENGTHS[symbol]
        code = (code + 1) << (length - previous)
        previous = length
        codes[(length, code)] = symbol
    return codes


_HUFFMAN = _huffman_codes()
_HUFFMAN_MAX_BITS = max(_HUFFMAN_CODE_LENGTHS)

DEFAULT_TABLE_SIZE = 4096
# An integer takes at most this many bytes after its prefix (2^35: more than any size here).
_MAX_INTEGER_BYTES = 5


class HpackError(ValueError):
    """A header block that does not decode: the connection must end (COMPRESSION_ERROR)."""


def huffman_decode(data: bytes | memoryview) -> bytes:
    """The bytes a Huffman-coded string stands for; raises HpackError if it is malformed."""
    out = bytearray()
    code = length = 0
    for byte in bytes(data):
        for shift in range(7, -1, -1):
            code = (code << 1) | ((byte >> shift) & 1)
            length += 1
            symbol = _HUFFMAN.get((length, code))
            if symbol is not None:
                if symbol == _EOS:
                    raise HpackError("a Huffman-coded string holds the end-of-string symbol")
                out.append(symbol)
                code = length = 0
            elif length > _HUFFMAN_MAX_BITS:
                raise HpackError("a Huffman-coded string holds an unknown code")
    # What is left must be padding: fewer than 8 bits, all ones (the start of EOS).
    if length > 7 or code != (1 << length) - 1:
        raise HpackError("a Huffman-coded string ends in bad padding")
    return bytes(out)


def _integer(block: bytes, pos: int, prefix_bits: int) -> tuple[int, int]:
    """The integer starting at `pos` with a `prefix_bits`-bit prefix, and the position after it."""
    limit = (1 << prefix_bits) - 1
    value = block[pos] & limit
    pos += 1
    if value < limit:
        return value, pos
    shift = 0
    for _ in range(_MAX_INTEGER_BYTES):
        if pos >= len(block):
            raise HpackError("a header block ends inside an integer")
        byte = block[pos]
        pos += 1
        value += (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return value, pos
    raise HpackError("a header block holds an integer too long to be a size or an index")


class Decoder:
    """Decodes the header blocks of one connection, in order (they share a table).

    `max_list_bytes` bounds a decoded list as HTTP/2's SETTINGS_MAX_HEADER_LIST_SIZE
    counts it (each field's name and value plus 32).
    """

    def __init__(self, max_list_bytes: int, table_size: int = DEFAULT_TABLE_SIZE) -> None:
        self._max_list_bytes = max_list_bytes
        self._max_table_size = table_size  # what we allow (our SETTINGS)
        self._table_size = table_size  # what the encoder chose, at most that
        self._table: deque[tuple[bytes, bytes]] = deque()
        self._table_bytes = 0

    def decode(self, block: bytes) -> list[tuple[bytes, bytes]]:
        fields: list[tuple[bytes, bytes]] = []
        list_bytes = 0
        pos = 0
        end = len(block)
        may_resize = True  # size updates come first in a block
        while pos < end:
            byte = block[pos]
            if byte & 0x80:  # indexed field
                index, pos = _integer(block, pos, 7)
                field = self._entry(index)
            elif byte & 0xE0 == 0x20:  # dynamic table size update
                if not may_resize:
                    raise HpackError("a table size update follows a header field")
                size, pos = _integer(block, pos, 5)
                if size > self._max_table_size:
                    raise HpackError(f"a table size update to {size} bytes exceeds {self._max_table_size}")
                self._table_size = size
                self._evict()
                continue
            else:
                indexing = byte & 0xC0 == 0x40
                index, pos = _integer(block, pos, 6 if indexing else 4)
                if index:
                    name = self._entry(index)[0]
                else:
                    name, pos = self._string(block, pos)
                value, pos = self._string(block, pos)
                field = (name, value)
                if indexing:
                    self._add(field)
            may_resize = False
            list_bytes += len(field[0]) + len(field[1]) + 32
            if list_bytes > self._max_list_bytes:
                raise HpackError(f"a header list exceeds {self._max_list_bytes} bytes")
            fields.append(field)
        return fields

    def _entry(self, index: int) -> tuple[bytes, bytes]:
        if 0 < index <= len(STATIC_TABLE):
            return STATIC_TABLE[index - 1]
        dynamic = index - len(STATIC_TABLE) - 1
        if 0 <= dynamic < len(self._table):
            return self._table[dynamic]
        raise HpackError(f"a header field refers to index {index}, which is not in the table")

    def _string(self, block: bytes, pos: int) -> tuple[bytes, int]:
        if pos >= len(block):
            raise HpackError("a header block ends where a string should start")
        huffman = block[pos] & 0x80
        length, pos = _integer(block, pos, 7)
        if length > len(block) - pos:
            raise HpackError("a string runs past the end of its header block")
        raw = block[pos : pos + length]
        return (huffman_decode(raw) if huffman else raw), pos + length

    def _add(self, field: tuple[bytes, bytes]) -> None:
        size = len(field[0]) + len(field[1]) + 32
        if size > self._table_size:
            self._table.clear()  # an entry larger than the table empties it (RFC 7541, 4.4)
            self._table_bytes = 0
            return
        self._table.appendleft(field)
        self._table_bytes += size
        self._evict()

    def _evict(self) -> None:
        while self._table_bytes > self._table_size:
            name, value = self._table.pop()
            self._table_bytes -= len(name) + len(value) + 32


def _encode_integer(value: int, prefix_bits: int, first: int) -> bytes:
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes([first | value])
    out = bytearray([first | limit])
    value -= limit
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def encode_literal(name: bytes, value: bytes) -> bytes:
    """One header field as a literal without indexing, new name, no Huffman."""
    return b"\x00" + _encode_integer(len(name), 7, 0) + name + _encode_integer(len(value), 7, 0) + value


def encode(fields: list[tuple[bytes, bytes]]) -> bytes:
    """A header block of `fields`, as literals (":status: 200" as its static index)."""
    return b"".join(b"\x88" if field == (b":status", b"200") else encode_literal(*field) for field in fields)
