"""The serving engine on the tiny random model (compiled), plus one SmolLM2 answer.

The tiny model's byte-level tokenizer (compile/tiny_model.py) has one token per byte (id 3 + byte) plus a few
merges, which makes multi-byte characters split over several tokens easy to produce.
"""

from __future__ import annotations

import json
import os
from dataclasses import replace

import jsonschema
import numpy as np
import pytest
from logitproc.runtime import GenerationConfig
from logitproc.serve.detokenizer import IncrementalDetokenizer
from logitproc.serve.engine import Engine
from logitproc.serve.stop_strings import StopStringFilter

GREEDY = GenerationConfig(temperature=0.0, max_tokens=24)
PROMPTS = ["Hello there", "The cat sat on", "What is a tree?", "x"]


def byte_token(b: int) -> int:
    """The tiny vocabulary's token for one byte."""
    return 3 + b


@pytest.fixture(scope="module")
def gguf():
    from logitproc.serve.cli_options import tiny_model

    return tiny_model()  # the model of `logitproc chat --model tiny`: one compile serves both test files


@pytest.fixture(scope="module")
def model(gguf):
    from logitproc.serve.compiled_model import CompiledModel

    return CompiledModel.open(gguf, target="cpu")


@pytest.fixture()
def engine(model) -> Engine:
    return Engine(model, max_batch=8)


def run_all(engine: Engine) -> dict[str, list]:
    """Step until idle; every delta by request id (sequence index order kept)."""
    seen: dict[str, list] = {}
    while engine.has_unfinished():
        for delta in engine.step():
            seen.setdefault(delta.request_id, []).append(delta)
    return seen


def outputs_of(deltas: list) -> dict[int, object]:
    return {d.index: d.output for d in deltas if d.output is not None}


def alone(model, prompt, config):
    return Engine(model, max_batch=8).generate(prompt, config)


# ---------------------------------------------------------------------------------------------------- pieces
class FakeTokenizer:
    """Byte tokens only: token id = 3 + byte, as in the tiny vocabulary (ids below 3 are special, skipped)."""

    def decode(self, ids, skip_special_tokens=True):
        return bytes(i - 3 for i in ids if i >= 3).decode("utf-8", errors="replace")


@pytest.mark.parametrize("text", ["plain ascii", "naïve café", "世界 🙂👍🏽", "a\ufffdb"])
def test_detokenizer_never_emits_a_partial_character(text: str) -> None:
    detok = IncrementalDetokenizer(FakeTokenizer())
    pieces = [detok.add_tokens([byte_token(b)]) for b in text.encode()]
    pieces.append(detok.flush())
    assert "".join(pieces) == text
    produced = ""
    for piece in pieces:
        produced += piece
        assert text.startswith(produced)  # every delta ends on a character boundary


def test_detokenizer_flushes_an_incomplete_character_and_survives_rollback() -> None:
    detok = IncrementalDetokenizer(FakeTokenizer())
    assert detok.add_tokens([byte_token(b) for b in b"ab"]) == "ab"
    assert detok.add_tokens([byte_token(0xF0), byte_token(0x9F)]) == ""
    detok.rollback(2)  # those bytes were never emitted
    assert detok.add_tokens([byte_token(b) for b in "é".encode()]) == "é"
    detok.rollback(2)  # "é" was emitted: text is not taken back, later text continues after it
    assert detok.add_tokens([byte_token(b) for b in "éz".encode()]) == "z"
    assert detok.add_tokens([byte_token(0xE4)]) == "" and detok.flush() == "\ufffd"


@pytest.mark.parametrize("chunks", [["abc"], list("abcSTOPdef"), ["ab", "cS", "TO", "Pdef"], ["abcST", "OPx"]])
def test_stop_string_filter_holds_back_prefixes_and_cuts_at_the_stop(chunks: list[str]) -> None:
    f = StopStringFilter(["STOP", "XY"])
    out = ""
    for chunk in chunks:
        out += f.feed(chunk)
        assert "STOP" not in out and not out.endswith(("S", "ST", "STO"))
    out += f.flush()
    full = "".join(chunks)
    assert out == full.split("STOP")[0]
    assert f.stopped == ("STOP" in full)


