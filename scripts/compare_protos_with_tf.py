"""Compare distserver's protobuf schemas with the ones of an installed TensorFlow.

Run with the Python of a venv that has TensorFlow (not distserver's venv):

    .tfenv/bin/python scripts/compare_protos_with_tf.py [-v]      (.tfenv: scripts/interop-setup)

For every message and enum of distserver/protos/*.proto, the script looks up the
TensorFlow type of the same name (package `distserver` <-> `tensorflow`, nested names
included, e.g. ConfigProto.Experimental) and checks each field WE define against
TensorFlow's field of the same number: name, type (message/enum types by name
relative to their package), repeated-ness, packed-ness, map-ness, oneof membership
and presence. Enum values we define must exist in TensorFlow with the same number.

Fields and enum values that TensorFlow has and we lack are only informational:
unknown fields survive a parse/serialize round trip, so lacking them is harmless.
Anything we define differently is an error; the exit status is 1 when there is one.

How TensorFlow's descriptors are found:
  * the `*_pb2` modules shipped with TensorFlow (tensorflow.core.framework,
    tensorflow.core.protobuf, tsl/xla protobuf packages) are imported;
  * master.proto and worker.proto have no Python modules in the TensorFlow wheel,
    so their serialized FileDescriptorProto is extracted from the C++ library
    (libtensorflow_cc.so / libtensorflow_framework.so), where protoc embeds it.

How OUR descriptors are loaded: the repository root is put on sys.path and
`distserver.protos.<x>_pb2` is imported. If importing the `distserver` package
fails in the TensorFlow venv (its __init__ may import things that venv lacks), the
packages `distserver` and `distserver.protos` are created as empty module objects
without executing their __init__.py, and the _pb2 modules are loaded via importlib.
"""

from __future__ import annotations

import argparse
import importlib
import mmap
import os
import pkgutil
import sys
import types
from collections.abc import Iterator
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

from google.protobuf import descriptor as _d
from google.protobuf import descriptor_pb2, descriptor_pool

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "distserver" / "protos"

TF_PROTO_PACKAGES = [
    "tensorflow.core.framework",
    "tensorflow.core.protobuf",
    "tensorflow.core.lib.core",
    "tensorflow.compiler.xla.tsl.protobuf",
    "tsl.protobuf",
    "xla.tsl.protobuf",
]
# TensorFlow .proto files whose Python modules are not in the wheel.
TF_NATIVE_ONLY_FILES = [
    "tensorflow/core/protobuf/master.proto",
    "tensorflow/core/protobuf/worker.proto",
    "tensorflow/core/protobuf/eager_service.proto",
]

TYPE_NAMES = {
    getattr(_d.FieldDescriptor, n): n[5:].lower() for n in dir(_d.FieldDescriptor) if n.startswith("TYPE_")
}


# --------------------------------------------------------------------------- loading


def load_our_modules() -> tuple[list[types.ModuleType], str]:
    """Import every distserver/protos/*_pb2.py; returns (modules, how)."""
    sys.path.insert(0, str(ROOT))
    names = sorted(p.stem for p in PROTO_DIR.glob("*_pb2.py"))
    try:
        importlib.import_module("distserver.protos")
        how = "imported the distserver package normally"
    except Exception as exc:  # the package __init__ needs something tfenv lacks
        for key in [k for k in sys.modules if k == "distserver" or k.startswith("distserver.")]:
            del sys.modules[key]
        for pkg, path in (("distserver", ROOT / "distserver"), ("distserver.protos", PROTO_DIR)):
            mod = types.ModuleType(pkg)
            mod.__path__ = [str(path)]  # a package, without running its __init__.py
            sys.modules[pkg] = mod
        sys.modules["distserver"].protos = sys.modules["distserver.protos"]  # type: ignore[attr-defined]
        how = f"created the distserver packages by hand ({type(exc).__name__}: {exc})"
    # With the hand-made packages, the import system finds the _pb2 files via __path__.
    return [importlib.import_module(f"distserver.protos.{name}") for name in names], how


