"""Hostile input to the runtime (issue 16): token ids, configs and logits a careless or hostile caller may send.

Every id is checked where it enters (prompt, append_token, drafts) and again by the processor on each batch; the
kernels that write by index skip entries outside their buffers whatever the host sends (checked with guard rows
around the buffer); bad configs and logits get errors naming the field; NaN / +inf logits are flagged, never sampled.
Property tests (hypothesis) throw arbitrary configs, ids, drafts, rollbacks and logits at the processor and compare
with the numpy pipeline.
"""

from __future__ import annotations

import copy
import pickle

import numpy as np
import pytest
import tvm
import tvm_ffi
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from logitproc import GenerationConfig, LogitProcessor, Sampler
from logitproc.runtime.answer_check import check_answer
from logitproc.runtime.field_error import FieldError
from logitproc.runtime.logits_io import empty_aligned, non_finite_rows
from logitproc.runtime.request_state import DraftTree, RequestState
from logitproc.runtime.response_format import parse_response_format
from logitproc.tir_kernels import reference
from pipeline_reference import process_row

V = 301  # not a multiple of 32
HOSTILE_INTS = [-1, -5, -(10**8), -(2**31), 2**31 - 1, 10**9]


# ---------------------------------------------------------------------------------------------------- kernels
GUARD = 16  # guard rows on each side: 16 rows of V float32 keep the inner rows 64-byte aligned, as TVM requires


def guarded(batch: int, vocab: int, rng: np.random.Generator):
    """(backing [GUARD + batch + GUARD, vocab] array, a TVM tensor over its middle rows (zero copy), the initial
    values): a kernel writing outside the tensor changes the guard rows."""
    backing = empty_aligned((batch + 2 * GUARD, vocab))
    backing[:] = values = rng.standard_normal(backing.shape).astype(np.float32)
    inner = tvm_ffi.from_dlpack(backing[GUARD : GUARD + batch], require_alignment=64)
    return backing, inner, values


