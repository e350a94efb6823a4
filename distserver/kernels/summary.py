"""TF 1.x summary ops: each outputs a serialized `Summary` proto in a DT_STRING scalar.

`tf.compat.v1.summary.scalar/histogram/image/audio/merge` build these; the client
(`FileWriter`, `SummarySaverHook`, `MonitoredTrainingSession`) writes what they return
to event files, so the bytes are what matter. Scalar, histogram (TensorFlow's bucket
limits), audio (16-bit WAV) and merged summaries are TensorFlow's bytes; images decode
to TensorFlow's pixels, but the PNG bytes are our encoder's.
"""

from __future__ import annotations

import math
import struct
import sys
import zlib
from typing import TYPE_CHECKING, Any

import numpy as np

from distserver.kernels._common import kernel_error
from distserver.kernels.registry import KernelContext, OpKernel, register_kernel
from distserver.protos.summary_pb2 import HistogramProto, Summary

if TYPE_CHECKING:
    from distserver.protos.node_def_pb2 import NodeDef


def _string_scalar(data: bytes) -> np.ndarray:
    out = np.empty((), dtype=object)
    out[()] = data
    return out


def _tag(kernel: OpKernel, value: Any) -> str:
    tag = np.asarray(value)
    if tag.shape != ():
        raise kernel_error(kernel, f"Tags must be a scalar, got shape {list(tag.shape)}")
    item = tag[()]
    return item.decode() if isinstance(item, bytes) else str(item)


@register_kernel("ScalarSummary")
class ScalarSummaryKernel(OpKernel):
    """`(tags, values)` of one shape -> a Summary with one simple_value per element."""

    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        tags, values = (np.asarray(v) for v in inputs)
        if tags.shape != values.shape:
            raise kernel_error(
                self,
                f"tags and values are not the same shape: {list(tags.shape)} != {list(values.shape)}",
            )
        summary = Summary()
        for tag, value in zip(tags.reshape(-1).tolist(), values.reshape(-1).tolist(), strict=True):
            name = tag.decode() if isinstance(tag, bytes) else str(tag)
            summary.value.add(tag=name, simple_value=float(value))
        return [_string_scalar(summary.SerializeToString())]


def _default_bucket_limits() -> list[float]:
    """TensorFlow's histogram buckets: ±1e-12 growing by 10% up to 1e20, zero, ±DBL_MAX."""
    positive = []
    limit = 1.0e-12
    while limit < 1.0e20:
        positive.append(limit)
        limit *= 1.1
    positive.append(sys.float_info.max)
    return [-v for v in reversed(positive)] + [0.0] + positive


_BUCKET_LIMITS = _default_bucket_limits()
_BUCKET_LIMITS_ARRAY = np.array(_BUCKET_LIMITS)


def histogram(values: np.ndarray) -> HistogramProto:
    """The HistogramProto TensorFlow's HistogramSummary makes of finite `values`.

    Counts per bucket (bucket i holds values below limit i and at or above limit i-1),
    then runs of empty buckets collapsed into one entry (the run's last limit, count 0);
    never empty (one bucket of DBL_MAX when there are no values).
    """
    flat = values.astype(np.float64).reshape(-1)
    counts = [0.0] * len(_BUCKET_LIMITS)
    # The bucket of a value: the index of the first limit above it.
    buckets, bucket_counts = np.unique(
        np.searchsorted(_BUCKET_LIMITS, flat, side="right"), return_counts=True
    )
    for index, count in zip(buckets.tolist(), bucket_counts.tolist(), strict=True):
        counts[index] = float(count)
    proto = HistogramProto(
        min=float(flat.min()) if flat.size else sys.float_info.max,
        max=float(flat.max()) if flat.size else -sys.float_info.max,
        num=float(flat.size),
        sum=float(flat.sum()),
        sum_squares=float(np.dot(flat, flat)),
    )
    i = 0
    while i < len(counts):
        end, count = _BUCKET_LIMITS[i], counts[i]
        i += 1
        if count <= 0.0:
            while i < len(counts) and counts[i] <= 0.0:
                end, count = _BUCKET_LIMITS[i], counts[i]
                i += 1
        proto.bucket_limit.append(end)
        proto.bucket.append(count)
    if not proto.bucket:
        proto.bucket_limit.append(sys.float_info.max)
        proto.bucket.append(0.0)
    return proto


