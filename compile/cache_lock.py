"""One builder at a time per cache entry: an exclusive lock, held while the entry is built or fetched."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path


def _lock_file(entry: Path) -> Path:
    """The lock of ``entry``: a file named by the hash of its absolute path, in a private folder of the temporary
    directory (so that no lock file is left in the cache itself)."""
    folder = Path(tempfile.gettempdir()) / f"logitproc-locks-{os.getuid()}"
    folder.mkdir(mode=0o700, exist_ok=True)
    return folder / (hashlib.sha256(str(entry.resolve()).encode()).hexdigest()[:32] + ".lock")


@contextlib.contextmanager
def cache_entry_lock(entry: Path) -> Iterator[None]:
    """Hold the exclusive lock of cache entry ``entry`` (a build directory or a fetched file), waiting while another
    process holds it, e.g. one building the same model; the lock is released when its holder exits, however it
    exits."""
    with open(_lock_file(entry), "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
