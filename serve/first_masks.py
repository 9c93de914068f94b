"""A new request's first token masks made before it joins the steps (``Engine.submit``: on the grammar thread), so
that no step waits for them.

The first mask of a sequence with a grammar is its dearest: with ``max_tokens`` set, its ``DocumentClosing`` searches
the shortest completion of the whole document from the grammar's start (a depth-first search over bytes through the
matcher, bounded at 4,000 tokens tried; 1-10 ms for the maskbench Kubernetes schemas on a 2-core CPU), and a grammar
engine may build lexer states on the way. Made inside a step, on the mask workers, that time is every running
stream's gap (the first search in a process also built the tokenizer's byte tables, 0.4-0.6 s, before
``Engine.prepare_constraints`` made them while the server loads). Filling each source's
row once for the first position, before the request is queued, leaves the results where the step finds them: the
closing keeps its plan for the state it was made in (no token is committed before the first step), and the grammar
engine keeps what it built. A mask source's ``fill_bitmask`` leaves the source's state as it was, so an extra fill
changes no answer.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
from logitproc.runtime import RequestState


def make_first_masks(states: Iterable[RequestState], vocab_size: int) -> None:
    """Fill every mask source of ``states`` once for the first output position (into a scratch row). A source that
    raises is left as it is: the step that fills its row meets the same failure and ends (or recovers) that request
    alone, as it would have without this."""
    row: np.ndarray | None = None
    for state in states:
        for source in state.mask_sources:
            if row is None:
                row = np.empty((vocab_size + 31) // 32, np.int32)
            try:
                source.fill_bitmask(row, ())
            except Exception:  # handled where it always was: in the step that fills the row
                continue