def check_guards(backing: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Assert the guard rows are untouched; return the inner rows."""
    np.testing.assert_array_equal(backing[:GUARD], values[:GUARD])
    np.testing.assert_array_equal(backing[-GUARD:], values[-GUARD:])
    return backing[GUARD:-GUARD]


def hostile_entries(rng: np.random.Generator, batch: int, vocab: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    """(rows, tokens): valid distinct pairs mixed with rows/tokens just outside, far outside and at int32's ends."""
    rows = rng.integers(0, batch, n).astype(np.int32)
    tokens = rng.permutation(vocab)[:n].astype(np.int32)
    bad_rows = [-1, batch, batch + 1, 2**31 - 1, -(2**31), -(10**8)]
    bad_tokens = [-1, vocab, vocab + 31, 2**31 - 1, -(2**31), -(10**8)]
    rows = np.concatenate([rows, bad_rows, [0] * len(bad_tokens)]).astype(np.int32)
    tokens = np.concatenate([tokens, [0] * len(bad_rows), bad_tokens]).astype(np.int32)
    return rows, tokens


@pytest.mark.parametrize("batch", [1, 3, 99])
def test_scatter_kernels_never_write_outside_their_buffer(lib, batch: int) -> None:
    rng = np.random.default_rng(batch)
    dev = tvm.cpu()
    rows, tokens = hostile_entries(rng, batch, V, min(V, 40))
    bias = rng.uniform(-5, 5, rows.size).astype(np.float32)
    counts = rng.integers(0, 4, rows.size).astype(np.int32)
    penalties = np.tile(np.array([0.5, 0.25, 1.3], np.float32), (batch, 1))

    inside = slice(GUARD, GUARD + batch)
    backing, inner, values = guarded(batch, V, rng)
    lib["apply_logit_bias_inplace"](inner, *(tvm.runtime.tensor(a, dev) for a in (rows, tokens, bias)))
    np.testing.assert_array_equal(check_guards(backing, values),
                                  reference.apply_logit_bias(values[inside], rows, tokens, bias))

    backing, inner, values = guarded(batch, V, rng)
    lib["apply_penalty_inplace"](inner, *(tvm.runtime.tensor(a, dev) for a in (rows, tokens, counts, penalties)))
    np.testing.assert_allclose(check_guards(backing, values),
                               reference.apply_penalty(values[inside], rows, tokens, counts, penalties), rtol=1e-6)

    row_ids = np.array([0, batch, -1, 2**31 - 1, -(10**8)], np.int32)
    words = (V + 31) // 32
    masks = rng.integers(-(2**31), 2**31, (row_ids.size, words), dtype=np.int64).astype(np.int32)
    backing, inner, values = guarded(batch, V, rng)
    lib["apply_bitmask_inplace"](inner, tvm.runtime.tensor(row_ids, dev), tvm.runtime.tensor(masks, dev))
    np.testing.assert_array_equal(check_guards(backing, values),
                                  reference.apply_bitmask(values[inside], row_ids, masks))

    short = masks[:, : words - 1]  # a bitmask too narrow for the vocabulary: nothing is read past it or written
    backing, inner, values = guarded(batch, V, rng)
    lib["apply_bitmask_inplace"](inner, tvm.runtime.tensor(row_ids[:1], dev), tvm.runtime.tensor(short[:1], dev))
    np.testing.assert_array_equal(backing, values)


# ---------------------------------------------------------------------------------------------------- ids
@pytest.mark.parametrize("bad", HOSTILE_INTS[:4])
def test_negative_draft_ids_are_refused_where_they_enter(bad: int) -> None:
    with pytest.raises(ValueError, match=r"draft token_ids: token ids must be in \[0, 2147483647\]"):
        DraftTree.chain([3, bad])
    with pytest.raises(TypeError, match="draft token_ids: token ids must be ints"):
        DraftTree.chain([3.0])


def test_ids_past_the_vocabulary_never_reach_a_kernel(proc) -> None:
    config = GenerationConfig(repetition_penalty=1.5, logit_bias={3: 1.0})
    state = RequestState([1, 2], config)
    other = RequestState([5], config)
    logits = np.zeros((2, V), np.float32)
    proc.inplace_update_logits(logits, [state, other])
    state.append_token(10**9)  # after the processor first saw the request
    with pytest.raises(ValueError, match=rf"token id 1000000000 \(appended to a sequence\) is outside the vocabulary "
                                         rf"\[0, {V}\)"):
        proc.inplace_update_logits(logits, [state, other])
    state.rollback(1)  # taken back: the state is usable again
    proc.inplace_update_logits(np.zeros((2, V), np.float32), [state, other])
    with pytest.raises(ValueError, match=rf"draft token id {V} is outside the vocabulary"):
        proc.inplace_update_logits(np.zeros((3, V), np.float32), [state, other], cum_num_token=[0, 2, 3],
                                   draft_trees=[DraftTree.chain([V]), None])
    for bad, kind in ((-1, ValueError), (2**31, ValueError), (1.5, TypeError), (True, TypeError)):
        with pytest.raises(kind, match="append_token: token ids must be"):
            state.append_token(bad)
        with pytest.raises(kind, match="prompt_token_ids: token ids must be"):
            RequestState([1, bad])
    assert state.output_token_ids == []


# ---------------------------------------------------------------------------------------------------- configs
def test_a_config_copies_pickles_and_hashes() -> None:
    config = GenerationConfig(temperature=0.5, logit_bias={"7": 2.0, 9: -1}, stop=["x"],
                              response_format={"type": "regex", "regex": "[ab]+"})
    for twin in (copy.copy(config), copy.deepcopy(config), pickle.loads(pickle.dumps(config))):
        assert twin == config and hash(twin) == hash(config)
        assert dict(twin.logit_bias) == {7: 2.0, 9: -1.0}
    assert len({config, copy.deepcopy(config), GenerationConfig()}) == 2
    with pytest.raises(TypeError):
        config.logit_bias[7] = 3.0  # still immutable


def test_numpy_scalars_are_taken_alike_and_stored_as_python_numbers() -> None:
    for kind in (np.float16, np.float32, np.float64, np.int32, np.int64):
        config = GenerationConfig(temperature=kind(1), top_p=kind(1), repetition_penalty=kind(2),
                                  logit_bias={np.int64(3): kind(1)})
        assert type(config.temperature) in (int, float) and type(config.repetition_penalty) in (int, float)
        assert list(config.logit_bias) == [3]
    config = GenerationConfig(top_k=np.int32(5), seed=np.uint64(2**63), max_tokens=np.int16(7), n=np.int8(2))
    assert (config.top_k, config.seed, config.max_tokens, config.n) == (5, 2**63, 7, 2)
    assert all(type(v) is int for v in (config.top_k, config.seed, config.max_tokens, config.n))
    with pytest.raises(TypeError, match="top_k must be an int"):
        GenerationConfig(top_k=np.float64(5))
    with pytest.raises(TypeError, match="temperature must be a number"):
        GenerationConfig(temperature=np.bool_(True))


@pytest.mark.parametrize(("fields", "kind", "says"), [
    ({"repetition_penalty": 1e300}, ValueError, r"repetition_penalty must be in \[0.001, 1000.0\], got 1e\+300"),
    ({"repetition_penalty": 1e-300}, ValueError, r"repetition_penalty must be in \[0.001, 1000.0\], got 1e-300"),
    ({"top_k": 2**31}, ValueError, r"top_k must be -1 or 0 \(off\) or in \[1, 2147483647\], got 2147483648"),
    ({"logit_bias": {"²": 1.0}}, TypeError, "logit_bias key '²' must be a token id"),
    ({"logit_bias": {"1.5": 1.0}}, TypeError, "logit_bias key '1.5' must be a token id"),
    ({"logit_bias": {2**31: 1.0}}, ValueError, r"logit_bias token id must be in \[0, 2147483647\]"),
    ({"logit_bias": {i: 1.0 for i in range(1025)}}, ValueError, "logit_bias holds 1025 entries; at most 1024"),
    ({"stop_token_ids": [2**40]}, ValueError, r"stop_token_ids entries must be token ids in \[0, 2147483647\]"),
])
def test_bad_configs_name_the_field_value_and_range(fields: dict, kind: type, says: str) -> None:
    with pytest.raises(kind, match=says) as raised:
        GenerationConfig(**fields)
    assert isinstance(raised.value, FieldError) and raised.value.param == next(iter(fields))  # typed, not parsed


@pytest.mark.parametrize("fields", [
    {"temperature": float("nan")}, {"top_p": 0.0}, {"n": 0}, {"stop": [""]}, {"bad_words": 3},
    {"logit_bias": {5: 101.0}}, {"allowed_token_ids": []}, {"response_format": {"type": "yaml"}},
    {"think_begin": ""}, {"seed": -1},
])
def test_every_config_refusal_carries_its_field(fields: dict) -> None:
    with pytest.raises((ValueError, TypeError)) as raised:
        GenerationConfig(**fields)
    assert isinstance(raised.value, FieldError) and raised.value.param == next(iter(fields))


def test_top_logprobs_beyond_the_vocabulary_is_refused(lib) -> None:
    small = LogitProcessor(lib, vocab_size=5, max_num_token=4)
    state = RequestState([1], GenerationConfig(logprobs=True, top_logprobs=8))
    with pytest.raises(ValueError, match="top_logprobs=8 exceeds the vocabulary size 5"):
        small.inplace_update_logits(np.zeros((1, 5), np.float32), [state])


def test_logits_of_the_wrong_kind_get_clear_errors(proc) -> None:
    state = RequestState([1], GenerationConfig())
    frozen = np.zeros((1, V), np.float32)
    frozen.flags.writeable = False
    with pytest.raises(ValueError, match="logits is read-only: it is updated in place"):
        proc.inplace_update_logits(frozen, [state])
    with pytest.raises(TypeError, match="logits must be a float32 numpy.ndarray .* got list"):
        proc.inplace_update_logits([[0.0] * V], [state])
    with pytest.raises(TypeError, match="logits must be float32, got float64"):
        proc.inplace_update_logits(np.zeros((1, V)), [state])


# ---------------------------------------------------------------------------------------------------- NaN / inf
def test_non_finite_rows_flags_nan_and_plus_inf_only() -> None:
    logits = np.zeros((5, V), np.float32)
    logits[1, 7] = np.nan
    logits[2, :] = np.nan
    logits[3, 9] = np.inf
    logits[4, :] = -np.inf  # every token masked: not an error of the model
    assert non_finite_rows(logits).tolist() == [False, True, True, True, False]


# ---------------------------------------------------------------------------------------------------- properties
configs = st.builds(
    GenerationConfig,
    temperature=st.sampled_from([0.0, 0.5, 1.0, 2.0]),
    presence_penalty=st.floats(-2, 2), frequency_penalty=st.floats(-2, 2),
    repetition_penalty=st.sampled_from([1.0, 0.5, 1.3, 1000.0]),
    logit_bias=st.dictionaries(st.integers(0, V - 1), st.floats(-100, 100), max_size=8),
)
token_lists = st.lists(st.integers(0, V - 1), max_size=12)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rows=st.lists(st.tuples(configs, token_lists.filter(bool), token_lists, token_lists, st.integers(0, 12)),
                     min_size=1, max_size=5),
       scale=st.sampled_from([1.0, 30.0, 1e4]), data=st.data())
