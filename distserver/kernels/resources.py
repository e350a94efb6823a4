"""Per-task state that outlives a step: variables, queues, and the manager holding them.

A `ResourceManager` maps `(container, name)` to a resource object, as TensorFlow's
`ResourceMgr` does. Containers group resources so that `Session.reset(target,
containers)` can drop them together; the empty container name means the default
container, `"localhost"`, which is where TensorFlow puts every resource whose op
names no container.

Every method is thread-safe: sync kernels run in worker threads while async ones run
on the event loop, and both reach the same manager.

Resource types: `VariableResource` (resource variables, see `kernels.state`),
`LegacyVariable` (TF 1.x reference variables, see `kernels.ref_variables`),
`FIFOQueue` (see `kernels.queue`) and the gradient accumulators of
`kernels.accumulators`.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import enum
import sys
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from distserver import errors
from distserver.kernels._common import shape_str, type_name

DEFAULT_CONTAINER = "localhost"
_UINT64 = (1 << 64) - 1


def _container_name(container: str) -> str:
    return container or DEFAULT_CONTAINER


class ResourceManager:
    """Thread-safe map from container name to `{resource name: resource}`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._containers: dict[str, dict[str, Any]] = {}
        # Counts the removals (`delete`, `clear`): a resource found while it had the same
        # value is still the one its name names (kernels keep what they found, see
        # `state._VariableKernel`).
        self.generation = 0

    def lookup(self, container: str, name: str) -> Any:
        """The resource `container/name`.

        Raises:
            NotFoundError: there is no such container or no such resource in it.
        """
        container = _container_name(container)
        with self._lock:
            resources = self._containers.get(container)
            if resources is None:
                raise errors.NotFoundError(
                    f"Container {container} does not exist. (Could not find resource: {container}/{name})"
                )
            try:
                return resources[name]
            except KeyError:
                raise errors.NotFoundError(f"Resource {container}/{name} does not exist.") from None

    def find(self, container: str, name: str) -> Any | None:
        """The resource `container/name`, or None (`lookup` without its errors)."""
        with self._lock:
            resources = self._containers.get(container or DEFAULT_CONTAINER)
            return None if resources is None else resources.get(name)

    def lookup_or_create(self, container: str, name: str, factory: Callable[[], Any]) -> Any:
        """The resource `container/name`, created by `factory()` first if it is absent.

        `factory` runs under the manager's lock, so concurrent callers create the
        resource once; it must be quick and must not call back into the manager. The
        result may be of another type than `factory` makes (a resource of that name
        already existed): callers check.
        """
        container = _container_name(container)
        with self._lock:
            resources = self._containers.setdefault(container, {})
            if name not in resources:
                resources[name] = factory()
            return resources[name]

    def create(self, container: str, name: str, resource: Any) -> None:
        """Add `resource` as `container/name`.

        Raises:
            AlreadyExistsError: a resource of that name is already in the container.
        """
        container = _container_name(container)
        with self._lock:
            resources = self._containers.setdefault(container, {})
            if name in resources:
                raise errors.AlreadyExistsError(f"Resource {container}/{name} already exists.")
            resources[name] = resource

    def delete(self, container: str, name: str) -> None:
        """Remove `container/name`. Raises NotFoundError when it does not exist."""
        container = _container_name(container)
        with self._lock:
            resources = self._containers.get(container)
            if resources is None or name not in resources:
                raise errors.NotFoundError(f"Resource {container}/{name} does not exist.")
            del resources[name]
            if not resources:
                del self._containers[container]
            self.generation += 1

    def clear(self, containers: Sequence[str]) -> None:
        """Drop every resource in `containers`; an empty list means the default container.

        Unknown container names are ignored, as TensorFlow's `Session.reset` does.
        """
        names = [_container_name(c) for c in containers] or [DEFAULT_CONTAINER]
        with self._lock:
            for container in names:
                self._containers.pop(container, None)
            self.generation += 1

    def containers(self) -> list[str]:
        """Sorted names of the containers that hold at least one resource."""
        with self._lock:
            return sorted(name for name, resources in self._containers.items() if resources)