def test_stop_string_filter_picks_the_earliest_stop() -> None:
    f = StopStringFilter(["world", "lo w"])
    assert f.feed("hello world") == "hel" and f.matched == "lo w"


# ---------------------------------------------------------------------------------------------------- greedy
def test_greedy_matches_the_numpy_reference(model, gguf) -> None:
    from logitproc.serve.numpy_llama import NumpyLlama

    engine = Engine(model)
    ids = engine.tokenize(PROMPTS[0])
    expected = NumpyLlama(gguf).generate_greedy(ids, 24, stop_ids=model.eos_token_ids)
    [out] = engine.generate(ids, GREEDY)
    assert out.token_ids == expected
    assert out.finish_reason == ("stop" if expected[-1] in model.eos_token_ids else "length")
    assert out.prompt_token_ids == ids and out.usage["completion_tokens"] == len(expected)


def test_requests_joining_mid_way_get_the_same_tokens_as_alone(model) -> None:
    configs = [GREEDY, GenerationConfig(temperature=0.9, top_p=0.9, seed=3, max_tokens=20),
               GenerationConfig(temperature=0.0, max_tokens=10, repetition_penalty=1.3, presence_penalty=0.5),
               GenerationConfig(temperature=1.2, top_k=20, min_p=0.02, seed=11, max_tokens=30)]
    expected = {p: alone(model, p, c)[0].token_ids for p, c in zip(PROMPTS, configs, strict=True)}
    engine = Engine(model, max_batch=3)  # the fourth request waits for a free slot
    rids, seen = {}, {}
    for k, (prompt, config) in enumerate(zip(PROMPTS, configs, strict=True)):
        rids[engine.add_request(prompt, config)] = prompt
        for _ in range(k + 2):  # the others are mid-way when the next one joins
            for delta in engine.step():
                seen.setdefault(delta.request_id, []).append(delta)
    for rid, deltas in run_all(engine).items():
        seen.setdefault(rid, []).extend(deltas)
    for rid, prompt in rids.items():
        assert outputs_of(seen[rid])[0].token_ids == expected[prompt], prompt
    assert engine.num_running == 0


def test_requests_added_from_another_thread_while_stepping(model) -> None:
    import threading

    config = GenerationConfig(temperature=0.0, max_tokens=12, ignore_eos=True)
    expected = {p: alone(model, p, config)[0].token_ids for p in PROMPTS}
    engine = Engine(model, max_batch=2)
    rids: dict[str, str] = {}

    def add_all() -> None:
        for prompt in PROMPTS:
            rids[engine.add_request(prompt, config)] = prompt

    adder = threading.Thread(target=add_all)
    adder.start()
    seen: dict[str, list] = {}
    while adder.is_alive() or engine.has_unfinished():
        for delta in engine.step():
            seen.setdefault(delta.request_id, []).append(delta)
    adder.join()
    assert {rids[r]: outputs_of(d)[0].token_ids for r, d in seen.items()} == expected


def test_n_sequences_with_a_seed_are_reproducible_and_distinct(model) -> None:
    config = GenerationConfig(temperature=1.0, seed=7, n=3, max_tokens=16, ignore_eos=True)
    first = alone(model, "Once upon", config)
    again = alone(model, "Once upon", config)
    assert [o.index for o in first] == [0, 1, 2]
    assert [o.token_ids for o in first] == [o.token_ids for o in again]
    assert len({tuple(o.token_ids) for o in first}) == 3
    # sequence i samples with seed + i: the same tokens as a single request with that seed
    single = alone(model, "Once upon", GenerationConfig(temperature=1.0, seed=8, max_tokens=16, ignore_eos=True))
    assert first[1].token_ids == single[0].token_ids
    greedy = alone(model, "Once upon", GenerationConfig(temperature=0.0, n=2, max_tokens=8))
    assert greedy[0].token_ids == greedy[1].token_ids


# ---------------------------------------------------------------------------------------------------- text
def streamed(engine: Engine, prompt, config) -> tuple[list[str], object]:
    pieces, output = [], None
    for delta in engine.stream(prompt, config):
        pieces.append(delta.text)
        output = delta.output or output
    return pieces, output


