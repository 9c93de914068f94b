"""The parts speculative decoding is built from (issue 13): prompt-lookup drafts from ``NgramIndex`` and a verify
forward (``Runner.verify``: logits after every token of a chunk, rejected ones taken back with ``popn``)."""

from __future__ import annotations

import numpy as np
import pytest
from logitproc.serve.ngram_index import NgramIndex


def brute_force(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The module docstring's loop."""
    for n in range(max_n, min_n - 1, -1):
        if n > len(tokens):
            continue
        suffix = tokens[-n:]
        ends = [e for e in range(n, len(tokens)) if tokens[e - n : e] == suffix]
        if ends:
            e = ends[-1]
            return [tokens[e + i % (len(tokens) - e)] for i in range(k)]
    return []


@pytest.mark.parametrize(("min_n", "max_n"), [(1, 1), (1, 4), (2, 3), (3, 5)])
def test_proposals_equal_the_brute_force_search(min_n: int, max_n: int) -> None:
    rng = np.random.default_rng(min_n * 10 + max_n)
    for alphabet in (2, 5, 40):
        tokens = [int(t) for t in rng.integers(0, alphabet, 300)]
        index = NgramIndex(tokens[:7], min_n=min_n, max_n=max_n)
        for end in range(7, len(tokens)):
            for k in (1, 3, 5):
                assert index.propose(k) == brute_force(tokens[:end], k, min_n, max_n), (alphabet, end, k)
            index.append(tokens[end])
            if end % 50 == 0:  # a rollback, then the same tokens again
                index.truncate(end - 5)
                index.extend(tokens[end - 5 : end + 1])


def test_the_match_length_follows_the_match_back_up_to_reach() -> None:
    """``propose_matched(k, reach)``: how many of the latest tokens (at most ``reach``, at least the suffix found)
    equal those before the proposal's source, by brute force."""
    rng = np.random.default_rng(7)
    tokens = [int(t) for t in rng.integers(0, 3, 200)]
    index = NgramIndex(tokens[:5], min_n=1, max_n=3)
    for end in range(5, len(tokens)):
        for reach in (0, 3, 8):
            proposal, matched = index.propose_matched(2, reach)
            context = tokens[:end]
            for n in range(3, 0, -1):
                starts = [e for e in range(n, end) if context[e - n : e] == context[-n:]]
                if starts:
                    start, want = starts[-1], n
                    while want < min(reach, start) and context[start - 1 - want] == context[end - 1 - want]:
                        want += 1
                    break
            else:
                want = 0
            assert matched == want, (end, reach)
        index.append(tokens[end])


def test_a_repeated_paragraph_is_proposed_in_full() -> None:
    paragraph = [11, 12, 13, 14, 15, 16, 17, 18]
    index = NgramIndex([1, 2, *paragraph, 3, 4, paragraph[0], paragraph[1]])
    assert index.propose(5) == paragraph[2:7]
    assert NgramIndex([7, 1, 2, 1, 2]).propose(5) == [1, 2, 1, 2, 1]  # a loop goes on as a loop
    assert NgramIndex([1, 2, 3]).propose(5) == []


def test_bad_settings_name_the_field() -> None:
    with pytest.raises(ValueError, match="prompt_lookup_min must be an int >= 1, got 0"):
        NgramIndex(min_n=0)
    with pytest.raises(ValueError, match=r"prompt_lookup_min \(5\) must be <= prompt_lookup_max \(4\)"):
        NgramIndex(min_n=5, max_n=4)
    with pytest.raises(ValueError, match=r"length must be in \[0, 2\]"):
        NgramIndex([1, 2]).truncate(3)


@pytest.fixture(scope="module")
def tiny():
    from logitproc.serve.cli_options import tiny_model

    return tiny_model()


def test_verify_gives_the_logits_after_every_token_and_popn_takes_drafts_back(tiny) -> None:
    from logitproc.compile import build_kernels
    from logitproc.serve.compiled_model import CompiledModel
    from logitproc.serve.numpy_llama import NumpyRunner

    compiled = CompiledModel.open(tiny, target="cpu")
    reference = NumpyRunner(tiny, kernel_library=build_kernels("cpu"))
    prompts = [[5, 6, 7, 8, 9], [20, 21, 22]]
    chunks = [[10, 11, 12, 13], [30]]
    for runner in (compiled, reference):
        for seq, prompt in enumerate(prompts):
            runner.add_sequence(seq)
            runner.prefill([seq], [prompt])
    got = compiled.verify([0, 1], chunks)
    want = reference.verify([0, 1], chunks)
    for g, w, chunk in zip(got, want, chunks, strict=True):
        assert g.shape == (len(chunk), compiled.vocab_size)
        np.testing.assert_allclose(g, w, atol=2e-2, rtol=0)  # the tiny model is float16 (docs/model.md)
    assert compiled.sequence_length(0) == 9 and compiled.sequence_length(1) == 4
    compiled.popn(0, 3)  # drafts 11, 12, 13 rejected: the cache is as if only 10 had been appended
    after = compiled.decode([0], [40])
    alone = CompiledModel.open(tiny, target="cpu")
    alone.add_sequence(0)
    alone.prefill([0], [prompts[0] + [10]])
    np.testing.assert_allclose(after[0], alone.decode([0], [40])[0], atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match=r"token_ids\[0\] is empty"):
        compiled.verify([0], [[]])
