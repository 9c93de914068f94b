"""The compiled model (``CompiledModel``) against the numpy reference (``NumpyLlama`` / ``NumpyRunner``).

Tiny random models (fast; two builds besides the session's ``--model tiny``): float32 weights and KV cache match
numpy within 1e-4 (a Hugging Face directory (safetensors) of a tiny model with Qwen2-style q/k/v biases and its own
output head: one build for the float32 tests and the Hugging Face reader), float16 weights within 2e-2 (measured
7e-3), a float16 KV cache the reference rounding the same values within 5e-3; prefill 9 == prefill 8 + decode 1;
batched == alone; chunked prefill; fork and popn; sequence id reuse; errors; build cache reuse; the
logit-processing kernels called from the model's own library.

SmolLM2-135M-Instruct (the real default model; select with ``-k smollm2``): logits of a chat prompt within 1e-2 of
``NumpyLlama`` (the GGUF's own Q4_1/Q8_0 blocks in the matmuls; on an AVX2 CPU every Q4_1 matmul (the packed
kernels) and the output head quantise the activations to 16-bit blocks: measured 2.9e-3 after the prompt,
2.4-7.9e-3 over 12 greedy decode steps, logits' standard deviation 3.4), the same greedy tokens, and the greedy
answer to "What is the capital of France?" names Paris. The GGUF is fetched once per
session into the test cache (or ``$LOGITPROC_TEST_MODEL_CACHE``), as in ``test_model_files.py``.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import pytest
import tiny_variants
import tvm
from kernel_harness import built_for_cpu
from logitproc import GenerationConfig, LogitProcessor, RequestState
from logitproc.compile import model_compile
from logitproc.compile.attention_kernels import rope_kernel
from logitproc.compile.gguf_model import GGUFModel, build_tokenizer
from logitproc.compile.hf_model import load_hf_dir
from logitproc.compile.kernel_library import KernelLibrary
from logitproc.compile.linear_kernels import FORMATS, linear_kernel, param_shapes, swiglu_kernel
from logitproc.compile.model_compile import compile_model
from logitproc.compile.rope import RopeScaling, llama3_factors
from logitproc.compile.tiny_model import make_tiny_model
from logitproc.serve.chat_template import model_chat_template
from logitproc.serve.cli_options import TINY_CONTEXT, tiny_model
from logitproc.serve.compiled_model import CompiledModel
from logitproc.serve.numpy_llama import NumpyLlama, NumpyRunner
from logitproc.tir_kernels import KERNEL_FACTORIES

TOL_F32 = 1e-4
TOL_F16 = 2e-2
TOL_KV16 = 5e-3  # float32 weights, float16 KV cache, against the reference rounding the same values (2.6e-3 seen)
TOL_AUTO = 1e-2  # SmolLM2's Q4_1/Q8_0 blocks, 16-bit activation blocks in the integer-dot matmuls (module doc)
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def tiny(tiny_model_compiled_by_cli) -> GGUFModel:
    """``--model tiny``: its default build (``m16``) is the one the session's CLI fixture compiled."""
    return tiny_model()


@pytest.fixture(scope="module")
def qwen_tiny() -> GGUFModel:
    return tiny_variants.qwen_tiny()


