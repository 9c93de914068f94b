"""RequestState: what the processor and sampler remember about one sequence between steps.

Penalty state is incremental: every token a sequence has seen (prompt or output) has one entry in growable arrays
(``appeared_token_ids``, ``output_counts``) found through a dict, so appending a token is O(1) and the processor
reads the arrays as they are, without walking the token history.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .config import MAX_INT32, GenerationConfig
from .grammar.closing import DocumentClosing
from .grammar.source import GrammarSource
from .mask_source import TokenMaskSource
from .think_mode import ThinkBudget


def checked_token(token: Any, field: str) -> int:
    """``token`` as an int in [0, 2**31 - 1] (ids reach the kernels as int32), else an error naming ``field``."""
    if isinstance(token, bool) or not isinstance(token, (int, np.integer)):
        raise TypeError(f"{field}: token ids must be ints, got {token!r} ({type(token).__name__})")
    if not 0 <= token <= MAX_INT32:
        raise ValueError(f"{field}: token ids must be in [0, {MAX_INT32}] (and below the vocabulary size), "
                         f"got {token!r}")
    return int(token)


@dataclass(frozen=True)
class DraftTree:
    """Draft tokens of speculative decoding: ``parents[i]`` is the index of token i's parent, -1 for the root.

    A chain d0, d1, ... is ``parents = [-1, 0, 1, ...]``. Parents come before their children.
    """

    token_ids: tuple[int, ...]
    parents: tuple[int, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "token_ids", tuple(checked_token(t, "draft token_ids") for t in self.token_ids))
        if len(self.token_ids) != len(self.parents):
            raise ValueError(f"draft tree: {len(self.token_ids)} token_ids but {len(self.parents)} parents")
        for i, p in enumerate(self.parents):
            if not -1 <= p < i:
                raise ValueError(f"draft tree: parents[{i}] = {p}, must be -1 or an earlier index in [0, {i})")

    @classmethod
    def chain(cls, token_ids: Sequence[int]) -> DraftTree:
        return cls(tuple(token_ids), tuple(range(-1, len(token_ids) - 1)))

    def path(self, node: int) -> list[int]:
        """Token ids from the root down to ``node`` (inclusive); node -1 is the root itself (empty path)."""
        out: list[int] = []
        while node != -1:
            out.append(self.token_ids[node])
            node = self.parents[node]
        return out[::-1]


class RequestState:
    """One sequence: its prompt, config, committed output, incremental penalty counts and seeded random stream."""

    def __init__(self, prompt_token_ids: Sequence[int], config: GenerationConfig | None = None,
                 mask_sources: Sequence[TokenMaskSource] = ()) -> None:
        self.config = config if config is not None else GenerationConfig()
        if not isinstance(self.config, GenerationConfig):
            raise TypeError(f"config must be a GenerationConfig, got {type(self.config).__name__}")
        self.prompt_token_ids = [checked_token(t, "prompt_token_ids") for t in prompt_token_ids]
        #: The largest token id the state holds (prompt, output): a processor checks it against its vocabulary
        #: on every batch, so that an id appended after the request joined never reaches a kernel unchecked.
        self.max_token_id = -1
        self.output_token_ids: list[int] = []
        self.draft_token_ids: list[int] = []
        self.mask_sources = list(mask_sources)
        self._index: dict[int, int] = {}
        self._tokens = np.zeros(max(16, len(self.prompt_token_ids)), np.int32)
        self._counts = np.zeros_like(self._tokens)
        self._size = 0
        #: Entry position touched by each appended output token, in order: consumers that mirror the entries
        #: (the processor's penalty layout) replay it from where they left off.
        self.touch_log = array("i")
        #: Number of entries before each output token was appended (rollback truncates the entries back to it).
        self._sizes_before = array("i")
        #: Bumped by every rollback: consumers mirroring the entries rebuild them.
        self.rollback_epoch = 0
        for token in self.prompt_token_ids:
            self._entry(token)
        seed = self.config.seed
        #: The sequence's random stream; drawn from only through ``draw_uniforms`` (and put back by ``keep_draws``).
        self.rng = np.random.Generator(np.random.PCG64(seed)) if seed is not None else np.random.default_rng()
        #: The stream's state before the last ``draw_uniforms`` and how many of its draws are kept, until
        #: ``keep_draws`` settles them; None when nothing is pending.
        self._pending_draws: tuple[dict[str, Any], int] | None = None

    def draw_uniforms(self, count: int) -> np.ndarray:
        """``count`` uniform float32 numbers in [0, 1) from the sequence's stream: the sampler's draws for its rows of
        one step (one each). A step that checked drafts then keeps the draws of the rows it committed
        (``keep_draws``), so the stream goes on as if the rejected rows had never drawn."""
        self._pending_draws = (self.rng.bit_generator.state, count)
        return self.rng.random(count, dtype=np.float32)

    def keep_draws(self, count: int) -> None:
        """Keep the first ``count`` draws of the last ``draw_uniforms`` and give the others back: the stream is where
        drawing only those would have left it. Nothing to do when no draws are pending (a greedy sequence draws
        nothing); settles them either way."""
        if self._pending_draws is None:
            return
        began, made = self._pending_draws
        if isinstance(count, bool) or not isinstance(count, int) or not 0 <= count <= made:
            raise ValueError(f"keep_draws: count must be in [0, {made}] (the draws made), got {count!r}")
        self._pending_draws = None
        if count < made:
            self.rng.bit_generator.state = began
            self.rng.random(count, dtype=np.float32)

    def _entry(self, token: int) -> int:
        position = self._index.get(token)
        if position is None:
            if self._size == self._tokens.size:
                self._tokens = np.concatenate([self._tokens, np.zeros_like(self._tokens)])
                self._counts = np.concatenate([self._counts, np.zeros_like(self._counts)])
            position = self._index[token] = self._size
            self._tokens[position] = token
            self._size += 1
            self.max_token_id = max(self.max_token_id, token)
        return position

    def append_token(self, token_id: int) -> None:
        """Commit a generated token: output counts (O(1)) and every mask source advance."""
        token = checked_token(token_id, "append_token")
        self.output_token_ids.append(token)
        self._sizes_before.append(self._size)
        position = self._entry(token)
        self._counts[position] += 1
        self.touch_log.append(position)
        for source in self.mask_sources:
            source.accept_token(token)

    def rollback(self, num_tokens: int) -> None:
        """Remove the last ``num_tokens`` output tokens: counts, entries first seen in them, and every mask source
        go back to where they were."""
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or not 0 <= num_tokens <= len(
                self.output_token_ids):
            raise ValueError(f"rollback: num_tokens must be in [0, {len(self.output_token_ids)}], got {num_tokens!r}")
        if num_tokens == 0:
            return
        keep = len(self.output_token_ids) - num_tokens
        for token in self.output_token_ids[keep:]:
            self._counts[self._index[token]] -= 1
        size = self._sizes_before[keep]
        for token in self._tokens[size : self._size]:
            del self._index[int(token)]
        self._counts[size : self._size] = 0
        self._size = size
        self.max_token_id = int(self._tokens[:size].max()) if size else -1
        del self.output_token_ids[keep:]
        del self._sizes_before[keep:]
        for source in self.mask_sources:
            source.rollback(num_tokens)
        self.rollback_epoch += 1

    # ---- closing within max_tokens (``grammar/closing.py``) ----------------------------------------------------------
    @property
    def closing(self) -> DocumentClosing | None:
        """The source that closes the document within ``max_tokens`` (a grammar with max_tokens), else None."""
        return next((s for s in self.mask_sources if isinstance(s, DocumentClosing)), None)

    def closable_token(self, token_id: int) -> int:
        """The token to commit for the sampled ``token_id``: itself, or the closing's next token when the document
        could no longer close within ``max_tokens`` after the sample (``DocumentClosing.closable_token``)."""
        closing = self.closing
        return token_id if closing is None else closing.closable_token(token_id)

    @property
    def closed_at_max_tokens(self) -> bool:
        """At least one output token was chosen by the closing to end the document within ``max_tokens``."""
        closing = self.closing
        return closing is not None and closing.closed

    @property
    def grammar_complete(self) -> bool | None:
        """The output is a whole match of its grammar (the grammar accepts here); None without a grammar."""
        for source in self.mask_sources:
            inner = source.inner if isinstance(source, ThinkBudget) else source
            if isinstance(inner, GrammarSource):
                return inner.is_accepting or inner.is_terminated
        return None

    @property
    def appeared_token_ids(self) -> np.ndarray:
        """Distinct tokens of the prompt and the output (a view; do not modify)."""
        return self._tokens[: self._size]

    @property
    def output_counts(self) -> np.ndarray:
        """Occurrences in the output of each of ``appeared_token_ids`` (0 for prompt-only tokens; a view)."""
        return self._counts[: self._size]

    def penalty_entries(self, draft_path: Sequence[int] = ()) -> tuple[np.ndarray, np.ndarray]:
        """(token ids, output counts) as if ``draft_path`` had been appended; the state itself is not changed."""
        if not draft_path:
            return self.appeared_token_ids, self.output_counts
        tokens, counts = self.appeared_token_ids.copy(), self.output_counts.copy()
        extra: dict[int, int] = {}
        for token in draft_path:
            position = self._index.get(token)
            if position is None:
                extra[token] = extra.get(token, 0) + 1
            else:
                counts[position] += 1
        if extra:
            tokens = np.concatenate([tokens, np.fromiter(extra, np.int32, len(extra))])
            counts = np.concatenate([counts, np.fromiter(extra.values(), np.int32, len(extra))])
        return tokens, counts

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def __repr__(self) -> str:
        return (f"RequestState(prompt={len(self.prompt_token_ids)} tokens, output={len(self.output_token_ids)} tokens)")
