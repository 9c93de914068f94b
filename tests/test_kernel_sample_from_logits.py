"""sample_from_logits: the fused kernel against the staged kernels (same uniforms, same tokens, bit for bit), against
``reference.sample_from_logits`` (chi-square over many uniforms per config), and on edge rows.

The staged path is ``softmax_with_temperature`` -> ``renormalize_probs`` (where ``renorm``) ->
``multinomial_from_uniform``, each compiled for this CPU; the GPU variant runs on lavapipe (when wgpu and Mesa's CPU
Vulkan driver are installed) against the staged kernels there.
"""

from __future__ import annotations

import numpy as np
import pytest
from kernel_harness import run_cpu, vulkan_kernels_or_skip
from logitproc.tir_kernels import multinomial, reference, renormalize, sample_from_logits, softmax, top_n
from scipy import stats

NAME = sample_from_logits.NAME
ALMOST_ONE = np.nextafter(np.float32(1), np.float32(0))


def row_params(batch: int, vocab: int, seed: int) -> dict[str, np.ndarray]:
    """A mix of every kind of row: greedy, tiny temperatures, top-k 1 / k >= V, top-p 1e-6, min-p, filters off."""
    rng = np.random.default_rng(seed)
    temperature = np.resize(np.array([0.7, 0.0, 1.0, 1e-4, 1e-39, 2.0, 0.5, 1.3], np.float32), batch)
    top_k = np.resize(np.array([0, 1, 50, vocab, vocab + 7, -1, 0, 3], np.int32), batch)
    top_p = np.resize(np.array([0.9, 1.0, 1e-6, 0.5, 1.0, 0.95, 0.0, 1.0], np.float32), batch)
    min_p = np.resize(np.array([0.0, 0.0, 0.05, 0.0, 0.2, 0.0, 0.0, 1.0], np.float32), batch)
    uniform = rng.random(batch).astype(np.float32)
    uniform[0] = 0.0
    if batch > 1:
        uniform[-1] = ALMOST_ONE
    return {"temperature": temperature, "top_k": top_k, "top_p": top_p, "min_p": min_p, "uniform": uniform}


