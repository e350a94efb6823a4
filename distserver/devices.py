"""Device names and rendezvous keys, in TensorFlow's formats.

A full device name names one device of one task of a cluster::

    /job:worker/replica:0/task:1/device:CPU:0

`DeviceSpec` parses such names and their partial forms (``"/job:ps"``,
``"/device:GPU:*"``, TensorFlow's legacy ``"/cpu:0"``) and merges them the way nested
``tf.device`` scopes do. A rendezvous key names one tensor crossing from one device to
another in a step::

    /job:ps/replica:0/task:0/device:CPU:0;00a3f1c2d4e5f607;/job:worker/replica:0/task:0/device:CPU:0;edge_7_Variable/read;0:0

that is ``src_device;src_incarnation;dst_device;tensor_name;frame_id:iter_id`` with the
incarnation as 16 lowercase hex digits (`rendezvous_key`, `parse_rendezvous_key`).
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Callable
from typing import Final, TypeVar

from distserver import errors

__all__ = [
    "DeviceSpec",
    "RendezvousKey",
    "full_device_name",
    "parse_rendezvous_key",
    "rendezvous_key",
    "task_name",
    "task_of_device",
]

_Parsed = TypeVar("_Parsed")
# The parses below are cached by their text (device names and rendezvous keys repeat
# every step), but only texts of up to this many characters: peers choose many of
# these strings (a RecvTensor's key), and a cache of long ones would hold what a peer
# sent (16,384 keys of 1 MiB: ~40 GB). Longer texts are parsed every time.
CACHED_TEXT_CHARS: Final = 1024


def _cached_when_short(maxsize: int) -> Callable[[Callable[[str], _Parsed]], Callable[[str], _Parsed]]:
    """`functools.lru_cache(maxsize)` for texts of up to `CACHED_TEXT_CHARS`."""

    def wrap(parse: Callable[[str], _Parsed]) -> Callable[[str], _Parsed]:
        cached = functools.lru_cache(maxsize=maxsize)(parse)

        @functools.wraps(parse)
        def lookup(text: str) -> _Parsed:
            return cached(text) if len(text) <= CACHED_TEXT_CHARS else parse(text)

        return lookup

    return wrap


_NAME: Final = r"[A-Za-z][A-Za-z0-9_]*"
_NAME_RE: Final = re.compile(_NAME)
_NUMBER_OR_STAR: Final = r"(\d+|\*)"
# One component of a device name, with or without its leading "/". "device:" and the
# bare "TYPE:N" forms are tried after job/replica/task, so those keywords win.
_COMPONENT_RE: Final = re.compile(
    rf"/?(?:job:(?P<job>{_NAME}|\*)"
    rf"|replica:(?P<replica>{_NUMBER_OR_STAR})"
    rf"|task:(?P<task>{_NUMBER_OR_STAR})"
    rf"|device:(?P<type>{_NAME}|\*)(?::(?P<index>{_NUMBER_OR_STAR}))?"
    rf"|(?!(?:job|replica|task|device):)(?P<bare_type>{_NAME}):(?P<bare_index>{_NUMBER_OR_STAR}))"
)
# TensorFlow spells these device types in upper case; the legacy "/cpu:0" forms use
# lower case.
_UPPER_CASE_TYPES: Final = frozenset({"cpu", "gpu", "tpu"})
_EXPECTED_FORM: Final = "/job:<name>/replica:<int>/task:<int>/device:<TYPE>:<int or *>, any part optional"

_UINT64_MASK: Final = (1 << 64) - 1
_HEX_RE: Final = re.compile(r"[0-9a-fA-F]{1,16}")
_FRAME_ITER_RE: Final = re.compile(r"(\d+):(\d+)")


@dataclasses.dataclass(frozen=True)
class DeviceSpec:
    """A possibly partial device name, such as ``/job:ps/task:0`` or ``/device:GPU:1``.

    Each field is ``None`` when the name leaves it unset (TensorFlow's ``*``). A
    ``device_type`` with ``device_index`` ``None`` prints as ``/device:TYPE:*``.

    Attributes:
        job: Job name, e.g. ``"worker"``.
        replica: Replica number.
        task: Task index within the job.
        device_type: Device type, e.g. ``"CPU"`` or ``"GPU"``.
        device_index: Index of the device of that type within the task.

    Raises:
        ValueError: When a field is malformed (a job or type that is not a name, a
            negative number).
    """

    job: str | None = None
    replica: int | None = None
    task: int | None = None
    device_type: str | None = None
    device_index: int | None = None

    def __post_init__(self) -> None:
        for label, name in (("job", self.job), ("device type", self.device_type)):
            if name is not None and not _NAME_RE.fullmatch(name):
                raise ValueError(
                    f"Invalid {label} {name!r}: must start with a letter and hold only letters, "
                    "digits and '_'"
                )
        for label, number in (
            ("replica", self.replica),
            ("task", self.task),
            ("device index", self.device_index),
        ):
            if number is not None and (isinstance(number, bool) or not isinstance(number, int) or number < 0):
                raise ValueError(f"Invalid {label} {number!r}: must be a non-negative int or None")

    @classmethod
    def from_string(cls, spec: str) -> DeviceSpec:
        """Parse a device name in any form TensorFlow accepts (results are cached).

        Components may come in any order, each at most once:

        * ``/job:<name>``, ``/replica:<n>``, ``/task:<n>`` (``*`` for unset);
        * ``/device:<TYPE>:<n>``, ``/device:<TYPE>:*``, ``/device:<TYPE>``,
          ``/device:*:<n>``;
        * the legacy and short forms ``/cpu:0``, ``/GPU:1``, ``CPU:0``, ``gpu:*``.

        The leading ``/`` of a component may be left out (``"job:ps/task:0"``, as
        `tf.DeviceSpec` allows). ``cpu``, ``gpu`` and ``tpu`` are upper-cased; other
        device types are kept as written. ``""`` and ``"/"`` give an empty spec.

        Args:
            spec: The device name.

        Returns:
            The parsed spec.

        Raises:
            ValueError: When `spec` is not a device name; the message names it and the
                expected form.
        """
        if cls is DeviceSpec:
            return _parse_device_spec(spec)
        return cls._parse(spec)

    @classmethod
    def _parse(cls, spec: str) -> DeviceSpec:
        fields: dict[str, str | int | None] = {}
        position = 0 if spec != "/" else 1
        while position < len(spec):
            # After the first component, every component starts with "/".
            if position and spec[position] != "/":
                raise cls._malformed(spec)
            match = _COMPONENT_RE.match(spec, position)
            if match is None or match.end() == position:
                raise cls._malformed(spec)
            position = match.end()
            if position < len(spec) and spec[position] != "/":
                raise cls._malformed(spec)
            groups = match.groupdict()
            parsed: dict[str, str | int | None] = {}
            if groups["job"] is not None:
                parsed["job"] = None if groups["job"] == "*" else groups["job"]
            elif groups["replica"] is not None:
                parsed["replica"] = _number_or_none(groups["replica"])
            elif groups["task"] is not None:
                parsed["task"] = _number_or_none(groups["task"])
            else:
                device_type = groups["type"] if groups["type"] is not None else groups["bare_type"]
                index = groups["index"] if groups["type"] is not None else groups["bare_index"]
                if device_type == "*":
                    parsed["device_type"] = None
                elif device_type.lower() in _UPPER_CASE_TYPES:
                    parsed["device_type"] = device_type.upper()
                else:
                    parsed["device_type"] = device_type
                parsed["device_index"] = None if index is None else _number_or_none(index)
            for key, value in parsed.items():
                if key in fields:
                    raise ValueError(
                        f"Malformed device name {spec!r}: {key.replace('_', ' ')} given more than once"
                    )
                fields[key] = value
        return cls(**fields)  # type: ignore[arg-type]

    @staticmethod
    def _malformed(spec: str) -> ValueError:
        return ValueError(f"Malformed device name {spec!r}: expected {_EXPECTED_FORM}")

    def to_string(self) -> str:
        """Return the canonical name: ``/job:J/replica:R/task:T/device:TYPE:N``.

        Only the set parts appear (``""`` when none is). A type without an index
        prints as ``/device:TYPE:*`` and an index without a type as ``/device:*:N``,
        as TensorFlow prints them.
        """
        parts: list[str] = []
        if self.job is not None:
            parts.append(f"/job:{self.job}")
        if self.replica is not None:
            parts.append(f"/replica:{self.replica}")
        if self.task is not None:
            parts.append(f"/task:{self.task}")
        if self.device_type is not None or self.device_index is not None:
            device_type = "*" if self.device_type is None else self.device_type
            index = "*" if self.device_index is None else str(self.device_index)
            parts.append(f"/device:{device_type}:{index}")
        return "".join(parts)

    def __str__(self) -> str:
        return self.to_string()

    def make_merged_spec(self, other: DeviceSpec | str) -> DeviceSpec:
        """Return this spec with every field that `other` sets replaced by other's.

        This is how nested device scopes combine: ``outer.make_merged_spec(inner)``.
        Fields merge one by one, as in `tf.DeviceSpec`: an inner ``/device:CPU:*`` under
        an outer ``/device:GPU:1`` gives ``/device:CPU:1``.

        Args:
            other: The spec whose set fields win (a string is parsed first).
        """
        if isinstance(other, str):
            other = DeviceSpec.from_string(other)
        return DeviceSpec(
            job=other.job if other.job is not None else self.job,
            replica=other.replica if other.replica is not None else self.replica,
            task=other.task if other.task is not None else self.task,
            device_type=other.device_type if other.device_type is not None else self.device_type,
            device_index=other.device_index if other.device_index is not None else self.device_index,
        )

    @property
    def is_fully_specified(self) -> bool:
        """Whether every field is set, so the spec names exactly one device."""
        return None not in (self.job, self.replica, self.task, self.device_type, self.device_index)

    def task_spec(self) -> DeviceSpec:
        """Return the spec of the task part only (job, replica, task)."""
        return DeviceSpec(job=self.job, replica=self.replica, task=self.task)


def _number_or_none(text: str) -> int | None:
    return None if text == "*" else int(text)


def full_device_name(
    job: str, task: int, *, replica: int = 0, device_type: str = "CPU", index: int = 0
) -> str:
    """Return a full device name, e.g. ``/job:worker/replica:0/task:1/device:CPU:0``.

    Raises:
        ValueError: When a part is malformed.
    """
    return DeviceSpec(job, replica, task, device_type, index).to_string()


def task_name(job: str, task: int, replica: int = 0) -> str:
    """Return a task's name, e.g. ``/job:worker/replica:0/task:1``.

    Raises:
        ValueError: When a part is malformed.
    """
    return DeviceSpec(job, replica, task).to_string()


@_cached_when_short(maxsize=4096)
def task_of_device(name: str) -> str:
    """Return the name of the task a device belongs to: its name up to the task.

    ``/job:ps/replica:0/task:1/device:CPU:0`` gives ``/job:ps/replica:0/task:1``.
    This is how TensorFlow's partitioner groups nodes by worker.

    Args:
        name: A device name that sets job, replica and task.

    Raises:
        ValueError: When `name` is malformed or does not set job, replica and task.
    """
    spec = DeviceSpec.from_string(name).task_spec()
    if spec.job is None or spec.replica is None or spec.task is None:
        raise ValueError(
            f"Device name {name!r} does not name a task: expected /job:<name>/replica:<int>/task:<int>"
        )
    return spec.to_string()


@dataclasses.dataclass(frozen=True, slots=True)
class RendezvousKey:
    """A parsed rendezvous key: its parts, its wire text, and the two tasks it joins.

    Made once where a key is born (a `_Send`/`_Recv` kernel, a plan) or arrives
    (`parse_rendezvous_key` on a RecvTensor or RunGraph request) and passed around as
    is, so nothing downstream splits the text again. Keys compare and hash by their
    parts; `text` is what travels on the wire.

    Raises:
        errors.InvalidArgumentError: ``Invalid rendezvous key: <text>`` when a device
            does not name a task.
    """

    src_device: str
    """Full name of the sending device."""
    src_incarnation: int
    """Incarnation of the sending device, as an unsigned 64-bit number."""
    dst_device: str
    """Full name of the receiving device."""
    tensor_name: str
    """Name of the tensor, e.g. ``"x:0"`` or ``"edge_7_Variable/read"``."""
    frame_id: int = 0
    """Frame of the value (0 outside loops)."""
    iter_id: int = 0
    """Loop iteration of the value (0 outside loops)."""
    text: str = dataclasses.field(default="", compare=False, repr=False)
    """The key as TensorFlow writes it (`rendezvous_key`); built from the parts when not given."""
    src_task: str = dataclasses.field(init=False, compare=False, repr=False)
    """The sending task, ``/job:<job>/replica:<r>/task:<t>``."""
    dst_task: str = dataclasses.field(init=False, compare=False, repr=False)
    """The receiving task."""

    def __post_init__(self) -> None:
        if not self.text:
            text = rendezvous_key(
                self.src_device,
                self.src_incarnation,
                self.dst_device,
                self.tensor_name,
                self.frame_id,
                self.iter_id,
            )
            object.__setattr__(self, "text", text)
            object.__setattr__(self, "src_incarnation", self.src_incarnation & _UINT64_MASK)
        try:
            object.__setattr__(self, "src_task", task_of_device(self.src_device))
            object.__setattr__(self, "dst_task", task_of_device(self.dst_device))
        except ValueError as exc:
            raise errors.InvalidArgumentError(f"Invalid rendezvous key: {self.text} ({exc})") from None

    def __str__(self) -> str:
        return self.text


def rendezvous_key(
    src_device: str,
    src_incarnation: int,
    dst_device: str,
    tensor_name: str,
    frame_id: int = 0,
    iter_id: int = 0,
) -> str:
    """Return TensorFlow's rendezvous key for a tensor sent between two devices.

    The format is ``src_device;%016x;dst_device;tensor_name;frame_id:iter_id``, as
    ``Rendezvous::CreateKey`` builds it. TensorFlow stores incarnations as uint64 but
    carries them in int64 attrs (``send_device_incarnation``); a negative value is
    taken as its two's-complement uint64.

    Args:
        src_device: Full name of the sending device.
        src_incarnation: Its incarnation, in ``[-2**63, 2**64)``.
        dst_device: Full name of the receiving device.
        tensor_name: Name of the tensor (``"x:0"``, ``"edge_7_Variable/read"``).
        frame_id: Frame of the value (0 outside loops).
        iter_id: Loop iteration of the value (0 outside loops).

    Raises:
        ValueError: When the incarnation is out of range or a part contains ``;``.
    """
    if not -(1 << 63) <= src_incarnation <= _UINT64_MASK:
        raise ValueError(f"Device incarnation {src_incarnation} does not fit in 64 bits")
    for part in (src_device, dst_device, tensor_name):
        if ";" in part:
            raise ValueError(f"A rendezvous key part cannot contain ';': {part!r}")
    incarnation = src_incarnation & _UINT64_MASK
    return f"{src_device};{incarnation:016x};{dst_device};{tensor_name};{frame_id}:{iter_id}"


@_cached_when_short(maxsize=16384)
def parse_rendezvous_key(key: str) -> RendezvousKey:
    """Split a rendezvous key into its parts.

    Args:
        key: A key made by `rendezvous_key` (or by TensorFlow).

    Returns:
        The parts; ``src_incarnation`` is unsigned.

    Raises:
        errors.InvalidArgumentError: ``Invalid rendezvous key: <key>`` unless the key
            has exactly five ``;``-separated parts, full device names (job, replica,
            task, type and index all set), a hex incarnation of at most 16 digits, a
            non-empty tensor name and a ``frame:iter`` pair of decimal numbers.
    """
    parts = key.split(";")
    if len(parts) == 5:
        src_device, incarnation, dst_device, tensor_name, frame_iter = parts
        frame_match = _FRAME_ITER_RE.fullmatch(frame_iter)
        if (
            tensor_name
            and frame_match is not None
            and _HEX_RE.fullmatch(incarnation)
            and _is_full_device_name(src_device)
            and _is_full_device_name(dst_device)
        ):
            return RendezvousKey(
                src_device,
                int(incarnation, 16),
                dst_device,
                tensor_name,
                int(frame_match[1]),
                int(frame_match[2]),
                text=key,
            )
    raise errors.InvalidArgumentError(f"Invalid rendezvous key: {key}")


def _is_full_device_name(name: str) -> bool:
    try:
        return DeviceSpec.from_string(name).is_fully_specified
    except ValueError:
        return False


@_cached_when_short(maxsize=4096)
def _parse_device_spec(spec: str) -> DeviceSpec:
    # Device names repeat endlessly (every node, every step); specs are immutable.
    return DeviceSpec._parse(spec)
