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
from logitproc.serve.speculation import (
    Candidate,
    Drafter,
    SpeculationPlanner,
    SpeculativeConfig,
    expected_tokens,
)

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


def test_the_plan_drafts_only_where_it_pays() -> None:
    """With forwards of n tokens timed, a sequence whose drafts are mostly accepted checks several, one whose
    drafts are rarely accepted checks none (its proposals are still compared with what comes: acceptance keeps
    being measured)."""
    planner = SpeculationPlanner(SpeculativeConfig())
    assert planner.plan([], 1, 100) == {} and planner.plan([], 0, 100) == {}
    for n in range(1, 8):
        planner.costs.record(n, 0.010 + 0.004 * (n - 1))
    good, bad = Drafter(SpeculativeConfig(), RequestState([1, 2])), Drafter(SpeculativeConfig(), RequestState([1]))
    good.matched = bad.matched = 4  # proposals found by a 4-token suffix
    for _ in range(20):
        good.record(5, 5)
        bad.record(5, 0)
    assert good.alpha > 0.9 and bad.alpha < 0.1
    assert good.alpha_for(1) == pytest.approx(0.3)  # the prior: a suffix of 1 token has not been measured
    # three decoding sequences: good, bad and one without a proposal
    plan = planner.plan([Candidate("good", good, [7] * 5, 5), Candidate("bad", bad, [8] * 5, 5)], 3, 100)
    assert list(plan) == ["good"] and len(plan["good"]) == 5
    assert planner.plan([Candidate("good", good, [7] * 5, 2)], 1, 100) == {"good": [7, 7]}  # max_tokens left
    assert planner.plan([Candidate("good", good, [7] * 5, 5)], 1, 3) == {"good": [7, 7, 7]}  # KV cache room
    # The unchecked proposal of `bad` is compared with the tokens that come: two hits raise its estimate.
    state = RequestState([1])
    before = bad.alpha
    bad.sync(state)
    bad.shadow([8, 8])
    bad.matched = 1  # a later proposal: the shadow keeps the suffix length of its own
    state.append_token(8)
    state.append_token(8)
    bad.sync(state)
    assert bad.alpha > before and bad.run == 2
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)
    assert expected_tokens(0.5, 2, follow=1.0) == pytest.approx(2.0)


def test_copies_are_drafted_in_runs() -> None:
    """Before any forward is timed, a copy-like proposal is checked at once (prior costs); after a draft accepted in
    full, the next one is checked at full length even when only a single token matched (the copy goes on); after a
    rejection, a single-token match is a guess again and is not checked. One verify slowed by other work does not
    keep the plan from checking full drafts, and forward costs follow the machine's speed."""
    config = SpeculativeConfig()
    planner = SpeculationPlanner(config)
    drafter = Drafter(config, RequestState([1, 2, 3]))
    drafter.sync(RequestState([1, 2, 3]))
    drafter.matched = 4
    assert "s" in planner.plan([Candidate("s", drafter, [7] * 5, 5)], 1, 100)  # nothing timed yet
    for n in range(1, 7):  # a decode step 10 ms, each further token 4 ms
        planner.costs.record(n, 0.010 + 0.004 * (n - 1))
    for _ in range(6):  # a few misses on single-token matches: those are guesses here
        drafter.matched = 1
        drafter.record(1, 0)
    assert drafter.alpha_for(1) < 0.15
    drafter.matched = 2
    drafter.record(1, 1)  # one token met again (a common word, in open text): no copy yet
    assert drafter.run == 1 and not drafter.running
    drafter.matched = 4
    drafter.record(5, 5)  # a copy: accepted in full
    drafter.matched = 1
    assert drafter.running and drafter.alpha == pytest.approx(drafter.follow) and drafter.follow > 0.8
    assert len(planner.plan([Candidate("s", drafter, [7] * 5, 5)], 1, 100)["s"]) == 5
    planner.costs.record(6, 0.200)  # one verify slowed by other work: the plan still checks full drafts
    assert planner.costs.seconds(6) == pytest.approx(0.030)
    assert len(planner.plan([Candidate("s", drafter, [7] * 5, 5)], 1, 100)["s"]) == 5
    drafter.record(5, 2)  # the copy ended after two tokens
    assert not drafter.running and drafter.alpha == pytest.approx(drafter.alpha_for(1))
    assert planner.plan([Candidate("s", drafter, [7] * 5, 5)], 1, 100) == {}
    for _ in range(5):  # the machine slows down 2x: each verify timing is scaled by the decodes of its time
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
    """On the real model: a copying answer (most drafts accepted) and an open one (most rejected) are the tokens
    plain greedy decoding gives."""
    paragraph = ("The river rises in the hills above the town, runs through the old market and the mill, and "
                 "reaches the sea twelve miles to the south.")
    for question in (f"Repeat this paragraph word for word.\n\n{paragraph}", "Name three colours."):
        messages = [{"role": "user", "content": question}]
        config = GenerationConfig(temperature=0, max_tokens=48)
        [want] = Engine(default_model_in_cache, max_batch=1).generate(messages, config)
        engine = Engine(default_model_in_cache, max_batch=1, speculative=FORCED)
        [got] = engine.generate(messages, config)
        assert got.token_ids == want.token_ids
        assert engine.stats.drafts > 0
