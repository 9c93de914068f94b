"""Chunked prefill: a step feeds the model at most its token budget, so a long prompt goes in over several steps and
never holds a running stream up for more than one step's budget (counted in steps and tokens, never in seconds).

Every answer is compared with the one the same request gets from an engine that prefills every prompt whole (greedy
or seeded), on the tiny compiled model.
"""

from __future__ import annotations

import numpy as np
import pytest
from logitproc.runtime import GenerationConfig
from logitproc.serve.engine import Engine

GREEDY = GenerationConfig(temperature=0.0, max_tokens=12, ignore_eos=True)
WHOLE = {"max_num_batched_tokens": None, "max_prefill_tokens_with_decode": None}


@pytest.fixture(scope="module")
def gguf():
    from logitproc.serve.cli_options import tiny_model

    return tiny_model()


@pytest.fixture(scope="module")
def model(gguf):
    from logitproc.serve.compiled_model import CompiledModel

    return CompiledModel.open(gguf, target="cpu")


def tokens(n: int, seed: int) -> list[int]:
    """A prompt of ``n`` byte tokens of the tiny vocabulary."""
    return (3 + np.random.default_rng(seed).integers(32, 127, n)).tolist()


def alone(model, prompt, config=GREEDY):
    return Engine(model, **WHOLE).generate(prompt, config)


def stepped(engine: Engine) -> list[tuple[int, dict[str, list]]]:
    """Step until idle; per step: the prompt tokens it fed, and its deltas by request id."""
    steps = []
    while engine.has_unfinished():
        before = engine.stats.prefill_tokens
        seen: dict[str, list] = {}
        for delta in engine.step():
            seen.setdefault(delta.request_id, []).append(delta)
        steps.append((engine.stats.prefill_tokens - before, seen))
    return steps


def output(steps, rid):
    outs = [d.output for _, seen in steps for d in seen.get(rid, []) if d.output is not None]
    assert len(outs) == 1
    return outs[0]


def first_token_step(steps, rid) -> int:
    return next(i for i, (_, seen) in enumerate(steps) if any(d.token_ids for d in seen.get(rid, [])))


def test_a_long_prompt_never_holds_up_a_running_stream(model) -> None:
    """A stream decodes while a 1,000-token prompt arrives: every step gives the stream its next token and feeds at
    most 8 prompt tokens; the long prompt's first token comes after its 125 chunks; both answers equal their
    answers alone."""
    engine = Engine(model, max_batch=4, max_num_batched_tokens=64, max_prefill_tokens_with_decode=8)
    running_config = GenerationConfig(temperature=0.0, max_tokens=200, ignore_eos=True)
    running = engine.add_request("Hello there", running_config)
    engine.step()  # its prompt and first token
    long = engine.add_request(tokens(1000, 0), GREEDY)
    steps = stepped(engine)
    ends = first_token_step(steps, long)
    assert ends == 124  # ceil(1000 / 8) steps, the first of them numbered 0
    for fed, seen in steps[: ends + 1]:
        assert fed <= 8
        assert sum(len(d.token_ids) for d in seen[running]) == 1  # the stream's next token, every step
    assert output(steps, running).token_ids == alone(model, "Hello there", running_config)[0].token_ids
    assert output(steps, long).token_ids == alone(model, tokens(1000, 0))[0].token_ids


def test_chunks_follow_the_budget_and_the_shortest_prompt_goes_first(model) -> None:
    """Nothing decoding: a step feeds max_num_batched_tokens; a short prompt arriving with a long one gets its
    first token in the first step, the long one goes in over the next steps."""
    engine = Engine(model, max_batch=4, max_num_batched_tokens=64)
    long, short = engine.add_request(tokens(200, 1), GREEDY), engine.add_request(tokens(30, 2), GREEDY)
    steps = stepped(engine)
    # step 0: the short prompt whole and 34 of the long one; then (decoding the short one) at most 16 per step
    assert steps[0][0] == 64 and first_token_step(steps, short) == 0
    assert [fed for fed, _ in steps[1:first_token_step(steps, long) + 1]] == [16] * 10 + [6]
    assert engine.stats.prefill_tokens == 230
    for rid, prompt in [(long, tokens(200, 1)), (short, tokens(30, 2))]:
        assert output(steps, rid).token_ids == alone(model, prompt)[0].token_ids


def test_greedy_and_seeded_answers_equal_with_and_without_chunked_prefill(model) -> None:
    """Long prompts of awkward lengths joining a running batch with a small budget, n=2 forks, a seeded sample:
    the tokens are those of the same requests prefilled whole."""
    jobs = [(tokens(333, 3), GREEDY), (tokens(517, 4), GREEDY), ("Hi", GREEDY),
            (tokens(201, 5), GenerationConfig(temperature=0.8, seed=7, n=2, max_tokens=10, ignore_eos=True)),
            (tokens(77, 6), GenerationConfig(temperature=0.0, max_tokens=30, ignore_eos=True))]
    expected = [[o.token_ids for o in alone(model, p, c)] for p, c in jobs]
    engine = Engine(model, max_batch=6, max_num_batched_tokens=40, max_prefill_tokens_with_decode=13)
    rids = [engine.add_request(p, c) for p, c in jobs]
    seen: dict[str, dict[int, list[int]]] = {}
    while engine.has_unfinished():
        for delta in engine.step():
            if delta.output is not None:
                seen.setdefault(delta.request_id, {})[delta.index] = delta.output.token_ids
    assert [[seen[r][i] for i in sorted(seen[r])] for r in rids] == expected