@pytest.fixture(scope="module")
def hf_directory(qwen_tiny: GGUFModel, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_variants.write_qwen_tiny(qwen_tiny, tmp_path_factory.mktemp("hf"))


@pytest.fixture(scope="module")
def m32(hf_directory: Path) -> CompiledModel:
    """float32 weights and KV cache, compiled from the Hugging Face directory (one build serves the float32 tests
    and the Hugging Face reader's); its reference is ``qwen_tiny``."""
    return CompiledModel.open(hf_directory, **tiny_variants.FLOAT32, max_num_sequences=8)


@pytest.fixture(scope="module")
def m32h(tiny: GGUFModel) -> CompiledModel:
    """float32 weights, a float16 KV cache (llama.cpp's default)."""
    return CompiledModel.open(tiny, **tiny_variants.FLOAT16_KV, max_num_sequences=4)


@pytest.fixture(scope="module")
def m16(tiny: GGUFModel) -> CompiledModel:
    return CompiledModel.open(tiny, max_num_sequences=8)


@pytest.fixture(scope="module")
def prompt(m32: CompiledModel) -> list[int]:
    return m32.tokenizer.encode(m32.apply_chat_template(QUESTION)).ids


@pytest.fixture(autouse=True)
def _no_leftover_sequences(request):
    """Every test starts and ends with no sequences in the module's models."""
    yield
    for name in ("m32", "m16", "m32h"):
        if name in request.fixturenames:
            model = request.getfixturevalue(name)
            for seq_id in model.sequence_ids:
                model.remove_sequence(seq_id)


def reference(model: GGUFModel, tokens: list[int], kv_dtype: str = "float32") -> np.ndarray:
    return NumpyLlama(model, kv_dtype).prefill(tokens)


# ---------------------------------------------------------------- logits against numpy


def test_float32_logits_match_numpy(qwen_tiny, m32, prompt) -> None:
    m32.add_sequence(0)
    logits = m32.prefill([0], [prompt])
    assert logits.shape == (1, m32.vocab_size) and logits.dtype == np.float32
    np.testing.assert_allclose(logits[0], reference(qwen_tiny, prompt), atol=TOL_F32, rtol=0)
    assert m32.sequence_length(0) == len(prompt)


def test_float16_logits_match_numpy_within_tolerance(tiny, m16, prompt) -> None:
    m16.add_sequence(3)
    logits = m16.prefill([3], [prompt])
    diff = np.abs(logits[0] - reference(tiny, prompt)).max()
    assert diff < TOL_F16, diff
    assert logits[0].std() > 0.5  # the tiny model's logits are not flat


def test_float16_kv_cache_matches_the_reference_rounding_the_same_values(tiny, m32h, prompt) -> None:
    """A float16 KV cache: q, k, v and the attention's output rounded to it; NumpyLlama with
    ``kv_dtype="float16"`` rounds the same values (measured 7e-5 after a prompt, up to 5e-4 over decode steps,
    where the float32 reference is 2-4e-3 away; 2.6e-3 after a fork), over a prefill, decode steps and a chunked
    prefill."""
    assert m32h.kv_dtype == "float16" and "float16 KV cache" in repr(m32h)
    ref = NumpyLlama(tiny, kv_dtype="float16")
    m32h.add_sequence(0)
    np.testing.assert_allclose(m32h.prefill([0], [prompt[:20]])[0], ref.prefill(prompt[:20]), atol=TOL_KV16, rtol=0)
    np.testing.assert_allclose(m32h.prefill([0], [prompt[20:]])[0], ref.extend(prompt[20:]), atol=TOL_KV16, rtol=0)
    for token in (5, 77, 9, 100, 3):
        np.testing.assert_allclose(m32h.decode([0], [token])[0], ref.decode(token), atol=TOL_KV16, rtol=0)
    full = NumpyLlama(tiny, kv_dtype="float32").prefill([*prompt, 5, 77, 9, 100, 3])
    assert np.abs(ref.decode(1) - full).max() > 0  # the rounding is real (a different model)


def test_a_fork_of_a_float16_cache_shares_its_pages(tiny, m32h, prompt) -> None:
    """Fork and popn over float16 pages (TVM's page copy in the cache's type): each branch continues as the
    reference of its own tokens."""
    m32h.add_sequence(0)
    m32h.prefill([0], [prompt])
    m32h.fork_sequence(0, 1)
    m32h.popn(1, 3)
    out = m32h.decode([0, 1], [5, 77])
    for row, tokens in ((out[0], [*prompt, 5]), (out[1], [*prompt[:-3], 77])):
        np.testing.assert_allclose(row, reference(tiny, tokens, "float16"), atol=TOL_KV16, rtol=0)


def test_kv_dtype_is_checked(tiny) -> None:
    with pytest.raises(ValueError, match="kv_dtype 'bfloat16' is not supported"):
        compile_model(tiny, kv_dtype="bfloat16")
    with pytest.raises(ValueError, match="kv_dtype 'int8' is not supported"):
        NumpyLlama(tiny, kv_dtype="int8")


def test_prefill_9_equals_prefill_8_plus_decode_1(m32, prompt) -> None:
    m32.add_sequence(0)
    m32.add_sequence(1)
    whole = m32.prefill([0], [prompt[:9]])
    m32.prefill([1], [prompt[:8]])
    step = m32.decode([1], [prompt[8]])
    np.testing.assert_allclose(step, whole, atol=1e-5, rtol=0)
    assert m32.sequence_length(0) == m32.sequence_length(1) == 9


def test_batched_prefill_and_decode_equal_each_alone(m32, prompt) -> None:
    lists = [prompt[:5], prompt[:23], prompt[3:14], prompt[:1]]
    ids = [10, 11, 12, 13]
    for s in ids:
        m32.add_sequence(s)
    batched = m32.prefill(ids, lists)
    next_tokens = [int(t) for t in batched.argmax(axis=1)]
    batched_step = m32.decode(ids[::-1], next_tokens[::-1])[::-1]
    for s in ids:
        m32.remove_sequence(s)
    for i, tokens in enumerate(lists):
        m32.add_sequence(0)
        alone = m32.prefill([0], [tokens])
        np.testing.assert_allclose(batched[i], alone[0], atol=1e-5, rtol=0)
        np.testing.assert_allclose(batched_step[i], m32.decode([0], [next_tokens[i]])[0], atol=1e-5, rtol=0)
        m32.remove_sequence(0)


def test_logits_returned_stay_as_returned_after_later_calls(m32, prompt) -> None:
    """Each call's logits are the caller's (the forward's own array, not a copy): later calls never write them."""
    m32.add_sequence(0)
    m32.add_sequence(1)
    returned = [m32.prefill([0, 1], [prompt[:7], prompt[:12]]), m32.decode([0, 1], [prompt[7], prompt[12]]),
                *m32.verify([0], [prompt[8:11]])]
    kept = [r.copy() for r in returned]
    m32.prefill([1], [prompt[13:20]])
    for _ in range(3):
        m32.decode([0, 1], [prompt[1], prompt[2]])
    for r, k in zip(returned, kept, strict=True):
        np.testing.assert_array_equal(r, k)
    m32.remove_sequence(0)
    m32.remove_sequence(1)


def test_chunked_prefill_equals_one_pass(qwen_tiny, m32, prompt) -> None:
    small = CompiledModel(m32.directory, max_num_sequences=4, prefill_chunk_size=8)
    lists = [prompt[:30], prompt[:3], prompt[5:25]]
    for s in range(3):
        small.add_sequence(s)
    logits = small.prefill([0, 1, 2], lists)
    for i, tokens in enumerate(lists):
        np.testing.assert_allclose(logits[i], reference(qwen_tiny, tokens), atol=TOL_F32, rtol=0)
    extended = small.prefill([1], [prompt[3:20]])  # extending an existing sequence across chunks
    np.testing.assert_allclose(extended[0], reference(qwen_tiny, prompt[:20]), atol=TOL_F32, rtol=0)


def test_fork_shares_the_prompt_and_popn_drops_tokens(qwen_tiny, m32, prompt) -> None:
    m32.add_sequence(0)
    m32.prefill([0], [prompt])
    m32.fork_sequence(0, 1)
    assert m32.sequence_length(1) == len(prompt)
    out = m32.decode([0, 1], [5, 77])
    np.testing.assert_allclose(out[0], reference(qwen_tiny, [*prompt, 5]), atol=TOL_F32, rtol=0)
    np.testing.assert_allclose(out[1], reference(qwen_tiny, [*prompt, 77]), atol=TOL_F32, rtol=0)
    m32.popn(1, 4)  # the forked token and three prompt tokens
    assert m32.sequence_length(1) == len(prompt) - 3
    again = m32.prefill([1], [[40, 41]])
    np.testing.assert_allclose(again[0], reference(qwen_tiny, [*prompt[:-3], 40, 41]), atol=TOL_F32, rtol=0)
    m32.remove_sequence(0)  # the child keeps its (shared) prefix
    np.testing.assert_allclose(m32.decode([1], [9])[0], reference(qwen_tiny, [*prompt[:-3], 40, 41, 9]),
                               atol=TOL_F32, rtol=0)


def test_accept_rollback_accept_gives_identical_logits(m32, prompt) -> None:
    m32.add_sequence(0)
    m32.prefill([0], [prompt[:10]])
    first = m32.prefill([0], [prompt[10:16]])
    m32.popn(0, 6)
    second = m32.prefill([0], [prompt[10:16]])
    np.testing.assert_array_equal(first, second)


def test_removed_ids_can_be_added_again(m32, prompt) -> None:
    m32.add_sequence(4)
    first = m32.prefill([4], [prompt[:12]])
    m32.remove_sequence(4)
    m32.add_sequence(4)
    assert m32.sequence_length(4) == 0
    np.testing.assert_array_equal(m32.prefill([4], [prompt[:12]]), first)


def test_bad_inputs_raise_clear_errors(m32, prompt) -> None:
    m32.add_sequence(0)
    with pytest.raises(ValueError, match="unknown seq_id 5"):
        m32.prefill([5], [[1, 2]])
    with pytest.raises(ValueError, match="unknown seq_id 5"):
        m32.decode([5], [1])
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, 277\)"):
        m32.prefill([0], [[1, 277]])
    with pytest.raises(ValueError, match="must lie in"):
        m32.decode([0], [-1])
    with pytest.raises(ValueError, match="is empty"):
        m32.prefill([0], [[]])
    with pytest.raises(ValueError, match="distinct"):
        m32.decode([0, 0], [1, 2])
    with pytest.raises(ValueError, match="2 seq_ids but 1"):
        m32.decode([0, 0], [1])
    with pytest.raises(ValueError, match="already exists"):
        m32.add_sequence(0)
    with pytest.raises(ValueError, match="must be >= 0"):
        m32.add_sequence(-1)
    with pytest.raises(ValueError, match="popn"):
        m32.popn(0, 1)
    with pytest.raises(ValueError, match="unknown parent_id"):
        m32.fork_sequence(9, 10)
    with pytest.raises(ValueError, match=f"exceed the context length {TINY_CONTEXT}"):
        m32.prefill([0], [[1] * (TINY_CONTEXT + 1)])
    assert m32.sequence_length(0) == 0  # nothing was appended by the failed calls
    small = CompiledModel(m32.directory, max_num_sequences=2, max_total_tokens=32)
    small.add_sequence(0)
    small.add_sequence(1)
    with pytest.raises(ValueError, match="too many sequences"):
        small.add_sequence(2)
    with pytest.raises(ValueError, match="too many sequences"):
        small.fork_sequence(0, 2)
    small.prefill([0], [prompt[:20]])
    with pytest.raises(ValueError, match="32 tokens"):
        small.prefill([1], [prompt[:13]])


