"""The Hugging Face integration against HF's own processors (RepetitionPenalty, SequenceBias, NoBadWords,
MinNewTokensLength, PrefixConstrained, the temperature and top-p warpers) on random logits, and inside ``generate()``
with a tiny random Llama and the tiny byte-level tokenizer: JSON answers parse, with HF's sampling or logitproc's."""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

from logitproc.compile.gguf_model import build_tokenizer  # noqa: E402
from logitproc.compile.tiny_model import make_tiny_model  # noqa: E402
from logitproc.integrations.transformers import LogitprocProcessor, LogitprocSampler  # noqa: E402
from logitproc.runtime import GenerationConfig, LogitProcessor, RequestState, Sampler  # noqa: E402
from logitproc.runtime.response_format import ResponseFormat  # noqa: E402
from logitproc.runtime.token_rules import bad_word_token_ids  # noqa: E402
from transformers import (  # noqa: E402
    LogitsProcessorList,
    MinNewTokensLengthLogitsProcessor,
    NoBadWordsLogitsProcessor,
    PrefixConstrainedLogitsProcessor,
    PreTrainedTokenizerFast,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    TemperatureLogitsWarper,
    TopPLogitsWarper,
)

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "ok"],
          "properties": {"name": {"type": "string", "maxLength": 8}, "ok": {"type": "boolean"}}}


@pytest.fixture(scope="module")
def tiny():
    model = make_tiny_model()
    return model, build_tokenizer(model)


@pytest.fixture(scope="module")
def hf_model(tiny):
    gguf, _ = tiny
    config = transformers.AutoConfig.for_model(
        "llama", vocab_size=len(gguf.tokens), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        eos_token_id=gguf.config.eos_id, bos_token_id=0, pad_token_id=0)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # a wider spread of logits than the default init gives, so that answers vary
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    return model


def random_case(vocab: int, rows: int = 3, length: int = 12, seed: int = 0):
    rng = np.random.default_rng(seed)
    ids = torch.from_numpy(rng.integers(0, vocab, (rows, length)))
    scores = torch.from_numpy((rng.standard_normal((rows, vocab)) * 3).astype(np.float32))
    return ids, scores


def step(ids: torch.Tensor, seed: int) -> torch.Tensor:
    """``ids`` with one more random column (the tokens HF appended)."""
    rng = np.random.default_rng(seed)
    return torch.cat([ids, torch.from_numpy(rng.integers(0, 50, (ids.shape[0], 1)))], dim=1)


def test_repetition_penalty_matches_hf_over_steps(lib):
    vocab = 1003
    ours = LogitprocProcessor(lib, GenerationConfig(repetition_penalty=1.3), vocab)
    theirs = RepetitionPenaltyLogitsProcessor(1.3)
    ids, _ = random_case(vocab)
    for k in range(4):
        _, scores = random_case(vocab, seed=10 + k)
        expected = theirs(ids, scores.clone())
        out = ours(ids, scores)
        assert out is scores  # in place
        torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
        ids = step(ids, k)


def test_logit_bias_matches_hf_sequence_bias(lib):
    vocab = 1003
    bias = {7: 4.5, 100: -3.0, 1002: 1.25}
    ours = LogitprocProcessor(lib, GenerationConfig(logit_bias=bias), vocab)
    theirs = SequenceBiasLogitsProcessor({(t,): b for t, b in bias.items()})
    ids, scores = random_case(vocab)
    expected = theirs(ids, scores.clone())
    torch.testing.assert_close(ours(ids, scores), expected, rtol=0, atol=1e-6)


def test_bad_words_match_hf_no_bad_words(lib, tiny):
    gguf, tokenizer = tiny
    vocab, eos = len(gguf.tokens), gguf.config.eos_id
    words = ("the", "cat", "on")
    sequences = [list(s) for s in bad_word_token_ids(words, lambda text: tokenizer.encode(text).ids)]
    assert any(len(s) > 1 for s in sequences)  # a multi-token word: banned after its prefix only
    ours = LogitprocProcessor(lib, GenerationConfig(bad_words=words), vocab, tokenizer=tokenizer, eos_token_ids=[eos])
    theirs = NoBadWordsLogitsProcessor(sequences, eos_token_id=eos)
    ids = torch.tensor([[5, 6, 7], [9, 10, 11]])
    longest = max(sequences, key=len)
    for k, appended in enumerate([[20, 21], longest[:-1][:1], longest[1:-1] or [30]]):
        _, scores = random_case(vocab, rows=2, seed=k)
        expected = theirs(ids, scores.clone())
        torch.testing.assert_close(ours(ids, scores), expected)
        ids = torch.cat([ids, torch.tensor([appended[0], appended[0]])[:, None]], dim=1)


