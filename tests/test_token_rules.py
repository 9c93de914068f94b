"""The token rules of vLLM's SamplingParams as mask sources: allowed_token_ids, bad_words, min_tokens.

Each source's rows are checked against a plain Python reference on awkward vocabulary sizes, with draft paths, and
through the LogitProcessor (draft rows equal each prefix processed alone, state unchanged afterwards).
"""

from __future__ import annotations

import numpy as np
import pytest
from logitproc import GenerationConfig, LogitProcessor, RequestState
from logitproc.runtime.constraints import ConstraintFactory
from logitproc.runtime.token_rules import AllowedTokens, BadWords, MinTokens, bad_word_token_ids
from logitproc.tir_kernels import reference as ref

V = 1003


def allowed_of(source, vocab: int, path=()) -> np.ndarray:
    """The boolean allowed-vector a source's row gives (True everywhere when it declines to constrain)."""
    row = np.full((vocab + 31) // 32, -1, np.int32)
    if not source.fill_bitmask(row, list(path)):
        return np.ones(vocab, bool)
    return np.unpackbits(row.view(np.uint8), bitorder="little")[:vocab].astype(bool)


@pytest.mark.parametrize("vocab", [1, 33, V, 128001])
def test_allowed_tokens_row(vocab: int) -> None:
    ids = sorted({0, vocab - 1, vocab // 2, min(31, vocab - 1)})
    expected = np.zeros(vocab, bool)
    expected[ids] = True
    source = AllowedTokens(ids, vocab)
    assert np.array_equal(allowed_of(source, vocab), expected)
    assert np.array_equal(allowed_of(source, vocab, [1, 2]), expected)
    with pytest.raises(ValueError, match=f"allowed_token_ids token id {vocab} is outside"):
        AllowedTokens([vocab], vocab)


@pytest.mark.parametrize("vocab", [33, 128001])
def test_min_tokens_bans_stop_ids_until_reached_counting_drafts(vocab: int) -> None:
    stops = [0, vocab - 1]
    source = MinTokens(3, stops, vocab)
    banned = np.ones(vocab, bool)
    banned[stops] = False
    assert np.array_equal(allowed_of(source, vocab), banned)
    assert np.array_equal(allowed_of(source, vocab, [5, 6]), banned)
    assert allowed_of(source, vocab, [5, 6, 7]).all()
    for t in (5, 6):
        source.accept_token(t)
    assert np.array_equal(allowed_of(source, vocab), banned)
    source.accept_token(7)
    assert allowed_of(source, vocab).all()
    source.rollback(2)
    assert np.array_equal(allowed_of(source, vocab), banned)


def test_bad_words_ban_the_last_token_after_the_others() -> None:
    words = [[7], [3, 4, 5], [9, 4], [3, 3, 4, 9]]  # prefixes of 1 to 3 tokens
    source = BadWords(words, V)

    def expected(history: list[int]) -> np.ndarray:
        out = np.ones(V, bool)
        for w in words:
            if len(w) == 1 or history[len(history) - len(w) + 1:] == w[:-1]:
                out[w[-1]] = False
        return out

    early = BadWords(words, V)  # fewer tokens out than the longest prefix: the prefix spans output and draft
    early.accept_token(3)
    assert not allowed_of(early, V, [3, 4])[9]
    early.accept_token(3)
    assert not allowed_of(early, V, [4])[9] and allowed_of(early, V, [5])[9]
    rng = np.random.default_rng(0)
    history: list[int] = []
    for _ in range(300):
        token = int(rng.choice([3, 4, 9, 1]))
        draft = [int(t) for t in rng.choice([3, 4, 9], size=int(rng.integers(0, 3)))]
        assert np.array_equal(allowed_of(source, V, draft), expected(history + draft))
        source.accept_token(token)
        history.append(token)
        if rng.random() < 0.1:
            k = int(rng.integers(0, len(history) + 1))
            source.rollback(k)
            del history[len(history) - k:]


def test_bad_words_are_tokenised_as_written_and_after_a_space() -> None:
    spelled = {"ab": [3], " ab": [4], "cd": [5, 6], " cd": [5, 6]}
    assert bad_word_token_ids(["ab", "cd", "ab"], spelled.__getitem__) == [[3], [4], [5, 6]]
    assert bad_word_token_ids([" ab"], spelled.__getitem__) == [[4]]


def test_factory_builds_the_rules_and_the_processor_applies_them_with_drafts(lib) -> None:
    from logitproc.compile.gguf_model import build_tokenizer
    from logitproc.compile.tiny_model import make_tiny_model

    tiny = make_tiny_model()
    assert tiny.config.vocab <= V
    factory = ConstraintFactory(build_tokenizer(tiny), V, [2])
    config = GenerationConfig(min_tokens=2, allowed_token_ids=[2, 5, 6, 7, 8], stop_token_ids=[8])
    sources = factory.sources_for(config)
    assert [type(s).__name__ for s in sources] == ["AllowedTokens", "MinTokens"]
    state = RequestState([1, 1], config, mask_sources=sources)
    proc = LogitProcessor(lib, V, 8)
    logits = np.zeros((3, V), np.float32)
    before = [s.__getattribute__("_accepted") for s in sources if isinstance(s, MinTokens)]
    proc.inplace_update_logits(logits, [state], draft_trees=[[5, 6]])
    finite = [set(np.flatnonzero(np.isfinite(r)).tolist()) for r in logits]
    assert finite == [{5, 6, 7}, {5, 6, 7}, {2, 5, 6, 7, 8}]  # EOS (2) and the stop id (8) from token 2 on
    assert [s._accepted for s in sources if isinstance(s, MinTokens)] == before
    ignore = factory.sources_for(GenerationConfig(min_tokens=1, ignore_eos=True))
    assert allowed_of(ignore[0], V)[2]  # with ignore_eos, EOS is not a stop token: not banned


def test_token_rule_config_errors_name_the_field() -> None:
    cases = [({"min_tokens": -1}, "min_tokens must be in"), ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
             ({"allowed_token_ids": []}, "allowed_token_ids must name"),
             ({"allowed_token_ids": [1, -2]}, "allowed_token_ids entries must be token ids in"),
             ({"bad_words": [""]}, "bad_words entries must be non-empty"),
             ({"bad_words": ["w"] * 65}, "at most 64")]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            GenerationConfig(**kwargs)
    with pytest.raises(TypeError, match="allowed_token_ids must be a list"):
        GenerationConfig(allowed_token_ids=3)
    with pytest.raises(ValueError, match="allowed_token_ids token id 2000 is outside"):
        GenerationConfig(allowed_token_ids=[2000]).check_vocab(V)


def test_rules_without_their_sources_are_refused_not_dropped(lib) -> None:
    proc = LogitProcessor(lib, V, 4)
    state = RequestState([1], GenerationConfig(min_tokens=3))
    with pytest.raises(ValueError, match="has no mask sources"):
        proc.inplace_update_logits(np.zeros((1, V), np.float32), [state])


def test_reference_packing_agrees() -> None:
    ids = [0, 31, 32, 1002]
    row = AllowedTokens(ids, V)._row
    expected = np.zeros(V, bool)
    expected[ids] = True
    assert np.array_equal(row, ref.pack_bitmask(expected[None, :])[0])


def test_jump_forward_respects_the_other_rules(lib) -> None:
    """A grammar forcing "abc" jumps over it, unless allowed_token_ids or bad_words forbid one of its tokens."""
    from logitproc.compile.gguf_model import build_tokenizer
    from logitproc.compile.tiny_model import make_tiny_model

    tiny = make_tiny_model()
    factory = ConstraintFactory(build_tokenizer(tiny), V, [tiny.config.eos_id])
    proc = LogitProcessor(lib, V, 4)
    regex = {"type": "regex", "regex": "abc[0-9]"}
    free = RequestState([5], GenerationConfig(response_format=regex),
                        mask_sources=factory.sources_for(GenerationConfig(response_format=regex)))
    jumped = proc.jump_forward(free)
    assert jumped is not None and factory.tokenizer.decode_bytes(free.output_token_ids) == b"abc"
    for config in (GenerationConfig(response_format=regex, bad_words=["b"]),
                   GenerationConfig(response_format=regex, allowed_token_ids=jumped.token_ids[:1])):
        state = RequestState([5], config, mask_sources=factory.sources_for(config))
        assert proc.jump_forward(state) is None and state.output_token_ids == []
