"""HPACK (`transports/hpack.py`): RFC 7541's decoding examples, hostile blocks, and the encoder.

The examples are RFC 7541 Appendix C, typed from the RFC: each block is decoded and
the decoder's dynamic table is then compared with the one the RFC lists, read back
through indexed fields (which do not change the table).
"""

from __future__ import annotations

import pytest

from distserver.transports.hpack import Decoder, HpackError, encode, encode_literal, huffman_decode

ROOMY = 1 << 20  # a header list bound no example comes near
STATIC_ENTRIES = 61


def block(text: str) -> bytes:
    """A header block from the RFC's hex dump ("8286 8441 ...")."""
    return bytes.fromhex(text.replace(" ", ""))


def dynamic_table(decoder: Decoder) -> list[tuple[bytes, bytes]]:
    """The decoder's dynamic table, newest first, read by decoding indexed fields 62, 63, ..."""
    entries = []
    index = STATIC_ENTRIES + 1
    while True:
        try:
            (entry,) = decoder.decode(indexed(index))
        except HpackError:
            return entries
        entries.append(entry)
        index += 1


def indexed(index: int) -> bytes:
    """An indexed header field (7-bit prefix integer)."""
    if index < 127:
        return bytes([0x80 | index])
    out, rest = bytearray([0xFF]), index - 127
    while rest >= 0x80:
        out.append((rest & 0x7F) | 0x80)
        rest >>= 7
    out.append(rest)
    return bytes(out)


def table_size(entries: list[tuple[bytes, bytes]]) -> int:
    return sum(len(name) + len(value) + 32 for name, value in entries)


# ----------------------------------------------------------------------------- C.2


def test_c_2_1_literal_with_indexing_enters_the_table():
    decoder = Decoder(ROOMY)
    fields = decoder.decode(block("400a 6375 7374 6f6d 2d6b 6579 0d63 7573 746f 6d2d 6865 6164 6572"))
    assert fields == [(b"custom-key", b"custom-header")]
    assert dynamic_table(decoder) == [(b"custom-key", b"custom-header")]
    assert table_size(dynamic_table(decoder)) == 55


def test_c_2_2_literal_without_indexing_leaves_the_table_empty():
    decoder = Decoder(ROOMY)
    assert decoder.decode(block("040c 2f73 616d 706c 652f 7061 7468")) == [(b":path", b"/sample/path")]
    assert dynamic_table(decoder) == []


def test_c_2_3_literal_never_indexed_leaves_the_table_empty():
    decoder = Decoder(ROOMY)
    assert decoder.decode(block("1008 7061 7373 776f 7264 0673 6563 7265 74")) == [(b"password", b"secret")]
    assert dynamic_table(decoder) == []


def test_c_2_4_indexed_field_from_the_static_table():
    decoder = Decoder(ROOMY)
    assert decoder.decode(block("82")) == [(b":method", b"GET")]
    assert dynamic_table(decoder) == []


# ----------------------------------------------------------------------------- C.3 and C.4

REQUESTS = [
    [(b":method", b"GET"), (b":scheme", b"http"), (b":path", b"/"), (b":authority", b"www.example.com")],
    [
        (b":method", b"GET"),
        (b":scheme", b"http"),
        (b":path", b"/"),
        (b":authority", b"www.example.com"),
        (b"cache-control", b"no-cache"),
    ],
    [
        (b":method", b"GET"),
        (b":scheme", b"https"),
        (b":path", b"/index.html"),
        (b":authority", b"www.example.com"),
        (b"custom-key", b"custom-value"),
    ],
]
REQUEST_TABLES = [
    ([(b":authority", b"www.example.com")], 57),
    ([(b"cache-control", b"no-cache"), (b":authority", b"www.example.com")], 110),
    (
        [
            (b"custom-key", b"custom-value"),
            (b"cache-control", b"no-cache"),
            (b":authority", b"www.example.com"),
        ],
        164,
    ),
]

