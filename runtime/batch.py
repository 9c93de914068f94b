"""Batch: one step's rows, validated once and handed to every stage of the processor and the sampler.

Without drafts a sequence has one row. With a draft tree of k nodes (a chain is a tree) it has k + 1 rows: row 0
predicts the token after the committed ones, row 1 + m the token after the path from the root to node m. Rows of
sequence i are ``cum_num_token[i]:cum_num_token[i + 1]``.

A batch also says what changed since the batch before it (``BatchUpdate``: the sequences that joined, left, or moved
to another first row) and holds the fast-path flags every stage checks (``any_bias``, ``any_penalties``,
``any_masks``, ``any_filters``, ``all_greedy``, ``any_logprobs``). It describes the rows and nothing else: it is not
written after it is made. What processing produces (the masks, their errors, the logits on the device) is returned
by the processor as a ``ProcessedBatch`` (``processed_batch.py``) and passed to the sampler.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from .logits_io import rows_and_vocab
from .request_state import DraftTree, RequestState

DraftArg = Sequence[DraftTree | Sequence[int] | None] | None


@dataclass(frozen=True)
class BatchUpdate:
    """Sequences that joined since the previous batch, left it, or start at another row (with their new row)."""

    joined: tuple[RequestState, ...] = ()
    left: tuple[RequestState, ...] = ()
    moved: tuple[tuple[RequestState, int], ...] = ()


#: dtypes of Batch.sampling_columns: temperature, top_k, top_p, min_p.
_SAMPLING_DTYPES = (np.float32, np.int32, np.float32, np.float32)

#: The update of a batch with the same sequences at the same rows as the one before it.
NO_CHANGE = BatchUpdate()


def _draft_of(state: RequestState, tree: DraftTree | Sequence[int] | None) -> DraftTree | None:
    if tree is None:
        return DraftTree.chain(state.draft_token_ids) if state.draft_token_ids else None
    if isinstance(tree, DraftTree):
        return tree
    return DraftTree.chain(tree)


def _validated_states(states: Sequence[RequestState]) -> tuple[RequestState, ...]:
    if not states:
        raise ValueError("states is empty: a step needs at least one request")
    seen: dict[int, int] = {}
    for i, s in enumerate(states):
        if not isinstance(s, RequestState):
            raise TypeError(f"states[{i}] must be a RequestState, got {type(s).__name__}")
        if id(s) in seen:
            raise ValueError(f"states[{seen[id(s)]}] and states[{i}] are the same RequestState; a sequence has one "
                             "entry per step (its draft tokens add its extra rows)")
        seen[id(s)] = i
    return tuple(states)


def _check_cum(cum_num_token: Any, expected: tuple[int, ...]) -> None:
    if cum_num_token is not None and tuple(int(x) for x in cum_num_token) != expected:
        raise ValueError(f"cum_num_token {list(cum_num_token)} does not match the rows the drafts need "
                         f"{list(expected)} (1 row per sequence plus 1 per draft token)")


class BatchMaker(Protocol):
    """What made a Batch (``LogitProcessor``), as the later stages of its step ask it."""

    def masks_deferred(self, batch: Batch) -> bool:
        """Whether ``batch``'s masks were left to the sampler (``inplace_update_logits(defer_masks=True)``): a
        later stage must then be given the ProcessedBatch that holds them, not the Batch."""
        ...


class Batch:
    """One step: per row its sequence and draft path; per sequence its first row; what changed since the last step."""

    def __init__(self, states: Sequence[RequestState], cum_num_token: Any = None, draft_trees: DraftArg = None,
                 previous: Batch | None = None, made_by: BatchMaker | None = None) -> None:
        #: The processor that made this batch (it keeps the caches the batch's update applies to), or None.
        self.made_by = made_by
        self.states = _validated_states(states)
        if draft_trees is not None and len(draft_trees) != len(self.states):
            raise ValueError(f"draft_trees has {len(draft_trees)} entries for {len(self.states)} states")
        if draft_trees is None and not any(s.draft_token_ids for s in self.states):  # decode: 1 row each
            self.cum_num_token = tuple(range(len(self.states) + 1))
            _check_cum(cum_num_token, self.cum_num_token)
            self.row_states = self.states
            self.paths: tuple[tuple[int, ...], ...] = ((),) * len(self.states)
            self.row_sequence = tuple(range(len(self.states)))
        else:
            drafts = [_draft_of(s, None if draft_trees is None else draft_trees[i]) for i, s in enumerate(self.states)]
            counts = [1 + (len(d.token_ids) if d else 0) for d in drafts]
            self.cum_num_token = tuple(int(x) for x in np.concatenate([[0], np.cumsum(counts)]))
            _check_cum(cum_num_token, self.cum_num_token)
            row_states, paths, owner = [], [], []
            for i, (state, draft) in enumerate(zip(self.states, drafts, strict=True)):
                nodes = range(len(draft.token_ids)) if draft is not None else range(0)
                row_states += [state] * (1 + len(nodes))
                owner += [i] * (1 + len(nodes))
                paths += [(), *(tuple(draft.path(n)) for n in nodes)]  # type: ignore[union-attr]
            self.row_states, self.paths, self.row_sequence = tuple(row_states), tuple(paths), tuple(owner)
        self.first_row = dict(zip(self.states, self.cum_num_token, strict=False))
        self.update = self._diff(previous)
        self.any_bias = self.any_penalties = self.any_filters = self.any_masks = False
        self.any_logprobs = self.any_raw_logprobs = False
        self.all_greedy = True
        sampling = []
        for state in self.states:  # one pass: these flags are read by every stage of the step
            c = state.config
            sampling.append(c.sampling_row)
            self.any_bias = self.any_bias or bool(c.logit_bias)
            self.any_penalties = self.any_penalties or c.has_penalties
            self.any_filters = self.any_filters or c.has_filters
            self.any_masks = self.any_masks or bool(state.mask_sources)
            self.all_greedy = self.all_greedy and c.greedy
            if c.logprobs:
                self.any_logprobs = True
                self.any_raw_logprobs = self.any_raw_logprobs or c.effective_logprobs_mode == "raw"
        #: Per row, (temperature, top_k, top_p, min_p) as the sampler's kernels take them (``sampling_row``), and the
        #: same as four arrays (float32, int32, float32, float32): gathered in the pass above, where the configs are
        #: read anyway, rather than by the sampler in a second pass over them.
        self.sampling_rows = sampling if self.row_states is self.states else [sampling[i] for i in self.row_sequence]
        self.sampling_columns = tuple(np.array(column, dtype) for column, dtype in
                                      zip(zip(*self.sampling_rows, strict=True), _SAMPLING_DTYPES, strict=True))

    @property
    def num_rows(self) -> int:
        return len(self.row_states)

    def _diff(self, previous: Batch | None) -> BatchUpdate:
        if previous is None:
            return BatchUpdate(joined=self.states)
        if previous.states == self.states and previous.cum_num_token == self.cum_num_token:
            return NO_CHANGE
        before = previous.first_row
        joined = tuple(s for s in self.states if s not in before)
        left = tuple(s for s in before if s not in self.first_row)
        moved = tuple((s, row) for s, row in self.first_row.items() if s in before and before[s] != row)
        return BatchUpdate(joined, left, moved)

    def same_rows(self, other: Batch) -> bool:
        """Both batches have the same sequences (the same objects, in order) and the same draft paths."""
        return self.states == other.states and self.paths == other.paths

    def check_array(self, array: Any, what: str, vocab_size: int, max_rows: int, owner: str) -> None:
        """``array`` is ``[num_rows, vocab_size]`` float32 (numpy or device) within ``max_rows``."""
        rows = rows_and_vocab(array, what, vocab_size)
        if rows != self.num_rows:
            raise ValueError(f"{what} has {rows} rows but the states (and drafts) need {self.num_rows}")
        if rows > max_rows:
            raise ValueError(f"{rows} {what} rows exceed {owner}max_num_token={max_rows}")

    def refuse_if_masks_deferred(self, stage: str) -> None:
        """Raise ValueError when this Batch's masks were deferred (``inplace_update_logits(defer_masks=True)``) and
        not applied since: ``stage`` given the Batch would process its rows without them."""
        if self.made_by is not None and self.made_by.masks_deferred(self):
            raise ValueError(f"{stage} was given the Batch, but inplace_update_logits(defer_masks=True) left its masks "
                             "to the sampler: pass the ProcessedBatch it returned (it holds the masks), not the Batch")

    def __repr__(self) -> str:
        return f"Batch({len(self.states)} sequences, {self.num_rows} rows, {self.update})"