def test_second_open_reuses_the_cached_build(tiny, m16, monkeypatch) -> None:
    def no_build(*args, **kwargs):
        raise AssertionError("the cached build must be reused")

    monkeypatch.setattr(model_compile, "_build_into", no_build)
    started = time.perf_counter()
    again = CompiledModel.open(tiny)
    elapsed = time.perf_counter() - started
    assert again.directory == m16.directory
    assert elapsed < 2.0, f"opening a cached tiny model took {elapsed:.2f}s"
    changed = make_tiny_model(seed=1)
    assert model_compile.memory_model_hash(changed) != model_compile.memory_model_hash(tiny)


def test_exported_directory_opens_as_model_and_kernel_library(m16, lib, tmp_path: Path) -> None:
    """The copy stands alone (model.so holds the model and the kernels), with the kernels of the target's library."""
    out = compile_model(tiny_model(), out=tmp_path / "export")  # a copy of the cached build
    library = KernelLibrary.load(out)
    assert library.module_file == "model.so" and len(library.kernel_names) == len(KERNEL_FACTORIES)
    assert set(library.prim_funcs()) == set(library.kernel_names)
    assert library.manifest["kernels"] == lib.manifest["kernels"]
    assert library.artifact("kernels.tir.py").read_text() == lib.artifact("kernels.tir.py").read_text()
    logits = np.random.default_rng(0).standard_normal((3, 277)).astype(np.float32)
    index, value = tvm.runtime.tensor(np.zeros(3, np.int32)), tvm.runtime.tensor(np.zeros(3, np.float32))
    library["argmax"](tvm.runtime.tensor(logits), index, value)
    np.testing.assert_array_equal(index.numpy(), logits.argmax(axis=1))
    np.testing.assert_array_equal(value.numpy(), logits.max(axis=1))
    reopened = CompiledModel.open(out)
    reopened.add_sequence(0)
    m16.add_sequence(0)
    np.testing.assert_array_equal(reopened.prefill([0], [[1, 2, 3]]), m16.prefill([0], [[1, 2, 3]]))


