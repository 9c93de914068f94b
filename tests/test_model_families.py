"""Every supported family (``compile/families``) against transformers, from a Hugging Face folder and from a GGUF.

For each family a tiny random-weight model is built with transformers once per session (``family_models.py``:
Llama with Llama 3.1's RoPE scaling and an EOS list, Qwen2 with q/k/v biases, Qwen3 with QK-norm and a head size
of its own, Phi-3 with fused q/k/v and gate/up, LongRoPE and partial rotary), saved as a Hugging Face folder
(safetensors) and written as a GGUF with gguf-py under llama.cpp's names and layout. Checked:

* both loaders give the same config and, tensor by tensor, the same weights;
* the numpy reference (``NumpyLlama``) from either format matches transformers' logits after every token of a
  prompt within 1e-4 (measured 3-5e-6; logits' standard deviation about 2);
* the compiled model (one build per family, from the GGUF, float32 weights and KV cache; from the folder too, slow,
  for the families whose folder gives another config: ``FOLDER_COMPILED``) matches transformers after the prompt and
  16 greedy decode steps within 1e-2;
* a Q8_0 GGUF's blocks (kept for the kernels) are un-permuted and split as the dense weights are;
* Mistral (a sliding window on every layer, wider than the prompt), linear RoPE scaling and transformers 4's
  ``rope_theta`` / ``rope_scaling`` spelling read right (numpy against transformers);
* an unknown architecture, RoPE type, ``config.json`` key or GGUF key is refused, naming it, before any compile.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import family_models
import numpy as np
import pytest
from family_models import CASES
from greedy_rows import greedy_rows
from logitproc.compile.families import FAMILIES, family_named
from logitproc.compile.gguf_config import config_from_gguf
from logitproc.compile.gguf_model import load_gguf
from logitproc.compile.gguf_tokenizer import read_gguf_metadata
from logitproc.compile.hf_config import config_from_hf
from logitproc.compile.hf_model import load_hf_dir
from logitproc.compile.llama_weights import dequantize_blocks, read_gguf_tensors
from logitproc.compile.model_compile import compile_model, eos_token_ids
from logitproc.serve.compiled_model import CompiledModel
from logitproc.serve.numpy_llama import NumpyLlama

pytest.importorskip("transformers")

TOL_NUMPY = 1e-4
TOL_COMPILED = 1e-2
PROMPT = [0, 1, 5, 80, 91, 7, 200, 150, 12, 260, 33, 101, 2, 45, 46, 47, 3, 270]
DECODE_STEPS = 16


@pytest.fixture(scope="session")
def families(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[object, Path, Path]]:
    """case name -> (transformers model, Hugging Face folder, GGUF path)."""
    root = tmp_path_factory.mktemp("families")
    out = {}
    for name, case in CASES.items():
        model = family_models.build_transformers_model(case)
        folder = family_models.write_hf_folder(model, case, root / f"hf-{name}")
        out[name] = (model, folder, family_models.write_gguf(model, case, root / f"tiny-{name}.gguf"))
    return out


@pytest.mark.parametrize("name", list(CASES))
def test_gguf_and_hf_folder_load_the_same_model(families, name: str) -> None:
    _, folder, gguf_path = families[name]
    hf, gguf = load_hf_dir(folder), load_gguf(gguf_path)
    assert hf.config.architecture == gguf.config.architecture == CASES[name].gguf_arch  # the family's name
    skip = {"name", "chat_template", "rope_scaling", "rope_factors", "rms_eps", "rope_attention_factor"}
    for key in ("rms_eps", "rope_attention_factor"):  # float32 in the GGUF
        assert getattr(hf.config, key) == pytest.approx(getattr(gguf.config, key), rel=1e-6)
    assert {k: v for k, v in vars(hf.config).items() if k not in skip} == \
        {k: v for k, v in vars(gguf.config).items() if k not in skip}
    np.testing.assert_allclose(hf.config.rope_factors or 0, gguf.config.rope_factors or 0, rtol=1e-6)
    assert hf.config.eos_ids == gguf.config.eos_ids == CASES[name].eos_ids
    assert set(hf.weights) == set(gguf.weights)
    for tensor, array in hf.weights.items():
        np.testing.assert_array_equal(gguf.weights[tensor], array, err_msg=tensor)


@pytest.mark.parametrize("fmt", ["hf", "gguf"])
@pytest.mark.parametrize("name", list(CASES))
def test_numpy_reference_matches_transformers(families, name: str, fmt: str) -> None:
    model, folder, gguf_path = families[name]
    loaded = load_hf_dir(folder) if fmt == "hf" else load_gguf(gguf_path)
    expected = family_models.reference_logits(model, PROMPT)
    got = NumpyLlama(loaded).extend_all(PROMPT)
    assert 1.5 < expected.std() < 3
    np.testing.assert_allclose(got, expected, atol=TOL_NUMPY, rtol=0)


#: The families compiled from their Hugging Face folder too (``slow``, a build each): those whose folder gives a config
#: other than the GGUF's beyond float32 rounding (Llama 3's RoPE scaling read as ``llama3`` from the folder and as the
#: GGUF's ``rope_freqs`` tensor; Phi-3's LongRoPE factors and attention factor). The others' folder and GGUF give the
#: same config (but for ``rms_eps``, rounded to float32 in the GGUF) and the same weights, tensor by tensor
#: (``test_gguf_and_hf_folder_load_the_same_model``), so that their folder's build would check their GGUF's build again
#: (measured 11-14 s of CPU each cold; 2026-11-28); a folder through the command's compile: ``test_compiled_model``'s
#: tiny Hugging Face directory (quick).
FOLDER_COMPILED = ("llama3", "phi3")
COMPILED = [(name, "gguf") for name in CASES] + [pytest.param(name, "hf", marks=pytest.mark.slow)
                                                  for name in FOLDER_COMPILED]


@pytest.mark.parametrize(("name", "fmt"), COMPILED, ids=lambda value: value)
def test_compiled_model_matches_transformers_over_greedy_decoding(families, name: str, fmt: str) -> None:
    """From the GGUF, and from the folder for ``FOLDER_COMPILED`` (``slow``: both loaders give the same config and
    weights, above)."""
    model, folder, gguf_path = families[name]
    compiled = CompiledModel.open(gguf_path if fmt == "gguf" else folder, weight_dtype="float32", kv_dtype="float32",
                                  max_num_sequences=2)
    assert compiled.eos_token_ids[:len(CASES[name].eos_ids)] == CASES[name].eos_ids
    rows, tokens = greedy_rows(compiled, PROMPT, DECODE_STEPS)
    expected = family_models.reference_logits(model, tokens)[len(PROMPT) - 1:]
    np.testing.assert_allclose(rows, expected, atol=TOL_COMPILED, rtol=0)


#: llama.cpp's ``phi3`` vocabulary loader looks up tokens of Phi-3's own vocabulary, which the tiny one lacks:
#: ``test_context_and_windows.py`` compares llama.cpp on a Phi-3 written with Phi-3's real vocabulary.
LLAMA_CPP_CASES = [name for name in CASES if name != "phi3"]


@pytest.mark.parametrize("name", LLAMA_CPP_CASES)
def test_llama_cpp_reads_the_gguf_as_the_numpy_reference_does(families, name: str) -> None:
    """llama.cpp itself (llama-cpp-python, float32 KV cache) on the same GGUF: its logits after every prompt token
    agree with the numpy reference's from that file (so the GGUF facts the writer and the loader share are
    llama.cpp's: Gemma's norms plus one, its scale, window pattern and two RoPE bases, Llama's q/k permutation).
    Measured 3-4e-6 (llama, qwen2, qwen3), 1.6e-3 and 2.1e-3 (Gemma 2 and 3: ggml's gelu is a float16 table)."""
    llama_cpp = pytest.importorskip("llama_cpp")
    _, _, gguf_path = families[name]
    f32 = 0  # GGML_TYPE_F32
    llm = llama_cpp.Llama(str(gguf_path), n_ctx=64, n_batch=64, logits_all=True, verbose=False, n_threads=1,
                          type_k=f32, type_v=f32)
    llm.eval(PROMPT)
    got = np.asarray(llm.scores[:len(PROMPT)])
    want = NumpyLlama(load_gguf(gguf_path)).extend_all(PROMPT)
    assert (got.argmax(-1) == want.argmax(-1)).all()
    np.testing.assert_allclose(got, want, atol=TOL_COMPILED, rtol=0)


@pytest.mark.parametrize("name", ["llama3", "phi3"])
def test_quantised_blocks_are_permuted_and_split_as_the_dense_weights(families, tmp_path: Path, name: str) -> None:
    """A Q8_0 GGUF's blocks, kept for the kernels, hold each canonical tensor's rows in the order the dense weights
    have (a llama GGUF's q/k rows un-permuted, Phi-3's fused q/k/v and gate/up split): dequantised, they are the
    loader's float32 weights exactly."""
    path = family_models.write_gguf(families[name][0], CASES[name], tmp_path / "q8.gguf", q8_0=True)
    dense = load_gguf(path)
    _, raw = read_gguf_tensors(path, dense.config, keep_blocks=True)
    assert {"blk.1.attn_q.weight", "blk.1.attn_k.weight", "blk.1.ffn_gate.weight", "blk.1.ffn_up.weight"} <= set(raw)
    for tensor, blocks in raw.items():
        np.testing.assert_array_equal(dequantize_blocks(*blocks), dense.weights[tensor], err_msg=tensor)


def _edited_folder(families, tmp_path: Path, name: str, **changes: object) -> Path:
    """A copy of family ``name``'s folder with ``config.json`` keys changed (a value of None removes the key)."""
    folder = shutil.copytree(families[name][1], tmp_path / f"edited-{name}")
    cfg = json.loads((folder / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def test_mistral_folder_reads_as_llama_with_its_window(tmp_path: Path) -> None:
    """MistralForCausalLM is the llama family; its sliding window (wider than the prompt here) is every layer's
    (``test_context_and_windows.py`` has one that bites)."""
    case = family_models.FamilyCase("mistral", "mistral", "llama", {"sliding_window": 256, "eos_token_id": 2})
    model = family_models.build_transformers_model(case, seed=1)
    loaded = load_hf_dir(family_models.write_hf_folder(model, case, tmp_path / "mistral"))
    assert loaded.config.architecture == "llama" and loaded.config.context == 512
    assert loaded.config.window_layers == (0, 1) and loaded.config.sliding_window == 256
    np.testing.assert_allclose(NumpyLlama(loaded).extend_all(PROMPT), family_models.reference_logits(model, PROMPT),
                               atol=TOL_NUMPY, rtol=0)


def test_linear_rope_scaling_matches_transformers(tmp_path: Path) -> None:
    case = family_models.FamilyCase("linear", "llama", "llama",
                                    {"rope_scaling": {"rope_type": "linear", "factor": 4.0}, "eos_token_id": 2})
    model = family_models.build_transformers_model(case, seed=2)
    loaded = load_hf_dir(family_models.write_hf_folder(model, case, tmp_path / "linear"))
    assert loaded.config.rope_scaling == "linear"
    np.testing.assert_allclose(NumpyLlama(loaded).extend_all(PROMPT), family_models.reference_logits(model, PROMPT),
                               atol=TOL_NUMPY, rtol=0)


def test_transformers_4_rope_spelling_reads_as_rope_parameters(families) -> None:
    cfg = json.loads((families["llama3"][1] / "config.json").read_text())
    params = dict(cfg["rope_parameters"])
    legacy = {k: v for k, v in cfg.items() if k != "rope_parameters"}
    legacy["rope_theta"] = params.pop("rope_theta")
    legacy["rope_scaling"] = {"type" if k == "rope_type" else k: v for k, v in params.items()}
    assert config_from_hf(legacy) == config_from_hf(cfg)
    assert config_from_hf(cfg).rope_scaling == "llama3" and config_from_hf(cfg).rope_theta == 500000.0


# ---------------------------------------------------------------- refusals, before any compile

REFUSED_CONFIGS = [
    ("qwen2", {"architectures": ["GPTNeoXForCausalLM"]}, "GPTNeoXForCausalLM"),
    ("qwen2", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}}, "yarn"),
    ("llama3", {"rope_parameters": {**family_models.LLAMA3_ROPE, "rope_theta": 5e5, "beta": 2}}, "beta"),
    ("qwen2", {"attn_logit_softcapping": 30.0}, "attn_logit_softcapping"),
    ("qwen2", {"use_sliding_window": True}, "use_sliding_window"),
    ("llama3", {"attention_bias": True}, "attention_bias"),
    ("qwen3", {"hidden_act": "gelu"}, "gelu"),
    ("qwen3", {"layer_types": ["sliding_attention", "full_attention"]}, "sliding_attention"),
    ("phi3", {"lm_head_bias": True}, "lm_head_bias"),
    ("qwen2", {"intermediate_size": 96}, r"mlp\..*_proj.weight has shape \[.*\], the config gives \[.*96.*\]"),
    ("gemma2", {"hidden_activation": "gelu"}, "hidden_activation"),
    ("gemma2", {"layer_types": ["sliding_attention", "chunked_attention"]}, "layer_types"),
    ("gemma2", {"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ("gemma2", {"sliding_window": None}, "sliding_window"),
]


@pytest.mark.parametrize(("name", "changes", "named"), REFUSED_CONFIGS, ids=[c[2][:24] for c in REFUSED_CONFIGS])
def test_unsupported_config_is_refused_before_compiling(families, tmp_path: Path, name, changes, named) -> None:
    folder = _edited_folder(families, tmp_path, name, **changes)
    (folder / "generation_config.json").unlink()
    lines: list[str] = []
    with pytest.raises(ValueError, match=named):
        compile_model(folder, progress=lines.append, weight_dtype="float32")
    assert not any("Relax" in line or "compil" in line for line in lines), lines


def test_a_model_without_an_end_of_sequence_token_is_refused(families, tmp_path: Path) -> None:
    folder = _edited_folder(families, tmp_path, "qwen3", eos_token_id=None)
    (folder / "generation_config.json").unlink()
    model = load_hf_dir(folder)
    assert model.config.eos_ids == ()
    assert eos_token_ids(model) == [2, 0]  # the tokenizer's special <|im_end|> and <|endoftext|>
    model.token_types = [1] * len(model.token_types)  # no special tokens either
    with pytest.raises(ValueError, match="no end-of-sequence token"):
        eos_token_ids(model)


@pytest.mark.parametrize(("key", "named"), [("llama.expert_count", "expert_count"),
                                            ("llama.attention.sliding_window", "sliding_window")])
def test_unsupported_gguf_key_is_refused_before_compiling(families, tmp_path: Path, key: str, named: str) -> None:
    model = families["llama3"][0]
    path = family_models.write_gguf(model, CASES["llama3"], tmp_path / "extra.gguf", extra_keys={key: 4})
    lines: list[str] = []
    with pytest.raises(ValueError, match=named):
        compile_model(path, progress=lines.append, weight_dtype="float32")
    assert not any("Relax" in line or "compil" in line for line in lines), lines


def test_unknown_gguf_architecture_is_refused(families, tmp_path: Path) -> None:
    case = family_models.FamilyCase("falcon", "llama", "falcon", {"eos_token_id": 2})
    path = family_models.write_gguf(families["llama3"][0], case, tmp_path / "falcon.gguf")
    with pytest.raises(ValueError, match="'falcon' is not supported"):
        load_gguf(path)


def test_gemma2_windows_and_soft_caps_bite(families) -> None:
    """The tiny Gemma 2's window, soft-caps and attention scale each change its logits (so the agreement above
    checks them): the numpy reference without any one of them is more than 1e-2 off transformers."""
    model, folder, _ = families["gemma2"]
    loaded = load_hf_dir(folder)
    expected = family_models.reference_logits(model, PROMPT)
    assert loaded.config.window_layers == (0,) and loaded.config.sliding_window == 6 < len(PROMPT)
    for change in ({"window_layers": ()}, {"attn_softcap": 0.0}, {"final_softcap": 0.0}, {"query_scale": None}):
        loaded.config = replace(load_hf_dir(folder).config, **change)
        if change == {"query_scale": None}:  # head_dim 32 is the scalar: a head_dim of 16 changes the scale
            loaded.config = replace(loaded.config, query_scale=16 ** -0.5)
        assert np.abs(NumpyLlama(loaded).extend_all(PROMPT) - expected).max() > 1e-2, change


def test_gemma2_query_pre_attn_scalar_scales_the_scores(tmp_path: Path) -> None:
    """A ``query_pre_attn_scalar`` other than head_dim (Gemma 2 27B's hidden / heads) from a Hugging Face folder."""
    case = family_models.FamilyCase("gemma2-27b", "gemma2", "gemma2",
                                    {**CASES["gemma2"].overrides, "query_pre_attn_scalar": 20})
    model = family_models.build_transformers_model(case, seed=3)
    loaded = load_hf_dir(family_models.write_hf_folder(model, case, tmp_path / "gemma2"))
    assert loaded.config.sm_scale == pytest.approx(20 ** -0.5)
    np.testing.assert_allclose(NumpyLlama(loaded).extend_all(PROMPT), family_models.reference_logits(model, PROMPT),
                               atol=TOL_NUMPY, rtol=0)


def test_compiled_gemma2_prefill_in_chunks_keeps_the_window(families) -> None:
    """A prompt fed in three chunks: the later chunks' queries read the window partly from the cached pages."""
    model, _, gguf_path = families["gemma2"]
    compiled = CompiledModel.open(gguf_path, weight_dtype="float32", kv_dtype="float32", max_num_sequences=2)
    compiled.add_sequence(0)
    for chunk in (PROMPT[:5], PROMPT[5:9], PROMPT[9:]):
        last = compiled.prefill([0], [chunk])[0]
    np.testing.assert_allclose(last, family_models.reference_logits(model, PROMPT)[-1], atol=TOL_COMPILED, rtol=0)


#: Gemma's logits on a q8_0 cache against the numpy reference quantising the same values (``test_kv_q8.py``'s bound)
TOL_Q8 = 2e-2
#: Gemma 3 (the model rotates q and k itself): its k reaches the cache's quantisation rounded to float16 (the cache's
#: element type), where the reference (and llama.cpp) quantise the float32 rotated k: measured 2.9e-2 on these
#: tokens (3.4e-4 against a reference rounding k to float16 first), where the q8_0 cache itself moves the logits by
#: 6.0e-2 from the float32 reference; docs/model.md, the q8_0 cache.
TOL_Q8_MODEL_ROPE = 4e-2


@pytest.mark.parametrize("kv_dtype", ["float32", "q8_0"])
@pytest.mark.parametrize("name", ["gemma2", "gemma3"])
def test_compiled_gemma_verify_is_its_decode_steps_bit_for_bit(families, name: str, kv_dtype: str) -> None:
    """The verify forward's exact attention in sliding layers (window, soft-cap; Gemma 3's own RoPE per layer), on a
    float32 and an 8-bit cache: a verify's rows, more tokens than the window, equal the decode steps of the same
    tokens exactly, and (q8_0) the numpy reference quantising the same values within ``TOL_Q8``."""
    _, _, gguf_path = families[name]
    compiled = CompiledModel.open(gguf_path, weight_dtype="float32", kv_dtype=kv_dtype, max_num_sequences=2)
    drafts = [5, 9, 100, 7, 8, 200, 3, 44, 12]
    compiled.add_sequence(0)
    compiled.prefill([0], [PROMPT])
    decoded = np.stack([compiled.decode([0], [t])[0] for t in drafts])
    compiled.popn(0, len(drafts))
    np.testing.assert_array_equal(compiled.verify([0], [drafts])[0], decoded)
    if kv_dtype == "q8_0":
        ref = NumpyLlama(load_gguf(gguf_path), kv_dtype="q8_0")
        ref.prefill(PROMPT)
        np.testing.assert_allclose(decoded, np.stack([ref.decode(t) for t in drafts]), rtol=0,
                                   atol=TOL_Q8_MODEL_ROPE if name == "gemma3" else TOL_Q8)


def test_gemma_end_of_turn_ends_an_answer(families) -> None:
    """A Gemma GGUF whose metadata names only ``<eos>``: its ``<end_of_turn>`` control token stops answers too (as
    llama.cpp's end-of-generation list has it)."""
    model = load_gguf(families["gemma2"][2])
    model.tokens[107] = "<end_of_turn>"
    assert 107 not in eos_token_ids(model)  # a plain token of that text does not
    model.token_types[107] = 3  # control
    assert eos_token_ids(model)[-1] == 107


@pytest.mark.parametrize(("layers", "scalar"), [(2, 32), (46, 64 // 4)])
def test_gemma2_gguf_query_scale_is_llama_cpps(families, layers: int, scalar: int) -> None:
    """A Gemma 2 GGUF stores no query_pre_attn_scalar: ``head_dim``, or ``hidden / heads`` for 46 layers (the 27B),
    as llama.cpp takes it; and a pattern key of one flag per layer names the sliding layers itself."""
    meta = read_gguf_metadata(families["gemma2"][2])
    meta["gemma2.block_count"] = layers
    meta["gemma2.attention.sliding_window_pattern"] = [i % 3 == 0 for i in range(layers)]
    small = load_gguf(families["gemma2"][2], load_weights=False).config
    family = family_named("gemma2")
    shapes = {name: small.stored_shape(parts) for name, parts in family.gguf_file_tensors(layers, True).items()}
    config = config_from_gguf(meta, shapes, {}, vocab_size=small.vocab)
    assert config.sm_scale == pytest.approx(scalar ** -0.5)
    assert config.window_layers == tuple(range(0, layers, 3))


def test_gemma2_gguf_without_its_window_is_refused(families, tmp_path: Path) -> None:
    path = family_models.write_gguf(families["gemma2"][0], CASES["gemma2"], tmp_path / "g.gguf", without_window=True)
    with pytest.raises(ValueError, match=r"gemma2\.attention\.sliding_window.*missing"):
        load_gguf(path)


def test_gemma3_transformers_4_spelling_reads_as_rope_parameters_per_layer_type(families) -> None:
    """Gemma 3's transformers 4 config (``rope_theta`` + ``rope_scaling`` for the global layers,
    ``rope_local_base_freq`` for the sliding ones, ``sliding_window_pattern`` instead of ``layer_types``) reads as
    transformers 5's ``rope_parameters`` per layer type."""
    cfg = json.loads((families["gemma3"][1] / "config.json").read_text())
    params = cfg["rope_parameters"]
    legacy = {k: v for k, v in cfg.items() if k not in ("rope_parameters", "layer_types", "_sliding_window_pattern")}
    legacy.update(rope_theta=params["full_attention"]["rope_theta"], rope_local_base_freq=10000.0,
                  rope_scaling={"rope_type": "linear", "factor": 8.0})
    assert config_from_hf(legacy) == config_from_hf(cfg)
    read = config_from_hf(cfg)
    assert read.window_layers == (0, 1) and read.local_rope_theta == 10000.0 and read.rope_scaling == "linear"


def test_gemma3_local_rope_and_window_bite(families) -> None:
    model, folder, _ = families["gemma3"]
    expected = family_models.reference_logits(model, PROMPT)
    for change in ({"window_layers": ()}, {"local_rope_theta": 0.0}):
        loaded = load_hf_dir(folder)
        loaded.config = replace(loaded.config, **change)
        assert np.abs(NumpyLlama(loaded).extend_all(PROMPT) - expected).max() > 1e-2, change


GEMMA3_REFUSED = [
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}, "one RoPE per layer type"),
    ({"rope_parameters": {**family_models.GEMMA3_ROPE,
                          "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}},
     "sliding layers"),
    ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
    ({"sliding_window_pattern": 2}, "sliding_window_pattern.* 2.*disagree"),
    ({"sliding_window_pattern": 2, "_sliding_window_pattern": 2}, "disagrees with layer_types"),
    ({"rope_local_base_freq": 5000.0}, "rope_local_base_freq"),
]


@pytest.mark.parametrize(("changes", "named"), GEMMA3_REFUSED, ids=[c[1][:20] for c in GEMMA3_REFUSED])
def test_gemma3_config_not_understood_is_refused(families, tmp_path: Path, changes, named) -> None:
    with pytest.raises(ValueError, match=named):
        load_hf_dir(_edited_folder(families, tmp_path, "gemma3", **changes))


def test_every_family_is_listed_with_its_formats() -> None:
    assert [f.name for f in FAMILIES] == ["llama", "qwen2", "qwen3", "phi3", "gemma2", "gemma3"]
    assert all(f.hf_architectures and f.gguf_architectures for f in FAMILIES)