@register_kernel("HistogramSummary")
class HistogramSummaryKernel(OpKernel):
    """`(tag, values)` -> a Summary with the values' histogram; NaN or Inf is an error."""

    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        tag = _tag(self, inputs[0])
        values = np.asarray(inputs[1])
        if values.size and not np.isfinite(values).all():
            raise kernel_error(self, f"Nan in summary histogram for: {tag}")
        summary = Summary()
        summary.value.add(tag=tag, histo=histogram(values))
        return [_string_scalar(summary.SerializeToString())]


@register_kernel("MergeSummary")
class MergeSummaryKernel(OpKernel):
    """Serialized Summaries (any shape) -> one Summary with all their values; tags must differ."""

    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        merged = Summary()
        tags: set[str] = set()
        for tensor in inputs:
            for item in np.asarray(tensor).reshape(-1).tolist():
                part = Summary()
                try:
                    part.ParseFromString(item if isinstance(item, bytes) else bytes(item))
                except Exception as exc:  # protobuf's DecodeError, or a non-bytes element
                    raise kernel_error(self, "Could not parse one of the summary inputs") from exc
                for value in part.value:
                    if value.tag and value.tag in tags:
                        raise kernel_error(self, f"Duplicate tag {value.tag} found in summary inputs")
                    tags.add(value.tag)
                    merged.value.add().CopyFrom(value)
        return [_string_scalar(merged.SerializeToString())]


def _numbered_tags(tag: str, kind: str, count: int, max_outputs: int) -> list[str]:
    if max_outputs == 1:
        return [f"{tag}/{kind}"]
    return [f"{tag}/{kind}/{i}" for i in range(count)]


def encode_png(pixels: np.ndarray) -> bytes:
    """A PNG of `pixels` (uint8, [height, width, channels], 1 to 4 channels), zlib level 6."""
    height, width, channels = pixels.shape
    color_type = {1: 0, 2: 4, 3: 2, 4: 6}[channels]
    rows = np.concatenate([np.zeros((height, 1), np.uint8), pixels.reshape(height, width * channels)], axis=1)

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, color_type, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(rows.tobytes(), 6))
        + chunk(b"IEND", b"")
    )


@register_kernel("ImageSummary")
class ImageSummaryKernel(OpKernel):
    """`(tag, images [batch, height, width, channels])` -> a Summary of up to `max_images` PNGs.

    uint8 images go as they are. Float images are scaled as TensorFlow does: all values
    non-negative -> the largest becomes 255; else 0.0 maps to 128 and the largest
    magnitude to the end of its side. Non-finite pixels take `bad_color`.
    """

    def __init__(self, node: NodeDef) -> None:
        super().__init__(node)
        self.max_images = self.attr_int("max_images", 3)
        if self.max_images < 1:
            raise kernel_error(self, f"max_images must be at least 1, got {self.max_images}")
        bad = self.node.attr["bad_color"].tensor if self.has_attr("bad_color") else None
        self.bad_color = np.frombuffer(bad.tensor_content, np.uint8) if bad and bad.tensor_content else None
        if self.bad_color is None and bad is not None and bad.int_val:
            self.bad_color = np.array(bad.int_val, np.uint8)

    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        tag = _tag(self, inputs[0])
        images = np.asarray(inputs[1])
        if images.ndim != 4 or images.shape[3] not in (1, 3, 4):
            raise kernel_error(
                self,
                f"Tensor must be 4-D with last dim 1, 3, or 4, not {list(images.shape)}",
            )
        count = min(images.shape[0], self.max_images)
        summary = Summary()
        for name, image in zip(
            _numbered_tags(tag, "image", count, self.max_images), images[:count], strict=True
        ):
            pixels = image if image.dtype == np.uint8 else self._to_uint8(image)
            height, width, channels = pixels.shape
            encoded = Summary.Image(
                height=height, width=width, colorspace=channels, encoded_image_string=encode_png(pixels)
            )
            summary.value.add(tag=name, image=encoded)
        return [_string_scalar(summary.SerializeToString())]

    def _to_uint8(self, image: np.ndarray) -> np.ndarray:
        values = image.astype(np.float32)
        finite = np.isfinite(values)
        good = values[finite]
        low = float(good.min()) if good.size else 0.0
        high = float(good.max()) if good.size else 0.0
        if low >= 0:
            scale, offset = (255.0 / high if high > 0 else 0.0), 0.0
        else:
            scale, offset = 127.0 / max(-low, high), 128.0
        pixels = np.clip(np.where(finite, values, 0.0) * scale + offset, 0, 255).astype(np.uint8)
        bad_pixels = ~finite.all(axis=-1)
        if bad_pixels.any():
            color = self.bad_color if self.bad_color is not None else np.array([255, 0, 0, 255], np.uint8)
            pixels[bad_pixels] = color[: pixels.shape[-1]]
        return pixels


