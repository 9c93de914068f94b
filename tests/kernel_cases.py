"""One table of kernel cases, on awkward sizes, with a check against the numpy references; used by the device matrix.

A case holds the arguments (outputs pre-filled with NaN or -7 so a missed write fails) and a check that receives the
arguments as the kernel left them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from logitproc.tir_kernels import reference as ref

#: (batch, vocab): vocab 1 and not a multiple of 32, the common 128k/152k vocabularies, batch 1 and 99.
SIZES = [(1, 1), (1, 31), (7, 33), (99, 33), (1, 128001), (3, 128256), (2, 151936)]

Check = Callable[[list[np.ndarray]], None]


@dataclass(frozen=True)
class KernelCase:
    kernel: str
    batch: int
    vocab: int
    args: tuple[np.ndarray, ...]
    check: Check

    @property
    def id(self) -> str:
        return f"{self.kernel}-B{self.batch}-V{self.vocab}"


def awkward_logits(rng: np.random.Generator, batch: int, vocab: int) -> np.ndarray:
    """Normal logits with a partly masked first row, an all -inf row (batch >= 3) and ties at the max (batch >= 2)."""
    x = (rng.standard_normal((batch, vocab)) * 3).astype(np.float32)
    x[0, ::2] = -np.inf if vocab > 1 else x[0, ::2]
    if batch >= 2 and vocab >= 4:
        x[1, [1, vocab - 1]] = x[1].max() + 1  # a tie at the max: lowest id wins
    if batch >= 3:
        x[2] = -np.inf
    return x


def _nan(*shape: int) -> np.ndarray:
    return np.full(shape, np.nan, np.float32)


def _neg7(*shape: int) -> np.ndarray:
    return np.full(shape, -7, np.int32)


def _sparse(rng: np.random.Generator, batch: int, vocab: int, per_row: int) -> tuple[np.ndarray, np.ndarray]:
    rows, toks = [], []
    for r in range(batch):
        chosen = rng.choice(vocab, size=min(per_row, vocab), replace=False)
        rows.append(np.full(chosen.size, r, np.int32))
        toks.append(chosen.astype(np.int32))
    return np.concatenate(rows), np.concatenate(toks)


def _probs(rng: np.random.Generator, batch: int, vocab: int) -> np.ndarray:
    return ref.softmax_with_temperature(awkward_logits(rng, batch, vocab), np.full(batch, 0.8, np.float32))


def logit_bias_case(rng: np.random.Generator, batch: int, vocab: int) -> KernelCase:
    logits = awkward_logits(rng, batch, vocab)
    rows, toks = _sparse(rng, batch, vocab, 9)
    bias = rng.uniform(-100, 100, rows.size).astype(np.float32)
    expected = ref.apply_logit_bias(logits, rows, toks, bias)
    return KernelCase("apply_logit_bias_inplace", batch, vocab, (logits, rows, toks, bias),
                      lambda out: np.testing.assert_array_equal(out[0], expected))


def penalty_case(rng: np.random.Generator, batch: int, vocab: int) -> KernelCase:
    logits = awkward_logits(rng, batch, vocab)
    rows, toks = _sparse(rng, batch, vocab, 40)
    cnt = rng.integers(0, 4, rows.size).astype(np.int32)
    penalties = np.stack([rng.uniform(-2, 2, batch), rng.uniform(-2, 2, batch), rng.uniform(0.5, 2, batch)],
                         axis=1).astype(np.float32)
    expected = ref.apply_penalty(logits, rows, toks, cnt, penalties)
    return KernelCase("apply_penalty_inplace", batch, vocab, (logits, rows, toks, cnt, penalties),
                      lambda out: np.testing.assert_allclose(out[0], expected, rtol=1e-6, atol=1e-6))


def bitmask_case(rng: np.random.Generator, batch: int, vocab: int) -> KernelCase:
    logits = awkward_logits(rng, batch, vocab)
    row_ids = np.flatnonzero(np.arange(batch) % 2 == 0).astype(np.int32)  # half the rows carry a mask
    allowed = rng.random((row_ids.size, vocab)) < 0.3
    allowed[0] = False  # every token of one row masked
    bitmask = ref.pack_bitmask(allowed)
    expected = ref.apply_bitmask(logits, row_ids, bitmask)
    return KernelCase("apply_bitmask_inplace", batch, vocab, (logits, row_ids, bitmask),
                      lambda out: np.testing.assert_array_equal(out[0], expected))


def softmax_case(rng: np.random.Generator, batch: int, vocab: int) -> KernelCase:
    logits = awkward_logits(rng, batch, vocab)
    temperature = np.resize(np.array([0.7, 0.0, 1.0, 2.0, 1e-4], np.float32), batch)
    expected = ref.softmax_with_temperature(logits, temperature)

    def check(out: list[np.ndarray]) -> None:
        probs = out[2]
        np.testing.assert_allclose(probs, expected, rtol=2e-5, atol=1e-7)
        assert np.all(probs[expected == 0] == 0), "masked or greedy-zero probabilities must be exactly 0"

    return KernelCase("softmax_with_temperature", batch, vocab, (logits, temperature, _nan(batch, vocab)), check)


def renormalize_case(rng: np.random.Generator, batch: int, vocab: int) -> KernelCase:
    probs = _probs(rng, batch, vocab)
    top_k = np.resize(np.array([0, 50, 1, -1, 7], np.int32), batch)
    top_p = np.resize(np.array([0.9, 1.0, 0.5, 0.95, 0.3], np.float32), batch)
    min_p = np.resize(np.array([0.0, 0.05, 0.0, 0.1, 0.0], np.float32), batch)
    expected = ref.renormalize(probs, top_k, top_p, min_p)

    def check(out: list[np.ndarray]) -> None:
        np.testing.assert_allclose(out[4], expected, rtol=1e-5, atol=1e-7)
        assert np.all(out[4][expected == 0] == 0), "dropped tokens must be exactly 0"

    return KernelCase("renormalize_probs", batch, vocab, (probs, top_k, top_p, min_p, _nan(batch, vocab)), check)


def multinomial_case(rng: np.random.Generator, batch: int, vocab: int) -> KernelCase:
    probs = _probs(rng, batch, vocab)
    uniform = rng.random(batch).astype(np.float32)
    uniform[0] = 0.0
    if batch > 1:
        uniform[-1] = np.nextafter(np.float32(1), np.float32(0))

    def check(out: list[np.ndarray]) -> None:
        tokens, chosen = out[2], out[3]
        for r in range(batch):
            p = probs[r].astype(np.float64)
            if not (p > 0).any():
                assert tokens[r] == -1 and chosen[r] == 0
                continue
            t = int(tokens[r])
            assert 0 <= t < vocab and p[t] > 0, f"row {r}: token {t} has probability 0"
            assert chosen[r] == probs[r, t]
            # float32 sums in another order may move the hit across a boundary by rounding only
            before, target = p[:t].sum(), float(uniform[r]) * p.sum()
            slack = 1e-5 * p.sum()
            assert before - slack <= target <= before + p[t] + slack, f"row {r}: token {t} is not where u lands"

    return KernelCase("multinomial_from_uniform", batch, vocab,
                      (probs, uniform, _neg7(batch), _nan(batch)), check)


def argmax_case(rng: np.random.Generator, batch: int, vocab: int) -> KernelCase:
    x = awkward_logits(rng, batch, vocab)
    index, value = ref.argmax(x)

    def check(out: list[np.ndarray]) -> None:
        np.testing.assert_array_equal(out[1], index)
        np.testing.assert_array_equal(out[2], value)

    return KernelCase("argmax", batch, vocab, (x, _neg7(batch), _nan(batch)), check)


def top_n_case(rng: np.random.Generator, batch: int, vocab: int) -> KernelCase:
    x = np.round(awkward_logits(rng, batch, vocab))  # many ties
    n = min(5, vocab)
    values, indices = ref.top_n(x, n)

    def check(out: list[np.ndarray]) -> None:
        np.testing.assert_array_equal(out[1], values)
        np.testing.assert_array_equal(out[2], indices)

    return KernelCase("top_n", batch, vocab, (x, _nan(batch, n), _neg7(batch, n)), check)


def log_softmax_case(rng: np.random.Generator, batch: int, vocab: int) -> KernelCase:
    x = awkward_logits(rng, batch, vocab)
    targets = rng.integers(0, vocab, batch).astype(np.int32)
    with np.errstate(divide="ignore", invalid="ignore"):
        logprob, lse = ref.log_softmax_gather(x, targets)

    def check(out: list[np.ndarray]) -> None:
        np.testing.assert_allclose(out[2], logprob, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(out[3], lse, rtol=1e-5, atol=1e-5)

    return KernelCase("log_softmax_gather", batch, vocab, (x, targets, _nan(batch), _nan(batch)), check)


def sample_from_logits_case(rng: np.random.Generator, batch: int, vocab: int) -> KernelCase:
    logits = awkward_logits(rng, batch, vocab)
    temperature = np.resize(np.array([0.7, 0.0, 1.0, 2.0, 1e-4], np.float32), batch)
    top_k = np.resize(np.array([0, 50, 1, -1, 7], np.int32), batch)
    top_p = np.resize(np.array([0.9, 1.0, 0.5, 0.95, 0.3], np.float32), batch)
    min_p = np.resize(np.array([0.0, 0.05, 0.0, 0.1, 0.0], np.float32), batch)
    renorm = np.resize(np.array([1, 1, 0], np.int32), batch)
    uniform = rng.random(batch).astype(np.float32)
    allowed = rng.random((2, vocab)) < 0.5
    allowed[:, 0] = True
    mask_index = np.resize(np.int32([-1, 0, -1, 1]), batch)  # rows 1 and 3 (mod 4) masked by the folded bitmask
    masked = logits.copy()
    for r in range(batch):
        if mask_index[r] >= 0:
            masked[r] = np.where(allowed[mask_index[r]], logits[r], -np.inf)
    probs = ref.softmax_with_temperature(masked, temperature)
    probs = np.where(renorm[:, None] != 0, ref.renormalize(probs, top_k, top_p, min_p), probs)

    top_count = np.resize(np.int32([3, 0]), batch)
    n = min(3, vocab)

    def check(out: list[np.ndarray]) -> None:
        tokens, chosen, top_values, top_ids = out[9], out[10], out[12], out[13]
        for r in range(batch):
            p = probs[r].astype(np.float64)
            t = int(tokens[r])
            if not (p > 0).any():
                assert t == -1 and chosen[r] == 0, f"row {r}: a row of zeros gives -1, got {t}"
                continue
            assert 0 <= t < vocab and p[t] > 0, f"row {r}: token {t} has probability 0"
            np.testing.assert_allclose(chosen[r], p[t], rtol=2e-5)
            before, target = p[:t].sum(), float(uniform[r]) * p.sum()
            slack = 1e-5 * p.sum()
            assert before - slack <= target <= before + p[t] + slack, f"row {r}: token {t} is not where u lands"
        for r in range(batch):  # processed top-n where asked: the largest probabilities, in order
            k = min(top_count[r], n)
            np.testing.assert_allclose(top_values[r, :k], np.sort(probs[r])[::-1][:k], rtol=2e-5, atol=1e-12)
            np.testing.assert_allclose(probs[r, top_ids[r, :k]], top_values[r, :k], rtol=2e-5, atol=1e-12)

    return KernelCase("sample_from_logits", batch, vocab, (logits, temperature, top_k, top_p, min_p, renorm, uniform,
                                                           mask_index, ref.pack_bitmask(allowed), _neg7(batch),
                                                           _nan(batch), top_count,
                                                           np.full((batch, n), np.nan, np.float32),
                                                           np.full((batch, n), -7, np.int32)), check)


CASE_BUILDERS = [logit_bias_case, penalty_case, bitmask_case, softmax_case, renormalize_case, multinomial_case,
                 argmax_case, top_n_case, log_softmax_case, sample_from_logits_case]


def all_cases() -> list[KernelCase]:
    cases = []
    for builder in CASE_BUILDERS:
        for batch, vocab in SIZES:
            cases.append(builder(np.random.default_rng(batch * 7919 + vocab), batch, vocab))
    return cases