C_3_PLAIN_REQUESTS = [
    "8286 8441 0f77 7777 2e65 7861 6d70 6c65 2e63 6f6d",
    "8286 84be 5808 6e6f 2d63 6163 6865",
    "8287 85bf 400a 6375 7374 6f6d 2d6b 6579 0c63 7573 746f 6d2d 7661 6c75 65",
]
C_4_HUFFMAN_REQUESTS = [
    "8286 8441 8cf1 e3c2 e5f2 3a6b a0ab 90f4 ff",
    "8286 84be 5886 a8eb 1064 9cbf",
    "8287 85bf 4088 25a8 49e9 5ba9 7d7f 8925 a849 e95b b8e8 b4bf",
]


@pytest.mark.parametrize("blocks", [C_3_PLAIN_REQUESTS, C_4_HUFFMAN_REQUESTS], ids=["C.3", "C.4"])
def test_requests_share_one_dynamic_table(blocks):
    decoder = Decoder(ROOMY)  # one decoder: each block refers to entries the previous ones added
    for hex_block, fields, (table, size) in zip(blocks, REQUESTS, REQUEST_TABLES, strict=True):
        assert decoder.decode(block(hex_block)) == fields
        assert dynamic_table(decoder) == table
        assert table_size(table) == size


def test_the_second_request_alone_refers_to_a_missing_entry():
    # C.3.2's "be" (index 62) only exists after C.3.1: a fresh decoder must refuse it.
    with pytest.raises(HpackError):
        Decoder(ROOMY).decode(block(C_3_PLAIN_REQUESTS[1]))


# ----------------------------------------------------------------------------- C.5 and C.6

DATE_21 = (b"date", b"Mon, 21 Oct 2013 20:13:21 GMT")
DATE_22 = (b"date", b"Mon, 21 Oct 2013 20:13:22 GMT")
LOCATION = (b"location", b"https://www.example.com")
PRIVATE = (b"cache-control", b"private")
COOKIE = (b"set-cookie", b"foo=ASDJKHQKBZXOQWEOPIUAXQWEOIU; max-age=3600; version=1")
RESPONSES = [
    [(b":status", b"302"), PRIVATE, DATE_21, LOCATION],
    [(b":status", b"307"), PRIVATE, DATE_21, LOCATION],
    [(b":status", b"200"), PRIVATE, DATE_22, LOCATION, (b"content-encoding", b"gzip"), COOKIE],
]
RESPONSE_TABLES = [
    ([LOCATION, DATE_21, PRIVATE, (b":status", b"302")], 222),
    ([(b":status", b"307"), LOCATION, DATE_21, PRIVATE], 222),  # ":status: 302" evicted
    ([COOKIE, (b"content-encoding", b"gzip"), DATE_22], 215),  # three more evicted
]

C_5_PLAIN_RESPONSES = [
    "4803 3330 3258 0770 7269 7661 7465 611d 4d6f 6e2c 2032 3120 4f63 7420 3230 3133 2032 303a"
    "3133 3a32 3120 474d 546e 1768 7474 7073 3a2f 2f77 7777 2e65 7861 6d70 6c65 2e63 6f6d",
    "4803 3330 37c1 c0bf",
    "88c1 611d 4d6f 6e2c 2032 3120 4f63 7420 3230 3133 2032 303a 3133 3a32 3220 474d 54c0 5a04"
    "677a 6970 7738 666f 6f3d 4153 444a 4b48 514b 425a 584f 5157 454f 5049 5541 5851 5745 4f49"
    "553b 206d 6178 2d61 6765 3d33 3630 303b 2076 6572 7369 6f6e 3d31",
]
C_6_HUFFMAN_RESPONSES = [
    "4882 6402 5885 aec3 771a 4b61 96d0 7abe 9410 54d4 44a8 2005 9504 0b81 66e0 82a6 2d1b ff6e"
    "919d 29ad 1718 63c7 8f0b 97c8 e9ae 82ae 43d3",
    "4883 640e ffc1 c0bf",
    "88c1 6196 d07a be94 1054 d444 a820 0595 040b 8166 e084 a62d 1bff c05a 839b d9ab 77ad 94e7"
    "821d d7f2 e6c7 b335 dfdf cd5b 3960 d5af 2708 7f36 72c1 ab27 0fb5 291f 9587 3160 65c0 03ed"
    "4ee5 b106 3d50 07",
]