def test_a_request_preempted_mid_prefill_resumes_with_the_same_tokens(gguf) -> None:
    """A KV cache of 256 tokens: a running answer grows until the long prompt still going in no longer fits, so
    that request is preempted between two of its chunks; it is prefilled again later and answers as it does
    alone."""
    from logitproc.serve.compiled_model import CompiledModel

    small = CompiledModel.open(gguf, target="cpu", max_total_tokens=256, max_num_sequences=4)
    grow = GenerationConfig(temperature=0.0, ignore_eos=True)  # to the end of the context
    expected = [Engine(small, **WHOLE).generate(p, c)[0].token_ids
                for p, c in [(tokens(40, 7), grow), (tokens(200, 8), GREEDY)]]
    engine = Engine(small, max_batch=4, max_num_batched_tokens=64, max_prefill_tokens_with_decode=8)
    first = engine.add_request(tokens(40, 7), grow)
    engine.step()
    second = engine.add_request(tokens(200, 8), GREEDY)
    steps = stepped(engine)
    preempted = output(steps, second)
    assert preempted.stats.preemptions == 1 and engine.stats.preemptions == 1
    # it was preempted before its prompt was all in: it prefilled more than its prompt, and had no token by then
    assert engine.stats.prefill_tokens > 40 + 200 + 200 // 2
    assert [output(steps, first).token_ids, preempted.token_ids] == expected


def test_a_prefix_cache_hit_starts_the_chunks_where_the_cached_prefix_ends(model) -> None:
    """A prompt sharing 250 tokens with a cached one prefills only the other 100, in chunks of the budget counted
    from the end of the shared prefix; the answer equals the one without a prefix cache."""
    engine = Engine(model, max_num_batched_tokens=64)
    engine.generate(tokens(300, 9), GREEDY)
    prompt = tokens(300, 9)[:250] + tokens(100, 10)
    rid = engine.add_request(prompt, GREEDY)
    steps = stepped(engine)
    out = output(steps, rid)
    assert out.stats.cached_tokens == 250
    assert [fed for fed, _ in steps[:2]] == [64, 36] and first_token_step(steps, rid) == 1
    assert out.token_ids == Engine(model, prefix_cache=False, **WHOLE).generate(prompt, GREEDY)[0].token_ids


def test_a_request_aborted_mid_prefill_ends_at_the_next_step(model) -> None:
    """Between two chunks of a long prompt, an abort ends the request at the next step and frees its KV cache
    (the chat REPL's Ctrl-C acts within one chunk)."""
    engine = Engine(model, max_num_batched_tokens=32, prefix_cache=False)
    rid = engine.add_request(tokens(1000, 11), GREEDY)
    for _ in range(3):
        assert engine.step() == []  # chunks: no token yet
    assert engine.kv_tokens == 96
    engine.abort(rid)
    [delta] = engine.step()
    assert delta.finish_reason == "abort" and delta.output.token_ids == []
    assert not engine.has_unfinished() and engine.kv_tokens == 0 and engine.stats.prefill_tokens == 96


def test_speculation_and_jump_forward_go_on_beside_a_chunked_prefill(model) -> None:
    """A drafting stream and a grammar-constrained one with jump-forward run while a long prompt goes in by chunks;
    each answer equals its answer alone."""
    schema = {"type": "object", "properties": {"name": {"enum": ["alpha", "beta"]}}, "required": ["name"],
              "additionalProperties": False}
    jobs = [("abc abc abc abc abc abc", GenerationConfig(temperature=0.0, max_tokens=40, ignore_eos=True)),
            ("A name:", GenerationConfig(temperature=0.0, max_tokens=40, response_format={
                "type": "json_schema", "json_schema": {"schema": schema}})),
            (tokens(600, 12), GREEDY)]
    options = {"jump_forward": True, "speculative": {"method": "ngram", "num_speculative_tokens": 3}}
    expected = [Engine(model, **options, **WHOLE).generate(p, c)[0].token_ids for p, c in jobs]
    engine = Engine(model, max_batch=4, max_num_batched_tokens=48, max_prefill_tokens_with_decode=10, **options)
    rids = [engine.add_request(p, c) for p, c in jobs[:2]]
    engine.step()
    rids.append(engine.add_request(*jobs[2]))
    steps = stepped(engine)
    assert [output(steps, r).token_ids for r in rids] == expected
    assert all(fed <= 48 for fed, _ in steps)


def test_budgets_are_checked(model) -> None:
    for bad, message in [({"max_num_batched_tokens": 8}, "max_num_batched_tokens must be None or an int above "
                                                           "max_batch=8"),
                         ({"max_num_batched_tokens": 64.0}, "max_num_batched_tokens"),
                         ({"max_prefill_tokens_with_decode": 0}, "max_prefill_tokens_with_decode must be None or an "
                                                                 "int >= 1, got 0")]:
        with pytest.raises(ValueError, match=message):
            Engine(model, max_batch=8, **bad)
