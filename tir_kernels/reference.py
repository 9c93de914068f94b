"""Numpy references of every kernel: the definition of their semantics, imported by tests and benchmarks.

Conventions shared by all kernels:
- logits and probabilities are float32 ``[rows, vocab]``; token ids and row indices are int32;
- a masked logit is ``-inf``; its probability is exactly ``0.0``;
- a row whose every logit is ``-inf`` has all-zero probabilities (never NaN); sampling marks it with token ``-1``;
- ties between equal values resolve to the lowest token id.

Each function returns new arrays and never modifies its inputs (the kernels named ``*_inplace`` do).
"""

from __future__ import annotations

import numpy as np

NEG_INF = np.float32(-np.inf)


def apply_logit_bias(logits: np.ndarray, pos2seq: np.ndarray, token_ids: np.ndarray, bias: np.ndarray) -> np.ndarray:
    """``out[pos2seq[i], token_ids[i]] += bias[i]`` for every sparse entry i (entries are duplicate-free); entries
    naming a row or token outside ``logits`` are skipped."""
    out = logits.copy()
    live = _inside(logits, pos2seq, token_ids)
    np.add.at(out, (pos2seq[live], token_ids[live]), bias[live].astype(np.float32))
    return out


def _inside(logits: np.ndarray, rows: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    """Entries naming a row and a token of ``logits`` (the kernels skip the others)."""
    batch, vocab = logits.shape
    return (rows >= 0) & (rows < batch) & (tokens >= 0) & (tokens < vocab)


def apply_penalty(
    logits: np.ndarray,
    pos2seq: np.ndarray,
    token_ids: np.ndarray,
    token_cnt: np.ndarray,
    penalties: np.ndarray,
) -> np.ndarray:
    """Repetition, then frequency and presence penalties, for each sparse (row, token, output count) entry.

    ``penalties[row] = (presence, frequency, repetition)``. Entries list every token that occurs in the prompt or the
    output of the row's sequence; ``token_cnt`` counts its occurrences in the output only (0 for prompt-only tokens).
    Entries with a negative row are padding and skipped, as are entries naming a row or token outside ``logits``::

        x = logits[r, t]
        x = x / rep if x > 0 else x * rep
        x -= frequency * cnt + presence * (cnt > 0)
    """
    out = logits.copy()
    live = _inside(logits, pos2seq, token_ids)
    pos2seq, token_ids, token_cnt = pos2seq[live], token_ids[live], token_cnt[live]
    rows, toks = pos2seq.astype(np.int64), token_ids.astype(np.int64)
    x = out[rows, toks]
    presence, frequency, repetition = (penalties[rows, j].astype(np.float32) for j in range(3))
    x = np.where(x > 0, x / repetition, x * repetition).astype(np.float32)
    cnt = token_cnt.astype(np.float32)
    x = x - (frequency * cnt + presence * (cnt > 0).astype(np.float32))
    out[rows, toks] = x
    return out


def unpack_bitmask(bitmask: np.ndarray, vocab: int) -> np.ndarray:
    """bool ``[rows, vocab]``: token v allowed iff bit ``v % 32`` of word ``v // 32`` is set."""
    words = bitmask.view(np.uint32)[:, np.arange(vocab) // 32]
    return ((words >> (np.arange(vocab, dtype=np.uint32) % 32)) & 1).astype(bool)


def pack_bitmask(allowed: np.ndarray) -> np.ndarray:
    """Inverse of unpack_bitmask: int32 ``[rows, ceil(vocab / 32)]`` with padding bits cleared."""
    rows, vocab = allowed.shape
    words = (vocab + 31) // 32
    padded = np.zeros((rows, words * 32), dtype=bool)
    padded[:, :vocab] = allowed
    bits = padded.reshape(rows, words, 32).astype(np.uint64) << np.arange(32, dtype=np.uint64)
    return bits.sum(axis=2).astype(np.uint32).view(np.int32)


def apply_bitmask(logits: np.ndarray, row_ids: np.ndarray, bitmask: np.ndarray) -> np.ndarray:
    """``out[row_ids[i], v] = -inf`` where bit v of ``bitmask[i]`` is clear; other rows untouched, as are row ids
    outside ``logits`` and every row when the bitmask has fewer than ``ceil(vocab / 32)`` words."""
    out = logits.copy()
    batch, vocab = logits.shape
    if bitmask.shape[1] * 32 < vocab:
        return out
    allowed = unpack_bitmask(bitmask, vocab)
    for i, r in enumerate(row_ids):
        if 0 <= r < batch:
            out[r] = np.where(allowed[i], out[r], NEG_INF)
    return out


def softmax_with_temperature(logits: np.ndarray, temperature: np.ndarray) -> np.ndarray:
    """Row-wise ``softmax(logits[r] / temperature[r])`` in float32.

    Temperature 0 gives a one-hot on the argmax (lowest id on ties). A row of only -inf gives zeros.
    """
    rows, vocab = logits.shape
    out = np.zeros((rows, vocab), dtype=np.float32)
    for r in range(rows):
        x = logits[r].astype(np.float64)
        m = x.max()
        if m == -np.inf:
            continue
        if temperature[r] == 0:
            out[r, int(np.argmax(x))] = 1.0
            continue
        e = np.exp((x - m) / np.float64(temperature[r]))
        out[r] = (e / e.sum()).astype(np.float32)
    return out


def argmax(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per row: (index of the largest value, lowest on ties; that value)."""
    idx = np.argmax(x, axis=1).astype(np.int32)
    return idx, x[np.arange(x.shape[0]), idx].astype(np.float32)


def renormalize(probs: np.ndarray, top_k: np.ndarray, top_p: np.ndarray, min_p: np.ndarray) -> np.ndarray:
    """min-p, then top-k, then top-p on each row of probabilities, then rescale the kept ones to sum to 1.

    Per row, with ``p`` the row and ``keep`` starting as ``p > 0``:
    1. min-p (0 = off): keep tokens with ``p >= min_p * max(p)``;
    2. top-k (<= 0 or >= vocab = off): keep tokens with ``p >=`` the k-th largest kept value (ties kept);
    3. top-p (1 = off): over the kept tokens, with ``mass = sum(kept p)``, drop every token whose value q satisfies
       ``sum(kept p where p <= q) <= (1 - top_p) * mass``; this equals sorting ascending and dropping while the
       cumulative sum is <= (1 - top_p) * mass, except that equal values are kept or dropped together. The largest
       value always stays.
    Kept tokens are divided by their sum; others become 0. A row of zeros stays zeros.
    """
    rows, vocab = probs.shape
    out = np.zeros_like(probs, dtype=np.float32)
    for r in range(rows):
        p = probs[r].astype(np.float64)
        keep = p > 0
        if not keep.any():
            continue
        if min_p[r] > 0:
            keep &= p >= np.float64(np.float32(min_p[r]) * np.float32(p.max()))
        k = int(top_k[r])
        if 0 < k < vocab:
            kept_values = np.sort(p[keep])[::-1]
            if k < kept_values.size:
                keep &= p >= kept_values[k - 1]
        if top_p[r] < 1:
            order = np.sort(p[keep])
            budget = (1.0 - np.float64(top_p[r])) * order.sum()
            # cumulative kept mass up to and including each distinct value
            values = np.unique(order)
            below = np.cumsum(order)[np.searchsorted(order, values, side="right") - 1]
            # the largest value always stays (top_p = 0 would otherwise drop every value)
            dropped = values[:-1][below[:-1] <= budget]
            if dropped.size:
                keep &= p > dropped.max()
        kept = np.where(keep, p, 0.0)
        if kept.sum() > 0:  # min_p > 1 keeps nothing: zeros, not NaN
            out[r] = (kept / kept.sum()).astype(np.float32)
    return out


def multinomial_from_uniform(probs: np.ndarray, uniform: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per row: the first token whose cumulative probability exceeds ``uniform[r] * sum(probs[r])``.

    Returns (token ids int32, the chosen token's probability). Tokens of probability 0 are never chosen; if rounding
    leaves the cumulative sum short of the target the last token with p > 0 is chosen. A row of zeros gives -1, 0.
    """
    rows = probs.shape[0]
    tokens = np.full(rows, -1, dtype=np.int32)
    chosen = np.zeros(rows, dtype=np.float32)
    for r in range(rows):
        p = probs[r].astype(np.float64)
        nonzero = np.flatnonzero(p > 0)
        if nonzero.size == 0:
            continue
        csum = np.cumsum(p)
        target = np.float64(uniform[r]) * csum[-1]
        hit = int(np.searchsorted(csum, target, side="right"))
        t = hit if hit < p.size and p[hit] > 0 else int(nonzero[-1])
        tokens[r] = t
        chosen[r] = probs[r, t]
    return tokens, chosen


def top_n(x: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Per row, the n largest values in decreasing order (equal values: lower id first) and their ids."""
    order = np.lexsort((np.broadcast_to(np.arange(x.shape[1]), x.shape), -x.astype(np.float64)), axis=1)[:, :n]
    return np.take_along_axis(x, order, axis=1).astype(np.float32), order.astype(np.int32)


def log_softmax_gather(logits: np.ndarray, target_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per row: (``log_softmax(logits[r])[target_ids[r]]``, ``logsumexp(logits[r])``); a row of -inf: -inf, -inf."""
    x = logits.astype(np.float64)
    m = x.max(axis=1, keepdims=True)
    finite = np.isfinite(m)
    safe_m = np.where(finite, m, 0.0)
    lse = (np.log(np.exp(x - safe_m).sum(axis=1, keepdims=True)) + safe_m)[:, 0]
    lse = np.where(finite[:, 0], lse, -np.inf)
    picked = x[np.arange(x.shape[0]), target_ids]
    logprob = np.where(finite[:, 0], picked - lse, -np.inf)
    return logprob.astype(np.float32), lse.astype(np.float32)


def sample_from_logits(logits: np.ndarray, temperature: np.ndarray, top_k: np.ndarray, top_p: np.ndarray,
                       min_p: np.ndarray, renorm: np.ndarray, uniform: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The staged pipeline on each row: temperature softmax, then (where ``renorm[r]``) min-p / top-k / top-p and
    rescaling, then the multinomial draw with ``uniform[r]``. Returns (token ids, the chosen token's probability);
    a row with every logit -inf gives -1, 0."""
    probs = softmax_with_temperature(logits, temperature)
    filtered = renormalize(probs, top_k, top_p, min_p)
    return multinomial_from_uniform(np.where(np.asarray(renorm)[:, None] != 0, filtered, probs), uniform)
