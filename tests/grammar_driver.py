"""Driving a grammar with random logits, as a model would: the tests' stand-in for a real model.

Each step draws Gumbel noise over the vocabulary (random logits), keeps the tokens the mask allows and takes the
best. After ``patience`` steps, tokens holding a closing character of JSON (quote, bracket, brace, comma) or EOS get
a bonus that grows with the step, so that a random output also finishes (a uniformly random token almost never
closes a string in a 129k vocabulary). Jump-forward, when on, appends forced text through ``GrammarSource``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
from logitproc.runtime.grammar import GrammarSource, TokenizerAdapter

CLOSERS = (b'"', b"}", b"]", b",")


def allowed_ids(row: np.ndarray, vocab_size: int) -> np.ndarray:
    return np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little")[:vocab_size])


def closer_bonus(adapter: TokenizerAdapter) -> np.ndarray:
    bonus = np.array([any(c in b for c in CLOSERS) for b in adapter.token_bytes], np.float32)
    bonus[list(adapter.eos_token_ids)] = 2.0
    return bonus


@dataclass
class Generation:
    token_ids: list[int]
    text: bytes
    finished: bool  # EOS taken
    dead_end: bool
    model_steps: int
    jumped_tokens: int


def drive(source: GrammarSource, adapter: TokenizerAdapter, rng: np.random.Generator, bonus: np.ndarray,
          max_steps: int = 400, patience: int = 8, jump_forward: bool = False,
          mask_times: list[float] | None = None) -> Generation:
    """One random generation; with ``mask_times``, the seconds of each mask fill are appended to it."""
    row = np.empty((adapter.vocab_size + 31) // 32, np.int32)
    out: list[int] = []
    eos = set(adapter.eos_token_ids)
    steps = jumped = 0
    while steps < max_steps:
        if jump_forward:
            found = source.jump_forward(out)
            if found is not None:
                source.rollback(found.rollback)
                del out[len(out) - found.rollback:]
                for t in found.token_ids:
                    source.accept_token(t)
                out.extend(found.token_ids)
                jumped += len(found.token_ids)
        started = time.perf_counter()
        source.fill_bitmask(row, [])
        if mask_times is not None:
            mask_times.append(time.perf_counter() - started)
        allowed = allowed_ids(row, adapter.vocab_size)
        if allowed.size == 0:
            return Generation(out, adapter.decode_bytes(out), False, True, steps, jumped)
        scores = rng.gumbel(size=allowed.size)
        if steps >= patience:
            scores += bonus[allowed] * 0.5 * (steps - patience + 1)
        token = int(allowed[np.argmax(scores)])
        steps += 1
        source.accept_token(token)
        if token in eos:
            return Generation(out, adapter.decode_bytes(out), True, False, steps, jumped)
        out.append(token)
    return Generation(out, adapter.decode_bytes(out), False, False, steps, jumped)