class VariableResource:
    """The state of one resource variable (TensorFlow's `Var`).

    `value` is `None` until the first assignment. The stored array is owned by the
    variable, or a view of the flat array a grouped update keeps its variables in
    (`kernels.state._VariableArena`, which alone writes there). Updates build a new
    array and replace it (under `lock`), so a reader may
    keep the array it got without copying it while other steps keep updating the
    variable; only an update that finds the array unshared (`unshared`: nothing but
    the variable references it) writes into it instead, as TensorFlow forwards a buffer
    whose reference count is one. Readers that keep the array take it with `read()`
    (under `lock`), so an in-place update never runs while a reader is getting its
    reference. The stored array is read-only between updates, which turns an
    accidental in-place write by a caller into an error instead of silent corruption.
    """

    def __init__(self, dtype: np.dtype[Any], shape: tuple[int | None, ...] | None = None) -> None:
        self.dtype = np.dtype(dtype)
        self.shape = shape  # declared by VarHandleOp; informational, TF does not enforce it
        self.value: np.ndarray | None = None
        # Held for every read-modify-write so concurrent updates never lose one.
        self.lock = threading.Lock()

    @property
    def is_initialized(self) -> bool:
        return self.value is not None

    def assign(self, value: np.ndarray) -> None:
        """Store a private copy of `value` (later changes of the caller's array don't show)."""
        self.replace(np.array(value, dtype=self.dtype, copy=True))

    def read(self) -> np.ndarray | None:
        """The stored array, for a reader that keeps it (see the class docstring)."""
        with self.lock:
            return self.value

    def unshared(self) -> bool:
        """With `lock` held: whether the stored array may be updated in place.

        True when it owns its memory and nothing but this variable references it: no
        step holds it (a ReadVariableOp's output waiting for a consumer, a fetch, a
        value waiting in a rendezvous or being serialised, a view of it), since every
        such holder counts in its reference count.
        """
        value = self.value
        # References: `self.value`, `value` and getrefcount's argument.
        return value is not None and value.flags.owndata and sys.getrefcount(value) == 3

    def replace(self, value: np.ndarray) -> None:
        """Store `value` itself; the caller hands over an array nobody else references."""
        value = np.asarray(value)
        value.flags.writeable = False
        self.value = value

    def __repr__(self) -> str:
        shape = None if self.value is None else self.value.shape
        return f"<VariableResource dtype={self.dtype} shape={shape}>"


class LegacyVariable(VariableResource):
    """The state of one TF 1.x reference variable (`VariableV2`, TensorFlow's `LegacyVar`).

    Stored like a resource variable, but under its own key (`legacy_variable_key`), so a
    resource variable and a reference variable of the same name do not collide, as in
    TensorFlow, where the resource manager keys resources by type and name.
    """


def legacy_variable_key(name: str) -> str:
    """The ResourceManager name a reference variable called `name` is stored under."""
    # TF node names cannot contain ':', so this never equals another resource's name.
    return f"{name}:legacy"


@dataclasses.dataclass(frozen=True, eq=False)
class VariableRef:
    """A reference to a legacy variable: the value of a `float_ref`-typed tensor.

    `VariableV2` outputs one, and `Assign`, `AssignAdd`, the `Apply*` optimizers and
    `IsVariableInitialized` take one and act on the variable itself. Every other
    kernel gets the variable's value instead, read when that kernel runs (the
    registry's dereferencing wrapper does it, as TensorFlow's executor does), so a
    read ordered after an update sees the update.
    """

    variable: LegacyVariable
    name: str  # the variable's node name, for messages

    def __repr__(self) -> str:
        return f"<VariableRef {self.name} {self.variable!r}>"


