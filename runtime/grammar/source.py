"""GrammarSource: a grammar matcher as the TokenMaskSource of one sequence, with draft tokens and jump-forward.

Draft tokens: the row for a draft position is filled by accepting the draft path, filling, and rolling back, so the
matcher ends exactly where it started. A draft path that leaves the grammar gets an all-zero row (no token is valid
after it; speculative verification rejects that path anyway).

Jump-forward (:meth:`GrammarSource.jump_forward`): when the grammar forces the next bytes, they are appended without
running the model. Appending the tokens of the forced text alone would give a tokenisation the model never saw at
the boundary (``"`` + ``,`` where the tokenizer has ``",``), so the tail of the output (its last
``RETOKENIZE_TOKENS`` tokens) plus the forced text is tokenised again with the real tokenizer; the tokens that
changed are rolled back and the new ones appended. A jump never ends on a token that is the prefix of a longer
token (the model could not produce that longer token afterwards), and it is refused when the re-tokenised text
does not decode to exactly the same bytes or the grammar would not accept the new tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..mask_source import JumpForward
from .backend import GrammarError, GrammarMatcher
from .recovery import RecoveringMatcher
from .tokenizer_adapter import TokenizerAdapter

#: Output tokens re-tokenised together with the forced text.
RETOKENIZE_TOKENS = 4


class GrammarSource:
    """The grammar constraint of one sequence (a TokenMaskSource with rollback and jump-forward)."""

    def __init__(self, matcher: GrammarMatcher, tokenizer: TokenizerAdapter, backend: str = "",
                 relaxed_keywords: tuple[str, ...] = (), recovery: RecoveringMatcher | None = None) -> None:
        """``recovery``: the matcher (``matcher`` itself or wrapped by it) that goes on with another grammar when
        the engine fails mid-answer; the relaxed keywords are then its (they grow when a recovery relaxes)."""
        self.matcher = matcher
        self.tokenizer = tokenizer
        self.backend = backend
        self._relaxed = relaxed_keywords
        self.recovery = recovery
        self.accepted = 0

    @property
    def relaxed_keywords(self) -> tuple[str, ...]:
        """Schema keywords the grammar does not enforce (``GrammarBackend.relaxed_keywords``)."""
        return self.recovery.relaxed_keywords if self.recovery is not None else self._relaxed

    # ---- TokenMaskSource -----------------------------------------------------------------------------------------
    def fill_bitmask(self, row: np.ndarray, draft_path: Sequence[int]) -> bool:
        if not draft_path:
            self.matcher.fill_next_token_bitmask(row)
            return True
        taken = self.matcher.try_accept_tokens(list(draft_path))
        try:
            if taken < len(draft_path):
                row.fill(0)
            else:
                self.matcher.fill_next_token_bitmask(row)
        finally:
            self.matcher.rollback(taken)
        return True

    def accept_token(self, token_id: int) -> None:
        if not self.matcher.try_accept_token(token_id):
            raise GrammarError(f"token {token_id} ({self.tokenizer.token_bytes[token_id]!r}) is not allowed by the "
                               f"grammar at output token {self.accepted}")
        self.accepted += 1

    def rollback(self, num_tokens: int) -> None:
        if not 0 <= num_tokens <= self.accepted:
            raise ValueError(f"cannot roll back {num_tokens} tokens: the grammar has accepted {self.accepted}")
        self.matcher.rollback(num_tokens)
        self.accepted -= num_tokens

    # ---- state -------------------------------------------------------------------------------------------------
    @property
    def is_accepting(self) -> bool:
        return self.matcher.is_accepting()

    @property
    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()

    # ---- jump-forward ------------------------------------------------------------------------------------------
    def jump_forward(self, output_token_ids: Sequence[int]) -> JumpForward | None:
        """What to change in the output to append the forced text; None when nothing can be forced.

        ``output_token_ids`` are the tokens this source has accepted (the sequence's output). The source's own
        state is left unchanged: the caller rolls back and appends through the RequestState, which advances it.
        """
        forced = self.matcher.forced_bytes()
        if not forced or self.matcher.is_terminated():
            return None
        tok = self.tokenizer
        tail = list(output_token_ids[max(0, len(output_token_ids) - min(RETOKENIZE_TOKENS, self.accepted)):])
        plan = self._retokenize(tail, forced) or self._retokenize([], forced)
        if plan is None:
            return None
        rollback, new_ids = plan
        # Do not end on a token that a longer token extends, nor on a special token.
        while new_ids and (tok.extendable[new_ids[-1]] or not tok.token_bytes[new_ids[-1]]):
            new_ids.pop()
        removed_text = tok.decode_bytes(output_token_ids[len(output_token_ids) - rollback:]) if rollback else b""
        if len(tok.decode_bytes(new_ids)) <= len(removed_text):
            return None  # a jump must add text, not only rewrite it
        # The grammar must take the new tokens after the rollback; the state is restored either way.
        removed = list(output_token_ids[len(output_token_ids) - rollback:]) if rollback else []
        self.matcher.rollback(rollback)
        taken = self.matcher.try_accept_tokens(new_ids)
        self.matcher.rollback(taken)
        if self.matcher.try_accept_tokens(removed) != len(removed):
            raise GrammarError("grammar state could not be restored after a jump-forward check")
        if taken == 0:
            return None
        return JumpForward(rollback, new_ids[:taken])

    def _retokenize(self, tail: list[int], forced: bytes) -> tuple[int, list[int]] | None:
        tok = self.tokenizer
        text = tok.decode_bytes(tail) + forced
        try:
            decoded = text.decode("utf-8")
        except UnicodeDecodeError:
            return None
        new_ids = tok.encode(decoded)
        if tok.decode_bytes(new_ids) != text:
            return None
        common = 0
        while common < min(len(tail), len(new_ids)) and tail[common] == new_ids[common]:
            common += 1
        if common == len(new_ids):
            return None
        return len(tail) - common, new_ids[common:]