def test_logit_processing_kernels_run_from_the_model_library(m16, prompt) -> None:
    m16.add_sequence(0)
    logits = m16.prefill([0], [prompt])
    processor = LogitProcessor(m16.kernel_library, m16.vocab_size, 4)
    states = [RequestState(prompt, GenerationConfig(temperature=0.0))]
    work = logits.copy()
    processor.inplace_update_logits(work, states)
    probs = processor.compute_probs_from_logits(work, states)
    assert probs[0, int(logits[0].argmax())] == 1.0 and probs[0].sum() == 1.0


def test_tokenizer_and_chat_template(m16, tiny) -> None:
    text = m16.apply_chat_template(QUESTION)
    assert text == model_chat_template(tiny).render(QUESTION)
    ids = m16.tokenizer.encode(text).ids
    assert m16.tokenizer.decode(ids, skip_special_tokens=False) == text
    assert m16.eos_token_ids == (2, 0)
    assert m16.context_length == TINY_CONTEXT and m16.max_num_sequences == 8 and m16.name == tiny.config.name


# ---------------------------------------------------------------- linear kernels against numpy

#: Per format: SmolLM2's projections in the formats its GGUF stores them in (qkv, o, gate_up, down: Q4_1; the tied
#: embedding / output head: Q8_0), an N that is not a multiple of the GEMM's 8-row groups, and (float formats) a K
#: that is not a multiple of 32. Each kernel takes about 2 s to compile.
LINEAR_SHAPES = {
    "q4_1": [(960, 576), (576, 576), (3072, 576), (576, 1536), (100, 64)],
    "q8_0": [(49152, 576), (576, 576), (100, 64)],
    "float16": [(960, 576), (100, 64), (40, 48)],
    "float32": [(576, 1536), (100, 64), (40, 48)],
}
TOKEN_COUNTS = (1, 3, 4, 5, 7, 8, 17, 64, 65, 96, 97, 130)


