"""Incremental detokenization that never emits a partial UTF-8 character.

A byte-level BPE token may hold only part of a multi-byte character (an emoji is often split over two or three
tokens); decoding such a prefix gives U+FFFD. :class:`IncrementalDetokenizer` decodes a window of the latest tokens
and emits the new text only when it does not end in U+FFFD; otherwise it waits for the next token. Per token::

    prefix = decode(ids[prefix_offset:read_offset])     # text already emitted, decoded again for context
    full   = decode(ids[prefix_offset:])
    if len(full) > len(prefix) and not full.endswith("\\ufffd"):
        emit full[len(prefix):]; prefix_offset, read_offset = read_offset, len(ids)

so the work per token does not grow with the output. ``flush()`` emits whatever is held back at the end (a genuine
U+FFFD, or bytes that never became a character). ``rollback(k)`` removes the last k tokens (jump-forward decoding
re-tokenizes the end of the output): text already emitted stays emitted, and later text is taken from the full
decode past what was emitted.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

REPLACEMENT = "\ufffd"


class Decoder(Protocol):
    """What the detokenizer needs from a tokenizer (a Hugging Face ``tokenizers.Tokenizer`` has it)."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Turns one sequence's output tokens into UTF-8-safe text deltas (special tokens skipped unless
    ``skip_special_tokens`` is False)."""

    def __init__(self, tokenizer: Decoder, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self.token_ids: list[int] = []
        self.text = ""  # everything emitted so far
        self._prefix_offset = 0
        self._read_offset = 0
        self._resync = False  # after a rollback past emitted text: decode everything, emit past len(self.text)

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special)

    def add_tokens(self, token_ids: Sequence[int]) -> str:
        """Append tokens; return the text they complete (may be empty while a character is incomplete)."""
        self.token_ids.extend(int(t) for t in token_ids)
        if self._resync:
            full = self._decode(self.token_ids)
            if len(full) <= len(self.text) or full.endswith(REPLACEMENT):
                return ""
            delta = full[len(self.text):]
            self._resync = False
            self._prefix_offset = self._read_offset = len(self.token_ids)
            self.text += delta
            return delta
        prefix = self._decode(self.token_ids[self._prefix_offset : self._read_offset])
        full = self._decode(self.token_ids[self._prefix_offset :])
        if len(full) <= len(prefix) or full.endswith(REPLACEMENT):
            return ""
        delta = full[len(prefix) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(self.token_ids)
        self.text += delta
        return delta

    def rollback(self, count: int) -> None:
        """Forget the last ``count`` tokens. Emitted text is never taken back."""
        if count <= 0:
            return
        if count > len(self.token_ids):
            raise ValueError(f"cannot roll back {count} tokens of {len(self.token_ids)}")
        del self.token_ids[len(self.token_ids) - count :]
        if self._read_offset > len(self.token_ids):
            self._resync = True
        self._prefix_offset = min(self._prefix_offset, len(self.token_ids))

    def flush(self) -> str:
        """At the end of the sequence: the text held back (an incomplete character decodes as U+FFFD)."""
        if self._resync:
            full = self._decode(self.token_ids)
            delta = full[len(self.text) :] if len(full) > len(self.text) else ""
        else:
            prefix = self._decode(self.token_ids[self._prefix_offset : self._read_offset])
            full = self._decode(self.token_ids[self._prefix_offset :])
            delta = full[len(prefix) :]
        self._resync = False
        self._prefix_offset = self._read_offset = len(self.token_ids)
        self.text += delta
        return delta
