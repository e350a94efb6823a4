"""tf.data in graph mode: datasets as values, iterators as resources.

A dataset op outputs a 0-d object array holding a `Dataset` (a description: its
inputs and parameters, nothing read yet). An iterator is a resource on the task that
holds it (`IteratorV2`, `OneShotIterator`); `MakeIterator` starts a fresh pass over a
dataset in it and `IteratorGetNext` takes the next element, or raises
`OutOfRangeError("End of sequence")` at the end, as TensorFlow does. `MapDataset` and
`FilterDataset` (and `ScanDataset`, `TakeWhileDataset`, `FlatMapDataset`,
`InterleaveDataset`) call their functions through
`KernelContext.call_function`, in the step of the `IteratorGetNext` that needs the
element; `OneShotIterator` calls its `dataset_factory` once, on its first run.

In a `tf.function`, `iter(dataset)` is an anonymous iterator (`AnonymousIteratorV3`,
or V2 with a deleter and `DeleteIterator`): a new one per run, owned by its handle
(`OwningHandle`), so it lives as long as the step's values hold the handle, as
TensorFlow's ref-counted handles do; `IteratorGetNextAsOptional` gives an empty
optional at the end. `for x in dataset:` becomes `ReduceDataset` over a `ScanDataset`
(and a `TakeWhileDataset` for a `break`): the reduce function runs once per element,
in the step.

`ShuffleDataset` is seeded (numpy's generator from `seed`/`seed2`): the same seeds
give the same order in every run, but not TensorFlow's order. `PrefetchDataset`
computes ahead: a task of the pass fills a bounded buffer (elements, errors and the
end, in order), with the step of the latest GetNext as its context; it stops when the
pass is dropped. Datasets do not cross tasks: an iterator's ops run where the iterator is.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import itertools
import math
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from distserver import errors
from distserver._cpus import usable_cpus
from distserver.kernels._common import handle_input, handle_output
from distserver.kernels.functional import to_bool
from distserver.kernels.optionals import OptionalValue, optional_tensor
from distserver.kernels.registry import KernelContext, OpKernel, register_kernel
from distserver.kernels.resources import DEFAULT_CONTAINER, ResourceManager
from distserver.protos.resource_handle_pb2 import ResourceHandleProto
from distserver.protos.tensor_pb2 import VariantTensorDataProto
from distserver.tensors import ResourceHandle, as_numpy_dtype

if TYPE_CHECKING:
    from distserver.protos.attr_value_pb2 import NameAttrList
    from distserver.protos.node_def_pb2 import NodeDef

# Elements a shuffle buffer, a batch or a cache may hold (a hostile graph could ask for more).
MAX_BUFFERED_ELEMENTS = 1 << 22
# Datasets an interleave may iterate at once.
MAX_INTERLEAVE_CYCLE = 1 << 16
# Scalars a padded batch may have (its padded shapes come from the graph).
MAX_PADDED_ELEMENTS = 1 << 28

Element = list[Any]
_anonymous_ids = itertools.count()


class ElementIterator:
    """One pass over a dataset."""

    async def next(self, ctx: KernelContext) -> Element | None:
        """The next element, or None at the end."""
        raise NotImplementedError


class Dataset:
    """A dataset description; `iterate()` starts a pass over it."""

    def iterate(self) -> ElementIterator:
        raise NotImplementedError

    def to_variant_proto(self) -> VariantTensorDataProto:
        """A dataset has no wire form: a value that must leave its task fails here."""
        raise errors.UnimplementedError(
            "A tf.data dataset cannot be sent to another task (distserver runs a dataset on the task "
            "that made it): place the ops that use it (its iterator, a tf.function looping over it, "
            "and the variables that loop updates) on the dataset's task"
        )


def _wrap(dataset: Dataset) -> np.ndarray:
    out = np.empty((), dtype=object)
    out[()] = dataset
    return out


def _dataset(value: Any) -> Dataset:
    array = np.asarray(value, dtype=object)
    item = array[()] if array.shape == () else None
    if not isinstance(item, Dataset):
        raise errors.InvalidArgumentError("Expected a dataset (a DT_VARIANT tensor made by a dataset op)")
    return item


def _count(value: Any, what: str) -> int:
    array = np.asarray(value)
    if array.shape != ():
        raise errors.InvalidArgumentError(f"{what} must be a scalar, got shape {list(array.shape)}")
    return int(array)


class _ListIterator(ElementIterator):
    def __init__(self, elements: Sequence[Element]) -> None:
        self.elements = elements
        self.position = 0

    async def next(self, ctx: KernelContext) -> Element | None:
        if self.position >= len(self.elements):
            return None
        self.position += 1
        return self.elements[self.position - 1]


class TensorSlices(Dataset):
    def __init__(self, components: list[Any]) -> None:
        sizes = {np.shape(c)[0] if np.ndim(c) else None for c in components}
        if not components or None in sizes or len(sizes) != 1:
            raise errors.InvalidArgumentError(
                "All components must be at least vectors with the same first dimension"
            )
        self.components = components
        self.size = int(np.shape(components[0])[0])

    def iterate(self) -> ElementIterator:
        return _ListIterator([[c[i] for c in self.components] for i in range(self.size)])


class Tensors(Dataset):
    def __init__(self, components: list[Any]) -> None:
        self.components = components

    def iterate(self) -> ElementIterator:
        return _ListIterator([self.components])


class Range(Dataset):
    def __init__(self, start: int, stop: int, step: int, dtype: np.dtype[Any]) -> None:
        if step == 0:
            raise errors.InvalidArgumentError("step must be a non-zero integer.")
        self.values = range(start, stop, step)
        self.dtype = dtype

    def iterate(self) -> ElementIterator:
        dataset = self

        class Counting(ElementIterator):
            position = 0

            async def next(self, ctx: KernelContext) -> Element | None:
                if self.position >= len(dataset.values):
                    return None
                self.position += 1
                return [np.asarray(dataset.values[self.position - 1], dtype=dataset.dtype)]

        return Counting()


class _Wrapping(Dataset):
    """A dataset over another one."""

    def __init__(self, source: Dataset) -> None:
        self.source = source


class Batch(_Wrapping):
    def __init__(self, source: Dataset, size: int, drop_remainder: bool) -> None:
        super().__init__(source)
        if not 0 < size <= MAX_BUFFERED_ELEMENTS:
            raise errors.InvalidArgumentError(f"Batch size must be greater than zero, got {size}")
        self.size, self.drop_remainder = size, drop_remainder

    def iterate(self) -> ElementIterator:
        dataset, source = self, self.source.iterate()

        class Batching(ElementIterator):
            async def next(self, ctx: KernelContext) -> Element | None:
                rows: list[Element] = []
                while len(rows) < dataset.size:
                    element = await source.next(ctx)
                    if element is None:
                        break
                    rows.append(element)
                if not rows or (dataset.drop_remainder and len(rows) < dataset.size):
                    return None
                return dataset.combine(rows)

        return Batching()

    def combine(self, rows: list[Element]) -> Element:
        """One batch of `rows` (at least one)."""
        try:
            return [np.stack([np.asarray(row[i]) for row in rows]) for i in range(len(rows[0]))]
        except ValueError as exc:
            raise errors.InvalidArgumentError(
                f"Cannot batch tensors with different shapes in a component: {exc}"
            ) from None


class PaddedBatch(Batch):
    """Batches whose component k has each element padded with `padding_values[k]` to
    `padded_shapes[k]` (a -1 dimension: the longest in the batch)."""

    def __init__(
        self,
        source: Dataset,
        size: int,
        padded_shapes: list[tuple[int, ...]],
        padding_values: list[np.ndarray],
        drop_remainder: bool,
    ) -> None:
        super().__init__(source, size, drop_remainder)
        for k, shape in enumerate(padded_shapes):
            if any(d < -1 for d in shape):
                raise errors.InvalidArgumentError(
                    f"padded_shapes[{k}] must hold sizes or -1 (pad to the longest), got {list(shape)}"
                )
        for k, value in enumerate(padding_values):
            if value.shape != ():
                raise errors.InvalidArgumentError(
                    f"padding_values[{k}] must be a scalar, got shape {list(value.shape)}"
                )
        self.padded_shapes, self.padding_values = padded_shapes, padding_values

    def combine(self, rows: list[Element]) -> Element:
        if len(rows[0]) != len(self.padded_shapes):
            raise errors.InvalidArgumentError(
                f"The elements have {len(rows[0])} components; padded_shapes lists {len(self.padded_shapes)}"
            )
        return [self.pad(k, [np.asarray(row[k]) for row in rows]) for k in range(len(rows[0]))]

    def pad(self, k: int, values: list[np.ndarray]) -> np.ndarray:
        """Component `k` of a batch: `values` padded to one shape and stacked."""
        padded = self.padded_shapes[k]
        for value in values:
            if value.ndim != len(padded):
                raise errors.InvalidArgumentError(
                    "All elements in a batch must have the same rank as the padded shape for "
                    f"component{k}: expected rank {len(padded)} but got element with rank {value.ndim}"
                )
        shape = tuple(
            max(value.shape[d] for value in values) if size == -1 else size for d, size in enumerate(padded)
        )
        if any(value.shape[d] > shape[d] for value in values for d in range(len(shape))):
            raise errors.DataLossError("Attempted to pad to a smaller size than the input element.")
        total = len(values) * math.prod(shape)
        if total > MAX_PADDED_ELEMENTS:
            raise errors.InvalidArgumentError(
                f"A padded batch of shape {[len(values), *shape]} has {total} elements, more than the "
                f"{MAX_PADDED_ELEMENTS} distserver allows: pad to smaller shapes"
            )
        dtype = values[0].dtype
        out = np.full((len(values), *shape), self.padding_values[k].astype(dtype), dtype=dtype)
        for i, value in enumerate(values):
            if value.dtype != dtype:
                raise errors.InvalidArgumentError(
                    f"Component {k} has elements of types {dtype} and {value.dtype} in one batch"
                )
            region: tuple[int | slice, ...] = (i, *(slice(0, d) for d in value.shape))
            out[region] = value
        return out


class Unbatch(_Wrapping):
    """The rows of each element: element k of the output is row k of every component."""

    def iterate(self) -> ElementIterator:
        source = self.source.iterate()

        class Unbatching(ElementIterator):
            def __init__(self) -> None:
                self.batch: list[np.ndarray] = []
                self.rows = self.position = 0

            async def next(self, ctx: KernelContext) -> Element | None:
                while self.position >= self.rows:
                    element = await source.next(ctx)
                    if element is None:
                        return None
                    self.batch = [np.asarray(c) for c in element]
                    if any(c.ndim == 0 for c in self.batch):
                        raise errors.InvalidArgumentError(
                            "Input element must have a non-scalar value in each component."
                        )
                    sizes = {c.shape[0] for c in self.batch}
                    if len(sizes) != 1:
                        raise errors.InvalidArgumentError(
                            "Input element must have the same batch size in each component. Component 0 "
                            f"had size {self.batch[0].shape[0]} but another component had size "
                            f"{sorted(sizes - {self.batch[0].shape[0]})[0]}."
                        )
                    self.rows, self.position = sizes.pop(), 0
                self.position += 1
                return [c[self.position - 1] for c in self.batch]

        return Unbatching()


class Cache(_Wrapping):
    """An in-memory cache: the first pass that reaches the end records the elements, and
    later passes replay them (a pass that stops early records nothing, as TensorFlow
    drops a partial cache)."""

    def __init__(self, source: Dataset) -> None:
        super().__init__(source)
        self.elements: list[Element] | None = None

    def iterate(self) -> ElementIterator:
        if self.elements is not None:
            return _ListIterator(self.elements)
        dataset, source = self, self.source.iterate()

        class Caching(ElementIterator):
            def __init__(self) -> None:
                self.recorded: list[Element] = []

            async def next(self, ctx: KernelContext) -> Element | None:
                element = await source.next(ctx)
                if element is None:
                    if dataset.elements is None:
                        dataset.elements = self.recorded
                    return None
                if len(self.recorded) >= MAX_BUFFERED_ELEMENTS:
                    raise errors.ResourceExhaustedError(
                        f"A cached dataset holds at most {MAX_BUFFERED_ELEMENTS} elements in memory"
                    )
                self.recorded.append(element)
                return element

        return Caching()


class Repeat(_Wrapping):
    def __init__(self, source: Dataset, count: int) -> None:
        super().__init__(source)
        self.count = count

    def iterate(self) -> ElementIterator:
        dataset = self

        class Repeating(ElementIterator):
            def __init__(self) -> None:
                self.epoch = 0
                self.current = dataset.source.iterate()
                self.seen_any = False

            async def next(self, ctx: KernelContext) -> Element | None:
                while dataset.count < 0 or self.epoch < dataset.count:
                    element = await self.current.next(ctx)
                    if element is not None:
                        self.seen_any = True
                        return element
                    self.epoch += 1
                    if not self.seen_any:  # an empty input repeats to nothing, not forever
                        return None
                    self.current = dataset.source.iterate()
                return None

        return Repeating()


class Take(_Wrapping):
    def __init__(self, source: Dataset, count: int) -> None:
        super().__init__(source)
        self.count = count

    def iterate(self) -> ElementIterator:
        dataset, source = self, self.source.iterate()

        class Taking(ElementIterator):
            taken = 0

            async def next(self, ctx: KernelContext) -> Element | None:
                if 0 <= dataset.count <= self.taken:
                    return None
                self.taken += 1
                return await source.next(ctx)

        return Taking()


class Skip(_Wrapping):
    def __init__(self, source: Dataset, count: int) -> None:
        super().__init__(source)
        self.count = count

    def iterate(self) -> ElementIterator:
        dataset, source = self, self.source.iterate()

        class Skipping(ElementIterator):
            skipped = False

            async def next(self, ctx: KernelContext) -> Element | None:
                if not self.skipped:
                    self.skipped = True
                    n = 0
                    while dataset.count < 0 or n < dataset.count:
                        if await source.next(ctx) is None:
                            return None
                        n += 1
                return await source.next(ctx)

        return Skipping()


class Shuffle(_Wrapping):
    def __init__(self, source: Dataset, buffer_size: int, seed: int, seed2: int, reshuffle: bool) -> None:
        super().__init__(source)
        if not 0 < buffer_size <= MAX_BUFFERED_ELEMENTS:
            raise errors.InvalidArgumentError(f"buffer_size must be greater than zero, got {buffer_size}")
        self.buffer_size, self.reshuffle = buffer_size, reshuffle
        self.seeds = (seed, seed2) if seed or seed2 else None
        self.passes = 0

    def iterate(self) -> ElementIterator:
        dataset, source = self, self.source.iterate()
        seed = None if self.seeds is None else [*self.seeds, self.passes if self.reshuffle else 0]
        self.passes += 1
        generator = np.random.default_rng(seed)

        class Shuffling(ElementIterator):
            def __init__(self) -> None:
                self.buffer: list[Element] = []
                self.exhausted = False

            async def next(self, ctx: KernelContext) -> Element | None:
                while not self.exhausted and len(self.buffer) < dataset.buffer_size:
                    element = await source.next(ctx)
                    if element is None:
                        self.exhausted = True
                    else:
                        self.buffer.append(element)
                if not self.buffer:
                    return None
                index = int(generator.integers(len(self.buffer)))
                self.buffer[index], self.buffer[-1] = self.buffer[-1], self.buffer[index]
                return self.buffer.pop()

        return Shuffling()


class Map(_Wrapping):
    def __init__(self, source: Dataset, function: NameAttrList, captured: list[Any], keep: bool) -> None:
        super().__init__(source)
        self.function, self.captured, self.keep = function, captured, keep
        """keep: a filter (keep elements for which the function is true), else a map."""

    def iterate(self) -> ElementIterator:
        dataset, source = self, self.source.iterate()

        class Mapping(ElementIterator):
            async def next(self, ctx: KernelContext) -> Element | None:
                while True:
                    element = await source.next(ctx)
                    if element is None:
                        return None
                    results = await ctx.call_function(dataset.function, [*element, *dataset.captured])
                    if not dataset.keep:
                        return results
                    if to_bool(results[0]):
                        return element

        return Mapping()


# tf.data.AUTOTUNE, as a buffer size or a cycle length.
AUTOTUNE = -1
# What `prefetch(tf.data.AUTOTUNE)` buffers.
AUTOTUNE_PREFETCH = 4
_END = object()  # a prefetch buffer's end of sequence


class _Prefetched:
    """What a prefetching pass shares with its producer task: the buffer and two events.

    The task holds this and the source pass, never the `Prefetching` iterator, so that
    dropping the iterator (a new MakeIterator, DeleteIterator, the anonymous iterator's
    last handle, the session's iterator kernel) frees it and its finalizer stops the task.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        # Elements, OpErrors and finally _END, in the order the source gave them.
        self.buffer: collections.deque[Any] = collections.deque()
        self.ready = asyncio.Event()  # the buffer is not empty
        self.space = asyncio.Event()  # the buffer has room
        self.space.set()
        self.ctx: KernelContext | None = None  # the step of the latest GetNext

    async def produce(self, source: ElementIterator) -> None:
        while True:
            await self.space.wait()
            ctx = self.ctx
            try:
                element = await source.next(ctx)  # type: ignore[arg-type]
            except errors.OpError as exc:
                self.put(exc)  # the consumer gets it at its place; the pass goes on, as TensorFlow's
                continue
            except Exception as exc:  # a bug: end the pass with it rather than leave GetNext waiting
                self.put(errors.InternalError(f"Prefetching failed: {type(exc).__name__}: {exc}"))
                self.put(_END)
                return
            self.put(_END if element is None else element)
            if element is None:
                return

    def put(self, item: Any) -> None:
        self.buffer.append(item)
        self.ready.set()
        if len(self.buffer) >= self.capacity:
            self.space.clear()

    async def take(self) -> Any:
        await self.ready.wait()
        item = self.buffer[0]
        if item is _END:
            return None  # stays: every later call is at the end too
        self.buffer.popleft()
        if not self.buffer:
            self.ready.clear()
        self.space.set()
        if isinstance(item, errors.OpError):
            raise item
        return item


def _stop(loop: asyncio.AbstractEventLoop, task: asyncio.Task[None]) -> None:
    # A finalizer: may run in any thread, at any allocation; the loop cancels the task.
    with contextlib.suppress(RuntimeError):  # the loop is closed: so is the task
        loop.call_soon_threadsafe(task.cancel)


class Prefetch(_Wrapping):
    """Elements computed ahead by a task of their own, at most `buffer_size` of them."""

    def __init__(self, source: Dataset, buffer_size: int) -> None:
        super().__init__(source)
        if buffer_size < -1 or buffer_size > MAX_BUFFERED_ELEMENTS:
            raise errors.InvalidArgumentError(
                f"buffer_size must be -1 (AUTOTUNE) or between 0 and {MAX_BUFFERED_ELEMENTS}, "
                f"got {buffer_size}"
            )
        self.buffer_size = AUTOTUNE_PREFETCH if buffer_size == AUTOTUNE else buffer_size

    def iterate(self) -> ElementIterator:
        if self.buffer_size == 0:
            return self.source.iterate()
        return _Prefetching(self.source.iterate(), self.buffer_size)


class _Prefetching(ElementIterator):
    def __init__(self, source: ElementIterator, capacity: int) -> None:
        self.source: ElementIterator | None = source  # until the producer starts
        self.shared = _Prefetched(capacity)

    async def next(self, ctx: KernelContext) -> Element | None:
        self.shared.ctx = ctx
        if self.source is not None:
            task = asyncio.get_running_loop().create_task(self.shared.produce(self.source))
            weakref.finalize(self, _stop, asyncio.get_running_loop(), task)
            self.source = None
        element: Element | None = await self.shared.take()
        return element


class Scan(_Wrapping):
    """`f(state..., element..., captured...) -> (new state..., output...)` over the elements."""

    def __init__(
        self, source: Dataset, function: NameAttrList, initial: list[Any], captured: list[Any]
    ) -> None:
        super().__init__(source)
        self.function, self.initial, self.captured = function, initial, captured

    def iterate(self) -> ElementIterator:
        dataset, source = self, self.source.iterate()

        class Scanning(ElementIterator):
            state = list(dataset.initial)

            async def next(self, ctx: KernelContext) -> Element | None:
                element = await source.next(ctx)
                if element is None:
                    return None
                results = await ctx.call_function(
                    dataset.function, [*self.state, *element, *dataset.captured]
                )
                count = len(self.state)
                if len(results) < count:
                    raise errors.InvalidArgumentError(
                        f"The scan function returned {len(results)} values; the state has {count} components"
                    )
                self.state = results[:count]
                return results[count:]

        return Scanning()


class TakeWhile(_Wrapping):
    """The elements up to the first for which `predicate(element..., captured...)` is false."""

    def __init__(self, source: Dataset, predicate: NameAttrList, captured: list[Any]) -> None:
        super().__init__(source)
        self.predicate, self.captured = predicate, captured

    def iterate(self) -> ElementIterator:
        dataset, source = self, self.source.iterate()

        class TakingWhile(ElementIterator):
            ended = False

            async def next(self, ctx: KernelContext) -> Element | None:
                if self.ended:
                    return None
                element = await source.next(ctx)
                if element is not None:
                    (keep,) = await ctx.call_function(dataset.predicate, [*element, *dataset.captured])
                    if _predicate_value(keep):
                        return element
                self.ended = True
                return None

        return TakingWhile()


def _predicate_value(value: Any) -> bool:
    array = np.asarray(value)
    if array.shape != () or array.dtype != np.bool_:
        raise errors.InvalidArgumentError("The take_while predicate must return a scalar bool tensor")
    return bool(array)


class Interleave(_Wrapping):
    """`f(element..., captured...)` gives a dataset per input element; the output takes
    `block_length` elements from each of `cycle_length` of them in turn (TensorFlow's
    deterministic order: a slot whose dataset ends passes its turn on and is refilled
    from the input when its turn comes again). `flat_map` is a cycle of one."""

    def __init__(
        self,
        source: Dataset,
        function: NameAttrList,
        captured: list[Any],
        cycle_length: int,
        block_length: int,
    ) -> None:
        super().__init__(source)
        if not 0 < cycle_length <= MAX_INTERLEAVE_CYCLE:
            raise errors.InvalidArgumentError(
                f"cycle_length must be greater than zero (and at most {MAX_INTERLEAVE_CYCLE}), "
                f"got {cycle_length}"
            )
        if block_length <= 0:
            raise errors.InvalidArgumentError(f"block_length must be greater than zero, got {block_length}")
        self.function, self.captured = function, captured
        self.cycle_length, self.block_length = cycle_length, block_length

    def iterate(self) -> ElementIterator:
        dataset, source = self, self.source.iterate()

        class Interleaving(ElementIterator):
            def __init__(self) -> None:
                self.slots: list[ElementIterator | None] = [None] * dataset.cycle_length
                self.slot = self.taken = 0  # whose turn, and how many of its block it gave
                self.input_ended = False

            def pass_turn(self) -> None:
                self.slot = (self.slot + 1) % dataset.cycle_length
                self.taken = 0

            async def next(self, ctx: KernelContext) -> Element | None:
                while True:
                    current = self.slots[self.slot]
                    if current is not None:
                        element = await current.next(ctx)
                        if element is None:
                            self.slots[self.slot] = None
                            self.pass_turn()
                            continue
                        self.taken += 1
                        if self.taken == dataset.block_length:
                            self.pass_turn()
                        return element
                    if not self.input_ended:
                        element = await source.next(ctx)
                        if element is not None:
                            (made,) = await ctx.call_function(dataset.function, [*element, *dataset.captured])
                            self.slots[self.slot] = _dataset(made).iterate()
                            continue
                        self.input_ended = True
                    if all(slot is None for slot in self.slots):
                        return None
                    self.pass_turn()

        return Interleaving()


class Zip(Dataset):
    def __init__(self, sources: list[Dataset]) -> None:
        self.sources = sources

    def iterate(self) -> ElementIterator:
        sources = [source.iterate() for source in self.sources]

        class Zipping(ElementIterator):
            async def next(self, ctx: KernelContext) -> Element | None:
                out: Element = []
                for source in sources:
                    element = await source.next(ctx)
                    if element is None:
                        return None
                    out.extend(element)
                return out

        return Zipping()


# --------------------------------------------------------------------------- dataset kernels


class _DatasetKernel(OpKernel):
    runs_on_loop = True  # builds a description; elements are made by IteratorGetNext

    def make(self, inputs: list[Any]) -> Dataset:
        raise NotImplementedError

    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        return [_wrap(self.make(inputs))]


@register_kernel("TensorSliceDataset")
class TensorSliceDatasetKernel(_DatasetKernel):
    def make(self, inputs: list[Any]) -> Dataset:
        return TensorSlices([np.asarray(c) for c in inputs])


@register_kernel("TensorDataset")
class TensorDatasetKernel(_DatasetKernel):
    def make(self, inputs: list[Any]) -> Dataset:
        return Tensors(list(inputs))


@register_kernel("RangeDataset")
class RangeDatasetKernel(_DatasetKernel):
    def make(self, inputs: list[Any]) -> Dataset:
        start, stop, step = (
            _count(v, name) for v, name in zip(inputs, ("start", "stop", "step"), strict=True)
        )
        types = self.node.attr["output_types"].list.type
        return Range(start, stop, step, as_numpy_dtype(types[0]) if types else np.dtype(np.int64))


@register_kernel("BatchDatasetV2")
class BatchDatasetV2Kernel(_DatasetKernel):
    def make(self, inputs: list[Any]) -> Dataset:
        source, size, drop = inputs
        return Batch(_dataset(source), _count(size, "batch_size"), bool(np.asarray(drop)))


@register_kernel("PaddedBatchDatasetV2")
class PaddedBatchDatasetV2Kernel(_DatasetKernel):
    """`(dataset, batch_size, padded_shapes (N), padding_values (N), drop_remainder)`."""

    has_drop_remainder = True

    def make(self, inputs: list[Any]) -> Dataset:
        count = self.attr_int("N")
        expected = 2 + 2 * count + self.has_drop_remainder
        if count < 1 or len(inputs) != expected:
            raise errors.InvalidArgumentError(
                f"{self.op} takes {expected} inputs for N={count}, got {len(inputs)}"
            )
        shapes = []
        for value in inputs[2 : 2 + count]:
            array = np.asarray(value)
            if array.ndim != 1 or array.dtype.kind not in "iu":
                raise errors.InvalidArgumentError("Each padded shape must be an integer vector")
            shapes.append(tuple(int(d) for d in array))
        drop = bool(np.asarray(inputs[-1])) if self.has_drop_remainder else False
        return PaddedBatch(
            _dataset(inputs[0]),
            _count(inputs[1], "batch_size"),
            shapes,
            [np.asarray(v) for v in inputs[2 + count : 2 + 2 * count]],
            drop,
        )


@register_kernel("PaddedBatchDataset")
class PaddedBatchDatasetKernel(PaddedBatchDatasetV2Kernel):
    """`(dataset, batch_size, padded_shapes (N), padding_values (N))`: never drops a remainder."""

    has_drop_remainder = False


@register_kernel("UnbatchDataset")
class UnbatchDatasetKernel(_DatasetKernel):
    def make(self, inputs: list[Any]) -> Dataset:
        return Unbatch(_dataset(inputs[0]))


@register_kernel("CacheDataset")
class CacheDatasetKernel(_DatasetKernel):
    """`(dataset, filename)`, and `CacheDatasetV2`'s `(dataset, filename, cache)`: in memory only."""

    def make(self, inputs: list[Any]) -> Dataset:
        filename = np.asarray(inputs[1], dtype=object)
        if filename.shape != () or filename[()] not in (b"", ""):
            raise errors.UnimplementedError(
                "distserver caches datasets in memory only: Dataset.cache(filename) with a file is not "
                "supported; call cache() without a filename"
            )
        return Cache(_dataset(inputs[0]))


@register_kernel("CacheDatasetV2")
class CacheDatasetV2Kernel(CacheDatasetKernel):
    pass


@register_kernel("DummyMemoryCache")
class DummyMemoryCacheKernel(OpKernel):
    """`-> handle`: what TF 2 passes to CacheDatasetV2; each cached dataset keeps its own elements."""

    runs_on_loop = True

    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        return [handle_output(ResourceHandle(ctx.device, DEFAULT_CONTAINER, "DummyMemoryCache"))]


@register_kernel("RepeatDataset")
class RepeatDatasetKernel(_DatasetKernel):
    def make(self, inputs: list[Any]) -> Dataset:
        return Repeat(_dataset(inputs[0]), _count(inputs[1], "count"))


@register_kernel("TakeDataset")
class TakeDatasetKernel(_DatasetKernel):
    def make(self, inputs: list[Any]) -> Dataset:
        return Take(_dataset(inputs[0]), _count(inputs[1], "count"))


@register_kernel("SkipDataset")
class SkipDatasetKernel(_DatasetKernel):
    def make(self, inputs: list[Any]) -> Dataset:
        return Skip(_dataset(inputs[0]), _count(inputs[1], "count"))


@register_kernel("PrefetchDataset")
class PrefetchDatasetKernel(_DatasetKernel):
    def make(self, inputs: list[Any]) -> Dataset:
        return Prefetch(_dataset(inputs[0]), _count(inputs[1], "buffer_size"))


@register_kernel("ShuffleDataset")
class ShuffleDatasetKernel(_DatasetKernel):
    def make(self, inputs: list[Any]) -> Dataset:
        source, buffer_size, seed, seed2 = inputs
        return Shuffle(
            _dataset(source),
            _count(buffer_size, "buffer_size"),
            _count(seed, "seed"),
            _count(seed2, "seed2"),
            self.attr_bool("reshuffle_each_iteration", True),
        )


@register_kernel("MapDataset")
class MapDatasetKernel(_DatasetKernel):
    def make(self, inputs: list[Any]) -> Dataset:
        return Map(_dataset(inputs[0]), self.node.attr["f"].func, list(inputs[1:]), keep=False)


@register_kernel("ParallelMapDatasetV2")
class ParallelMapDatasetV2Kernel(_DatasetKernel):
    """`map(f, num_parallel_calls=n)`: `(dataset, other_arguments..., num_parallel_calls)`.

    Elements are made one at a time, in order (what `deterministic=True` promises, and
    one of the orders `deterministic=False` allows).
    """

    def make(self, inputs: list[Any]) -> Dataset:
        _count(inputs[-1], "num_parallel_calls")
        return Map(_dataset(inputs[0]), self.node.attr["f"].func, list(inputs[1:-1]), keep=False)


@register_kernel("ParallelMapDataset")
class ParallelMapDatasetKernel(ParallelMapDatasetV2Kernel):
    """The V1 op (an int32 `num_parallel_calls`), the same inputs."""


@register_kernel("FilterDataset")
class FilterDatasetKernel(_DatasetKernel):
    def make(self, inputs: list[Any]) -> Dataset:
        return Map(_dataset(inputs[0]), self.node.attr["predicate"].func, list(inputs[1:]), keep=True)


@register_kernel("FlatMapDataset")
class FlatMapDatasetKernel(_DatasetKernel):
    """`(dataset, other_arguments...)`: the elements of `f`'s dataset for each element, in turn."""

    def make(self, inputs: list[Any]) -> Dataset:
        return Interleave(_dataset(inputs[0]), self.node.attr["f"].func, list(inputs[1:]), 1, 1)


@register_kernel("InterleaveDataset")
class InterleaveDatasetKernel(_DatasetKernel):
    """`(dataset, other_arguments..., cycle_length, block_length)`."""

    # Inputs after `other_arguments`: cycle_length, block_length, and (parallel versions)
    # buffer_output_elements, prefetch_input_elements, num_parallel_calls.
    trailing = 2

    def make(self, inputs: list[Any]) -> Dataset:
        end = len(inputs) - self.trailing
        cycle_length = _count(inputs[end], "cycle_length")
        if cycle_length == AUTOTUNE:
            cycle_length = usable_cpus()  # TensorFlow's choice (its schedulable CPUs)
        return Interleave(
            _dataset(inputs[0]),
            self.node.attr["f"].func,
            list(inputs[1:end]),
            cycle_length,
            _count(inputs[end + 1], "block_length"),
        )


@register_kernel("ParallelInterleaveDatasetV4")
class ParallelInterleaveDatasetV4Kernel(InterleaveDatasetKernel):
    """`interleave(..., num_parallel_calls=n)`: one element at a time, in the deterministic order."""

    trailing = 5


@register_kernel("ParallelBatchDataset")
class ParallelBatchDatasetKernel(_DatasetKernel):
    """`batch(..., num_parallel_calls=n)`: `(dataset, batch_size, num_parallel_calls, drop_remainder)`."""

    def make(self, inputs: list[Any]) -> Dataset:
        source, size, _, drop = inputs
        return Batch(_dataset(source), _count(size, "batch_size"), bool(np.asarray(drop)))


@register_kernel("ZipDataset")
class ZipDatasetKernel(_DatasetKernel):
    def make(self, inputs: list[Any]) -> Dataset:
        return Zip([_dataset(v) for v in inputs])


@register_kernel("ScanDataset")
class ScanDatasetKernel(_DatasetKernel):
    """`(dataset, initial_state..., other_arguments...)`, `f` over (state, element)."""

    def make(self, inputs: list[Any]) -> Dataset:
        count = len(self.node.attr["Tstate"].list.type)
        return Scan(
            _dataset(inputs[0]),
            self.node.attr["f"].func,
            list(inputs[1 : 1 + count]),
            list(inputs[1 + count :]),
        )


@register_kernel("TakeWhileDataset")
class TakeWhileDatasetKernel(_DatasetKernel):
    def make(self, inputs: list[Any]) -> Dataset:
        return TakeWhile(_dataset(inputs[0]), self.node.attr["predicate"].func, list(inputs[1:]))


@register_kernel("ReduceDataset")
class ReduceDatasetKernel(OpKernel):
    """`(dataset, initial_state..., other_arguments...) -> state...`: `f(state..., element...,
    captured...)` folded over every element (what `for x in dataset:` becomes in a tf.function).

    Runs in the step, as long as the dataset lasts (the step's cancellation stops it).
    """

    is_async = True
    is_stateful = True  # f may update variables

    def __init__(self, node: NodeDef) -> None:
        super().__init__(node)
        self.function = node.attr["f"].func
        self.count = len(node.attr["Tstate"].list.type)

    async def compute_async(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        try:
            state = list(inputs[1 : 1 + self.count])
            captured = list(inputs[1 + self.count :])
            elements = _dataset(inputs[0]).iterate()
            while (element := await elements.next(ctx)) is not None:
                state = await ctx.call_function(self.function, [*state, *element, *captured])
                if len(state) != self.count:
                    raise errors.InvalidArgumentError(
                        f"The reduce function returned {len(state)} values; "
                        f"the state has {self.count} components"
                    )
                await asyncio.sleep(0)  # a dataset of cheap elements never waits: let the loop breathe
            return state
        except errors.OpError as exc:
            raise errors.with_node(exc, self.name) from None


# --------------------------------------------------------------------------- iterators


class IteratorResource:
    """An iterator: the pass it is on (None before MakeIterator), taken one element at a time."""

    def __init__(self, name: str = "") -> None:
        self.name = name
        self.current: ElementIterator | None = None
        self.lock = asyncio.Lock()
        self.deleted = False  # by DeleteIterator: every later use is NotFoundError

    def check_alive(self) -> None:
        if self.deleted:
            raise errors.NotFoundError(f"Resource {DEFAULT_CONTAINER}/{self.name} does not exist.")

    async def start(self, dataset: Dataset) -> None:
        """Start a new pass over `dataset` (MakeIterator)."""
        async with self.lock:
            self.check_alive()
            self.current = dataset.iterate()

    async def next_or_none(self, ctx: KernelContext) -> Element | None:
        """The next element, or None at the end."""
        async with self.lock:  # one GetNext at a time, in order
            self.check_alive()
            if self.current is None:
                raise errors.FailedPreconditionError(
                    "GetNext() failed because the iterator has not been initialized. Ensure that you "
                    "have run the initializer operation for this iterator before getting the next element."
                )
            return await self.current.next(ctx)

    async def next(self, ctx: KernelContext) -> Element:
        element = await self.next_or_none(ctx)
        if element is None:
            raise errors.OutOfRangeError("End of sequence")
        return element

    def delete(self) -> None:
        self.check_alive()
        self.deleted = True
        self.current = None


@dataclasses.dataclass(frozen=True)
class OwningHandle(ResourceHandle):
    """The handle of an anonymous iterator, holding the iterator itself.

    TF 2's anonymous iterators are owned by their handles: the iterator lives as long
    as a copy of its handle does (here: as long as a value holds this object) and is
    never in the task's resource manager. On the wire it is a plain handle.
    """

    iterator: IteratorResource | None = dataclasses.field(default=None, compare=False, repr=False)


def _iterator(ctx: KernelContext, kernel: OpKernel, value: Any) -> IteratorResource:
    handle = handle_input(kernel, value)
    resource = handle.iterator if isinstance(handle, OwningHandle) else None
    if resource is None:
        resource = ctx.resources.lookup(handle.container, handle.name)
    if not isinstance(resource, IteratorResource):
        raise errors.InvalidArgumentError(f"Resource {handle.container}/{handle.name} is not an iterator")
    return resource


class _IteratorKernel(OpKernel):
    is_async = True
    is_stateful = True

    async def run(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        raise NotImplementedError

    async def compute_async(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        try:
            return await self.run(ctx, inputs)
        except errors.OpError as exc:
            raise errors.with_node(exc, self.name) from None


@register_kernel("IteratorV2")
class IteratorV2Kernel(_IteratorKernel):
    """The handle of iterator `shared_name` (created empty on first use)."""

    def __init__(self, node: NodeDef) -> None:
        super().__init__(node)
        self.container = self.attr_str("container", "") or DEFAULT_CONTAINER
        # Without a shared_name, each kernel (one per session) has an iterator of its own,
        # which goes with the kernel (the session), as in TensorFlow.
        self.owns_iterator = not self.attr_str("shared_name", "")
        self.iterator_name = self.attr_str("shared_name", "") or f"_{next(_anonymous_ids)}_{self.name}"

    async def run(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        def create() -> IteratorResource:
            if self.owns_iterator:
                loop = asyncio.get_running_loop()
                weakref.finalize(self, _forget, loop, ctx.resources, self.container, self.iterator_name)
            return IteratorResource(self.iterator_name)

        resource = ctx.resources.lookup_or_create(self.container, self.iterator_name, create)
        if not isinstance(resource, IteratorResource):
            raise errors.InvalidArgumentError(
                f"Resource {self.container}/{self.iterator_name} is not an iterator"
            )
        return [handle_output(ResourceHandle(ctx.device, self.container, self.iterator_name))]


def _forget(loop: asyncio.AbstractEventLoop, resources: ResourceManager, container: str, name: str) -> None:
    # A finalizer (any thread, any allocation): the loop drops the iterator, stopping its prefetching.
    def drop() -> None:
        with contextlib.suppress(errors.NotFoundError):  # a Reset dropped it already
            resources.delete(container, name)

    with contextlib.suppress(RuntimeError):  # the loop is closed: nothing runs any more
        loop.call_soon_threadsafe(drop)


@register_kernel("OneShotIterator")
class OneShotIteratorKernel(IteratorV2Kernel):
    """An iterator over the dataset `dataset_factory` returns, made on the first run."""

    def __init__(self, node: NodeDef) -> None:
        super().__init__(node)
        self.factory = node.attr["dataset_factory"].func

    async def run(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        outputs = await super().run(ctx, inputs)
        resource = ctx.resources.lookup(self.container, self.iterator_name)
        async with resource.lock:
            if resource.current is None:
                (dataset,) = await ctx.call_function(self.factory, [])
                resource.current = _dataset(dataset).iterate()
        return outputs


@register_kernel("MakeIterator")
class MakeIteratorKernel(_IteratorKernel):
    """Start a new pass over `dataset` in `iterator` (the initializable iterator's initializer)."""

    async def run(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        dataset = _dataset(inputs[0])
        await _iterator(ctx, self, inputs[1]).start(dataset)
        return []


def _check_components(kernel: OpKernel, element: Element) -> Element:
    expected = len(kernel.node.attr["output_types"].list.type)
    if expected and len(element) != expected:
        raise errors.InvalidArgumentError(
            f"The iterator's elements have {len(element)} components; output_types lists {expected}"
        )
    return element


@register_kernel("IteratorGetNext")
class IteratorGetNextKernel(_IteratorKernel):
    async def run(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        return _check_components(self, await _iterator(ctx, self, inputs[0]).next(ctx))


@register_kernel("IteratorGetNextAsOptional")
class IteratorGetNextAsOptionalKernel(_IteratorKernel):
    """`iterator -> optional`: the next element, or an empty optional at the end."""

    async def run(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        element = await _iterator(ctx, self, inputs[0]).next_or_none(ctx)
        if element is None:
            return [optional_tensor(OptionalValue(None))]
        return [optional_tensor(OptionalValue(tuple(_check_components(self, element))))]


@register_kernel("AnonymousIteratorV3")
class AnonymousIteratorV3Kernel(_IteratorKernel):
    """`-> handle`: a new iterator each run, owned by its handle (see `OwningHandle`)."""

    async def run(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        return [handle_output(self.new_handle(ctx))]

    def new_handle(self, ctx: KernelContext) -> OwningHandle:
        name = f"AnonymousIterator{next(_anonymous_ids)}"
        return OwningHandle(ctx.device, DEFAULT_CONTAINER, name, iterator=IteratorResource(name))


class IteratorDeleter:
    """The `deleter` of `AnonymousIteratorV2`: keeps its iterator alive while it is held."""

    def __init__(self, iterator: IteratorResource) -> None:
        self.iterator = iterator

    def to_variant_proto(self) -> VariantTensorDataProto:
        """A deleter has no wire form, as in TensorFlow: it stays with its iterator."""
        raise errors.UnimplementedError("An iterator's deleter cannot be sent to another task or fetched")


@register_kernel("AnonymousIteratorV2")
class AnonymousIteratorV2Kernel(AnonymousIteratorV3Kernel):
    """`-> (handle, deleter)`: as V3; `DeleteIterator` takes both."""

    async def run(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        handle = self.new_handle(ctx)
        deleter = np.empty((), dtype=object)
        deleter[()] = IteratorDeleter(handle.iterator)  # type: ignore[arg-type]
        return [handle_output(handle), deleter]


@register_kernel("DeleteIterator")
class DeleteIteratorKernel(_IteratorKernel):
    """`(handle, deleter) -> ()`: the iterator is gone; later uses of its handle fail."""

    async def run(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        handle = handle_input(self, inputs[0])
        if isinstance(handle, OwningHandle):
            _iterator(ctx, self, inputs[0]).delete()
        else:
            _iterator(ctx, self, inputs[0])  # an iterator, not another resource
            ctx.resources.delete(handle.container, handle.name)
        return []


@register_kernel("IteratorToStringHandle")
class IteratorToStringHandleKernel(OpKernel):
    """The iterator's handle as a string (a serialized ResourceHandleProto, as TensorFlow's)."""

    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        handle = handle_input(self, inputs[0])
        return [np.asarray(handle.to_proto().SerializeToString(), dtype=object)]


@register_kernel("IteratorFromStringHandleV2")
class IteratorFromStringHandleV2Kernel(OpKernel):
    def compute(self, ctx: KernelContext, inputs: list[Any]) -> list[Any]:
        text = np.asarray(inputs[0], dtype=object)
        data = text[()] if text.shape == () else None
        if not isinstance(data, bytes):
            raise errors.InvalidArgumentError("string_handle must be a scalar string")
        try:
            proto = ResourceHandleProto.FromString(data)
        except Exception:
            raise errors.InvalidArgumentError("Could not parse an iterator string handle") from None
        return [handle_output(ResourceHandle.from_proto(proto))]
