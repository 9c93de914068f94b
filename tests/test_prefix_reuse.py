"""Prefix reuse in the engine: later turns and shared system prompts prefill only what is new, answers unchanged.

Every answer is compared with the one the same request gets from an engine without a prefix cache (greedy or
seeded), on the tiny compiled model; the KV cache's size is small where eviction and preemption are tested.
"""

from __future__ import annotations

import pytest
from logitproc.runtime import GenerationConfig
from logitproc.serve.engine import Engine

GREEDY = GenerationConfig(temperature=0.0, max_tokens=12, ignore_eos=True)
SYSTEM = "You are a careful assistant. Answer in one short sentence, and never repeat the question back. " * 2


@pytest.fixture(scope="module")
def model():
    from logitproc.serve.cli_options import tiny_model
    from logitproc.serve.compiled_model import CompiledModel

    return CompiledModel.open(tiny_model(), target="cpu")


def answer(engine: Engine, prompt, config=GREEDY):
    [out] = engine.generate(prompt, config)
    return out


def test_a_conversation_prefills_only_its_new_turn(model) -> None:
    """Each turn's prompt is the previous prompt, its answer and a new message (token ids, as a chat template
    renders a history); only the new part is prefilled, and the answers equal those without a prefix cache."""
    cached = Engine(model)
    turns = [cached.tokenize(t) for t in ["What is a tree?", " And a forest?", " Name one."]]
    prompts, replies, prompt = [], [], []
    for i, turn in enumerate(turns):
        prompt = prompt + (replies[-1].token_ids if replies else []) + turn
        before = cached.stats.prefill_tokens
        out = answer(cached, prompt)
        prefilled = cached.stats.prefill_tokens - before
        # every earlier turn (prompt and answer, but for the answer's last token, never fed) comes from the cache
        reused = len(prompts[-1]) + len(replies[-1].token_ids) - 1 if i else 0
        assert out.stats.cached_tokens == reused
        assert prefilled == len(prompt) - reused
        prompts.append(prompt)
        replies.append(out)
    plain = Engine(model, prefix_cache=False)
    for prompt, reply in zip(prompts, replies, strict=True):
        out = answer(plain, prompt)
        assert out.token_ids == reply.token_ids and out.stats.cached_tokens == 0


def test_requests_sharing_a_system_prompt_fork_it(model) -> None:
    questions = ["What is rain?", "Why is the sky blue?", "Count to three.", "Say hi."]
    configs = [GREEDY, GenerationConfig(temperature=0.8, seed=3, max_tokens=10, ignore_eos=True),
               GenerationConfig(temperature=0.7, seed=1, n=2, max_tokens=8, ignore_eos=True), GREEDY]
    plain = Engine(model, prefix_cache=False)
    expected = [plain.generate([{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}], c)
                for q, c in zip(questions, configs, strict=True)]
    engine = Engine(model)
    first = engine.generate([{"role": "system", "content": SYSTEM}, {"role": "user", "content": questions[0]}],
                            configs[0])
    assert first[0].stats.cached_tokens == 0
    rids = [engine.add_request([{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}], c)
            for q, c in zip(questions[1:], configs[1:], strict=True)]
    outputs: dict[str, dict[int, object]] = {}
    while engine.has_unfinished():
        for d in engine.step():
            if d.output is not None:
                outputs.setdefault(d.request_id, {})[d.index] = d.output
    system_tokens = len(engine.tokenize([{"role": "system", "content": SYSTEM}]))
    assert [o.token_ids for o in first] == [o.token_ids for o in expected[0]]
    for rid, want in zip(rids, expected[1:], strict=True):
        got = [outputs[rid][i] for i in sorted(outputs[rid])]
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
        assert got[0].stats.cached_tokens >= system_tokens - 8  # the system prompt (the template's tail may differ)


def test_eviction_under_memory_pressure_and_preemption_keep_answers(model) -> None:
    """A KV cache of 160 tokens and 4 sequence slots: cache entries are evicted (least recently used first) to admit
    requests and before anything is preempted; answers equal those of an engine without a prefix cache."""
    from logitproc.serve.cli_options import tiny_model
    from logitproc.serve.compiled_model import CompiledModel

    small = CompiledModel.open(tiny_model(), target="cpu", max_total_tokens=160, max_num_sequences=4)
    prompts = [f"Story number {i}: once upon a time there was a" for i in range(6)]
    config = GenerationConfig(temperature=0.0, max_tokens=40, ignore_eos=True)
    expected = [answer(Engine(small, max_batch=3, prefix_cache=False), p, config).token_ids for p in prompts]
    engine = Engine(small, max_batch=3)
    for p, want in zip(prompts[:2], expected[:2], strict=True):  # two entries of 71 tokens in the cache
        assert answer(engine, p, config).token_ids == want
    again = answer(engine, prompts[1], config)  # 142 + 33 > 160: the least recently used entry (prompts[0]) goes
    assert again.token_ids == expected[1] and again.stats.cached_tokens == again.stats.prompt_tokens - 1
    a, b = engine.tokenize(prompts[0]), engine.tokenize(prompts[1])
    shared = next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)  # "Story number "
    assert answer(engine, prompts[0], config).stats.cached_tokens == shared  # its own entry was evicted
    rids = [engine.add_request(p, config) for p in prompts]  # six at once: entries evicted, then preemption
    outputs = {}
    while engine.has_unfinished():
        for d in engine.step():
            if d.output is not None:
                outputs[d.request_id] = d.output
    assert [outputs[r].token_ids for r in rids] == expected
    assert engine.stats.preemptions > 0
    assert len(small.sequence_ids) <= small.max_num_sequences
    assert sum(small.sequence_length(s) for s in small.sequence_ids) <= small.max_total_tokens
    engine.clear_prefix_cache()
    assert small.sequence_ids == ()


def test_an_identical_prompt_still_prefills_its_last_token(model) -> None:
    engine = Engine(model)
    first = answer(engine, "The cat sat on")
    again = answer(engine, "The cat sat on")
    assert again.token_ids == first.token_ids
    assert again.stats.cached_tokens == again.stats.prompt_tokens - 1


def test_a_new_engine_takes_over_the_models_kv_cache(model) -> None:
    old = Engine(model)
    answer(old, "Hello there")
    assert model.sequence_ids  # kept for reuse
    new = Engine(model)
    assert model.sequence_ids == ()
    assert answer(new, "Hello there").stats.cached_tokens == 0
