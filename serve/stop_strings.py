"""Stop strings over streamed text: never emit text past a stop, nor a piece that may become one.

:class:`StopStringFilter` receives the text deltas of one sequence. It keeps back the longest suffix of the text
that is a proper prefix of some stop string (it may still become that stop string once more text arrives) and
releases it as soon as it cannot. When a stop string appears, the text before its first occurrence is released,
the stop string and everything after it are dropped, and ``stopped`` becomes True. With no stop strings every delta
passes through unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence


class StopStringFilter:
    """Filters one sequence's text deltas against its stop strings (the stop string itself is not emitted)."""

    def __init__(self, stop: Sequence[str]) -> None:
        if any(not s for s in stop):
            raise ValueError("stop strings must be non-empty")
        self.stop = tuple(stop)
        self._held = ""
        self.stopped = False
        #: The stop string found (None until one is).
        self.matched: str | None = None

    @property
    def held(self) -> str:
        """Text received but not yet released (a possible start of a stop string)."""
        return self._held

    def feed(self, delta: str) -> str:
        """Take the next text delta; return the text that is safe to emit now."""
        if self.stopped:
            return ""
        if not self.stop:
            return delta
        text = self._held + delta
        # The held text contains no whole stop string, so any match ends inside the new delta.
        found = -1
        for s in self.stop:
            at = text.find(s)
            if at != -1 and (found == -1 or at < found):
                found, self.matched = at, s
        if found != -1:
            self.stopped = True
            self._held = ""
            return text[:found]
        keep = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(text)), keep, -1):
                if text.endswith(s[:k]):
                    keep = k
                    break
        self._held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep]

    def flush(self) -> str:
        """At the end of the sequence (for another reason than a stop string): release the held text."""
        out, self._held = ("" if self.stopped else self._held), ""
        return out
