"""Drop known harmless messages that native libraries print on the process's stderr (file descriptor 2).

- TVM's ``transform.h:...: Warning: Fast mode segfaults when there are out-of-bounds indices``, printed at every
  model compile (``compile/model_compile.py`` filters it around ``tvm.compile``): the embedding lookup is a ``take``
  in fast mode, which does not check its indices. The engine checks every token id against the vocabulary before it
  reaches the model (``Engine.add_request``), so the lookup never sees an out-of-range index.
- Mesa's ``error: XDG_RUNTIME_DIR is invalid or not set in the environment.``, printed by the lavapipe Vulkan driver
  each time it probes for a Wayland display while Vulkan devices are listed (``logitproc devices`` filters it);
  nothing is displayed, so nothing is missing.

Native code writes to the descriptor directly, so ``sys.stderr`` cannot catch it: :func:`filtered_stderr` points
descriptor 2 at a pipe for the duration of a block and copies every other line to the real stderr as it arrives.
"""

from __future__ import annotations

import os
import re
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

HARMLESS = (
    re.compile(rb"transform\.h:\d+: Warning: Fast mode segfaults when there are out-of-bounds indices"),
    re.compile(rb"^error: XDG_RUNTIME_DIR is invalid or not set in the environment\.?\s*$"),
)


def is_harmless(line: bytes) -> bool:
    return any(pattern.search(line) for pattern in HARMLESS)


def _copy_lines(source: int, target: int) -> None:
    with os.fdopen(source, "rb", buffering=0) as pipe:
        pending = b""
        while chunk := pipe.read(65536):
            pending += chunk
            *lines, pending = pending.split(b"\n")
            kept = b"".join(line + b"\n" for line in lines if not is_harmless(line))
            if kept:
                os.write(target, kept)
        if pending and not is_harmless(pending):
            os.write(target, pending)


@contextmanager
def filtered_stderr() -> Iterator[None]:
    """Within the block, lines of descriptor 2 matching ``HARMLESS`` are dropped; the others pass unchanged."""
    sys.stderr.flush()
    saved = os.dup(2)
    read_end, write_end = os.pipe()
    copier = threading.Thread(target=_copy_lines, args=(read_end, saved), name="filtered-stderr", daemon=True)
    copier.start()
    os.dup2(write_end, 2)
    os.close(write_end)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)  # closes the pipe's last write end: the copier drains it and stops
        copier.join()
        os.close(saved)
