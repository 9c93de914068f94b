"""Speculative decoding in the engine (issue 13): prompt-lookup drafts checked in one verify forward give the tokens
decoding gives (greedy and seeded sampling, with penalties, grammars, stop strings, n > 1, a mixed batch), the
first tokens' distribution is that of plain sampling, rejected drafts leave nothing behind, and the plan drafts
only where it pays."""

from __future__ import annotations

import json

import numpy as np
import pytest
from logitproc.runtime import GenerationConfig, RequestState
from logitproc.serve.engine import Engine
from logitproc.serve.speculation import Candidate, Drafter, SpeculationPlanner, SpeculativeConfig

FORCED = {"method": "ngram", "num_speculative_tokens": 5, "adaptive": False}  # every proposal checked


@pytest.fixture(scope="module")
def model():
    from logitproc.serve.cli_options import tiny_model
    from logitproc.serve.compiled_model import CompiledModel

    return CompiledModel.open(tiny_model(), target="cpu")


def prompts() -> list[list[int]]:
    rng = np.random.default_rng(0)
    return [list(range(10, 40)) * 3, [int(t) for t in rng.integers(0, 270, 50)], [5, 6, 7, 8] * 10 + [9]]


def run(model, prompt, config, speculative=None, max_batch=4):
    engine = Engine(model, max_batch=max_batch, speculative=speculative)
    return engine.generate(prompt, config), engine.stats


CONFIGS = {
    "greedy": GenerationConfig(temperature=0, max_tokens=60, ignore_eos=True),
    "top_p": GenerationConfig(temperature=0.9, top_p=0.9, seed=5, max_tokens=60, ignore_eos=True),
    "penalties+logprobs": GenerationConfig(temperature=1.0, seed=11, max_tokens=60, presence_penalty=0.5,
                                           frequency_penalty=0.3, repetition_penalty=1.1, ignore_eos=True,
                                           logprobs=True, top_logprobs=2),
    "n=2 top_k": GenerationConfig(temperature=0.7, top_k=20, seed=3, n=2, max_tokens=40, ignore_eos=True),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_speculation_gives_the_tokens_decoding_gives(model, name) -> None:
    """Each row's token is sampled as decoding would sample it (same random stream, one draw per committed token),
    so greedy and seeded answers are the same with and without drafts; the drafts were checked and some accepted."""
    config = CONFIGS[name]
    accepted = 0
    for prompt in prompts():
        want, _ = run(model, prompt, config)
        got, stats = run(model, prompt, config, FORCED)
        for w, g in zip(want, got, strict=True):
            assert g.token_ids == w.token_ids and g.text == w.text and g.finish_reason == w.finish_reason
            if config.logprobs:
                np.testing.assert_allclose(g.logprobs, w.logprobs, atol=1e-4)
                assert [[t for t, _ in row] for row in g.top_logprobs] == [[t for t, _ in row] for row in
                                                                          w.top_logprobs]
        assert stats.drafts > 0 and stats.draft_tokens >= stats.accepted_draft_tokens
        assert got[0].stats.draft_tokens > 0
        accepted += stats.accepted_draft_tokens
    assert accepted > 0


def test_a_batch_mixing_drafting_and_plain_sequences_matches_decoding(model) -> None:
    """Requests that draft (repetitive prompts) run beside ones that do not, joining at different steps."""
    configs = [CONFIGS["greedy"], CONFIGS["top_p"], GenerationConfig(temperature=0.8, seed=9, max_tokens=30,
                                                                      stop=["\n\n"])]

    def answers(speculative):
        engine = Engine(model, max_batch=8, speculative=speculative)
        ids = []
        for i, prompt in enumerate(prompts() * 2):
            ids.append(engine.add_request(prompt, configs[i % len(configs)]))
            engine.step()
        outputs = {}
        while engine.has_unfinished():
            for delta in engine.step():
                if delta.output is not None:
                    outputs[delta.request_id] = (delta.output.token_ids, delta.output.text)
        return [outputs[i] for i in ids], engine.stats

    want, _ = answers(None)
    got, stats = answers(FORCED)
    assert got == want
    assert stats.accepted_draft_tokens > 0


def test_first_tokens_follow_the_sampling_distribution(model) -> None:
    """Unseeded: the empirical distribution of the tokens at draft positions matches plain sampling (chi-square),
    so acceptance with p(d) and resampling without d is exact rejection sampling."""
    from scipy.stats import chi2_contingency

    prompt = [5, 6, 7, 8] * 10 + [5, 6]  # the drafts propose 7, 8, 5, ...
    # only the prompt's tokens allowed: every context's last token occurred before, so every step has a proposal
    config = GenerationConfig(temperature=1.5, max_tokens=4, ignore_eos=True, allowed_token_ids=[5, 6, 7, 8])
    counts = {}
    for speculative in (None, FORCED):
        engine = Engine(model, max_batch=8, speculative=speculative)
        tokens = []
        for _ in range(25):
            ids = [engine.add_request(prompt, config) for _ in range(8)]
            outs = {}
            while engine.has_unfinished():
                for delta in engine.step():
                    if delta.output is not None:
                        outs[delta.request_id] = delta.output.token_ids
            tokens += [tuple(outs[i][1:4]) for i in ids]  # the first token comes from the prefill
        counts[speculative is None] = tokens
        if speculative is not None:
            assert engine.stats.draft_tokens > 0
    for position in (0, 1, 2):
        values = sorted({t[position] for t in counts[True] + counts[False]})
        table = np.array([[sum(t[position] == v for t in counts[side]) for v in values] for side in (True, False)])
        table = table[:, table.sum(axis=0) >= 5]  # chi-square needs expected counts that are not tiny
        _, p, _, _ = chi2_contingency(table)
        assert p > 1e-4, (position, table)


def test_rejected_drafts_leave_no_trace(model) -> None:
    """After rejections, every state equals a run that never drafted: a JSON schema answer (grammar matcher), stop
    strings, the detokenized text, and the KV cache (kept as a prefix cache entry of the same size, whose reuse gives
    the same continuation)."""
    schema = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                               "b": {"enum": ["x", "yy", "zzz"]}},
              "required": ["a", "b"], "additionalProperties": False}
    constrained = GenerationConfig(temperature=0.9, seed=1, max_tokens=100,
                                   response_format={"type": "json_schema", "json_schema": {"schema": schema}})
    stopped = GenerationConfig(temperature=0, max_tokens=60, stop=[" 163"], ignore_eos=True)
    for config in (constrained, stopped):
        results = []
        for speculative in (None, FORCED):
            engine = Engine(model, max_batch=4, speculative=speculative)
            [out] = engine.generate(prompts()[0], config)
            cached = engine.prefix_cache_tokens
            [again] = engine.generate(prompts()[0] + out.token_ids[:-1], GenerationConfig(temperature=0, max_tokens=8))
            results.append((out.token_ids, out.text, out.finish_reason, cached, again.token_ids,
                            again.stats.cached_tokens))
        assert results[0] == results[1]
        if config is constrained:
            assert results[1][2] == "stop"
            assert set(json.loads(results[1][1])) == {"a", "b"}