def test_processor_agrees_with_numpy_under_arbitrary_input(proc, rows, scale, data) -> None:
    """Arbitrary configs, prompts, outputs, rollbacks and drafts: the processed logits equal the numpy pipeline's,
    and every state is left as it was. Hostile ids in drafts or appends are refused without touching the logits."""
    states, paths = [], []
    for config, prompt, output, draft, rollback in rows:
        state = RequestState(prompt, config)
        for token in output:
            state.append_token(token)
        state.rollback(min(rollback, len(output)))
        states.append(state)
        paths.append(draft)
    trees = [DraftTree.chain(p) if p else None for p in paths]
    cum = np.cumsum([0] + [1 + len(p) for p in paths]).tolist()
    n = cum[-1]
    logits = (np.random.default_rng(n).standard_normal((n, V)) * scale).astype(np.float32)
    logits[0, : V // 2] = -np.inf  # a partly masked row
    work = logits.copy()
    snapshot = [(list(s.prompt_token_ids), list(s.output_token_ids), s.appeared_token_ids.copy(),
                 s.output_counts.copy()) for s in states]
    proc.inplace_update_logits(work, states, cum_num_token=cum, draft_trees=trees)
    for i, state in enumerate(states):
        for j in range(1 + len(paths[i])):
            r = cum[i] + j
            expected, _ = process_row(logits[r], state.config, state.prompt_token_ids,
                                      state.output_token_ids + paths[i][:j])
            np.testing.assert_allclose(work[r], expected, rtol=1e-5, atol=1e-5 * scale)
    for state, (prompt, output, appeared, counts) in zip(states, snapshot, strict=True):
        assert state.prompt_token_ids == prompt and state.output_token_ids == output
        np.testing.assert_array_equal(state.appeared_token_ids, appeared)
        np.testing.assert_array_equal(state.output_counts, counts)

    hostile = data.draw(st.sampled_from([V, V + 1, 2**31 - 1]))
    bad_trees = list(trees)
    bad_trees[-1] = DraftTree.chain([*paths[-1], hostile])
    bad_cum = [*cum[:-1], cum[-1] + 1]
    probe = np.zeros((bad_cum[-1], V), np.float32)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        proc.inplace_update_logits(probe, states, cum_num_token=bad_cum, draft_trees=bad_trees)
    assert not probe.any()


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(temperature=st.sampled_from([0.0, 1e-30, 1e-6, 1.0, 1e30]), top_k=st.sampled_from([0, 1, V, 2**31 - 1]),
       top_p=st.sampled_from([1e-6, 0.5, 1.0]), seed=st.integers(0, 2**64 - 1))
def test_sampler_never_returns_a_masked_or_out_of_range_token(lib, temperature, top_k, top_p, seed) -> None:
    proc, sampler = LogitProcessor(lib, V, 4), Sampler(lib, V, 4)
    config = GenerationConfig(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    logits = (np.random.default_rng(seed % 2**32).standard_normal((3, V)) * 10).astype(np.float32)
    logits[1, ::2] = -np.inf
    logits[2, :] = -np.inf
    logits[2, 17] = 0.0  # one allowed token
    states = [RequestState([1], config) for _ in range(3)]
    proc.inplace_update_logits(logits, states)
    probs = sampler.renormalize(proc.compute_probs_from_logits(logits, states), states)
    tokens = sampler.sample(probs, states).token_ids
    assert 0 <= tokens[0] < V and tokens[1] % 2 == 1 and tokens[2] == 17


@pytest.mark.parametrize("text", ["[" * 5000, "[" * 5000 + "]" * 5000, "[" * 400 + "]" * 400])
def test_the_answer_check_never_raises_on_answers_too_deep_to_follow(text: str) -> None:
    schema = {"anyOf": [{"type": "array", "items": {"$ref": "#"}}, {"type": "integer"}]}
    fmt = parse_response_format({"type": "json_schema", "json_schema": {"name": "deep", "schema": schema}})
    check = check_answer(fmt, text)
    assert check.valid is None and "deeper than the checker can follow" in check.error