def test_stop_string_across_token_boundaries(model) -> None:
    config = GenerationConfig(temperature=0.0, max_tokens=40, ignore_eos=True)
    tokenizer = model.tokenizer
    [full] = alone(model, PROMPTS[1], config)
    # a stop string made of the end of one token's text and the start of the next one's
    prefixes = [tokenizer.decode(full.token_ids[:k]) for k in range(1, len(full.token_ids))]
    stop = None
    for p in prefixes:
        if 2 <= len(p) < len(full.text) - 2 and full.text.startswith(p) and "\ufffd" not in full.text[: len(p) + 2]:
            candidate = full.text[len(p) - 2 : len(p) + 2]
            if full.text.find(candidate) == len(p) - 2:
                stop = candidate
                break
    assert stop is not None, f"no token boundary to test in {full.text!r}"
    pieces, out = streamed(Engine(model), PROMPTS[1], GenerationConfig(temperature=0.0, max_tokens=40,
                                                                        ignore_eos=True, stop=[stop, "never"]))
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == full.text[: full.text.find(stop)] == "".join(pieces)
    assert out.token_ids == full.token_ids[: len(out.token_ids)]  # tokens up to the one completing the stop


def test_streamed_text_is_utf8_safe_and_equals_the_decoded_tokens(model) -> None:
    emoji = "🙂"  # F0 9F 99 82: four byte tokens, so every prefix is an incomplete character
    for seed in range(3):
        bias = {byte_token(b): 9.0 for b in emoji.encode()}
        config = GenerationConfig(temperature=0.7, seed=seed, max_tokens=40, ignore_eos=True, logit_bias=bias)
        pieces, out = streamed(Engine(model), "emoji: " + emoji * 3, config)
        produced = ""
        for piece in pieces:
            produced += piece
            assert out.text.startswith(produced)
        assert produced == out.text == model.tokenizer.decode(out.token_ids)


# ---------------------------------------------------------------------------------------------------- finish
def test_max_tokens_and_full_context_finish_with_length(model) -> None:
    [out] = alone(model, "abc", GenerationConfig(temperature=0.0, max_tokens=5, ignore_eos=True))
    assert out.finish_reason == "length" and len(out.token_ids) == 5
    prompt = [byte_token(ord("a"))] * (model.context_length - 3)
    [out] = alone(model, prompt, GenerationConfig(temperature=0.0, ignore_eos=True))
    assert out.finish_reason == "length" and len(out.token_ids) == 3


def test_eos_stop_token_ids_and_ignore_eos(model) -> None:
    eos = model.eos_token_ids[0]
    [out] = alone(model, "abc", GenerationConfig(temperature=0.0, logit_bias={eos: 100.0}, max_tokens=5))
    assert (out.finish_reason, out.token_ids, out.text, out.stop_reason) == ("stop", [eos], "", eos)
    [out] = alone(model, "abc", GenerationConfig(temperature=0.0, logit_bias={eos: 100.0}, max_tokens=5,
                                                 ignore_eos=True))
    assert out.finish_reason == "length" and out.token_ids == [eos] * 5
    [ref] = alone(model, "abc", GenerationConfig(temperature=0.0, max_tokens=5, ignore_eos=True))
    third = ref.token_ids[2]
    [out] = alone(model, "abc", GenerationConfig(temperature=0.0, max_tokens=5, ignore_eos=True,
                                                 stop_token_ids=[third]))
    first = ref.token_ids.index(third)
    assert out.finish_reason == "stop" and out.token_ids == ref.token_ids[: first + 1] and out.stop_reason == third


class _BanAfter:
    """A mask source that allows everything for ``k`` tokens, then nothing (a grammar at a dead end)."""

    def __init__(self, k: int) -> None:
        self.left = k

    def fill_bitmask(self, row: np.ndarray, draft_path) -> bool:
        if self.left > len(draft_path):
            return False
        row[:] = 0
        return True

    def accept_token(self, token_id: int) -> None:
        self.left -= 1

    def rollback(self, num_tokens: int) -> None:
        self.left += num_tokens

    def jump_forward(self, output_token_ids) -> None:
        return None