def test_rows_reordered_like_beam_search_follow_their_sequences(lib):
    vocab = 1003
    ours = LogitprocProcessor(lib, GenerationConfig(repetition_penalty=1.5), vocab)
    theirs = RepetitionPenaltyLogitsProcessor(1.5)
    ids, scores = random_case(vocab)
    ours(ids, scores)
    ids = step(ids, 1)[[2, 0, 1]]  # rows swapped places and each got a token
    ids = step(ids, 2)
    _, scores = random_case(vocab, seed=5)
    expected = theirs(ids, scores.clone())
    torch.testing.assert_close(ours(ids, scores), expected, rtol=1e-6, atol=1e-6)


def test_sampling_fields_and_masks_without_tokenizer_are_refused(lib):
    with pytest.raises(ValueError, match="temperature"):
        LogitprocProcessor(lib, GenerationConfig(temperature=0.5), 1003)
    with pytest.raises(ValueError, match="tokenizer"):
        LogitprocProcessor(lib, GenerationConfig(response_format=ResponseFormat.json_schema(SCHEMA)), 1003)


def test_generate_with_repetition_penalty_matches_hf(lib, hf_model):
    prompt = torch.tensor([[1, 50, 60, 70, 80]])
    expected = hf_model.generate(prompt, max_new_tokens=12, do_sample=False, repetition_penalty=1.4)
    ours = LogitprocProcessor(lib, GenerationConfig(repetition_penalty=1.4), hf_model.config.vocab_size)
    got = hf_model.generate(prompt, max_new_tokens=12, do_sample=False, logits_processor=LogitsProcessorList([ours]))
    assert got.tolist() == expected.tolist()


@pytest.mark.parametrize("sample", [False, True])
def test_generate_with_a_json_schema_gives_json_that_validates(lib, tiny, hf_model, sample):
    gguf, tokenizer = tiny
    hf_tokenizer = PreTrainedTokenizerFast(tokenizer_object=tokenizer)
    config = GenerationConfig(response_format=ResponseFormat.json_schema(SCHEMA), max_tokens=32,
                              repetition_penalty=1.1)
    prompts = torch.tensor([[1, 50, 60, 70], [1, 90, 91, 92]])
    processor = LogitprocProcessor(lib, config, hf_model.config.vocab_size, tokenizer=hf_tokenizer,
                                   eos_token_ids=[gguf.config.eos_id])
    torch.manual_seed(3)
    out = hf_model.generate(prompts, max_new_tokens=64, do_sample=sample, top_p=0.9 if sample else None,
                            logits_processor=LogitsProcessorList([processor]))
    for row in out[:, prompts.shape[1]:].tolist():
        answer = tokenizer.decode([t for t in row if t != gguf.config.eos_id], skip_special_tokens=True)
        jsonschema.validate(json.loads(answer), SCHEMA)


@pytest.mark.parametrize("kind", [LogitprocProcessor, LogitprocSampler])
def test_generate_with_a_tree_decode_map_stays_on_its_paths(lib, tiny, hf_model, kind):
    from logitproc.runtime.tree_decode import TreeDecodeConfig

    gguf, tokenizer = tiny
    eos, paths = gguf.config.eos_id, [b"yes", b"no", b"maybe"]
    prefixes: dict[str, set[int]] = {}
    for path in paths:
        ids = [3 + b for b in path]  # the tiny vocabulary's byte tokens
        for k in range(len(ids) + 1):
            prefixes.setdefault("_".join(str(t) for t in [0, *ids[:k]]), set()).add(ids[k] if k < len(ids) else eos)
    tree = TreeDecodeConfig.from_dict({"start_token_id": 0, "end_token_id": eos, "sep": "_",
                                       "prefix_dict": {k: sorted(v) for k, v in prefixes.items()}}, len(gguf.tokens))
    processor = kind(lib, GenerationConfig(), hf_model.config.vocab_size, tokenizer=tokenizer, eos_token_ids=[eos],
                     tree_decode=tree)
    torch.manual_seed(1)
    out = hf_model.generate(torch.tensor([[1, 50, 60], [1, 70, 80], [1, 90, 100]]), max_new_tokens=8,
                            do_sample=kind is LogitprocProcessor, logits_processor=LogitsProcessorList([processor]))
    for row in out[:, 3:].tolist():
        assert bytes(t - 3 for t in row[:row.index(eos)]) in paths


