"""Which sequence, and which draft path, each row of a logits array belongs to.

Without drafts a sequence has one row. With a draft tree of k nodes (a chain is a tree) it has k + 1 rows: row 0
predicts the token after the committed ones, row 1 + m the token after the path from the root to node m. Rows of
sequence i are ``cum_num_token[i]:cum_num_token[i + 1]``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .logits_io import rows_and_vocab
from .request_state import DraftTree, RequestState


@dataclass(frozen=True)
class RowPlan:
    """Per logits row: its state and the draft tokens to treat as appended; plus the sequences' row offsets."""

    states: tuple[RequestState, ...]
    paths: tuple[tuple[int, ...], ...]
    cum_num_token: tuple[int, ...]

    @property
    def num_rows(self) -> int:
        return len(self.states)


def _draft_of(state: RequestState, tree: DraftTree | Sequence[int] | None) -> DraftTree | None:
    if tree is None:
        return DraftTree.chain(state.draft_token_ids) if state.draft_token_ids else None
    if isinstance(tree, DraftTree):
        return tree
    return DraftTree.chain(tree)


def plan_rows(states: Sequence[RequestState], cum_num_token: Sequence[int] | np.ndarray | None = None,
              draft_trees: Sequence[DraftTree | Sequence[int] | None] | None = None) -> RowPlan:
    """Validate the batch description and expand it to one entry per logits row."""
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
    if draft_trees is not None and len(draft_trees) != len(states):
        raise ValueError(f"draft_trees has {len(draft_trees)} entries for {len(states)} states")
    if draft_trees is None and not any(s.draft_token_ids for s in states):  # the common decode step: 1 row each
        expected = tuple(range(len(states) + 1))
        if cum_num_token is not None and tuple(int(x) for x in cum_num_token) != expected:
            raise ValueError(f"cum_num_token {list(cum_num_token)} does not match the rows the drafts need "
                             f"{list(expected)} (1 row per sequence plus 1 per draft token)")
        return RowPlan(tuple(states), ((),) * len(states), expected)
    drafts = [_draft_of(s, None if draft_trees is None else draft_trees[i]) for i, s in enumerate(states)]
    counts = [1 + (len(d.token_ids) if d else 0) for d in drafts]
    expected = tuple(int(x) for x in np.concatenate([[0], np.cumsum(counts)]))
    if cum_num_token is not None:
        given = tuple(int(x) for x in cum_num_token)
        if given != expected:
            raise ValueError(f"cum_num_token {list(given)} does not match the rows the drafts need {list(expected)} "
                             "(1 row per sequence plus 1 per draft token)")
    row_states: list[RequestState] = []
    paths: list[tuple[int, ...]] = []
    for state, draft in zip(states, drafts, strict=True):
        row_states.append(state)
        paths.append(())
        if draft is not None:
            for node in range(len(draft.token_ids)):
                row_states.append(state)
                paths.append(tuple(draft.path(node)))
    return RowPlan(tuple(row_states), tuple(paths), expected)


def plan_for_array(array: Any, what: str, vocab_size: int, max_rows: int, owner: str,
                   states: Sequence[RequestState], cum_num_token: Any = None, draft_trees: Any = None) -> RowPlan:
    """plan_rows, plus the checks that ``array`` is ``[plan.num_rows, vocab_size]`` float32 within capacity."""
    plan = plan_rows(states, cum_num_token, draft_trees)
    rows = rows_and_vocab(array, what, vocab_size)
    if rows != plan.num_rows:
        raise ValueError(f"{what} has {rows} rows but the states (and drafts) need {plan.num_rows}")
    if rows > max_rows:
        raise ValueError(f"{rows} {what} rows exceed {owner}max_num_token={max_rows}")
    return plan