def load_tf_modules() -> list[types.ModuleType]:
    """Import TensorFlow's shipped *_pb2 modules of the packages in TF_PROTO_PACKAGES."""
    loaded = []
    for pkg_name in TF_PROTO_PACKAGES:
        try:
            pkg = importlib.import_module(pkg_name)
        except Exception:
            continue
        for info in pkgutil.iter_modules(pkg.__path__):
            if not info.name.endswith("_pb2"):
                continue
            try:
                loaded.append(importlib.import_module(f"{pkg_name}.{info.name}"))
            except Exception as exc:
                print(f"note: cannot import {pkg_name}.{info.name}: {exc}", file=sys.stderr)
    return loaded


def _native_libraries() -> list[Path]:
    import tensorflow

    base = Path(tensorflow.__file__).parent
    libs = sorted(base.glob("libtensorflow_cc.so*")) + sorted(base.glob("libtensorflow_framework.so*"))
    libs += sorted(base.glob("python/*.so"))
    return [p for p in libs if p.is_file()]


# FileDescriptorProto field number -> wire type; protoc serializes in number order.
_FDP_WIRE = {1: 2, 2: 2, 3: 2, 4: 2, 5: 2, 6: 2, 7: 2, 8: 2, 9: 2, 10: 0, 11: 0, 12: 2, 13: 2, 14: 0, 15: 2}


