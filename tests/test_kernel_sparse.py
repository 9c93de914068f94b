"""apply_logit_bias_inplace and apply_penalty_inplace on the CPU against the numpy references."""

from __future__ import annotations

import numpy as np
import pytest
from kernel_harness import run_cpu
from logitproc.tir_kernels import reference

SHAPES = [(1, 1), (1, 31), (7, 33), (1, 128001), (7, 128256), (1, 151936), (99, 33), (99, 1000)]


def sparse_entries(rng: np.random.Generator, batch: int, vocab: int, per_row: int) -> tuple[np.ndarray, np.ndarray]:
    """Duplicate-free (row, token) entries, up to ``per_row`` per row."""
    rows, toks = [], []
    for r in range(batch):
        n = min(per_row, vocab)
        rows.append(np.full(n, r, dtype=np.int32))
        toks.append(rng.choice(vocab, size=n, replace=False).astype(np.int32))
    return np.concatenate(rows), np.concatenate(toks)


def logits_with_masked_rows(rng: np.random.Generator, batch: int, vocab: int) -> np.ndarray:
    logits = (rng.standard_normal((batch, vocab)) * 4).astype(np.float32)
    logits[0, : vocab // 2] = -np.inf
    if batch > 2:
        logits[2] = -np.inf
    return logits


@pytest.mark.parametrize(("batch", "vocab"), SHAPES)
def test_logit_bias_matches_reference(batch: int, vocab: int) -> None:
    rng = np.random.default_rng(batch * 1000 + vocab)
    logits = logits_with_masked_rows(rng, batch, vocab)
    pos2seq, token_ids = sparse_entries(rng, batch, vocab, per_row=17)
    bias = rng.uniform(-100, 100, size=pos2seq.size).astype(np.float32)
    (out, *_) = run_cpu("apply_logit_bias_inplace", logits, pos2seq, token_ids, bias)
    np.testing.assert_array_equal(out, reference.apply_logit_bias(logits, pos2seq, token_ids, bias))


@pytest.mark.parametrize(("batch", "vocab"), SHAPES)
def test_penalty_matches_reference(batch: int, vocab: int) -> None:
    rng = np.random.default_rng(batch * 1000 + vocab + 1)
    logits = logits_with_masked_rows(rng, batch, vocab)
    pos2seq, token_ids = sparse_entries(rng, batch, vocab, per_row=64)
    # Prompt-only tokens have count 0 (repetition only); output tokens count >= 1.
    token_cnt = rng.integers(0, 5, size=pos2seq.size).astype(np.int32)
    penalties = np.stack(
        [rng.uniform(-2, 2, batch), rng.uniform(-2, 2, batch), rng.uniform(0.5, 2, batch)], axis=1
    ).astype(np.float32)
    (out, *_) = run_cpu("apply_penalty_inplace", logits, pos2seq, token_ids, token_cnt, penalties)
    np.testing.assert_allclose(out, reference.apply_penalty(logits, pos2seq, token_ids, token_cnt, penalties),
                               rtol=1e-6, atol=1e-6)


def test_penalty_semantics_by_hand() -> None:
    logits = np.array([[2.0, -2.0, 3.0, 0.0]], dtype=np.float32)
    pos2seq = np.zeros(3, dtype=np.int32)
    token_ids = np.array([0, 1, 3], dtype=np.int32)
    token_cnt = np.array([0, 2, 1], dtype=np.int32)  # token 0 only in the prompt
    penalties = np.array([[0.5, 0.25, 2.0]], dtype=np.float32)  # presence, frequency, repetition
    (out, *_) = run_cpu("apply_penalty_inplace", logits, pos2seq, token_ids, token_cnt, penalties)
    # token 0: 2 / 2 = 1 (no output count); token 1: -2 * 2 - (0.25 * 2 + 0.5) = -5; token 2 untouched;
    # token 3: 0 * 2 - (0.25 + 0.5) = -0.75
    np.testing.assert_array_equal(out, np.array([[1.0, -5.0, 3.0, -0.75]], dtype=np.float32))


@pytest.mark.parametrize("kernel", ["apply_logit_bias_inplace", "apply_penalty_inplace"])
def test_empty_sparse_lists_leave_logits_alone(kernel: str) -> None:
    logits = np.random.default_rng(0).standard_normal((3, 33)).astype(np.float32)
    empty_i = np.zeros(0, dtype=np.int32)
    bias_args = (np.zeros(0, np.float32),)
    extra = bias_args if kernel == "apply_logit_bias_inplace" else (empty_i, np.ones((3, 3), np.float32))
    (out, *_) = run_cpu(kernel, logits, empty_i, empty_i, *extra)
    np.testing.assert_array_equal(out, logits)


def test_penalty_entries_with_a_negative_row_are_padding() -> None:
    rng = np.random.default_rng(3)
    logits = rng.standard_normal((3, 77)).astype(np.float32)
    pos2seq = np.array([0, -1, 2, -1, 1], np.int32)
    token_ids = np.array([5, 5, 76, 0, 0], np.int32)
    token_cnt = np.array([1, 9, 0, 9, 2], np.int32)
    penalties = np.tile(np.array([[1.0, 0.5, 1.5]], np.float32), (3, 1))
    (out, *_) = run_cpu("apply_penalty_inplace", logits, pos2seq, token_ids, token_cnt, penalties)
    expected = reference.apply_penalty(logits, pos2seq, token_ids, token_cnt, penalties)
    np.testing.assert_allclose(out, expected, rtol=1e-6)
    live = pos2seq >= 0
    np.testing.assert_allclose(expected, reference.apply_penalty(logits, pos2seq[live], token_ids[live],
                                                                 token_cnt[live], penalties), rtol=0)