def encode_wav(samples: np.ndarray, sample_rate: float) -> bytes:
    """A 16-bit PCM WAV of `samples` ([frames, channels], floats in [-1, 1]: x 32768, rounded, clipped)."""
    channels = samples.shape[1]
    scaled = samples.astype(np.float32) * np.float32(32768.0)
    rounded = np.sign(scaled) * np.floor(np.abs(scaled) + 0.5)  # halves away from zero, as C's roundf
    pcm: bytes = np.clip(rounded, -32768, 32767).astype("<i2").tobytes()
    rate = int(sample_rate)
    block = channels * 2
    header = struct.pack(
        "<4sI4s4sIHHIIHH4sI",
        b"RIFF", 36 + len(pcm), b"WAVE",
        b"fmt ", 16, 1, channels, rate, rate * block, block, 16,
        b"data", len(pcm),
    )  # fmt: skip
    return header + pcm


@register_kernel("AudioSummaryV2", "AudioSummary")
class AudioSummaryKernel(OpKernel):
    """`(tag, audio [batch, frames(, channels)], sample_rate)` -> up to `max_outputs` WAVs.

    AudioSummary (v1) takes the sample rate as an attr, V2 as an input.
    """

    def __init__(self, node: NodeDef) -> None:
        super().__init__(node)
        self.max_outputs = self.attr_int("max_outputs", 3)
        if self.max_outputs < 1:
            raise kernel_error(self, f"max_outputs must be at least 1, got {self.max_outputs}")
        self.sample_rate_attr = self.attr_float("sample_rate") if self.op == "AudioSummary" else None

    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        tag = _tag(self, inputs[0])
        audio = np.asarray(inputs[1], np.float32)
        rate = self.sample_rate_attr if self.sample_rate_attr is not None else float(np.asarray(inputs[2]))
        if not math.isfinite(rate) or rate <= 0:
            raise kernel_error(self, f"sample_rate must be positive, got {rate}")
        if audio.ndim == 2:
            audio = audio[:, :, None]
        if audio.ndim != 3:
            raise kernel_error(self, f"Tensor must be 2-D or 3-D, got {list(audio.shape)}")
        count = min(audio.shape[0], self.max_outputs)
        summary = Summary()
        for name, clip in zip(
            _numbered_tags(tag, "audio", count, self.max_outputs), audio[:count], strict=True
        ):
            encoded = Summary.Audio(
                sample_rate=rate,
                num_channels=clip.shape[1],
                length_frames=clip.shape[0],
                encoded_audio_string=encode_wav(clip, rate),
                content_type="audio/wav",
            )
            summary.value.add(tag=name, audio=encoded)
        return [_string_scalar(summary.SerializeToString())]