def _decoded(model, seq: int, tokens: list[int]) -> np.ndarray:
    """The logits of decoding ``tokens`` one by one on ``seq``, then taken back out of the KV cache."""
    rows = np.stack([model.decode([seq], [t])[0] for t in tokens])
    model.popn(seq, len(tokens))
    return rows


@pytest.mark.parametrize("prompt_length", [5, 16, 33, 300])
def test_verify_logits_are_decode_logits_bit_for_bit(model, prompt_length) -> None:
    """A verify forward's rows equal the decode steps of the same tokens exactly (the attention's exact mode), for
    one sequence, a batch of sequences of other lengths, and sequences forked from it inside a page and at a page
    boundary (their last KV block shared or empty), so that greedy answers cannot differ with drafts."""
    rng = np.random.default_rng(prompt_length)
    prompt = [int(t) for t in rng.integers(0, model.vocab_size, prompt_length)]
    a, b, c, d = 900, 901, 902, 903  # not the ids the engines of the other tests left in the cache
    drafts = {seq: [int(t) for t in rng.integers(0, model.vocab_size, n)] for seq, n in ((a, 6), (b, 2), (c, 9),
                                                                                         (d, 4))}
    model.add_sequence(a)
    model.add_sequence(b)
    try:
        model.prefill([a, b], [prompt, prompt[: prompt_length // 2 + 1]])
        model.fork_sequence(a, c, prompt_length - 3 if prompt_length > 3 else 1)
        model.fork_sequence(a, d, prompt_length // 16 * 16)
        want = {seq: _decoded(model, seq, tokens) for seq, tokens in drafts.items()}
        got = model.verify(list(drafts), list(drafts.values()))
        for seq, rows in zip(drafts, got, strict=True):
            np.testing.assert_array_equal(rows, want[seq])
    finally:
        for seq in drafts:
            if seq in model.sequence_ids:
                model.remove_sequence(seq)


def test_bad_speculative_settings_name_the_field(model) -> None:
    with pytest.raises(ValueError, match=r"method must be one of \['ngram'\], got 'eagle'"):
        Engine(model, speculative={"method": "eagle"})
    with pytest.raises(ValueError, match=r"num_speculative_tokens must be an int in \[1, 32\], got 0"):
        Engine(model, speculative={"num_speculative_tokens": 0})
    with pytest.raises(ValueError, match=r"unknown keys \['k'\]"):
        Engine(model, speculative={"k": 3})
    with pytest.raises(ValueError, match=r"prompt_lookup_min \(3\) must be <= prompt_lookup_max \(2\)"):
        SpeculativeConfig(prompt_lookup_min=3, prompt_lookup_max=2)
    with pytest.raises(ValueError, match=r"K in 'ngram:K' must be an int, got 'x'"):
        SpeculativeConfig.parse("ngram:x")
    with pytest.raises(TypeError, match="speculative must be"):
        Engine(model, speculative=5)
    assert SpeculativeConfig.parse("ngram:7").num_speculative_tokens == 7
    assert SpeculativeConfig.of("ngram") == SpeculativeConfig()


def drafter_after(tokens: list[int], prompt: int) -> tuple[Drafter, RequestState]:
    """A drafter synced over ``tokens`` (the first ``prompt`` of them the prompt), one token at a time."""
    state = RequestState(tokens[:prompt])
    drafter = Drafter(SpeculativeConfig(), state)
    drafter.sync(state)
    for token in tokens[prompt:]:
        state.append_token(token)
        drafter.sync(state)
    return drafter, state


def timed(planner: SpeculationPlanner, slope: float) -> None:
    for n in range(1, 8):  # a decode step 10 ms, each further token slope x 10 ms
        planner.costs.record(n, 0.010 * (1 + slope * (n - 1)))


def test_each_draft_token_is_checked_while_its_chance_exceeds_its_cost() -> None:
    """The chance of a draft token grows with the match behind it (the rule of succession before anything is
    measured), every committed token measures it, and a sequence checks draft j exactly when the chance that the
    first j are accepted exceeds what a verify token costs in decode steps."""
    copy = list(range(100, 130))
    fresh, _ = drafter_after([7, *copy, 8, copy[0], copy[1]], prompt=33)  # a copy starts: 2 tokens match
    assert fresh.propose(5) == copy[2:7] and fresh.matched == 2
    assert fresh.reach_chances(3) == pytest.approx([2 / 3, 2 / 3 * 3 / 4, 2 / 3 * 3 / 4 * 4 / 5])
    planner = SpeculationPlanner(SpeculativeConfig())
    assert len(planner.plan([Candidate("s", fresh, copy[2:7], 5)], 1, 100)["s"]) == 5  # nothing timed: prior
    timed(planner, 0.3)  # P(5) = 2/7 < 0.3 < P(4) = 1/3
    assert len(planner.plan([Candidate("s", fresh, copy[2:7], 5)], 1, 100)["s"]) == 4
    timed(planner, 0.7)  # only P(1) = 2/3 pays
    assert planner.plan([Candidate("s", fresh, copy[2:7], 5)], 1, 100) == {"s": copy[2:3]}
    assert planner.plan([Candidate("s", fresh, copy[2:7], 5)], 1, 0) == {}  # no KV cache room
    # After the copy went on for 20 tokens, its draft tokens are measured as near-certain.
    copying, _ = drafter_after([7, *copy, 8, *copy[:22]], prompt=33)
    assert copying.propose(5) == copy[22:27] and copying.matched == 8
    assert copying.reach_chances(5)[-1] > 0.9
    timed(planner, 0.7)
    assert len(planner.plan([Candidate("s", copying, copy[22:27], 5)], 1, 100)["s"]) == 5
    assert planner.plan([Candidate("s", copying, copy[22:27], 2)], 1, 100) == {"s": copy[22:24]}  # tokens left


def test_guesses_are_learned_and_not_checked() -> None:
    """Open text where single tokens recur with other continuations: within a few tokens the single-token matches'
    chance is measured low and their drafts are not checked, while a batch's copying sequence still is."""
    rng = np.random.default_rng(1)
    text = [int(t) for t in rng.integers(0, 12, 60)]  # 12 distinct tokens: every token recurs, rarely its successor
    guessing, _ = drafter_after(text, prompt=10)
    assert 0 < guessing.chance(1) < 0.2
    copy = list(range(100, 130))
    copying, _ = drafter_after([7, *copy, 8, *copy[:22]], prompt=33)
    planner = SpeculationPlanner(SpeculativeConfig())
    timed(planner, 0.2)
    proposal = guessing.propose(5)
    assert proposal and guessing.matched <= 2
    plan = planner.plan([Candidate("guess", guessing, proposal, 5),
                         Candidate("copy", copying, copying.propose(5), 5)], 3, 100)
    assert list(plan) == ["copy"] and len(plan["copy"]) == 5


def test_forward_costs_are_robust_to_a_slow_forward_and_follow_the_machine() -> None:
    """One verify slowed by other work does not move the line, and each verify timing is scaled by the decodes of
    its time (the machine's speed drifts)."""
    planner = SpeculationPlanner(SpeculativeConfig())
    timed(planner, 0.4)
    planner.costs.record(6, 0.200)
    assert planner.costs.seconds(6) == pytest.approx(0.030)
    for _ in range(5):  # the machine slows down 2x
        planner.costs.record(1, 0.020)
    assert planner.costs.seconds(6) == pytest.approx(0.060)


def test_open_ended_answers_are_not_slowed_by_hopeless_drafts(model) -> None:
    """Adaptive (the default): a sampled answer at high temperature, whose drafts are rarely accepted, checks
    few drafts once acceptance is measured."""
    prompt = prompts()[1]
    config = GenerationConfig(temperature=1.5, seed=2, max_tokens=120, ignore_eos=True)
    _, forced = run(model, prompt, config, FORCED)
    _, adaptive = run(model, prompt, config, {"method": "ngram"})
    assert forced.acceptance_rate < 0.2
    assert adaptive.draft_tokens < forced.draft_tokens / 3


def test_speculation_with_jump_forward_gives_the_same_document(model) -> None:
    """Jump-forward appends the tokens a grammar forces; speculation checks drafts between those jumps."""
    schema = {"type": "object", "properties": {"name": {"enum": ["alpha", "beta"]}, "n": {"type": "integer",
                                                                                           "maximum": 9}},
              "required": ["name", "n"], "additionalProperties": False}
    config = GenerationConfig(temperature=0.9, seed=1, max_tokens=100,
                              response_format={"type": "json_schema", "json_schema": {"schema": schema}})
    answers = []
    for speculative in (None, FORCED):
        engine = Engine(model, max_batch=2, jump_forward=True, speculative=speculative)
        [out] = engine.generate(prompts()[0], config)
        answers.append((out.text, out.finish_reason))
    assert answers[0] == answers[1]


def test_preempted_drafting_requests_finish(gguf_small) -> None:
    """A KV cache too short for every request: the latest are preempted and recomputed; drafts never take the room
    a running sequence needs, and every answer ends normally."""
    engine = Engine(gguf_small, max_batch=4, speculative=FORCED)
    config = GenerationConfig(temperature=0, max_tokens=30, ignore_eos=True)
    ids = [engine.add_request(p[:20], config) for p in prompts()]
    outs = {}
    while engine.has_unfinished():
        for delta in engine.step():
            if delta.output is not None:
                outs[delta.request_id] = delta.output
    assert [outs[i].finish_reason for i in ids] == ["length"] * 3
    assert all(len(outs[i].token_ids) == 30 for i in ids)
    assert engine.stats.preemptions > 0 and engine.stats.accepted_draft_tokens > 0


@pytest.fixture(scope="module")
def gguf_small():
    from logitproc.serve.cli_options import tiny_model
    from logitproc.serve.compiled_model import CompiledModel

    return CompiledModel.open(tiny_model(), target="cpu", max_total_tokens=96, max_num_sequences=4)


def test_smollm2_greedy_answers_are_the_same_with_drafts(default_model_in_cache) -> None:
    """On the real model: a copying answer (most drafts accepted) and open ones (most rejected; the story's answer
    changed with drafts before the verify's attention was decode's) are the tokens plain greedy decoding gives."""
    paragraph = ("The river rises in the hills above the town, runs through the old market and the mill, and "
                 "reaches the sea twelve miles to the south.")
    for question, tokens in ((f"Repeat this paragraph word for word.\n\n{paragraph}", 48),
                             ("Name three colours.", 48), ("Write a short story about a lighthouse keeper.", 128)):
        messages = [{"role": "user", "content": question}]
        config = GenerationConfig(temperature=0, max_tokens=tokens)
        [want] = Engine(default_model_in_cache, max_batch=1).generate(messages, config)
        engine = Engine(default_model_in_cache, max_batch=1, speculative=FORCED)
        [got] = engine.generate(messages, config)
        assert got.token_ids == want.token_ids
        assert engine.stats.drafts > 0