def random_weights(n_out: int, n_in: int, fmt: str, rng: np.random.Generator) -> tuple[list[np.ndarray], np.ndarray]:
    """Random arrays storing a weight in ``fmt`` (``param_shapes``) and the float64 matrix they stand for."""
    arrays = {}
    for suffix, shape, dtype in param_shapes(n_out, n_in, fmt):
        if dtype == "int8":
            arrays[suffix] = rng.integers(-127, 128, shape).astype(np.int8)
        elif dtype == "uint8":
            arrays[suffix] = rng.integers(0, 256, shape).astype(np.uint8)
        else:
            arrays[suffix] = (rng.standard_normal(shape) * 0.05).astype(dtype)
    if fmt in ("float32", "float16"):
        w = arrays["weight"].astype(np.float64)
    else:
        scales = np.repeat(arrays["scales"].astype(np.float64), 32, axis=1)
        if fmt == "q8_0":
            w = arrays["codes"].astype(np.float64) * scales
        else:  # byte j of a block's 16: weight j in the low nibble, weight 16 + j in the high one
            codes = arrays["codes"].reshape(n_out, n_in // 32, 16)
            q = np.concatenate([codes & 15, codes >> 4], axis=2).reshape(n_out, n_in)
            w = q * scales + np.repeat(arrays["mins"].astype(np.float64), 32, axis=1)
    return list(arrays.values()), w


@pytest.mark.parametrize("mode", ["auto", "decode", "prefill"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_linear_kernels_match_numpy_on_awkward_token_counts(fmt: str, mode: str) -> None:
    """Both schedules (dot products below 8 tokens, the register-tiled GEMM from 8 on: tails of 1/2/3 vectors,
    partial vectors, several 96-token tiles, a partial last row group) against float64 numpy; "decode" runs the dot
    products and "prefill" the GEMM at every token count, and those two are batch-invariant: the first n tokens of
    a 130-token input give bitwise the rows they give alone, at every count."""
    rng = np.random.default_rng(1)
    dev = tvm.cpu()
    for n_out, n_in in LINEAR_SHAPES[fmt] if mode == "auto" else LINEAR_SHAPES[fmt][-1:]:
        run = _cpu_kernel(linear_kernel, n_out, n_in, fmt, mode=mode)
        arrays, w = random_weights(n_out, n_in, fmt, rng)
        weights = [tvm.runtime.tensor(a, dev) for a in arrays]
        counts = TOKEN_COUNTS if n_out < 10000 else (1, 4, 17)
        tokens = rng.standard_normal((max(counts), n_in)).astype(np.float32)
        rows = {}
        for n in counts:
            x = tokens[:n]
            y = tvm.runtime.tensor(np.full((n, n_out), np.nan, np.float32), dev)
            run(tvm.runtime.tensor(x, dev), *weights, y)
            expected = x.astype(np.float64) @ w.T
            np.testing.assert_allclose(y.numpy(), expected, rtol=0, atol=1e-5 * np.abs(expected).max(),
                                       err_msg=f"{fmt} {n_out}x{n_in}, {n} tokens")
            rows[n] = y.numpy()
        if mode != "auto":
            for n, y in rows.items():
                np.testing.assert_array_equal(y, rows[max(counts)][:n], err_msg=f"{fmt} {mode}: {n} tokens")


@pytest.mark.parametrize("fmt", ["q8_0", "q4_1"])
def test_integer_dot_kernels_are_batch_invariant(fmt: str) -> None:
    """The integer-dot matvecs (AVX2, ``int8_dot``) in "decode" and "prefill" modes: row t of y is bitwise the same
    whatever the token count (the float kernels' invariance is checked with their numerics above)."""
    rng = np.random.default_rng(3)
    n_out, n_in = 40, 256
    arrays, _ = random_weights(n_out, n_in, fmt, rng)
    dev = tvm.cpu()
    weights = [tvm.runtime.tensor(a, dev) for a in arrays]
    x = rng.standard_normal((40, n_in)).astype(np.float32)
    for mode in ("decode", "prefill"):
        run = _cpu_kernel(linear_kernel, n_out, n_in, fmt, True, mode=mode)
        rows = {}
        for n in (1, 2, 3, 4, 5, 7, 8, 9, 16, 17, 40):
            y = tvm.runtime.tensor(np.zeros((n, n_out), np.float32), dev)
            run(tvm.runtime.tensor(x[:n], dev), *weights, y)
            rows[n] = y.numpy()
        for n, y in rows.items():
            np.testing.assert_array_equal(y, rows[40][:n], err_msg=f"{fmt} {mode}: {n} tokens")


def _cpu_kernel(factory, *args, **kwargs):
    """The kernel ``factory(*args, **kwargs)`` compiled for this CPU, as a callable (once, in the build cache)."""
    return built_for_cpu(factory, *args, **kwargs)


def test_swiglu_kernel_matches_numpy() -> None:
    rng = np.random.default_rng(2)
    run, dev = _cpu_kernel(swiglu_kernel, 48), tvm.cpu()
    for n in (1, 5, 70):
        gu = (rng.standard_normal((n, 96)) * 6).astype(np.float32)
        gu[0, :4] = [-200.0, -90.0, 90.0, 0.0]  # exp's clamp and both tails
        out = tvm.runtime.tensor(np.full((n, 48), np.nan, np.float32), dev)
        run(tvm.runtime.tensor(gu, dev), out)
        g = gu[:, :48].astype(np.float64)
        np.testing.assert_allclose(out.numpy(), g / (1 + np.exp(-g)) * gu[:, 48:], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("scaling", ["unscaled", "llama3", "longrope-partial"])
def test_rope_kernel_rotates_halves_like_numpy(scaling: str) -> None:
    """The KV cache's RoPE slot: q and k heads rotated (pairs i, i + r/2 of the first r values) at each token's
    position by the given inverse frequencies (unscaled, Llama 3's per-frequency divisors, or LongRoPE's short
    factors with its attention factor on 12 of 16 values), the rest and v copied; q's carried heads get k and v
    (qkv's last 2 h_kv heads are padding)."""
    rng = np.random.default_rng(3)
    h_q, h_kv, d, theta = 4, 2, 16, 10000.0
    rope_dim, factor, factors = d, 1.0, ()
    if scaling == "llama3":
        factors = llama3_factors(theta, d, 8.0, 1.0, 4.0, 64)
    elif scaling == "longrope-partial":
        rope_dim, factor, factors = 12, 1.13, (1.0, 1.2, 1.5, 2.0, 3.0, 4.5)
    inv_freq = RopeScaling(theta, factors).inverse_frequencies(rope_dim)
    run, dev = _cpu_kernel(rope_kernel, h_kv, h_q, d, tuple(inv_freq), attention_factor=factor), tvm.cpu()
    half = rope_dim // 2
    for n in (1, 3, 70):
        qkv = rng.standard_normal((n, h_q + 2 * h_kv, d)).astype(np.float32)
        positions = rng.integers(0, 500, n).astype(np.int32)
        outs = [tvm.runtime.tensor(np.full((n, h, d), np.nan, np.float32), dev) for h in (h_q + 2 * h_kv, h_kv, h_kv)]
        padded = np.concatenate([qkv, np.full((n, 2 * h_kv, d), np.nan, np.float32)], axis=1)
        run(tvm.runtime.tensor(padded, dev), tvm.runtime.tensor(positions, dev), *outs, 1)
        freq = positions[:, None] / theta ** (np.arange(half) * 2 / rope_dim) / (np.asarray(factors) if factors else 1)
        cos, sin = factor * np.cos(freq)[:, None, :], factor * np.sin(freq)[:, None, :]
        a, b = qkv[..., :half], qkv[..., half:rope_dim]
        rotated = np.concatenate([a * cos - b * sin, b * cos + a * sin, qkv[..., rope_dim:]], axis=-1)
        expected = (rotated[:, :h_q], rotated[:, h_q:h_q + h_kv], qkv[:, h_q + h_kv:])
        q_out, k_out, v_out = (out.numpy() for out in outs)
        for out, want in zip((q_out[:, :h_q], k_out, v_out), expected, strict=True):
            np.testing.assert_allclose(out, want, rtol=0, atol=2e-4)
        np.testing.assert_array_equal(q_out[:, h_q:], np.concatenate([k_out, v_out], axis=1))


# ---------------------------------------------------------------- the numpy runner


def test_numpy_runner_matches_the_compiled_model(qwen_tiny, m32, prompt, lib) -> None:
    runner = NumpyRunner(qwen_tiny, kernel_library=lib, kv_dtype="float32")
    for model in (runner, m32):
        model.add_sequence(0)
        model.add_sequence(1)
    a = runner.prefill([0, 1], [prompt, prompt[:7]])
    b = m32.prefill([0, 1], [prompt, prompt[:7]])
    np.testing.assert_allclose(a, b, atol=TOL_F32, rtol=0)
    for model in (runner, m32):
        model.fork_sequence(0, 2)
        model.popn(2, 2)
    a = runner.decode([2, 1, 0], [3, 4, 5])
    b = m32.decode([2, 1, 0], [3, 4, 5])
    np.testing.assert_allclose(a, b, atol=TOL_F32, rtol=0)
    assert runner.sequence_length(2) == len(prompt) - 1


# ---------------------------------------------------------------- Hugging Face directories


def test_hf_directory_equals_the_in_memory_model(qwen_tiny, hf_directory, m32, prompt) -> None:
    """Read back, the directory is the model (config, weights, logits of the reference); compiled (``m32``, whose
    float32 tests hold it to the in-memory model's reference), its tokenizer is the model's."""
    assert {p.name for p in hf_directory.iterdir()} >= {"config.json", "model.safetensors", "tokenizer.json"}
    loaded = load_hf_dir(hf_directory)
    assert loaded.config.n_layers == qwen_tiny.config.n_layers and not loaded.config.tied_embeddings
    assert set(loaded.weights) == set(qwen_tiny.weights)
    for name, array in qwen_tiny.weights.items():
        np.testing.assert_array_equal(loaded.weights[name], array, err_msg=name)
    np.testing.assert_allclose(reference(loaded, prompt), reference(qwen_tiny, prompt), atol=1e-6, rtol=0)
    assert m32.name == "hf-tiny" and m32.weight_formats["lm_head"] == "float32"
    assert m32.tokenizer.encode("the cat sat").ids == build_tokenizer(qwen_tiny).encode("the cat sat").ids


# ---------------------------------------------------------------- SmolLM2 (the real default model)


@pytest.fixture(scope="module")
def smollm2_path() -> Path:
    from logitproc.compile.model_fetch import fetch_default_model

    return fetch_default_model(os.environ.get("LOGITPROC_TEST_MODEL_CACHE"))


@pytest.fixture(scope="module")
def smollm2(smollm2_path: Path) -> CompiledModel:
    return CompiledModel.open(smollm2_path, max_num_sequences=4)


def test_smollm2_logits_match_numpy(smollm2, smollm2_path: Path) -> None:
    from logitproc.compile.gguf_model import load_gguf

    ids = smollm2.tokenizer.encode(smollm2.apply_chat_template(QUESTION)).ids
    smollm2.add_sequence(0)
    logits = smollm2.prefill([0], [ids])[0]
    expected = NumpyLlama(load_gguf(smollm2_path)).prefill(ids)
    smollm2.remove_sequence(0)
    assert smollm2.weight_formats["qkv"] == "q4_1" and smollm2.weight_formats["embed"] == "q8_0"
    assert np.abs(logits - expected).max() < TOL_AUTO
    assert int(logits.argmax()) == int(expected.argmax())


def test_smollm2_decode_logits_match_numpy(smollm2, smollm2_path: Path) -> None:
    from logitproc.compile.gguf_model import load_gguf

    ids = smollm2.tokenizer.encode(smollm2.apply_chat_template(QUESTION)).ids
    reference = NumpyLlama(load_gguf(smollm2_path))
    expected = reference.prefill(ids)
    smollm2.add_sequence(0)
    smollm2.prefill([0], [ids])
    for _ in range(6):
        token = int(expected.argmax())
        logits = smollm2.decode([0], [token])[0]
        expected = reference.decode(token)
        assert np.abs(logits - expected).max() < TOL_AUTO
        assert int(logits.argmax()) == int(expected.argmax())
    smollm2.remove_sequence(0)


def test_smollm2_greedy_answer_names_paris(smollm2) -> None:
    ids = smollm2.tokenizer.encode(smollm2.apply_chat_template(QUESTION)).ids
    smollm2.add_sequence(0)
    logits = smollm2.prefill([0], [ids])
    out: list[int] = []
    for _ in range(12):
        token = int(logits[0].argmax())
        if token in smollm2.eos_token_ids:
            break
        out.append(token)
        logits = smollm2.decode([0], [token])
    smollm2.remove_sequence(0)
    assert "Paris" in smollm2.tokenizer.decode(out)
