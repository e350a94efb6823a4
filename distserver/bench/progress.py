"""The progress display of `distserver bench`, on stderr.

A live bar (tqdm, from the ``bench`` extra) when stderr is a terminal and tqdm is
installed; otherwise one plain line per finished measurement, so a log file or CI
output stays readable.
"""

from __future__ import annotations

import shutil
import sys
import time
from typing import Any, TextIO


class Progress:
    """`total` measurements; `start(label)` before each, `done()` after; `write` for messages."""

    def __init__(self, total: int, stream: TextIO | None = None, *, live: bool | None = None) -> None:
        self.total, self.count = total, 0
        self.stream = stream if stream is not None else sys.stderr
        self.started = time.monotonic()
        self.label = ""
        self._bar: Any = None
        if live is None:
            live = self.stream.isatty()
        if live:
            try:
                from tqdm import tqdm
            except ImportError:
                tqdm = None
            if tqdm is not None:
                # A terminal that reports a size of 0x0 (some ptys) gets 100x20, not an invisible bar.
                size = shutil.get_terminal_size((100, 20))
                self._bar = tqdm(
                    total=total, file=self.stream, unit="measurement", ncols=size.columns, nrows=size.lines
                )

    @property
    def live(self) -> bool:
        return self._bar is not None

    def start(self, label: str) -> None:
        self.label = label
        if self._bar is not None:
            self._bar.set_description_str(label)

    def done(self) -> None:
        self.count += 1
        if self._bar is not None:
            self._bar.update(1)
        else:
            elapsed = time.monotonic() - self.started
            self._line(f"[{self.count}/{self.total}] {self.label} ({elapsed:.0f} s)")

    def write(self, message: str) -> None:
        if self._bar is not None:
            self._bar.write(f"[bench] {message}", file=self.stream)
        else:
            self._line(message)

    def _line(self, text: str) -> None:
        print(f"[bench] {text}", file=self.stream, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
