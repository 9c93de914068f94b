"""Progress on the command line's stderr: one line per step, and on a terminal a live count of the seconds the current
step has run, so that long work (a fetch, the kernel build, the model compile, writing weights, a long prefill) shows
a sign of life; piped, only the step lines appear."""

from __future__ import annotations

import sys
import threading
import time
from typing import TextIO

#: A step that has run this long gets its live counter (shorter ones print only their line).
COUNTER_AFTER_S = 1.0
#: How often the counter is redrawn.
REDRAW_S = 0.5
#: Erase the terminal's current line.
CLEAR_LINE = "\r\x1b[K"


class ProgressLine:
    """Call it with each step's line (it prints it); ``status(text)`` shows a transient line on a terminal (a prefill's
    tokens so far). Use it as a context manager: closing it stops the counter and erases the transient line.

    On a terminal, a daemon thread redraws ``  ... 12s`` under the last step's line while the step runs; nothing is
    redrawn when ``stream`` is not a terminal.
    """

    def __init__(self, stream: TextIO | None = None) -> None:
        self._stream = stream if stream is not None else sys.stderr
        self._live = self._stream.isatty()
        self._lock = threading.Lock()
        self._since = time.monotonic()
        self._status = ""
        self._shown = False  # a transient line is on screen
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None
        if self._live:
            self._thread = threading.Thread(target=self._redraw, name="logitproc-progress", daemon=True)
            self._thread.start()

    def __call__(self, line: str) -> None:
        """Print one step's line (on stderr); its counter starts now."""
        with self._lock:
            self._erase()
            self._stream.write(line + "\n")
            self._stream.flush()
            self._since, self._status = time.monotonic(), ""

    def status(self, text: str) -> None:
        """Show ``text`` as the transient line (a terminal only), replaced by the next step or status."""
        if not self._live:
            return
        with self._lock:
            self._status = text
            self._draw()

    def close(self) -> None:
        """Stop the counter and erase the transient line."""
        self._closed.set()
        if self._thread is not None:
            self._thread.join()
        with self._lock:
            self._erase()

    def __enter__(self) -> ProgressLine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _redraw(self) -> None:
        while not self._closed.wait(REDRAW_S):
            with self._lock:
                if self._status or time.monotonic() - self._since >= COUNTER_AFTER_S:
                    self._draw()

    def _draw(self) -> None:
        elapsed = time.monotonic() - self._since
        text = self._status or "..."
        self._stream.write(f"{CLEAR_LINE}  {text} {elapsed:.0f}s")
        self._stream.flush()
        self._shown = True

    def _erase(self) -> None:
        if self._shown:
            self._stream.write(CLEAR_LINE)
            self._stream.flush()
            self._shown = False