Element = tuple[np.ndarray, ...]
"""One queue element: a value per component."""

# TensorFlow's QueueBase::kUnbounded: the capacity of a queue created with capacity < 0.
UNBOUNDED_CAPACITY = 2**31 - 1


class _Outcome(enum.Enum):
    NO_PROGRESS = 0
    PROGRESS = 1
    COMPLETE = 2


@dataclasses.dataclass(eq=False)
class _Attempt:
    """One enqueue, dequeue or close waiting its turn (TensorFlow's QueueBase::Attempt)."""

    kind: str  # "enqueue", "dequeue" or "close"
    future: asyncio.Future[None]
    pending: collections.deque[Element] = dataclasses.field(default_factory=collections.deque)
    requested: int = 0
    allow_fewer: bool = False  # DequeueUpTo: a closed queue may give fewer (at least one)
    taken: list[Element] = dataclasses.field(default_factory=list)
    error: errors.OpError | None = None
    done: bool = False


class FIFOQueue:
    """A first-in first-out queue of tuples of tensors (TensorFlow's FIFOQueue).

    Enqueues, dequeues and closes are *attempts* served strictly in arrival order, one
    line for each direction, exactly as TensorFlow's QueueBase does: a blocked
    `dequeue(3)` at the head of the line collects elements as they arrive and a later
    `dequeue(1)` waits behind it; `enqueue` of a batch adds elements as room frees up;
    `close()` waits behind the enqueues that were already pending.

    State is guarded by a `threading.Lock` and waiters are woken through their own event
    loop (`call_soon_threadsafe` from other threads), so any thread may call `size()` or
    `close_and_cancel()`; the waiting methods are coroutines. Cancelling a waiting
    coroutine (or its timeout expiring) withdraws its attempt: a partly collected
    batch goes back to the front of the queue, so no element is ever lost.
    """

    kind = "FIFOQueue"  # in error texts, as TensorFlow names the queue class

    def __init__(
        self,
        name: str,
        component_types: Sequence[np.dtype[Any]],
        shapes: Sequence[tuple[int, ...]] = (),
        capacity: int = -1,
    ) -> None:
        if shapes and len(shapes) != len(component_types):
            raise errors.InvalidArgumentError(
                f"FIFOQueue '{name}' has {len(component_types)} component types but {len(shapes)} shapes"
            )
        self.name = name
        self.component_types = tuple(np.dtype(t) for t in component_types)
        self.shapes = tuple(tuple(s) for s in shapes)  # () means "any shape"
        self.capacity = UNBOUNDED_CAPACITY if capacity < 0 else capacity
        self._lock = threading.Lock()
        self._items: collections.deque[Element] = collections.deque()
        self._closed = False
        self._enqueue_attempts: collections.deque[_Attempt] = collections.deque()
        self._dequeue_attempts: collections.deque[_Attempt] = collections.deque()

    # ---------------------------------------------------------------- inspection

    def size(self) -> int:
        """Number of elements in the queue now."""
        with self._lock:
            return len(self._items)

    @property
    def closed(self) -> bool:
        with self._lock:
            return self._closed

    def matches(
        self, component_types: Sequence[np.dtype[Any]], shapes: Sequence[tuple[int, ...]], capacity: int
    ) -> None:
        """Check that a node asking for this shared queue asks for the same queue.

        Raises:
            InvalidArgumentError: with TensorFlow's "Shared queue ... has ..." text.
        """
        requested = UNBOUNDED_CAPACITY if capacity < 0 else capacity
        if requested != self.capacity:
            raise errors.InvalidArgumentError(
                f"Shared queue '{self.name}' has capacity {self.capacity} "
                f"but requested capacity was {requested}"
            )
        types = tuple(np.dtype(t) for t in component_types)
        if types != self.component_types:
            raise errors.InvalidArgumentError(
                f"Shared queue '{self.name}' has component types {_type_list(self.component_types)} "
                f"but requested component types were {_type_list(types)}"
            )
        if tuple(tuple(s) for s in shapes) != self.shapes:
            raise errors.InvalidArgumentError(
                f"Shared queue '{self.name}' has component shapes {_shape_list(self.shapes)} "
                f"but requested component shapes were {_shape_list(shapes)}"
            )

    def validate_element(self, components: Sequence[np.ndarray]) -> Element:
        """Check one element against the queue's types and shapes; returns it as a tuple."""
        self._validate_types(components)
        for i, (value, shape) in enumerate(zip(components, self.shapes, strict=False)):
            if value.shape != shape:
                raise errors.InvalidArgumentError(
                    f"Shape mismatch in tuple component {i}. Expected {shape_str(shape)}, "
                    f"got {shape_str(value.shape)}"
                )
        return tuple(components)

    def validate_batch(self, components: Sequence[np.ndarray]) -> list[Element]:
        """Check a batch (every component stacked along dimension 0); returns its elements."""
        self._validate_types(components)
        for i, value in enumerate(components):
            if value.ndim == 0:
                raise errors.InvalidArgumentError(
                    f"Enqueuing many elements needs tensors of rank >= 1, but component {i} is a scalar"
                )
        batch = components[0].shape[0]
        for i, value in enumerate(components):
            if self.shapes:
                expected = (batch, *self.shapes[i])
                if value.shape != expected:
                    raise errors.InvalidArgumentError(
                        f"Shape mismatch in tuple component {i}. Expected {shape_str(expected)}, "
                        f"got {shape_str(value.shape)}"
                    )
            elif value.shape[0] != batch:
                raise errors.InvalidArgumentError(
                    "All input tensors must have the same size in the 0th dimension. "
                    f"Component {i} has {value.shape[0]}, and should have {batch}"
                )
        return [tuple(value[j, ...] for value in components) for j in range(batch)]

    def _validate_types(self, components: Sequence[np.ndarray]) -> None:
        if len(components) != len(self.component_types):
            raise errors.InvalidArgumentError(
                f"Wrong number of components in tuple. Expected {len(self.component_types)}, "
                f"got {len(components)}"
            )
        for i, (value, dtype) in enumerate(zip(components, self.component_types, strict=True)):
            if value.dtype != dtype:
                raise errors.InvalidArgumentError(
                    f"Type mismatch in tuple component {i}. Expected {type_name(dtype)}, "
                    f"got {type_name(value.dtype)}"
                )

    # ---------------------------------------------------------------- operations

    async def enqueue(self, elements: Sequence[Element], timeout: float | None = None) -> None:
        """Add `elements` in order, waiting for room when the queue is full.

        Raises:
            CancelledError: the queue is closed (TF: "FIFOQueue '<name>' is closed."), or
                it was closed with `cancel_pending_enqueues` while this call waited.
            DeadlineExceededError: `timeout` seconds passed first; the elements already
                added stay in the queue.
        """
        if not elements:
            return
        attempt = self._new_attempt("enqueue")
        attempt.pending.extend(elements)
        await self._run(attempt, timeout)

    async def dequeue(
        self, count: int = 1, timeout: float | None = None, *, allow_fewer: bool = False
    ) -> list[Element]:
        """Remove and return `count` elements, waiting until that many are available.

        With `allow_fewer` (DequeueUpTo), a closed queue gives what it still holds, if
        anything.

        Raises:
            OutOfRangeError: the queue is closed and holds fewer than `count` elements
                (with `allow_fewer`: none).
            DeadlineExceededError: `timeout` seconds passed first (nothing is removed).
        """
        if count == 0:
            return []
        attempt = self._new_attempt("dequeue")
        attempt.requested = count
        attempt.allow_fewer = allow_fewer
        await self._run(attempt, timeout)
        return attempt.taken

    async def close(self, cancel_pending_enqueues: bool = False) -> None:
        """Close the queue: later enqueues fail, dequeues drain what is left.

        Without `cancel_pending_enqueues` the close waits behind the enqueues already
        pending (they complete first), and closing a closed queue raises AbortedError,
        as in TensorFlow. With it, pending enqueues fail with CancelledError at once.
        """
        if cancel_pending_enqueues:
            self.close_and_cancel()
            return
        await self._run(self._new_attempt("close"), None)

    def close_and_cancel(self) -> None:
        """Close now and fail every pending enqueue; callable from any thread."""
        with self._lock:
            self._closed = True
            cancelled = list(self._enqueue_attempts)
            self._enqueue_attempts.clear()
            for attempt in cancelled:
                attempt.error = errors.CancelledError("Enqueue operation was cancelled")
                attempt.done = True
            finished = cancelled + self._flush_locked()
        wake_waiters(finished)

    # ---------------------------------------------------------------- machinery

    @staticmethod
    def _new_attempt(kind: str) -> _Attempt:
        return _Attempt(kind, asyncio.get_running_loop().create_future())

    def _line(self, attempt: _Attempt) -> collections.deque[_Attempt]:
        return self._dequeue_attempts if attempt.kind == "dequeue" else self._enqueue_attempts

    async def _run(self, attempt: _Attempt, timeout: float | None) -> None:
        with self._lock:
            self._line(attempt).append(attempt)
            finished = self._flush_locked()
        wake_waiters(finished)
        if not attempt.done:
            try:
                async with asyncio.timeout(timeout):
                    await attempt.future
            except BaseException as exc:  # cancelled, or timed out
                self._withdraw(attempt)
                if isinstance(exc, TimeoutError):
                    what = "Dequeue" if attempt.kind == "dequeue" else "Enqueue"
                    raise errors.DeadlineExceededError(
                        f"{what} operation on {self.kind} '{self.name}' timed out after {timeout:g} s"
                    ) from None
                raise
        if attempt.error is not None:
            raise attempt.error

    def _withdraw(self, attempt: _Attempt) -> None:
        with self._lock:
            if not attempt.done:
                self._line(attempt).remove(attempt)
                attempt.done = True
            # A dequeue's elements go back to the front (in order) even when the attempt
            # had completed: its caller is gone and would drop them.
            if attempt.taken:
                self._items.extendleft(reversed(attempt.taken))
                attempt.taken = []
            finished = self._flush_locked()
        wake_waiters(finished)

    def _flush_locked(self) -> list[_Attempt]:
        # TensorFlow's FlushUnlocked: serve both lines until neither makes progress.
        finished: list[_Attempt] = []
        progress = True
        while progress:
            progress = self._serve_locked(self._enqueue_attempts, finished)
            progress = self._serve_locked(self._dequeue_attempts, finished) or progress
        return finished

    def _serve_locked(self, line: collections.deque[_Attempt], finished: list[_Attempt]) -> bool:
        progress = False
        while line:
            attempt = line[0]
            if attempt.kind == "dequeue":
                outcome = self._try_dequeue_locked(attempt)
            elif attempt.kind == "enqueue":
                outcome = self._try_enqueue_locked(attempt)
            else:
                outcome = self._try_close_locked(attempt)
            if outcome is _Outcome.NO_PROGRESS:
                break
            progress = True
            if outcome is _Outcome.PROGRESS:
                break
            line.popleft()
            attempt.done = True
            finished.append(attempt)
        return progress

    def _try_close_locked(self, attempt: _Attempt) -> _Outcome:
        if self._closed:
            attempt.error = errors.AbortedError(f"Queue '{self.name}' is already closed.")
        self._closed = True
        return _Outcome.COMPLETE

    def _try_enqueue_locked(self, attempt: _Attempt) -> _Outcome:
        if self._closed:
            attempt.error = errors.CancelledError(f"{self.kind} '{self.name}' is closed.")
            return _Outcome.COMPLETE
        moved = False
        while attempt.pending and len(self._items) < self.capacity:
            self._items.append(attempt.pending.popleft())
            moved = True
        if not attempt.pending:
            return _Outcome.COMPLETE
        return _Outcome.PROGRESS if moved else _Outcome.NO_PROGRESS

    def _try_dequeue_locked(self, attempt: _Attempt) -> _Outcome:
        missing = attempt.requested - len(attempt.taken)
        if self._closed and len(self._items) < missing:
            if attempt.allow_fewer and (attempt.taken or self._items):
                while self._items:
                    attempt.taken.append(self._pop_locked())
                return _Outcome.COMPLETE
            # Not enough will ever arrive: put back what was collected, report the shortfall.
            self._items.extendleft(reversed(attempt.taken))
            attempt.taken = []
            attempt.error = errors.OutOfRangeError(
                f"{self.kind} '{self.name}' is closed and has insufficient elements "
                f"(requested {attempt.requested}, current size {len(self._items)})"
            )
            return _Outcome.COMPLETE
        moved = min(missing, self._available_locked())
        attempt.taken.extend(self._pop_locked() for _ in range(moved))
        if len(attempt.taken) == attempt.requested:
            return _Outcome.COMPLETE
        return _Outcome.PROGRESS if moved else _Outcome.NO_PROGRESS

    def _available_locked(self) -> int:
        """How many elements a dequeue may take now."""
        return len(self._items)

    def _pop_locked(self) -> Element:
        """The next element a dequeue takes."""
        return self._items.popleft()

    def __repr__(self) -> str:
        return f"<{self.kind} {self.name!r} size={self.size()} capacity={self.capacity} closed={self.closed}>"