def edge_logits(batch: int, vocab: int, seed: int) -> np.ndarray:
    """Gaussian logits; rows with every token masked, one allowed token, ties at the max, half masked, all equal."""
    x = (np.random.default_rng(seed).standard_normal((batch, vocab)) * 3).astype(np.float32)
    if batch >= 3:
        x[2] = -np.inf
    if batch >= 4:
        x[3] = -np.inf
        x[3, vocab // 2] = 1.5
    if batch >= 5 and vocab >= 4:
        x[4, [1, vocab - 1]] = x[4].max() + 1
    if batch >= 6:
        x[5, ::2] = -np.inf
    if batch >= 7:
        x[6] = 0.25
    return x


def no_masks(batch: int, vocab: int) -> tuple[np.ndarray, np.ndarray]:
    """mask_index and bitmask for a batch without masks (one all-allowed row: the runtime always passes one)."""
    return np.full(batch, -1, np.int32), np.full((1, (vocab + 31) // 32), -1, np.int32)


def fused_cpu_top(logits: np.ndarray, p: dict[str, np.ndarray], renorm: np.ndarray,
                  masks: tuple[np.ndarray, np.ndarray] | None, top_count: np.ndarray,
                  n: int) -> tuple[np.ndarray, ...]:
    """(token, chosen, top values, top ids) of the fused kernel; rows with top_count 0 must leave their top slots."""
    batch, vocab = logits.shape
    mask_index, bitmask = no_masks(batch, vocab) if masks is None else masks
    out = run_cpu(NAME, logits, p["temperature"], p["top_k"], p["top_p"], p["min_p"], renorm.astype(np.int32),
                  p["uniform"], mask_index, bitmask, np.full(batch, -7, np.int32), np.full(batch, np.nan, np.float32),
                  top_count.astype(np.int32), np.full((batch, n), np.nan, np.float32),
                  np.full((batch, n), -7, np.int32))
    np.testing.assert_array_equal(out[0], logits)  # the logits are not modified
    values, ids = out[12], out[13]
    for r in range(batch):  # nothing written past what a row asked for
        assert np.isnan(values[r, top_count[r]:]).all() and (ids[r, top_count[r]:] == -7).all(), r
    return out[9], out[10], values, ids


def fused_cpu(logits: np.ndarray, p: dict[str, np.ndarray], renorm: np.ndarray,
              masks: tuple[np.ndarray, np.ndarray] | None = None) -> tuple[np.ndarray, np.ndarray]:
    token, chosen, _, _ = fused_cpu_top(logits, p, renorm, masks, np.zeros(logits.shape[0], np.int32), 1)
    return token, chosen


def staged_probs_cpu(logits: np.ndarray, p: dict[str, np.ndarray], renorm: bool) -> np.ndarray:
    batch, vocab = logits.shape
    probs = run_cpu(softmax.NAME, logits, p["temperature"], np.full((batch, vocab), np.nan, np.float32))[2]
    if renorm:
        probs = run_cpu(renormalize.NAME, probs, p["top_k"], p["top_p"], p["min_p"],
                        np.full((batch, vocab), np.nan, np.float32))[4]
    return probs


def staged_cpu(logits: np.ndarray, p: dict[str, np.ndarray], renorm: bool) -> tuple[np.ndarray, np.ndarray]:
    batch = logits.shape[0]
    probs = staged_probs_cpu(logits, p, renorm)
    out = run_cpu(multinomial.NAME, probs, p["uniform"], np.full(batch, -7, np.int32),
                  np.full(batch, np.nan, np.float32))
    return out[2], out[3]


@pytest.mark.parametrize("renorm", [True, False])
@pytest.mark.parametrize(("batch", "vocab"), [(1, 1), (8, 31), (8, 33), (99, 33), (16, 1003), (8, 128001),
                                              (9, 128256), (3, 151936)])
def test_same_tokens_as_the_staged_kernels(batch: int, vocab: int, renorm: bool) -> None:
    """Bit-identical tokens and chosen probabilities, for every kind of row, with and without renormalisation."""
    logits = edge_logits(batch, vocab, batch * 31 + vocab)
    p = row_params(batch, vocab, vocab)
    token, chosen = fused_cpu(logits, p, np.full(batch, int(renorm)))
    ref_token, ref_chosen = staged_cpu(logits, p, renorm)
    np.testing.assert_array_equal(token, ref_token)
    np.testing.assert_array_equal(chosen, ref_chosen)


@pytest.mark.parametrize(("batch", "vocab"), [(1, 1), (7, 33), (9, 1003), (5, 128256)])
def test_a_folded_bitmask_equals_applying_it_first(batch: int, vocab: int) -> None:
    """mask_index / bitmask give the tokens of apply_bitmask_inplace followed by the staged kernels: rows masked by
    their own row of the bitmask, rows sharing one, a row whose every token is disallowed, and indices that name no
    row (negative, past the bitmask) left unmasked; the logits are not modified."""
    rng = np.random.default_rng(batch + vocab)
    logits = (rng.standard_normal((batch, vocab)) * 3).astype(np.float32)
    allowed = rng.random((3, vocab)) < 0.4
    allowed[0, 0] = True  # at least one token allowed in row 0
    allowed[2] = False  # every token disallowed
    bitmask = reference.pack_bitmask(allowed)
    mask_index = np.resize(np.int32([0, -1, 1, 2, 7, 1, -5]), batch)
    p = row_params(batch, vocab, 17)
    masked = logits.copy()
    for r in range(batch):
        if 0 <= mask_index[r] < 3:
            masked[r] = np.where(allowed[mask_index[r]], logits[r], -np.inf)
    for renorm in (True, False):
        token, chosen = fused_cpu(logits, p, np.full(batch, int(renorm)), (mask_index, bitmask))
        ref_token, ref_chosen = staged_cpu(masked, p, renorm)
        np.testing.assert_array_equal(token, ref_token)
        np.testing.assert_array_equal(chosen, ref_chosen)
    # a bitmask too narrow for the vocabulary is not read: every row is sampled unmasked
    narrow = (np.full(batch, 0, np.int32), np.zeros((1, max(0, (vocab - 1) // 32)), np.int32))
    if narrow[1].shape[1] > 0:
        token, _ = fused_cpu(logits, p, np.ones(batch), narrow)
        np.testing.assert_array_equal(token, fused_cpu(logits, p, np.ones(batch))[0])


@pytest.mark.parametrize(("batch", "vocab", "n"), [(1, 1, 1), (8, 33, 33), (99, 33, 5), (16, 1003, 20),
                                                   (9, 128256, 20)])
def test_top_n_of_the_row_sampled_from_equals_top_n_of_the_staged_probabilities(batch: int, vocab: int,
                                                                                 n: int) -> None:
    """Processed top-n logprobs in the fused kernel: per row, the first top_count[r] entries of the top_n kernel run
    on the staged probabilities (after renormalize where renorm), bit for bit: greedy rows (one-hot), every token
    masked (zeros), one allowed token, ties, top_p 1e-6, rows asking for fewer than n, rows asking for none, and
    masks folded from the bitmask."""
    logits = edge_logits(batch, vocab, vocab + n)
    p = row_params(batch, vocab, batch + n)
    top_count = np.resize(np.int32([n, 0, n, max(1, n // 2), n, 1, n, n]), batch)
    allowed = np.random.default_rng(n).random((1, vocab)) < 0.5
    allowed[0, -1] = True
    mask_index = np.resize(np.int32([-1, -1, -1, -1, -1, -1, -1, 0]), batch)
    masked = logits.copy()
    masked[mask_index == 0] = np.where(allowed[0], logits[mask_index == 0], -np.inf)
    for renorm in (True, False):
        token, chosen, values, ids = fused_cpu_top(logits, p, np.full(batch, int(renorm)),
                                                   (mask_index, reference.pack_bitmask(allowed)), top_count, n)
        probs = staged_probs_cpu(masked, p, renorm)
        ref_values, ref_ids = run_cpu(top_n.NAME, probs, np.zeros((batch, n), np.float32),
                                      np.zeros((batch, n), np.int32))[1:]
        for r in range(batch):
            k = top_count[r]
            np.testing.assert_array_equal(values[r, :k], ref_values[r, :k], err_msg=f"row {r}")
            np.testing.assert_array_equal(ids[r, :k], ref_ids[r, :k], err_msg=f"row {r}")
        # the draw is unchanged by asking for top-n
        np.testing.assert_array_equal(token, fused_cpu(logits, p, np.full(batch, int(renorm)),
                                                       (mask_index, reference.pack_bitmask(allowed)))[0])
        np.testing.assert_array_equal(chosen, staged_cpu(masked, p, renorm)[1])


NON_FINITE_ROWS = [  # (what, where the NaN / +inf values go, mask allows them)
    ("nan", [5], True), ("+inf", [0], True), ("nan everywhere", slice(None), True), ("nan and +inf", [3, 900], True),
    ("nan at a masked token", [7], False), ("+inf at the last token", [-1], True),
    ("negative nan", [11], True), ("nan of all ones", [12], True), ("+inf at a masked token", [2], False)]
#: NaNs by their bits: the sign bit set (x86's default NaN), every bit set but the sign.
ODD_NANS = {"negative nan": np.uint32(0xFFC00000).view(np.float32),
            "nan of all ones": np.uint32(0x7FFFFFFF).view(np.float32)}


@pytest.mark.parametrize("vocab", [1003, 128256])
def test_rows_holding_nan_or_plus_inf_are_flagged_not_sampled(vocab: int) -> None:
    """A NaN or +inf logit (even at a token the row's mask disallows) gives NON_FINITE and chosen 0, greedy or not,
    and leaves the row's top-n slots alone; -inf rows still give -1, and the other rows their staged tokens."""
    cases = len(NON_FINITE_ROWS)
    batch = 2 * cases + 2
    logits = (np.random.default_rng(vocab).standard_normal((batch, vocab)) * 3).astype(np.float32)
    allowed = np.ones((cases, vocab), bool)
    mask_index = np.full(batch, -1, np.int32)
    for c, (what, where, visible) in enumerate(NON_FINITE_ROWS):
        for r in (c, cases + c):  # sampled, then greedy
            logits[r, where] = ODD_NANS.get(what, np.nan if "nan" in what else np.inf)
            if what == "nan and +inf":
                logits[r, where[1]] = np.inf
            if not visible:
                allowed[c, where] = False
                mask_index[r] = c
    logits[-2] = -np.inf
    logits[-1, [1, 2]] = -np.inf  # (-inf logits are masked tokens, not an error)
    p = {"temperature": np.float32([0.8] * cases + [0.0] * cases + [1.0, 0.7]),
         "top_k": np.zeros(batch, np.int32), "top_p": np.full(batch, 0.9, np.float32),
         "min_p": np.zeros(batch, np.float32), "uniform": np.full(batch, 0.5, np.float32)}
    token, chosen, values, ids = fused_cpu_top(logits, p, np.ones(batch), (mask_index, reference.pack_bitmask(allowed)),
                                               np.resize(np.int32([3, 0]), batch), 3)
    flagged = 2 * cases
    np.testing.assert_array_equal(token[:flagged], sample_from_logits.NON_FINITE)
    np.testing.assert_array_equal(chosen[:flagged], 0)
    assert np.isnan(values[:flagged]).all() and (ids[:flagged] == -7).all()
    assert token[-2] == -1 and chosen[-2] == 0
    assert token[-1] == staged_cpu(logits[-1:], {k: v[-1:] for k, v in p.items()}, True)[0][0]


def test_many_uniforms_give_the_staged_tokens() -> None:
    """One row repeated with 2000 uniforms: every draw equals the staged kernels' draw."""
    rng = np.random.default_rng(5)
    vocab, batch = 1003, 2000
    logits = np.repeat((rng.standard_normal((1, vocab)) * 2).astype(np.float32), batch, axis=0)
    p = {"temperature": np.full(batch, 0.8, np.float32), "top_k": np.full(batch, 40, np.int32),
         "top_p": np.full(batch, 0.9, np.float32), "min_p": np.full(batch, 0.01, np.float32),
         "uniform": rng.random(batch).astype(np.float32)}
    token, chosen = fused_cpu(logits, p, np.ones(batch))
    ref_token, ref_chosen = staged_cpu(logits, p, True)
    np.testing.assert_array_equal(token, ref_token)
    np.testing.assert_array_equal(chosen, ref_chosen)


def test_short_and_long_candidate_lists_give_the_staged_tokens() -> None:
    """renormalize's CPU search runs on a candidate list when it is short (<= 8192 values) and on the row otherwise
    (and the fused draw on the list only when it holds every kept value): rows on both sides of each limit, at
    V=128001, give the staged kernels' tokens."""
    batch, vocab = 12, 128001
    logits = (np.random.default_rng(21).standard_normal((batch, vocab)) * 3).astype(np.float32)
    #           top-k 20 / 9000 / 40000, top-p short / long / flat, min-p short / long, mixes
    p = {"temperature": np.float32([0.7, 1.0, 1.0, 0.5, 1.0, 8.0, 0.7, 2.0, 0.7, 1.0, 0.3, 1.5]),
         "top_k": np.int32([20, 9000, 40000, 0, 0, 0, 0, 0, 50, 200, 0, 5000]),
         "top_p": np.float32([1.0, 1.0, 1.0, 0.5, 0.999, 0.9, 1.0, 1.0, 0.9, 0.95, 0.8, 0.999]),
         "min_p": np.float32([0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.1, 1e-7, 0.0, 0.01, 0.05, 0.0]),
         "uniform": np.random.default_rng(22).random(batch).astype(np.float32)}
    token, chosen = fused_cpu(logits, p, np.ones(batch))
    ref_token, ref_chosen = staged_cpu(logits, p, True)
    np.testing.assert_array_equal(token, ref_token)
    np.testing.assert_array_equal(chosen, ref_chosen)


def test_mixed_renorm_flags_follow_each_row() -> None:
    """renorm is per row: each row equals the staged path with or without renormalize_probs."""
    batch, vocab = 8, 1003
    logits = edge_logits(batch, vocab, 3)
    p = row_params(batch, vocab, 3)
    renorm = np.array([1, 0, 1, 0, 0, 1, 1, 0])
    token, chosen = fused_cpu(logits, p, renorm)
    with_r, without_r = staged_cpu(logits, p, True), staged_cpu(logits, p, False)
    for r in range(batch):
        src = with_r if renorm[r] else without_r
        assert (token[r], chosen[r]) == (src[0][r], src[1][r]), r


def test_edge_rows() -> None:
    """All masked: -1 and 0; one allowed token: that token; ties: the lowest id when greedy, and only tied tokens at
    tiny temperatures; top_k 1 and top_p 1e-6: the argmax; k >= V: no filter."""
    vocab = 1003
    rng = np.random.default_rng(11)
    base = (rng.standard_normal(vocab) * 2).astype(np.float32)
    base[[17, 600]] = base.max() + 3  # a tie at the max
    one = np.full(vocab, -np.inf, np.float32)
    one[321] = -5.0
    masked = np.full(vocab, -np.inf, np.float32)
    #        (row, temperature, top_k, top_p, min_p, allowed tokens)
    cases = [(masked, 0.7, 0, 1.0, 0.0, set()), (masked, 0.0, 0, 1.0, 0.0, set()),
             (one, 0.7, 5, 0.5, 0.1, {321}), (one, 0.0, 0, 1.0, 0.0, {321}), (one, 1e-30, 0, 1.0, 0.0, {321}),
             (base, 0.0, 0, 1.0, 0.0, {17}), (base, 1e-6, 0, 1.0, 0.0, {17, 600}),
             (base, 1e-39, 0, 1.0, 0.0, {17, 600}), (base, 1.0, 1, 1.0, 0.0, {17, 600}),
             (base, 1.0, 0, 1e-6, 0.0, {17, 600}), (base, 1.0, 0, 0.0, 0.0, {17, 600}),
             (base, 1.0, 0, 1.0, 1.0, {17, 600})]
    for u in (0.0, 0.5, float(ALMOST_ONE)):
        batch = len(cases)
        logits = np.stack([c[0] for c in cases])
        p = {"temperature": np.array([c[1] for c in cases], np.float32),
             "top_k": np.array([c[2] for c in cases], np.int32), "top_p": np.array([c[3] for c in cases], np.float32),
             "min_p": np.array([c[4] for c in cases], np.float32), "uniform": np.full(batch, u, np.float32)}
        token, chosen = fused_cpu(logits, p, np.ones(batch))
        for r, case in enumerate(cases):
            if not case[5]:
                assert token[r] == -1 and chosen[r] == 0, (r, u)
            else:
                assert int(token[r]) in case[5], (r, u, token[r])
                assert chosen[r] > 0
    # k >= V is no filter: the same draw as top_k 0
    logits = np.repeat(base[None, :], 64, axis=0)
    uniform = np.random.default_rng(2).random(64).astype(np.float32)
    draws = []
    for k in (0, vocab, vocab + 100):
        p = {"temperature": np.ones(64, np.float32), "top_k": np.full(64, k, np.int32),
             "top_p": np.ones(64, np.float32), "min_p": np.zeros(64, np.float32), "uniform": uniform}
        draws.append(fused_cpu(logits, p, np.ones(64))[0])
    np.testing.assert_array_equal(draws[0], draws[1])
    np.testing.assert_array_equal(draws[0], draws[2])


CHI_CONFIGS = [  # (temperature, top_k, top_p, min_p)
    (1.0, 0, 1.0, 0.0), (0.7, 0, 0.9, 0.0), (1.3, 20, 1.0, 0.0), (1.0, 0, 1.0, 0.05), (0.9, 30, 0.8, 0.02)]


@pytest.mark.parametrize("config", CHI_CONFIGS, ids=[f"T{c[0]}-k{c[1]}-p{c[2]}-minp{c[3]}" for c in CHI_CONFIGS])
def test_frequencies_follow_the_numpy_oracle(config: tuple[float, int, float, float]) -> None:
    """Chi-square of 20000 draws (one uniform each, from many seeds) against the oracle's probabilities."""
    temperature, top_k, top_p, min_p = config
    vocab, draws = 61, 20000
    rng = np.random.default_rng(int(temperature * 100) + top_k)
    row = (rng.standard_normal((1, vocab)) * 1.5).astype(np.float32)
    row[0, ::7] = -np.inf  # masked tokens
    expected = reference.renormalize(reference.softmax_with_temperature(row, np.float32([temperature])),
                                     np.int32([top_k]), np.float32([top_p]), np.float32([min_p]))[0]
    uniform = np.concatenate([np.random.default_rng(seed).random(draws // 100).astype(np.float32)
                              for seed in range(100)])
    p = {"temperature": np.full(draws, temperature, np.float32), "top_k": np.full(draws, top_k, np.int32),
         "top_p": np.full(draws, top_p, np.float32), "min_p": np.full(draws, min_p, np.float32), "uniform": uniform}
    token, _ = fused_cpu(np.repeat(row, draws, axis=0), p, np.ones(draws))
    counts = np.bincount(token, minlength=vocab)
    assert counts[expected == 0].sum() == 0, "a token the oracle gives probability 0 was sampled"
    kept = expected > 0
    want = expected[kept].astype(np.float64)
    result = stats.chisquare(counts[kept], want / want.sum() * counts.sum())
    assert result.pvalue > 1e-4, (result, config)


def test_vulkan_flags_rows_holding_nan_or_plus_inf() -> None:
    """On lavapipe: NaN / +inf rows (one hidden under the row's mask) give NON_FINITE, chosen 0, no top-n; greedy or
    not; a row of -inf gives -1; a finite row its token."""
    kernels = vulkan_kernels_or_skip()
    vocab, batch = 1003, 6
    logits = (np.random.default_rng(3).standard_normal((batch, vocab)) * 3).astype(np.float32)
    logits[0, 5] = np.nan
    logits[1, 0] = np.inf
    logits[2, 7] = np.nan  # masked below
    logits[3, 9] = np.nan  # greedy
    logits[4] = -np.inf
    allowed = np.ones((1, vocab), bool)
    allowed[0, 7] = False
    mask_index = np.int32([-1, -1, 0, -1, -1, -1])
    temperature = np.float32([1.0, 0.7, 1.0, 0.0, 1.0, 1.0])
    token, chosen = np.full(batch, -7, np.int32), np.full(batch, np.nan, np.float32)
    values, ids = np.full((batch, 2), np.nan, np.float32), np.full((batch, 2), -7, np.int32)
    kernels[NAME](logits, temperature, np.zeros(batch, np.int32), np.full(batch, 0.9, np.float32),
                  np.zeros(batch, np.float32), np.ones(batch, np.int32), np.full(batch, 0.5, np.float32), mask_index,
                  reference.pack_bitmask(allowed), token, chosen, np.full(batch, 2, np.int32), values, ids)
    np.testing.assert_array_equal(token[:4], sample_from_logits.NON_FINITE)
    np.testing.assert_array_equal(chosen[:4], 0)
    assert np.isnan(values[:4]).all() and (ids[:4] == -7).all()
    assert token[4] == -1 and 0 <= token[5] < vocab and chosen[5] > 0


@pytest.mark.parametrize("width", [6, 20])
@pytest.mark.parametrize(("batch", "vocab"), [(1, 1), (8, 33), (16, 1003), (3, 128256)])
def test_vulkan_matches_the_staged_vulkan_kernels(batch: int, vocab: int, width: int) -> None:
    """On lavapipe: the GPU variant gives the staged GPU kernels' tokens with the same uniforms, and their top_n for
    the processed top-n (width 20: rows asking for more than 8 take the bound and the list, the others the rounds)."""
    kernels = vulkan_kernels_or_skip()
    logits = edge_logits(batch, vocab, vocab + 1)
    p = row_params(batch, vocab, batch)
    allowed = np.random.default_rng(vocab).random((2, vocab)) < 0.5
    allowed[:, 0] = True
    mask_index = np.resize(np.int32([1, -1, 0]), batch)
    masked = logits.copy()
    for r in range(batch):
        if mask_index[r] >= 0:
            masked[r] = np.where(allowed[mask_index[r]], logits[r], -np.inf)
    n = min(vocab, width)
    top_count = np.resize(np.int32([n, 0, 2, n // 2 + 1]), batch)
    for renorm in (0, 1):
        token, chosen = np.full(batch, -7, np.int32), np.full(batch, np.nan, np.float32)
        values, ids = np.full((batch, n), np.nan, np.float32), np.full((batch, n), -7, np.int32)
        kernels[NAME](logits, p["temperature"], p["top_k"], p["top_p"], p["min_p"], np.full(batch, renorm, np.int32),
                      p["uniform"], mask_index, reference.pack_bitmask(allowed), token, chosen, top_count, values, ids)
        probs = np.full((batch, vocab), np.nan, np.float32)
        kernels[softmax.NAME](masked, p["temperature"], probs)
        if renorm:
            out = np.full((batch, vocab), np.nan, np.float32)
            kernels[renormalize.NAME](probs, p["top_k"], p["top_p"], p["min_p"], out)
            probs = out
        ref_token, ref_chosen = np.full(batch, -7, np.int32), np.full(batch, np.nan, np.float32)
        kernels[multinomial.NAME](probs, p["uniform"], ref_token, ref_chosen)
        np.testing.assert_array_equal(token, ref_token)
        np.testing.assert_array_equal(chosen, ref_chosen)
        ref_values, ref_ids = np.zeros((batch, n), np.float32), np.zeros((batch, n), np.int32)
        kernels[top_n.NAME](probs, ref_values, ref_ids)
        for r in range(batch):  # processed top-n: the staged top_n of the same probabilities; nothing else written
            k = top_count[r]
            np.testing.assert_array_equal(values[r, :k], ref_values[r, :k])
            np.testing.assert_array_equal(ids[r, :k], ref_ids[r, :k])
            assert np.isnan(values[r, k:]).all() and (ids[r, k:] == -7).all()


def test_gpu_rows_do_not_depend_on_the_batch_on_vulkan() -> None:
    """On lavapipe: a row's softmax, renormalized row, token and chosen probability are the same bits whether it is
    sampled alone or among other rows (the softmax's split over blocks depends on the vocabulary alone)."""
    kernels = vulkan_kernels_or_skip()
    vocab = 5003
    logits = edge_logits(9, vocab, 11)
    p = row_params(9, vocab, 5)
    allowed = np.ones((1, vocab), bool)
    results = {}
    for batch in (1, 4, 9):
        rows = [logits[:batch], p["temperature"][:batch], p["top_k"][:batch], p["top_p"][:batch], p["min_p"][:batch]]
        probs = np.full((batch, vocab), np.nan, np.float32)
        kernels[softmax.NAME](rows[0], rows[1], probs)
        out = np.full((batch, vocab), np.nan, np.float32)
        kernels[renormalize.NAME](probs, rows[2], rows[3], rows[4], out)
        token, chosen = np.full(batch, -7, np.int32), np.full(batch, np.nan, np.float32)
        kernels[NAME](*rows, np.ones(batch, np.int32), p["uniform"][:batch], np.full(batch, -1, np.int32),
                      reference.pack_bitmask(allowed), token, chosen, np.zeros(batch, np.int32),
                      np.zeros((batch, 1), np.float32), np.zeros((batch, 1), np.int32))
        results[batch] = (probs, out, token, chosen)
    for batch in (4, 9):
        for wide, alone in zip(results[batch], results[1], strict=True):
            np.testing.assert_array_equal(wide[:1], alone)
    for wide, narrow in zip(results[9], results[4], strict=True):
        np.testing.assert_array_equal(wide[:4], narrow)
