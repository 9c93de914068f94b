"""A fast way for TVMScript's ``T.macro`` calls to find their parser, used while this package makes its kernels.

Each call of a ``T.macro`` inside a ``T.prim_func`` looks for the parser that is running by asking
``inspect.getouterframes`` for the whole call stack (TVM 0.27, ``ScriptMacro._find_parser_def``), which builds each
frame's source context, and ``inspect.getmodule`` scans every loaded module for a frame whose file is not a module's
(CPython issue 92041); the parser's frames are several hundred deep. Making this package's kernels calls macros
hundreds of times: that lookup was most of the time a kernel takes to make (the logit-processing kernels 20.8 s ->
2.4 s, the paged prefill attention kernel 3.9 s -> 1.1 s, measured on this machine), and so of every model compile.

``fast_macro_lookup()`` replaces the lookup, while it is entered, by one that walks the frames (``frame.f_back``)
and returns the same parser, the first one found from the innermost frame out, as TVM's does; the kernels' TVMScript
comes out the same text. Entering it is thread-safe and re-entrant; the last exit puts TVM's own lookup back.
Nothing is changed on import.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from tvm.script.parser.core.parser import ScriptMacro

_lock = threading.Lock()
_entered = 0
_original = ScriptMacro._find_parser_def


def _find_parser_by_frames(self: ScriptMacro) -> Any:
    """The innermost running parser of the calling frames (those whose module holds it), as TVM's lookup finds it."""
    frame = sys._getframe()
    while frame is not None:
        parser = frame.f_globals.get(ScriptMacro.parser_object_name)
        if parser is not None:
            return parser
        frame = frame.f_back
    raise RuntimeError(f"{ScriptMacro.parser_object_name} not available")


@contextmanager
def fast_macro_lookup() -> Iterator[None]:
    """While entered, ``T.macro`` calls find their parser by walking frames (the module's docstring)."""
    global _entered
    with _lock:
        if _entered == 0:
            ScriptMacro._find_parser_def = _find_parser_by_frames
        _entered += 1
    try:
        yield
    finally:
        with _lock:
            _entered -= 1
            if _entered == 0:
                ScriptMacro._find_parser_def = _original