class RandomShuffleQueue(FIFOQueue):
    """A queue whose dequeues take elements in random order (TensorFlow's RandomShuffleQueue).

    While it is open, a dequeue leaves at least `min_after_dequeue` elements in it (so
    every element taken was drawn from a well-mixed pool); once it is closed, the rest
    can be taken. `seed`/`seed2` make the order reproducible (not TensorFlow's order).
    """

    kind = "RandomShuffleQueue"

    def __init__(
        self,
        name: str,
        component_types: Sequence[np.dtype[Any]],
        shapes: Sequence[tuple[int, ...]] = (),
        capacity: int = -1,
        *,
        min_after_dequeue: int = 0,
        seed: int = 0,
        seed2: int = 0,
    ) -> None:
        super().__init__(name, component_types, shapes, capacity)
        self.min_after_dequeue = min_after_dequeue
        key = [seed & _UINT64, seed2 & _UINT64] if seed or seed2 else None
        self._generator = np.random.Generator(np.random.Philox(key=key))

    def _available_locked(self) -> int:
        if self._closed:
            return len(self._items)
        return max(0, len(self._items) - self.min_after_dequeue)

    def _pop_locked(self) -> Element:
        index = int(self._generator.integers(len(self._items)))
        self._items.rotate(-index)
        element = self._items.popleft()
        self._items.rotate(index)
        return element


def wake_waiters(attempts: Iterable[Any]) -> None:
    """Resolve the `future` of each finished attempt (a queue's dequeue or enqueue, an
    accumulator's take) on the loop that waits on it; directly when we are on it."""
    try:
        running: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    for attempt in attempts:
        loop = attempt.future.get_loop()
        if loop is running:
            _resolve(attempt.future)
        else:
            try:
                loop.call_soon_threadsafe(_resolve, attempt.future)
            except RuntimeError:  # that loop is closed: nobody waits any more
                pass


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():  # a cancelled waiter already gave up on it
        future.set_result(None)


def _type_list(types: Sequence[np.dtype[Any]]) -> str:
    return ", ".join(type_name(t) for t in types)


def _shape_list(shapes: Sequence[tuple[int, ...]]) -> str:
    return "[" + ", ".join(shape_str(s) for s in shapes) + "]"
