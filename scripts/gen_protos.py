"""Generate distserver/protos/*_pb2.py and *_pb2.pyi from the .proto files.

Usage:
    python scripts/gen_protos.py          # regenerate in place
    python scripts/gen_protos.py --check  # exit 1 if the committed files drifted

The generated files are committed (DO NOT EDIT them by hand); CI runs `--check`.
"""

from __future__ import annotations

import argparse
import filecmp
import shutil
import sys
import tempfile
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "distserver" / "protos"


def generate(out_dir: Path) -> None:
    """Compile every .proto under distserver/protos into `out_dir` (same layout)."""
    protos = sorted(str(p.relative_to(ROOT)) for p in PROTO_DIR.glob("*.proto"))
    include = Path(protoc.__file__).parent / "_proto"
    args = [
        "protoc",
        f"-I{ROOT}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        *protos,
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed; see the messages above")


def generated_files(base: Path) -> list[Path]:
    proto_dir = base / "distserver" / "protos"
    return sorted(p.relative_to(base) for p in proto_dir.glob("*_pb2.py*"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if generated code drifted")
    options = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        generate(out)
        fresh = generated_files(out)
        if options.check:
            committed = generated_files(ROOT)
            drift = sorted(set(fresh) ^ set(committed))
            drift += [
                f for f in fresh if f in committed and not filecmp.cmp(out / f, ROOT / f, shallow=False)
            ]
            if drift:
                print("Generated protobuf code is out of date; run python scripts/gen_protos.py:")
                for f in sorted(set(drift)):
                    print(f"  {f}")
                return 1
            print(f"{len(fresh)} generated files match their .proto sources")
            return 0
        for stale in generated_files(ROOT):
            (ROOT / stale).unlink()
        for f in fresh:
            shutil.copyfile(out / f, ROOT / f)
        print(f"wrote {len(fresh)} files")
    return 0


if __name__ == "__main__":
    sys.exit(main())