def test_a_row_with_every_token_masked_finishes_with_grammar_dead_end(model, monkeypatch) -> None:
    engine = Engine(model)
    monkeypatch.setattr(engine, "_mask_sources", lambda config: [_BanAfter(3)] if config.seed == 1 else [])
    dead = engine.add_request("abc", GenerationConfig(temperature=0.0, seed=1, max_tokens=10, ignore_eos=True))
    other = engine.add_request("abc", GenerationConfig(temperature=0.0, max_tokens=10, ignore_eos=True))
    seen = run_all(engine)
    out = outputs_of(seen[dead])[0]
    assert out.finish_reason == "grammar_dead_end" and len(out.token_ids) == 3 and -1 not in out.token_ids
    assert outputs_of(seen[other])[0].finish_reason == "length"


# ---------------------------------------------------------------------------------------------------- errors
def test_bad_requests_fail_alone_at_add_request(model) -> None:
    config = GenerationConfig(temperature=0.0, max_tokens=12, ignore_eos=True)
    [expected] = alone(model, PROMPTS[0], config)
    engine = Engine(model, max_batch=4)
    rid = engine.add_request(PROMPTS[0], config, request_id="good")
    engine.step()
    bad = [
        (lambda: engine.add_request([5] * model.context_length, config), "context"),
        (lambda: engine.add_request([3, model.vocab_size], config), "outside the vocabulary"),
        (lambda: engine.add_request("", config), "empty"),
        (lambda: engine.add_request("a", GenerationConfig(logit_bias={model.vocab_size + 1: 1.0})), "vocabulary"),
        (lambda: engine.add_request("a", GenerationConfig(n=5)), "max_batch"),
        (lambda: engine.add_request("a", config, request_id="good"), "already in use"),
        (lambda: engine.add_request([{"role": "user"}], config), "content"),
    ]
    for add, message in bad:
        with pytest.raises(ValueError, match=message):
            add()
    assert outputs_of(run_all(engine)[rid])[0].token_ids == expected.token_ids


def test_abort_running_waiting_and_closed_streams(model) -> None:
    config = GenerationConfig(temperature=0.0, max_tokens=30, ignore_eos=True)
    [expected] = alone(model, PROMPTS[2], config)
    engine = Engine(model, max_batch=2)
    keep = engine.add_request(PROMPTS[2], config)
    stop = engine.add_request(PROMPTS[0], config)
    waiting = engine.add_request(PROMPTS[1], GenerationConfig(n=2, max_tokens=5))
    seen: dict[str, list] = {}
    for _ in range(4):
        for d in engine.step():
            seen.setdefault(d.request_id, []).append(d)
    engine.abort(stop)
    engine.abort(waiting)
    for rid, deltas in run_all(engine).items():
        seen.setdefault(rid, []).extend(deltas)
    stopped = outputs_of(seen[stop])[0]
    assert stopped.finish_reason == "abort" and 0 < len(stopped.token_ids) < 30
    assert [o.finish_reason for o in outputs_of(seen[waiting]).values()] == ["abort", "abort"]
    assert outputs_of(seen[keep])[0].token_ids == expected.token_ids
    stream = engine.stream("abc", config)
    next(stream)
    stream.close()  # closing the stream aborts its request
    assert not engine.has_unfinished() and engine.num_running == 0


def test_preempted_requests_resume_with_the_same_tokens(gguf) -> None:
    """A KV cache of 96 tokens, four requests with no max_tokens: the latest is preempted when the cache runs out and
    later prefilled again; every answer (sampled, penalised, grammar-constrained, n=2) equals the one it gets alone,
    and its streamed text is its final text (nothing repeated or lost across the preemption)."""
    from logitproc.serve.compiled_model import CompiledModel

    small = CompiledModel.open(gguf, target="cpu", max_total_tokens=96, max_num_sequences=4)
    jobs = [(PROMPTS[0], GenerationConfig(temperature=0.0, ignore_eos=True)),
            (PROMPTS[1], GenerationConfig(temperature=0.9, seed=5, ignore_eos=True, frequency_penalty=0.4)),
            (PROMPTS[2], GenerationConfig(temperature=0.7, seed=9, n=2, ignore_eos=True)),
            (PROMPTS[3], GenerationConfig(temperature=0.0, max_tokens=80, response_format={"type": "json_object"}))]
    expected = [Engine(small, max_batch=4).generate(p, c) for p, c in jobs]
    engine = Engine(small, max_batch=4)
    rids = [engine.add_request(p, c) for p, c in jobs]
    seen = run_all(engine)
    assert engine.stats.preemptions > 0 and engine.num_running == 0
    for rid, want in zip(rids, expected, strict=True):
        got = outputs_of(seen[rid])
        assert [o.token_ids for o in got.values()] == [o.token_ids for o in want]
        assert [o.finish_reason for o in got.values()] == [o.finish_reason for o in want]
        for index, out in got.items():
            assert "".join(d.text for d in seen[rid] if d.index == index) == out.text
    assert sum(outputs_of(seen[r])[0].stats.preemptions for r in rids) == engine.stats.preemptions