@pytest.mark.parametrize("blocks", [C_5_PLAIN_RESPONSES, C_6_HUFFMAN_RESPONSES], ids=["C.5", "C.6"])
def test_responses_evict_from_a_256_byte_table(blocks):
    decoder = Decoder(ROOMY, table_size=256)
    for hex_block, fields, (table, size) in zip(blocks, RESPONSES, RESPONSE_TABLES, strict=True):
        assert decoder.decode(block(hex_block)) == fields
        assert dynamic_table(decoder) == table
        assert table_size(table) == size


# ----------------------------------------------------------------------------- Huffman


def huffman_bits(*codes: tuple[int, int]) -> bytes:
    """Codes (value, length in bits) packed MSB first, padded with ones to a byte."""
    value = length = 0
    for code, bits in codes:
        value, length = (value << bits) | code, length + bits
    padding = -length % 8
    value, length = (value << padding) | ((1 << padding) - 1), length + padding
    return value.to_bytes(length // 8, "big")


A, SPACE = (0x3, 5), (0x14, 6)  # RFC 7541 Appendix B: 'a', ' '
BYTE_00, BYTE_FF, NEWLINE = (0x1FF8, 13), (0x3FFFFEE, 26), (0x3FFFFFFC, 30)
EOS = (0x3FFFFFFF, 30)


def test_huffman_decodes_the_rfc_string():
    assert huffman_decode(block("f1e3 c2e5 f23a 6ba0 ab90 f4ff")) == b"www.example.com"


def test_huffman_decodes_short_and_long_codes():
    data = huffman_bits(A, BYTE_00, SPACE, BYTE_FF, NEWLINE, A)
    assert huffman_decode(data) == b"a\x00 \xff\na"


def test_huffman_empty_string():
    assert huffman_decode(b"") == b""


# ----------------------------------------------------------------------------- hostile blocks

HOSTILE_HUFFMAN = {
    "EOS inside": huffman_bits(A, EOS, A),
    "EOS alone": huffman_bits(EOS),
    "padding of 8 bits": b"\xff",
    "padding longer than 7 bits after a symbol": huffman_bits(A) + b"\xff",  # 3 + 8 one bits
    "padding not all ones": bytes([0b00011_000]),  # 'a', then 000
    "padding of zeros": bytes([0b00011_010]),
}


@pytest.mark.parametrize("data", HOSTILE_HUFFMAN.values(), ids=HOSTILE_HUFFMAN.keys())
def test_bad_huffman_is_refused(data):
    with pytest.raises(HpackError):
        huffman_decode(data)
    # The same string as a header value, inside a block.
    with pytest.raises(HpackError):
        Decoder(ROOMY).decode(b"\x00\x01x" + bytes([0x80 | len(data)]) + data)


HOSTILE_BLOCKS = {
    "index 0": "80",
    "index past the static table": "be",  # 62, with an empty dynamic table
    "huge index": "ff ff ff ff ff 0f",
    "name index past the table": "7e 01 78",  # literal with indexing, name index 62
    "name index 0 with no name": "40",
    "string longer than the block": "00 05 61 62 63",
    "value longer than the block": "00 01 61 7f 00",
    "last value one byte longer than the block": "00 01 61 03 62 63",
    "value missing": "00 01 61",
    "name missing": "00",
    "integer with too many continuation bytes": "ff 80 80 80 80 80 80 80 80 01",
    "string length with too many continuation bytes": "00 7f ff ff ff ff ff ff ff 01",
    # 127 written with ten zero-valued continuation bytes, then a good name and value:
    # only the integer's length is wrong (RFC 7541, 5.1: a limit on octet length).
    "overlong integer of a small value": "00 7f" + " 80" * 10 + " 00" + " 61" * 127 + " 01 62",
    "truncated integer": "ff",
    "integer truncated after a continuation byte": "ff 80",
    "truncated string length": "00 7f",
    "size update above the maximum": "3f e2 1f",  # 31 + 98 + 31 * 128 = 4097
    "size update after a field": "82 20",
    "huge size update": "3f ff ff ff ff 0f",
}


@pytest.mark.parametrize("hex_block", HOSTILE_BLOCKS.values(), ids=HOSTILE_BLOCKS.keys())
def test_hostile_block_is_refused(hex_block):
    with pytest.raises(HpackError):
        Decoder(ROOMY).decode(block(hex_block))


def test_size_updates_up_to_the_maximum_are_taken():
    decoder = Decoder(ROOMY)
    # 4096 (the maximum) then 0: both allowed, at the start of a block.
    assert decoder.decode(block("3f e1 1f 20 82")) == [(b":method", b"GET")]
    # The table is now 0 bytes: an entry added with indexing does not stay.
    assert decoder.decode(block("40 01 61 01 62")) == [(b"a", b"b")]
    assert dynamic_table(decoder) == []


def test_size_update_shrinks_the_table():
    decoder = Decoder(ROOMY)
    decoder.decode(block(C_3_PLAIN_REQUESTS[0]))  # :authority (57 bytes) enters the table
    decoder.decode(block("40 01 61 01 62"))  # a: b (34 bytes) enters the table
    assert dynamic_table(decoder) == [(b"a", b"b"), (b":authority", b"www.example.com")]
    decoder.decode(block("3f 1b"))  # size update to 58: only the newest entry fits
    assert dynamic_table(decoder) == [(b"a", b"b")]


def test_header_list_bound():
    two_methods = block("82 82")  # 2 * (7 + 3 + 32) = 84 bytes as SETTINGS_MAX_HEADER_LIST_SIZE counts
    assert Decoder(84).decode(two_methods) == [(b":method", b"GET")] * 2
    with pytest.raises(HpackError):
        Decoder(83).decode(two_methods)


def test_header_list_bound_counts_one_large_literal():
    literal = encode_literal(b"x-big", b"v" * 1000)
    assert Decoder(1037).decode(literal) == [(b"x-big", b"v" * 1000)]
    with pytest.raises(HpackError):
        Decoder(1036).decode(literal)


# ----------------------------------------------------------------------------- encoder

ROUND_TRIP = [
    (b":status", b"200"),
    (b"content-type", b"application/grpc"),
    (b"grpc-status", b"0"),
    (b"empty", b""),
    (b"x-long", b"v" * 300),  # a length of 300: a 7-bit prefix and two more bytes
    (b"x-" + b"n" * 200, b"long name"),
    (b"x-exactly-127", b"e" * 127),  # the first length that needs a continuation byte
    (b"x-126", b"f" * 126),
    (b"x-bin", bytes(range(256)) * 70),  # 17920: three-byte length
]


def test_encoded_fields_decode_to_the_same_fields():
    data = encode(ROUND_TRIP)
    decoder = Decoder(ROOMY)
    assert decoder.decode(data) == ROUND_TRIP
    assert dynamic_table(decoder) == []  # literals without indexing: no table state


def test_encoded_blocks_decode_in_sequence_on_one_decoder():
    decoder = Decoder(ROOMY)
    for fields in (ROUND_TRIP[:2], ROUND_TRIP[2:5], ROUND_TRIP[5:]):
        assert decoder.decode(encode(fields)) == fields


def test_encoder_uses_multi_byte_lengths():
    literal = encode_literal(b"k", b"v" * 300)
    # 0x00, name length 1, "k", then 300: 0x7f (127), then 173 in 7-bit groups: 0xad (45 | more), 0x01.
    assert literal[:6] == b"\x00\x01k\x7f\xad\x01"
    assert literal[6:] == b"v" * 300
    assert encode([(b":status", b"200")]) == b"\x88"


def test_encoded_empty_list_is_an_empty_block():
    assert encode([]) == b""
    assert Decoder(ROOMY).decode(b"") == []
