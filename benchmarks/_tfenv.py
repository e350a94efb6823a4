"""Find, or create, the TensorFlow environment of the benchmarks (`distserver.bench.tfenv`).

python benchmarks/_tfenv.py            # find or create; print the interpreter
python benchmarks/_tfenv.py --no-create
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from distserver.bench.tfenv import TFUnavailable, find_or_create

REPO = Path(__file__).resolve().parent.parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-create", action="store_true", help="only look, never install")
    args = parser.parse_args()
    try:
        env = find_or_create(REPO, create=not args.no_create)
    except TFUnavailable as exc:
        sys.exit(f"TensorFlow unavailable: {exc}")
    versions = f"tensorflow {env.tensorflow}, numpy {env.numpy}, python {env.python_version}"
    print(f"{env.python}  ({versions}; {env.source})")


if __name__ == "__main__":
    main()