def test_logprobs_and_stats(model) -> None:
    engine = Engine(model)
    config = GenerationConfig(temperature=0.8, seed=2, max_tokens=6, ignore_eos=True, logprobs=True, top_logprobs=3)
    [out] = engine.generate(PROMPTS[0], config)
    assert len(out.logprobs) == len(out.top_logprobs) == len(out.token_ids) == 6
    assert all(lp <= 0 for lp in out.logprobs) and all(len(t) == 3 for t in out.top_logprobs)
    st = out.stats
    assert st.prefill_tokens_per_s > 0 and st.decode_tokens_per_s > 0 and 0 < st.processing_share < 1
    assert engine.stats.steps == 6 and engine.stats.decode_tokens == 5 and "tok/s" in engine.stats.summary()


# ---------------------------------------------------------------------------------------------------- grammar
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer", "minimum": 0,
                                                                      "maximum": 120},
                   "pet": {"enum": ["cat", "dog"]}},
    "required": ["name", "age", "pet"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("jump_forward", [False, True])
def test_json_schema_output_validates(model, jump_forward: bool) -> None:
    engine = Engine(model, jump_forward=jump_forward)
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
    # A random model loves the whitespace JSON allows between tokens: bias it away (the mask still decides).
    no_space = {byte_token(b): -100.0 for b in b" \t\r\n"}
    for seed in range(3):
        [out] = engine.generate("person:", GenerationConfig(temperature=0.8, seed=seed, max_tokens=120,
                                                            response_format=fmt, logit_bias=no_space))
        assert out.finish_reason == "stop", out
        jsonschema.validate(json.loads(out.text), SCHEMA)
    if jump_forward:
        assert engine.stats.jump_forward_tokens > 0 and engine.stats.jump_forward_steps_saved > 0
    else:
        assert engine.stats.jump_forward_tokens == 0


def test_jump_forward_is_chosen_per_request(model) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
    config = GenerationConfig(temperature=0.8, seed=1, max_tokens=120, response_format=fmt,
                              logit_bias={byte_token(b): -100.0 for b in b" \t\r\n"})
    engine = Engine(model, max_batch=2, jump_forward=True)
    on, off = engine.add_request("person:", config), engine.add_request("person:", config, jump_forward=False)
    seen = run_all(engine)
    [out_on], [out_off] = outputs_of(seen[on]).values(), outputs_of(seen[off]).values()
    assert out_on.stats.jump_forward_tokens > 0 and out_off.stats.jump_forward_tokens == 0
    for out in (out_on, out_off):
        jsonschema.validate(json.loads(out.text), SCHEMA)
    with pytest.raises(ValueError, match="jump_forward=True needs an engine created with jump_forward=True"):
        Engine(model).add_request("x", config, jump_forward=True)
    with pytest.raises(TypeError, match="jump_forward must be a boolean"):
        engine.add_request("x", config, jump_forward="yes")


def test_nan_or_inf_logits_end_only_their_sequence_with_an_error(gguf) -> None:
    from logitproc.serve.compiled_model import CompiledModel

    class Poisoned(CompiledModel):
        """The tiny model, whose logits turn NaN (or +inf) for one sequence from its third decode step."""

        poisoned: dict[int, float] = {}
        steps: dict[int, int] = {}

        def decode(self, seq_ids, token_ids):
            logits = super().decode(seq_ids, token_ids)
            for row, seq in enumerate(seq_ids):
                self.steps[seq] = self.steps.get(seq, 0) + 1
                if seq in self.poisoned and self.steps[seq] >= 3:
                    logits[row, 5] = self.poisoned[seq]
            return logits

    model = Poisoned.open(gguf, target="cpu")
    config = GenerationConfig(temperature=0.0, max_tokens=12, ignore_eos=True)
    for bad in (np.nan, np.inf):
        engine = Engine(model, max_batch=4)
        rids = [engine.add_request(p, config) for p in PROMPTS[:3]]
        engine.step()  # prefill: the model's sequence ids are known from here
        Poisoned.poisoned = {model.sequence_ids[1]: bad}
        Poisoned.steps = {}
        outs = {rid: outputs_of(d)[0] for rid, d in run_all(engine).items()}
        hit = outs[rids[1]]
        assert hit.finish_reason == "error" and "non_finite_logits" in hit.error and len(hit.token_ids) == 3
        for rid, prompt in ((rids[0], PROMPTS[0]), (rids[2], PROMPTS[2])):
            assert outs[rid].finish_reason == "length"
            assert outs[rid].token_ids == alone(model, prompt, config)[0].token_ids


def test_a_seeded_request_samples_the_same_tokens_whatever_else_runs(model) -> None:
    """Batch invariance (issue 16): the model reduces each sequence's rows in one order whatever the batch, so a
    seeded sampled answer alone equals the same request among 7 others (joining at different steps)."""
    config = GenerationConfig(temperature=1.0, top_p=0.95, seed=1234, max_tokens=40, ignore_eos=True)
    [expected] = alone(model, PROMPTS[1], config)
    engine = Engine(model, max_batch=8)
    others = GenerationConfig(temperature=0.9, seed=7, max_tokens=30, ignore_eos=True)
    for i in range(3):
        engine.add_request(PROMPTS[i % len(PROMPTS)] * (i + 1), others)
    engine.step()
    engine.step()
    target = engine.add_request(PROMPTS[1], config)
    for i in range(4):
        engine.add_request(PROMPTS[(i + 2) % len(PROMPTS)], others)
    got = outputs_of(run_all(engine)[target])[0]
    assert got.token_ids == expected.token_ids


def test_regex_forces_multibyte_characters_through_the_stream(model) -> None:
    pieces, out = streamed(Engine(model), "x", GenerationConfig(temperature=1.0, seed=0, max_tokens=40,
                                                                 response_format={"type": "regex",
                                                                                  "regex": "(é|€|🙂){3}"}))
    assert out.finish_reason == "stop" and len(out.text) == 3 and set(out.text) <= set("é€🙂")
    assert all(p == "" or set(p) <= set("é€🙂") for p in pieces)


def test_grammar_requests_join_a_running_batch(model) -> None:
    regex = GenerationConfig(temperature=0.0, max_tokens=30, response_format={"type": "regex", "regex": "[a-z]{4,9}!"})
    plain = GenerationConfig(temperature=0.0, max_tokens=30, ignore_eos=True)
    expected = [alone(model, p, c)[0] for p, c in [(PROMPTS[0], plain), (PROMPTS[1], regex), (PROMPTS[2], regex)]]
    engine = Engine(model, max_batch=4, jump_forward=True)
    rids = [engine.add_request(PROMPTS[0], plain)]
    engine.step()
    rids.append(engine.add_request(PROMPTS[1], regex))
    engine.step()
    rids.append(engine.add_request(PROMPTS[2], regex))
    seen = run_all(engine)
    for rid, want in zip(rids, expected, strict=True):
        assert outputs_of(seen[rid])[0].text == want.text
    assert expected[1].finish_reason == "stop" and expected[1].text.endswith("!")


def test_a_thinking_budget_needs_a_model_with_a_thinking_mode(model) -> None:
    """The tiny model has no <think> token: a budget is refused at add_request rather than answered with nothing."""
    engine = Engine(model)
    with pytest.raises(ValueError, match=r"max_thinking_tokens=5: .* has no thinking mode \(think_begin='<think>'"):
        engine.add_request("think first", GenerationConfig(max_thinking_tokens=5))
    assert not engine.has_unfinished()


def test_thinking_budget_forces_the_end_marker(model) -> None:
    """Markers the vocabulary has as tokens of their own (the tiny model's ChatML tokens stand in for <think>)."""
    config = GenerationConfig(temperature=1.0, seed=4, max_tokens=40, ignore_eos=True, max_thinking_tokens=5,
                              think_begin="<|im_start|>", think_end="<|im_end|>")
    [out] = alone(model, "think first", config)
    begin, end = (model.tokenizer.token_to_id(m) for m in ("<|im_start|>", "<|im_end|>"))
    assert out.prompt_token_ids[-1] == begin  # generation starts inside the think block
    assert end in out.token_ids[:6], out.token_ids  # at most 5 thinking tokens, then the end marker


def test_a_schema_the_backend_cannot_compile_fails_alone(model) -> None:
    engine = Engine(model)
    rid = engine.add_request("abc", GenerationConfig(temperature=0.0, max_tokens=4, ignore_eos=True))
    bad = {"type": "json_schema", "json_schema": {"schema": {"type": "object", "properties": {"a": {"$ref": "#/x"}}}}}
    with pytest.raises(ValueError):
        engine.add_request("abc", GenerationConfig(response_format=bad))
    assert outputs_of(run_all(engine)[rid])[0].finish_reason == "length"


# ---------------------------------------------------------------------------------------------------- SmolLM2
@pytest.fixture(scope="module")
def smollm2():
    from logitproc.compile.model_fetch import fetch_default_model
    from logitproc.serve.compiled_model import CompiledModel

    return CompiledModel.open(str(fetch_default_model(os.environ.get("LOGITPROC_TEST_MODEL_CACHE"))), target="cpu")


def test_smollm2_knows_the_capital_of_france(smollm2) -> None:
    engine = Engine(smollm2)
    [out] = engine.generate([{"role": "user", "content": "What is the capital of France?"}],
                            GenerationConfig(temperature=0.0, max_tokens=40))
    assert "Paris" in out.text, out.text


def test_min_tokens_allowed_token_ids_and_bad_words(model) -> None:
    eos = model.eos_token_ids[0]
    # EOS pushed up by +100: without min_tokens the answer is EOS at once; with it, exactly min_tokens tokens first.
    config = GenerationConfig(temperature=0.0, logit_bias={eos: 100.0}, max_tokens=20)
    [out] = alone(model, "abc", replace(config, min_tokens=6))
    assert len(out.token_ids) == 7 and out.token_ids[-1] == eos and out.finish_reason == "stop"
    assert eos not in out.token_ids[:6]
    # Stop strings are looked for only after min_tokens tokens (vLLM's rule).
    letters = [byte_token(b) for b in b"ab"]
    only_ab = replace(config, logit_bias={}, allowed_token_ids=letters, max_tokens=12, ignore_eos=True)
    [free] = alone(model, "abc", only_ab)
    assert set(free.token_ids) <= set(letters) and len(free.token_ids) == 12
    first = free.text[:2]  # one byte a token here: characters are tokens
    [at_once] = alone(model, "abc", replace(only_ab, stop=[first]))
    assert at_once.finish_reason == "stop" and at_once.text == ""
    [held] = alone(model, "abc", replace(only_ab, stop=[first], min_tokens=4))
    later = free.text.find(first, 4)
    assert held.text == (free.text if later < 0 else free.text[:later])
    assert held.finish_reason == ("length" if later < 0 else "stop")
    # A bad word never appears, however much the bias pushes its tokens: one token, and two ("xx": no x after x).
    push = GenerationConfig(temperature=0.0, logit_bias={byte_token(ord("x")): 100.0}, max_tokens=10, ignore_eos=True)
    [pushed] = alone(model, "abc", push)
    assert pushed.text == "x" * 10
    [clean] = alone(model, "abc", replace(push, bad_words=["x"]))
    assert "x" not in clean.text and len(clean.token_ids) == 10
    [paired] = alone(model, "abc", replace(push, bad_words=["xx"]))
    assert "xx" not in paired.text and paired.text.count("x") == 5 and len(paired.token_ids) == 10
