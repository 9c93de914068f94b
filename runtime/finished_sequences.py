"""Finished sequences: once a sequence is finished only its EOS tokens are allowed (RTP-LLM's MultiSeq processor).

In a multi-sequence request (n > 1, beams) the sequences step together; one that has finished while the others go on
must keep producing EOS. :class:`FinishedSequenceMask` does not constrain a running sequence (``fill_bitmask``
returns False); after ``finish()`` is called or an EOS token is committed, only the EOS tokens are allowed. A draft
path that contains an EOS token is treated the same way from that token on.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .mask_source import NeverForces


class FinishedSequenceMask(NeverForces):
    """A TokenMaskSource that allows only ``eos_ids`` once its sequence has finished."""

    __slots__ = ("eos_ids", "_eos", "_words", "_bits", "_finished", "_eos_at", "_accepted")

    def __init__(self, eos_ids: Sequence[int] | int) -> None:
        ids = (eos_ids,) if isinstance(eos_ids, (int, np.integer)) and not isinstance(eos_ids, bool) else eos_ids
        checked = tuple(ids)
        if not checked:
            raise ValueError("eos_ids must hold at least one token id")
        for t in checked:
            if isinstance(t, bool) or not isinstance(t, (int, np.integer)) or t < 0:
                raise ValueError(f"eos_ids: token ids must be ints >= 0, got {t!r}")
        self.eos_ids = tuple(sorted({int(t) for t in checked}))
        self._eos = frozenset(self.eos_ids)
        words: dict[int, int] = {}
        for t in self.eos_ids:
            words[t >> 5] = words.get(t >> 5, 0) | (1 << (t & 31))
        self._words = np.fromiter(words, np.int64, len(words))
        self._bits = np.fromiter(words.values(), np.uint64, len(words)).astype(np.uint32)
        self._finished = False
        self._eos_at: int | None = None  # index of the first accepted EOS
        self._accepted = 0

    def finish(self) -> None:
        """Mark the sequence finished (e.g. it hit a stop string or max_tokens while the others go on)."""
        self._finished = True

    @property
    def finished(self) -> bool:
        return self._finished

    def fill_bitmask(self, row: np.ndarray, draft_path: Sequence[int]) -> bool:
        if not self._finished and not any(int(t) in self._eos for t in draft_path):
            return False
        if self.eos_ids[-1] >= row.size * 32:
            raise ValueError(f"finished-sequence mask: EOS token {self.eos_ids[-1]} is outside the bitmask row "
                             f"({row.size * 32} tokens)")
        row.fill(0)
        row.view(np.uint32)[self._words] = self._bits
        return True

    def accept_token(self, token_id: int) -> None:
        if int(token_id) in self._eos and self._eos_at is None:
            self._eos_at = self._accepted
            self._finished = True
        self._accepted += 1

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens (an EOS among them no longer finishes the sequence)."""
        if not 0 <= num_tokens <= self._accepted:
            raise ValueError(f"cannot roll back {num_tokens} tokens: {self._accepted} were accepted")
        self._accepted -= num_tokens
        if self._eos_at is not None and self._eos_at >= self._accepted:
            self._eos_at = None
            self._finished = False

    def __repr__(self) -> str:
        return f"FinishedSequenceMask(eos_ids={list(self.eos_ids)}, finished={self._finished})"
