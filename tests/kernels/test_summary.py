"""Summary kernels on their own: the Summary protos they serialize."""

from __future__ import annotations

import struct
import sys
import zlib

import numpy as np
import pytest

from distserver import errors
from distserver.kernels import create_kernel
from distserver.kernels.summary import encode_png, encode_wav, histogram
from distserver.protos.summary_pb2 import Summary


def run(make_node, ctx, op: str, inputs: list, **attrs) -> Summary:
    kernel = create_kernel(make_node(op, name="s", **attrs))
    (out,) = kernel.compute(ctx, inputs)
    return Summary.FromString(out[()])


def strings(*values: str) -> np.ndarray:
    return np.array([v.encode() for v in values], dtype=object)


def test_scalar_summary_has_one_value_per_tag(make_node, ctx):
    summary = run(make_node, ctx, "ScalarSummary", [strings("a", "b"), np.array([1.5, -2.0], np.float32)],
                  T=np.float32)  # fmt: skip
    assert [(v.tag, v.simple_value) for v in summary.value] == [("a", 1.5), ("b", -2.0)]
    with pytest.raises(errors.InvalidArgumentError, match="not the same shape"):
        run(make_node, ctx, "ScalarSummary", [strings("a"), np.array([1.0, 2.0], np.float32)], T=np.float32)


def test_histogram_counts_and_collapses_empty_buckets():
    proto = histogram(np.array([0.0, 0.0, 1.0, 1.05, -3.0]))
    assert (proto.min, proto.max, proto.num) == (-3.0, 1.05, 5)
    assert proto.sum == pytest.approx(-0.95)
    assert proto.sum_squares == pytest.approx(1 + 1.05**2 + 9)
    assert sum(proto.bucket) == 5
    assert proto.bucket_limit[-1] == sys.float_info.max  # the last run of empty buckets
    nonempty = [
        (limit, count) for limit, count in zip(proto.bucket_limit, proto.bucket, strict=True) if count
    ]
    assert nonempty[1] == (1e-12, 2.0)  # zeros land in the bucket just above 0
    assert [count for _, count in nonempty] == [1.0, 2.0, 1.0, 1.0]  # -3; the zeros; 1.0; 1.05
    empty = histogram(np.zeros(0))
    assert (list(empty.bucket_limit), list(empty.bucket)) == ([sys.float_info.max], [0.0])


def test_histogram_refuses_nan(make_node, ctx):
    with pytest.raises(errors.InvalidArgumentError, match="Nan in summary histogram for: h"):
        run(make_node, ctx, "HistogramSummary", [np.array(b"h", dtype=object), np.array([1.0, np.nan])],
            T=np.float64)  # fmt: skip


def test_merge_joins_values_and_refuses_duplicate_tags(make_node, ctx):
    def one(tag: str) -> bytes:
        return Summary(value=[Summary.Value(tag=tag, simple_value=1.0)]).SerializeToString()

    both = np.array([one("x"), one("y")], dtype=object)
    merged = run(make_node, ctx, "MergeSummary", [both], N=1)
    assert [v.tag for v in merged.value] == ["x", "y"]
    with pytest.raises(errors.InvalidArgumentError, match="Duplicate tag x found in summary inputs"):
        run(make_node, ctx, "MergeSummary", [np.array([one("x"), one("x")], dtype=object)], N=1)


def _png_pixels(data: bytes) -> tuple[int, int, int, bytes]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    offset, idat, header = 8, b"", None
    while offset < len(data):
        (length,) = struct.unpack(">I", data[offset : offset + 4])
        kind, body = data[offset + 4 : offset + 8], data[offset + 8 : offset + 8 + length]
        (crc,) = struct.unpack(">I", data[offset + 8 + length : offset + 12 + length])
        assert zlib.crc32(kind + body) == crc
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            idat += body
        offset += 12 + length
    assert header is not None
    return header[0], header[1], header[3], zlib.decompress(idat)


def test_png_holds_the_pixels_row_by_row():
    pixels = np.arange(2 * 3 * 3, dtype=np.uint8).reshape(2, 3, 3)
    width, height, color_type, raw = _png_pixels(encode_png(pixels))
    assert (width, height, color_type) == (3, 2, 2)
    assert raw == b"".join(b"\0" + row.tobytes() for row in pixels)


def test_wav_is_16_bit_pcm_rounding_halves_away_from_zero():
    samples = np.array([[0.5 / 32768], [-0.5 / 32768], [1.5], [-1.0]], np.float32)
    data = encode_wav(samples, 8000)
    assert data[:4] == b"RIFF"
    assert data[8:16] == b"WAVEfmt "
    assert np.frombuffer(data[44:], "<i2").tolist() == [1, -1, 32767, -32768]