@pytest.mark.parametrize("kind", [LogitprocProcessor, LogitprocSampler])
def test_generate_with_a_thinking_budget_ends_thinking_in_time(lib, tiny, hf_model, kind):
    gguf, tokenizer = tiny
    eos = gguf.config.eos_id
    sampling = {"temperature": 0.0} if kind is LogitprocSampler else {}
    config = GenerationConfig(max_thinking_tokens=6, response_format=ResponseFormat.regex("[a-z]{1,4}"), **sampling)
    begin = tokenizer.encode(config.think_begin).ids
    processor = kind(lib, config, hf_model.config.vocab_size, tokenizer=tokenizer, eos_token_ids=[eos])
    prompt = torch.tensor([[1, 50, 60, *begin]])
    out = hf_model.generate(prompt, max_new_tokens=40, do_sample=False,
                            logits_processor=LogitsProcessorList([processor]))[0, prompt.shape[1]:].tolist()
    end = tokenizer.encode(config.think_end).ids
    thought = next(k for k in range(len(out)) if out[k:k + len(end)] == end)  # tokens thought before the marker
    assert thought <= 6
    answer = tokenizer.decode(out[thought + len(end):], skip_special_tokens=True)
    assert answer.strip().isalpha() and len(answer.strip()) <= 4
    with pytest.raises(ValueError, match="think_begin"):
        kind(lib, config, hf_model.config.vocab_size, tokenizer=tokenizer, eos_token_ids=[eos])(
            torch.tensor([[1, 50, 60]]), torch.zeros((1, hf_model.config.vocab_size)))


def test_beam_search_with_repetition_penalty_matches_hf(lib, hf_model):
    prompt = torch.tensor([[1, 50, 60, 70, 80], [1, 90, 91, 92, 93]])
    expected = hf_model.generate(prompt, max_new_tokens=10, do_sample=False, num_beams=3, repetition_penalty=1.4)
    ours = LogitprocProcessor(lib, GenerationConfig(repetition_penalty=1.4), hf_model.config.vocab_size)
    got = hf_model.generate(prompt, max_new_tokens=10, do_sample=False, num_beams=3,
                            logits_processor=LogitsProcessorList([ours]))
    assert got.tolist() == expected.tolist()


def test_min_tokens_matches_hf_min_new_tokens(lib, tiny):
    gguf, tokenizer = tiny
    vocab, eos = len(gguf.tokens), gguf.config.eos_id
    ids, _ = random_case(vocab, rows=2, length=5)
    ours = LogitprocProcessor(lib, GenerationConfig(min_tokens=3), vocab, tokenizer=tokenizer, eos_token_ids=[eos])
    theirs = MinNewTokensLengthLogitsProcessor(prompt_length_to_skip=5, min_new_tokens=3, eos_token_id=eos)
    for k in range(5):  # EOS banned for the first three new tokens, then allowed
        _, scores = random_case(vocab, rows=2, seed=20 + k)
        expected = theirs(ids, scores.clone())
        assert torch.isinf(expected[:, eos]).all() == (k < 3)
        torch.testing.assert_close(ours(ids, scores), expected)
        ids = step(ids, k)


def test_allowed_token_ids_match_hf_prefix_constrained(lib, tiny):
    gguf, tokenizer = tiny
    vocab, eos = len(gguf.tokens), gguf.config.eos_id
    allowed = [4, 9, 40, 41, 200, vocab - 1]
    ours = LogitprocProcessor(lib, GenerationConfig(allowed_token_ids=allowed), vocab, tokenizer=tokenizer,
                              eos_token_ids=[eos])
    theirs = PrefixConstrainedLogitsProcessor(lambda batch, ids: allowed, num_beams=1)
    ids, scores = random_case(vocab, rows=2)
    expected = theirs(ids, scores.clone())
    torch.testing.assert_close(ours(ids, scores), expected)


def test_sampler_leaves_the_runtimes_token_alone_in_each_row(lib):
    vocab = 1003
    config = GenerationConfig(temperature=0.8, top_p=0.9, repetition_penalty=1.2, logit_bias={5: 3.0}, seed=7)
    ids, scores = random_case(vocab, rows=4)
    ours = LogitprocSampler(lib, config, vocab)
    states = [RequestState(row, config) for row in ids.tolist()]
    expected = Sampler(lib, vocab, 4).sample_from_logits(scores.numpy().copy(), states,
                                                         processor=LogitProcessor(lib, vocab, 4))
    out = ours(ids, scores)
    assert out is scores
    assert torch.isfinite(out).sum(dim=1).tolist() == [1] * 4
    assert out.argmax(dim=1).tolist() == expected.token_ids.tolist()  # the same seeds, the same draws
    assert (out.max(dim=1).values == 0).all()


