"""The one contract every token mask source implements (grammar, think budget, Tree Decode, token rules, ...)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np


@dataclass(frozen=True)
class JumpForward:
    """Make the output agree with a jump: drop its last ``rollback`` tokens, then append ``token_ids``."""

    rollback: int
    token_ids: list[int]


class TokenMaskSource(Protocol):
    """Something that constrains a sequence's next token (a grammar, a tree, a think budget, ...).

    ``fill_bitmask(row, draft_path)`` writes the allowed tokens for the next position, as if ``draft_path`` had been
    appended, into ``row`` (int32 ``[ceil(V/32)]``, bit ``v % 32`` of word ``v // 32`` = token v allowed), leaving its
    own state as it was; it returns False when it does not constrain that position (the row is then ignored).
    ``accept_token(t)`` advances it after a token is committed (raising when it refuses the token);
    ``rollback(n)`` undoes the last ``n`` accepted tokens (jump-forward re-tokenisation, draft verification);
    ``jump_forward(output_token_ids)`` says which tokens it forces next (None when it forces nothing), leaving its
    state unchanged: the caller applies the jump through ``RequestState.rollback`` / ``append_token``.
    """

    def fill_bitmask(self, row: np.ndarray, draft_path: Sequence[int]) -> bool: ...

    def accept_token(self, token_id: int) -> None: ...

    def rollback(self, num_tokens: int) -> None: ...

    def jump_forward(self, output_token_ids: Sequence[int]) -> JumpForward | None: ...


class NeverForces:
    """Mixin of the sources that constrain without forcing anything: ``jump_forward`` is always None."""

    __slots__ = ()

    def jump_forward(self, output_token_ids: Sequence[int]) -> JumpForward | None:
        return None