def _read_varint(buf: mmap.mmap, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        b = buf[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            return value, pos
        if shift > 63:
            raise ValueError("varint too long")


def _extract_descriptor(buf: mmap.mmap, start: int) -> bytes:
    """Bytes of the FileDescriptorProto starting at `start` (ends where fields stop making sense)."""
    pos, last = start, 0
    while pos < len(buf):
        try:
            tag, after = _read_varint(buf, pos)
        except (ValueError, IndexError):
            break
        number, wire = tag >> 3, tag & 7
        if _FDP_WIRE.get(number) != wire or number < last or (number == 1 and last):
            break
        if wire == 0:
            _, after = _read_varint(buf, after)
        else:
            length, after = _read_varint(buf, after)
            after += length
        if after > len(buf):
            break
        pos, last = after, number
    return bytes(buf[start:pos])


def load_native_file(pool: descriptor_pool.DescriptorPool, name: str, libs: list[Path]) -> bool:
    """Add TF's `name` (and missing deps) to `pool` from the embedded descriptor in a .so."""
    try:
        pool.FindFileByName(name)
        return True
    except KeyError:
        pass
    needle = b"\n" + bytes([len(name)]) + name.encode() + b"\x12"
    for lib in libs:
        with lib.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            at = buf.find(needle)
            while at >= 0:
                raw = _extract_descriptor(buf, at)
                fdp = descriptor_pb2.FileDescriptorProto()
                try:
                    fdp.ParseFromString(raw)
                except Exception:
                    fdp = None
                if fdp is not None and fdp.name == name and (fdp.message_type or fdp.enum_type):
                    for dep in fdp.dependency:
                        if not load_native_file(pool, dep, libs):
                            print(f"note: dependency {dep} of {name} not found", file=sys.stderr)
                    pool.AddSerializedFile(raw)
                    return True
                at = buf.find(needle, at + 1)
    return False


# --------------------------------------------------------------------------- comparing


def relative_name(desc: _d.Descriptor | _d.EnumDescriptor) -> str:
    package = desc.file.package
    return desc.full_name[len(package) + 1 :] if package else desc.full_name


def walk_messages(desc: _d.Descriptor) -> Iterator[_d.Descriptor]:
    yield desc
    for nested in desc.nested_types:
        yield from walk_messages(nested)


def walk_file(fd: _d.FileDescriptor) -> Iterator[_d.Descriptor | _d.EnumDescriptor]:
    yield from fd.enum_types_by_name.values()
    for msg in fd.message_types_by_name.values():
        for m in walk_messages(msg):
            yield m
            yield from m.enum_types


def is_map(field: _d.FieldDescriptor) -> bool:
    return (
        field.type == _d.FieldDescriptor.TYPE_MESSAGE
        and field.message_type.GetOptions().map_entry
        and field.is_repeated
    )


def type_string(field: _d.FieldDescriptor) -> str:
    if field.type == _d.FieldDescriptor.TYPE_MESSAGE:
        return relative_name(field.message_type)
    if field.type == _d.FieldDescriptor.TYPE_ENUM:
        return f"enum {relative_name(field.enum_type)}"
    return TYPE_NAMES[field.type]


def describe(field: _d.FieldDescriptor) -> str:
    parts = []
    if is_map(field):
        entry = field.message_type
        key, value = entry.fields_by_name["key"], entry.fields_by_name["value"]
        parts.append(f"map<{type_string(key)}, {type_string(value)}>")
    else:
        if field.is_repeated:
            parts.append("repeated")
        parts.append(type_string(field))
    text = f"{' '.join(parts)} {field.name} = {field.number}"
    if field.is_repeated and field.is_packed:
        text += " [packed]"
    return text


class Comparison:
    def __init__(self, verbose: bool) -> None:
        self.errors: list[str] = []
        self.infos: list[str] = []
        self.verbose = verbose
        self.compared = 0

    def error(self, text: str) -> None:
        self.errors.append(text)

    def info(self, text: str) -> None:
        self.infos.append(text)

    def compare_field(self, where: str, ours: _d.FieldDescriptor, theirs: _d.FieldDescriptor) -> None:
        problems = []
        if ours.name != theirs.name:
            problems.append(f"name {ours.name!r} != TF {theirs.name!r}")
        if ours.type != theirs.type:
            problems.append(f"type {TYPE_NAMES[ours.type]} != TF {TYPE_NAMES[theirs.type]}")
        elif (
            ours.type in (_d.FieldDescriptor.TYPE_MESSAGE, _d.FieldDescriptor.TYPE_ENUM)
            and not is_map(ours)
            and type_string(ours) != type_string(theirs)
        ):
            problems.append(f"type {type_string(ours)} != TF {type_string(theirs)}")
        if ours.is_repeated != theirs.is_repeated:
            problems.append(f"repeated={ours.is_repeated} != TF repeated={theirs.is_repeated}")
        if ours.is_repeated and theirs.is_repeated and ours.is_packed != theirs.is_packed:
            problems.append(f"packed={ours.is_packed} != TF packed={theirs.is_packed}")
        if is_map(ours) != is_map(theirs):
            problems.append(f"map={is_map(ours)} != TF map={is_map(theirs)}")
        elif is_map(ours):
            for part in ("key", "value"):
                a = ours.message_type.fields_by_name[part]
                b = theirs.message_type.fields_by_name[part]
                if type_string(a) != type_string(b):
                    problems.append(f"map {part} {type_string(a)} != TF {type_string(b)}")
        our_oneof = ours.containing_oneof.name if ours.containing_oneof else None
        tf_oneof = theirs.containing_oneof.name if theirs.containing_oneof else None
        # proto3 `optional` shows up as a synthetic oneof named "_<field>"; compare via presence.
        if our_oneof != tf_oneof and not (
            (our_oneof or "").startswith("_") or (tf_oneof or "").startswith("_")
        ):
            problems.append(f"oneof {our_oneof} != TF oneof {tf_oneof}")
        if not ours.is_repeated and ours.has_presence != theirs.has_presence:
            problems.append(f"has_presence={ours.has_presence} != TF {theirs.has_presence}")
        if problems:
            self.error(f"{where}: field {ours.number}: {'; '.join(problems)}  (TF: {describe(theirs)})")

    def compare_message(self, ours: _d.Descriptor, theirs: _d.Descriptor) -> None:
        where = relative_name(ours)
        self.compared += 1
        if ours.GetOptions().map_entry != theirs.GetOptions().map_entry:
            self.error(f"{where}: map-entry-ness differs from TF {theirs.full_name}")
        for field in ours.fields:
            tf_field = theirs.fields_by_number.get(field.number)
            if tf_field is None:
                self.error(
                    f"{where}: field {describe(field)}: TF {theirs.full_name} has no field {field.number}"
                )
                continue
            self.compare_field(where, field, tf_field)
        for tf_field in theirs.fields:
            if tf_field.number not in ours.fields_by_number:
                self.info(f"{where}: lacks TF field {describe(tf_field)}")

    def compare_enum(self, ours: _d.EnumDescriptor, theirs: _d.EnumDescriptor) -> None:
        where = relative_name(ours)
        self.compared += 1
        for value in ours.values:
            tf_value = theirs.values_by_name.get(value.name)
            if tf_value is None:
                self.error(f"{where}: value {value.name} = {value.number}: not in TF {theirs.full_name}")
            elif tf_value.number != value.number:
                self.error(f"{where}: value {value.name} = {value.number} != TF {tf_value.number}")
        for tf_value in theirs.values:
            if tf_value.name not in ours.values_by_name:
                self.info(f"{where}: lacks TF enum value {tf_value.name} = {tf_value.number}")


def build_tf_index(
    files: list[_d.FileDescriptor],
) -> dict[str, list[_d.Descriptor | _d.EnumDescriptor]]:
    """Relative name -> TF descriptors of that name, from `files` and their dependencies."""
    index: dict[str, list[_d.Descriptor | _d.EnumDescriptor]] = {}
    seen: set[str] = set()
    stack = list(files)
    while stack:
        fd = stack.pop()
        if fd.name in seen:
            continue
        seen.add(fd.name)
        stack.extend(fd.dependencies)
        if fd.package.split(".")[0] not in ("tensorflow", "tsl", "xla"):
            continue
        for desc in walk_file(fd):
            index.setdefault(relative_name(desc), []).append(desc)
    return index


def find_tf(
    ours: _d.Descriptor | _d.EnumDescriptor,
    pool: descriptor_pool.DescriptorPool,
    index: dict[str, list[_d.Descriptor | _d.EnumDescriptor]],
) -> _d.Descriptor | _d.EnumDescriptor | None:
    tf_name = "tensorflow" + ours.full_name[len("distserver") :]
    finder = pool.FindMessageTypeByName if isinstance(ours, _d.Descriptor) else pool.FindEnumTypeByName
    try:
        return finder(tf_name)
    except KeyError:
        pass
    kind = type(ours)
    candidates = [d for d in index.get(relative_name(ours), []) if isinstance(d, kind)]
    candidates.sort(key=lambda d: d.file.package != "tensorflow")
    return candidates[0] if candidates else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-q", "--quiet", action="store_true", help="do not list the TF fields we lack")
    options = parser.parse_args()

    ours, how = load_our_modules()
    print(f"distserver protos: {len(ours)} modules ({how})")
    tf_modules = load_tf_modules()
    import tensorflow

    print(f"TensorFlow {tensorflow.__version__}: {len(tf_modules)} *_pb2 modules imported")
    pool = descriptor_pool.Default()
    libs = _native_libraries()
    tf_files = [
        m.DESCRIPTOR for m in tf_modules if isinstance(getattr(m, "DESCRIPTOR", None), _d.FileDescriptor)
    ]
    for name in TF_NATIVE_ONLY_FILES:
        if load_native_file(pool, name, libs):
            tf_files.append(pool.FindFileByName(name))
            print(f"loaded {name} from the descriptor embedded in TensorFlow's C++ library")
        else:
            print(f"WARNING: TensorFlow's {name} not found")
    index = build_tf_index(tf_files)

    cmp = Comparison(verbose=not options.quiet)
    for module in ours:
        for desc in walk_file(module.DESCRIPTOR):
            if isinstance(desc, _d.Descriptor) and desc.GetOptions().map_entry:
                continue  # compared through the map field
            theirs = find_tf(desc, pool, index)
            if theirs is None:
                cmp.error(
                    f"{relative_name(desc)} ({module.DESCRIPTOR.name}): no TensorFlow type of that name"
                )
            elif isinstance(desc, _d.Descriptor):
                cmp.compare_message(desc, theirs)  # type: ignore[arg-type]
            else:
                cmp.compare_enum(desc, theirs)  # type: ignore[arg-type]

    if cmp.verbose and cmp.infos:
        print(f"\nTF fields/values we lack ({len(cmp.infos)}, informational):")
        for line in cmp.infos:
            print(f"  info: {line}")
    if cmp.errors:
        print(f"\nMISMATCHES ({len(cmp.errors)}):")
        for line in cmp.errors:
            print(f"  ERROR: {line}")
    print(
        f"\ncompared {cmp.compared} messages/enums: {len(cmp.errors)} mismatches, "
        f"{len(cmp.infos)} TF fields/values we lack"
    )
    return 1 if cmp.errors else 0


if __name__ == "__main__":
    sys.exit(main())