def test_sampled_tokens_stay_in_hfs_top_p_set(lib):
    """The hard rule against HF's own warpers: every draw is a token HF's temperature + top-p would keep."""
    vocab, rows = 1003, 16
    config = GenerationConfig(temperature=0.7, top_p=0.8, seed=3)
    ids, _ = random_case(vocab, rows=rows)
    ours = LogitprocSampler(lib, config, vocab)
    warpers = LogitsProcessorList([TemperatureLogitsWarper(0.7), TopPLogitsWarper(0.8)])
    drawn = set()
    for k in range(30):
        _, scores = random_case(vocab, rows=rows, seed=100 + k)
        kept = torch.isfinite(warpers(ids, scores.clone()))
        tokens = ours(ids, scores).argmax(dim=1)
        assert kept[torch.arange(rows), tokens].all()
        drawn.update(tokens.tolist())
        ids = torch.cat([ids, tokens[:, None]], dim=1)
    assert len(drawn) > rows  # it samples, not only the argmax


def test_sampled_frequencies_follow_hfs_warped_distribution(lib):
    """The statistical rule: 20,000 draws from one row of logits (each row its own stream) land on each token as
    often as HF's temperature + top-p + softmax says, within sampling noise."""
    vocab, rows = 61, 20000
    logits = torch.from_numpy(np.random.default_rng(4).standard_normal(vocab).astype(np.float32) * 2)
    ids = torch.zeros((rows, 1), dtype=torch.int64)
    warpers = LogitsProcessorList([TemperatureLogitsWarper(0.8), TopPLogitsWarper(0.9)])
    expected = torch.softmax(warpers(ids[:1], logits[None].clone()), dim=-1)[0].numpy()
    ours = LogitprocSampler(lib, GenerationConfig(temperature=0.8, top_p=0.9), vocab)
    tokens = ours(ids, logits.repeat(rows, 1)).argmax(dim=1).numpy()
    observed = np.bincount(tokens, minlength=vocab) / rows
    assert observed[expected == 0].sum() == 0  # nothing outside HF's top-p set
    assert np.abs(observed - expected).max() < 5 * np.sqrt(expected.max() / rows)  # five standard deviations


def test_sampler_refuses_what_generate_cannot_return_and_rows_without_a_token(lib):
    with pytest.raises(ValueError, match="logprobs"):
        LogitprocSampler(lib, GenerationConfig(temperature=0.5, logprobs=True), 1003)
    ours = LogitprocSampler(lib, GenerationConfig(temperature=0.5), 1003)
    ids, scores = random_case(1003, rows=2)
    scores[1, 17] = float("nan")
    with pytest.raises(ValueError, match="row 1 .*NaN"):
        ours(ids, scores)


def test_generate_with_the_sampler_greedy_matches_hf(lib, hf_model):
    prompt = torch.tensor([[1, 50, 60, 70, 80], [1, 90, 91, 92, 93]])
    expected = hf_model.generate(prompt, max_new_tokens=12, do_sample=False, repetition_penalty=1.4)
    ours = LogitprocSampler(lib, GenerationConfig(temperature=0.0, repetition_penalty=1.4), hf_model.config.vocab_size)
    got = hf_model.generate(prompt, max_new_tokens=12, do_sample=False, logits_processor=LogitsProcessorList([ours]))
    assert got.tolist() == expected.tolist()


def test_generate_with_the_sampler_and_a_json_schema_gives_json_that_validates(lib, tiny, hf_model):
    gguf, tokenizer = tiny
    eos = gguf.config.eos_id
    config = GenerationConfig(response_format=ResponseFormat.json_schema(SCHEMA), max_tokens=32, temperature=0.9,
                              top_p=0.9, repetition_penalty=1.1, seed=5)
    prompts = torch.tensor([[1, 50, 60, 70], [1, 90, 91, 92], [1, 30, 31, 32]])

    def run(**sampling) -> list[list[int]]:
        processor = LogitprocSampler(lib, config, hf_model.config.vocab_size, tokenizer=tokenizer, eos_token_ids=[eos])
        out = hf_model.generate(prompts, max_new_tokens=64, logits_processor=LogitsProcessorList([processor]),
                                **sampling)
        return out[:, prompts.shape[1]:].tolist()

    answers = run(do_sample=False)
    for row in answers:
        text = tokenizer.decode([t for t in row if t != eos], skip_special_tokens=True)
        jsonschema.validate(json.loads(text), SCHEMA)
    assert run(do_sample=False) == answers  # seeded: the same answers again
    # HF's own warpers and draw after it change nothing: only the drawn token has any probability
    torch.manual_seed(0)
    assert run(do_sample=True, temperature=0.7, top_k=50, top_p=0.9, min_p=0.05) == answers
