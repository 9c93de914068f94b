"""The 8-bit KV cache (``kv_dtype="q8_0"``, issue 30): a tiny model with 64-wide heads (GQA, 2 query heads over
one KV head) against the numpy reference that rounds and quantises the same values, its verify bit for bit its
decode steps, a sequence's logits independent of the batch; refused where the heads do not hold whole blocks."""

from __future__ import annotations

import numpy as np
import pytest
import tiny_variants
from logitproc.compile.model_compile import compile_model
from logitproc.compile.tiny_model import make_tiny_model
from logitproc.serve.compiled_model import CompiledModel
from logitproc.serve.numpy_llama import NumpyLlama

#: Logits against the q8_0 reference (float32 weights, the same rounding and quantisation). The float32 sums run in
#: another order, and a last-bit difference that moves a value across a float16 or int8 rounding boundary moves it
#: by a whole step (an int8 step is 1/127 of its block's largest value): measured up to 6.9e-3 over three prompts,
#: where the quantisation itself moves the logits by 3-9e-2 from the float16 cache's reference.
TOL_Q8 = 2e-2


@pytest.fixture(scope="module")
def wide():
    return tiny_variants.wide_tiny()


@pytest.fixture(scope="module")
def q8(wide) -> CompiledModel:
    return CompiledModel(compile_model(wide, **tiny_variants.Q8_KV))


def test_q8_0_cache_matches_the_reference_quantising_the_same_values(wide, q8) -> None:
    """Prefill in two chunks (one over a page boundary), decode steps, and a verify, each within ``TOL_Q8`` of
    ``NumpyLlama(kv_dtype="q8_0")``."""
    rng = np.random.default_rng(1)
    prompt = [int(t) for t in rng.integers(0, q8.vocab_size, 37)]
    ref = NumpyLlama(wide, kv_dtype="q8_0")
    assert q8.kv_dtype == "q8_0" and "q8_0 KV cache" in repr(q8)
    q8.add_sequence(0)
    try:
        np.testing.assert_allclose(q8.prefill([0], [prompt[:20]])[0], ref.prefill(prompt[:20]), atol=TOL_Q8, rtol=0)
        np.testing.assert_allclose(q8.prefill([0], [prompt[20:]])[0], ref.extend(prompt[20:]), atol=TOL_Q8, rtol=0)
        for token in (5, 77, 9):
            np.testing.assert_allclose(q8.decode([0], [token])[0], ref.decode(token), atol=TOL_Q8, rtol=0)
        drafts = [3, 100, 41, 8]
        rows = q8.verify([0], [drafts])[0]
        for row, token in zip(rows, drafts, strict=True):
            np.testing.assert_allclose(row, ref.decode(token), atol=TOL_Q8, rtol=0)
    finally:
        q8.remove_sequence(0)


def test_q8_0_verify_is_its_decode_steps_bit_for_bit_and_batch_invariant(q8) -> None:
    rng = np.random.default_rng(2)
    prompts = [[int(t) for t in rng.integers(0, q8.vocab_size, n)] for n in (30, 17)]
    tokens = [int(t) for t in rng.integers(0, q8.vocab_size, 6)]
    q8.add_sequence(0)
    q8.add_sequence(1)
    try:
        q8.prefill([0, 1], prompts)
        alone = np.stack([q8.decode([0], [t])[0] for t in tokens])
        q8.popn(0, len(tokens))
        together = np.stack([q8.decode([0, 1], [t, t])[0] for t in tokens])
        q8.popn(0, len(tokens))
        verified = q8.verify([0], [tokens])[0]
        np.testing.assert_array_equal(together, alone)
        np.testing.assert_array_equal(verified, alone)
    finally:
        q8.remove_sequence(0)
        q8.remove_sequence(1)


def test_q8_0_needs_heads_of_whole_blocks() -> None:
    tiny = make_tiny_model(seed=0)  # heads of 16
    with pytest.raises(ValueError, match="kv_dtype 'q8_0' needs a head size that is a multiple of 32, got 16"):
        compile_model(tiny, kv_dtype="q8_0")


@pytest.mark.slow
def test_smollm2_answers_paris_with_the_q8_0_cache(default_model_in_cache) -> None:
    """The default model compiled with the 8-bit cache (a build of its own: slow) still answers the capital."""
    from logitproc.runtime import GenerationConfig
    from logitproc.serve.cli_options import open_model
    from logitproc.serve.engine import Engine

    model = open_model("default", "cpu", "q8_0")  # the GGUF the fixture put in the cache
    assert model.kv_dtype == "q8_0"
    [out] = Engine(model, max_batch=1).generate([{"role": "user", "content": "What is the capital of France?"}],
                                                GenerationConfig(temperature=0, max_tokens=16))
    assert "Paris" in out.text, out.text
