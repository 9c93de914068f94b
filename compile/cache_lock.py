"""One builder at a time per cache entry: an exclusive lock on a file beside the entry, held while it is built."""

from __future__ import annotations

import contextlib
import fcntl
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def cache_entry_lock(final: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``.<name>.lock`` beside ``final`` (waiting for another process that holds it, e.g.
    one building the same model); the kernel releases it when the holder exits, however it exits."""
    final.parent.mkdir(parents=True, exist_ok=True)
    with open(final.parent / f".{final.name}.lock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
