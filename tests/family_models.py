"""Tiny random-weight models of each supported family, built with transformers (the oracle) and written both as a
Hugging Face folder and as a GGUF by gguf-py under llama.cpp's names and layout, for ``test_model_families.py``.

Each model: 2 layers, hidden 64, 4 query / 2 KV heads, FFN 128, the tiny byte-level BPE vocabulary of
``compile/tiny_model.py`` (277 tokens, so the tests need no other tokenizer); norms and biases re-randomised (the
default init sets norms to 1 and biases to 0, which would hide a missing norm or bias), projections scaled so the
logits have a standard deviation of about 2. The GGUF is written as llama.cpp's converter writes it (facts taken
from ``convert_hf_to_gguf.py``, re-stated here, not shared with the loader): a ``llama`` GGUF's q/k rows permuted
for adjacent-pair RoPE, ``qwen2``/``qwen3``/``phi3`` in Hugging Face's order; Llama 3's RoPE scaling as a
``rope_freqs`` tensor of per-frequency divisors; Phi-3's fused ``attn_qkv`` and gate+up ``ffn_up``, its LongRoPE
factors as ``rope_factors_short/long`` tensors with the attention factor and original context as keys; the EOS,
EOT and EOM ids as separate keys.
"""

from __future__ import annotations

import copy
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from logitproc.compile.gguf_model import build_tokenizer
from logitproc.compile.tiny_model import make_tiny_model

VOCAB = 277
#: Llama 3.1's scaling on tiny sizes: with theta 5e5 and head size 16 the 8 frequencies fall in all three bands.
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}


@dataclass(frozen=True)
class FamilyCase:
    """One tiny model: transformers' ``model_type``, the config overrides, the GGUF architecture and EOS ids."""

    name: str
    model_type: str
    gguf_arch: str
    overrides: dict[str, Any]
    #: (eos, eot, eom) written to the GGUF; the config's eos_token_id list holds the first two
    eos_ids: tuple[int, ...] = (2,)


#: Families whose RMS norms multiply by ``1 + w`` (their norms are re-randomised around 0, not 1; llama.cpp's
#: converter stores ``w + 1``).
PLUS_ONE_NORMS = ("gemma2", "gemma3_text")

#: Phi-3's LongRoPE on tiny sizes: partial rotary 0.75 of head size 16 (12 rotated values, 6 frequencies), an
#: original context of 128 in a max_position_embeddings of 512 (attention factor sqrt(1 + ln 4 / ln 128)).
PHI3_ROPE = {"rope_type": "longrope", "short_factor": [1.0, 1.2, 1.5, 2.0, 3.0, 4.5],
             "long_factor": [2.0, 3.0, 4.0, 6.0, 8.0, 12.0]}

#: Gemma 3's RoPE per layer type (transformers 5's spelling): a theta of 1e4 locally, 1e6 scaled by 8 globally.
GEMMA3_ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
               "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0}}

CASES = {
    "llama3": FamilyCase("llama3", "llama", "llama",
                         {"rope_theta": 500000.0, "rope_scaling": LLAMA3_ROPE, "bos_token_id": 0,
                          "eos_token_id": [2, 0]}, eos_ids=(2, 0)),
    "qwen2": FamilyCase("qwen2", "qwen2", "qwen2", {"rope_theta": 1000000.0, "eos_token_id": 2}),
    "qwen3": FamilyCase("qwen3", "qwen3", "qwen3", {"head_dim": 32, "eos_token_id": 2}),
    "phi3": FamilyCase("phi3", "phi3", "phi3",
                       {"partial_rotary_factor": 0.75, "original_max_position_embeddings": 128,
                        "rope_scaling": PHI3_ROPE, "bos_token_id": 0, "eos_token_id": 2, "pad_token_id": 1}),
    # a window of 6 (the prompt is 18 tokens) and soft-caps that bite at these sizes
    "gemma2": FamilyCase("gemma2", "gemma2", "gemma2",
                         {"head_dim": 32, "query_pre_attn_scalar": 32, "sliding_window": 6,
                          "attn_logit_softcapping": 2.0, "final_logit_softcapping": 6.0,
                          "tie_word_embeddings": True, "bos_token_id": 0, "eos_token_id": 2, "pad_token_id": 1}),
    # 3 layers, two sliding (window 6) and one global; the global RoPE scaled as Gemma 3 4B's, the local one not
    "gemma3": FamilyCase("gemma3", "gemma3_text", "gemma3",
                         {"num_hidden_layers": 3, "sliding_window_pattern": 3, "head_dim": 32,
                          "query_pre_attn_scalar": 32, "sliding_window": 6, "rope_parameters": GEMMA3_ROPE,
                          "tie_word_embeddings": True, "bos_token_id": 0, "eos_token_id": [2, 3],
                          "pad_token_id": 1}, eos_ids=(2, 3)),
}


def build_transformers_model(case: FamilyCase, seed: int = 0) -> Any:
    """The tiny transformers model of ``case`` (float32, eval mode), weights re-randomised (module doc)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    sizes = {"vocab_size": VOCAB, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "intermediate_size": 128, "max_position_embeddings": 512,
             "rms_norm_eps": 1e-5, "tie_word_embeddings": False}
    cfg = AutoConfig.for_model(case.model_type, **{**sizes, **copy.deepcopy(case.overrides)})
    return _rerandomised(AutoModelForCausalLM.from_config(cfg).eval(), case.model_type in PLUS_ONE_NORMS, seed)


def _rerandomised(model: Any, plus_one: bool, seed: int) -> Any:
    """``model`` with every parameter drawn anew (module doc): norms around 1 (``plus_one``: around 0), biases
    around 0, embeddings (scaled down for Gemma's embedding scale) and projections at logit scale ~2."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=generator)
            if "norm" in name:
                p.copy_((0 if plus_one else 1) + 0.3 * noise)
            elif name.endswith("bias"):
                p.copy_(0.5 * noise)
            elif "embed_tokens" in name:
                p.copy_(noise / (4 if plus_one else 1))  # tied: the output head too
            else:
                p.copy_(noise / math.sqrt(p.shape[-1]) * (2.0 if "lm_head" in name else 1.0))
    return model


def build_gemma3_multimodal(seed: int = 0) -> Any:
    """A tiny random ``Gemma3ForConditionalGeneration``: the text model of the ``gemma3`` case beside a SigLIP
    vision tower of one layer (28-pixel images, 14-pixel patches, 4 tokens per image), re-randomised as above."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3TextConfig, SiglipVisionConfig

    sizes = {"vocab_size": VOCAB, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
             "intermediate_size": 128, "max_position_embeddings": 512, "rms_norm_eps": 1e-5}
    text = Gemma3TextConfig(**{**sizes, **copy.deepcopy(CASES["gemma3"].overrides)})
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                image_size=28, patch_size=14)
    cfg = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4, eos_token_id=[2, 3],
                       boi_token_index=270, eoi_token_index=271, image_token_index=272)
    return _rerandomised(Gemma3ForConditionalGeneration(cfg).eval(), True, seed)


def reference_logits(model: Any, ids: list[int]) -> np.ndarray:
    """transformers' float32 logits ``[len(ids), vocab]`` after each token."""
    import torch

    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


def write_hf_folder(model: Any, case: FamilyCase, directory: Path) -> Path:
    """``save_pretrained`` (safetensors) plus the tiny tokenizer and a generation config naming the EOS ids."""
    model.save_pretrained(directory, safe_serialization=True)
    tiny = make_tiny_model()
    (directory / "tokenizer.json").write_text(build_tokenizer(tiny).to_str())
    (directory / "tokenizer_config.json").write_text(json.dumps({"chat_template": tiny.config.chat_template}))
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": list(case.eos_ids)}))
    return directory


def _llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's converter's q/k permutation: half-rotation rows -> adjacent pairs."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _llama3_rope_freqs(theta: float, dim: int, rope: dict[str, Any]) -> np.ndarray:
    """The ``rope_freqs`` tensor llama.cpp's converter writes for a ``llama3`` rope scaling."""
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    out = []
    for freq in 1.0 / theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim):
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, np.float32)


def _write_vocab(writer: Any, vocab: dict[str, Any]) -> None:
    """A real vocabulary's ``tokenizer.*`` metadata (a SentencePiece one: model, pre, tokens, scores, types, the
    special ids and flags, the chat template) as gguf-py writes them."""
    writer.add_tokenizer_model(vocab["tokenizer.ggml.model"])
    writer.add_tokenizer_pre(vocab["tokenizer.ggml.pre"])
    writer.add_token_list(vocab["tokenizer.ggml.tokens"])
    writer.add_token_scores(vocab["tokenizer.ggml.scores"])
    writer.add_token_types(vocab["tokenizer.ggml.token_type"])
    for key, value in vocab.items():
        if key.endswith("_token_id"):
            writer.add_uint32(key, value)
        elif isinstance(value, bool):
            writer.add_bool(key, value)
    if "tokenizer.chat_template" in vocab:
        writer.add_chat_template(vocab["tokenizer.chat_template"])


_LAYER = {"self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up",  # phi3's fused tensors
          "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
          "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
          "self_attn.k_norm": "attn_k_norm", "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate",
          "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


#: Gemma's four norms (llama.cpp's names).
_SANDWICH = {"input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
             "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm"}


def write_gguf(model: Any, case: FamilyCase, path: Path, *, extra_keys: dict[str, int] | None = None,
               q8_0: bool = False, without_window: bool = False, vocab: dict[str, Any] | None = None) -> Path:
    """The same weights as a GGUF (F32 tensors; with ``q8_0`` the matrices quantised to Q8_0 by gguf-py) as
    llama.cpp's converter lays them out (module doc); ``without_window``: no ``attention.sliding_window`` key;
    ``vocab``: the ``tokenizer.*`` metadata of a real vocabulary (``material.vocab_metadata``) instead of the tiny
    one (its EOS id too)."""
    import gguf

    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    tiny = make_tiny_model()
    arch = case.gguf_arch
    Q8_0 = gguf.GGMLQuantizationType.Q8_0
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(f"tiny-{case.name}")
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    rope = dict(cfg.rope_parameters.get("full_attention", cfg.rope_parameters))  # Gemma 3: the global layers'
    theta = float(rope["rope_theta"])
    if arch not in ("gemma2",):  # Gemma 2's converter writes no base (llama.cpp's default 10000)
        writer.add_rope_freq_base(theta)
    if arch == "gemma3":  # the local base, the global scaling, the window and (llama.cpp reads it) the pattern
        writer.add_rope_freq_base_swa(float(cfg.rope_parameters["sliding_attention"]["rope_theta"]))
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_sliding_window(cfg.sliding_window)
        writer.add_sliding_window_pattern(3)
    rope_dim = int(head_dim * rope.get("partial_rotary_factor", 1.0))
    if rope_dim != head_dim:
        writer.add_rope_dimension_count(rope_dim)
    if rope.get("rope_type") == "longrope":
        original = cfg.rope_parameters["original_max_position_embeddings"]
        scale = cfg.max_position_embeddings / original
        writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)))
        writer.add_rope_scaling_orig_ctx_len(original)
    if arch == "phi3":  # the converter writes 0 for a model without a window (Phi-4-mini)
        writer.add_sliding_window(getattr(cfg, "sliding_window", None) or 0)
    if arch in ("gemma2",):
        writer.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        writer.add_final_logit_softcapping(cfg.final_logit_softcapping)
        if not without_window:
            writer.add_sliding_window(cfg.sliding_window)
    if head_dim != cfg.hidden_size // cfg.num_attention_heads or arch in ("gemma2", "gemma3"):
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if vocab is not None:
        _write_vocab(writer, vocab)
    else:
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("gpt-2")  # llama.cpp's name (it refuses "gpt2")
        writer.add_token_list(tiny.tokens)
        writer.add_token_types([1 if t == 6 else t for t in tiny.token_types])
        writer.add_token_merges(tiny.merges)
        writer.add_bos_token_id(0)
        for add, token in zip((writer.add_eos_token_id, writer.add_eot_token_id, writer.add_eom_token_id),
                              case.eos_ids, strict=False):
            add(token)
        writer.add_chat_template(tiny.config.chat_template)
    for key, value in (extra_keys or {}).items():
        writer.add_uint32(key, value)

    state = {k: v.detach().numpy().astype(np.float32) for k, v in model.state_dict().items()}
    writer.add_tensor("token_embd.weight", state["model.embed_tokens.weight"])
    if cfg.rope_parameters.get("rope_type") == "llama3":
        writer.add_tensor("rope_freqs.weight", _llama3_rope_freqs(theta, head_dim, dict(cfg.rope_parameters)))
    if cfg.rope_parameters.get("rope_type") == "longrope":
        for kind in ("long", "short"):
            writer.add_tensor(f"rope_factors_{kind}.weight",
                              np.asarray(cfg.rope_parameters[f"{kind}_factor"], np.float32))
    plus_one = case.model_type in PLUS_ONE_NORMS  # the converter adds 1 to every norm weight
    layer_names = {**_LAYER, **_SANDWICH} if plus_one else _LAYER
    for i in range(cfg.num_hidden_layers):
        for hf, ggml in layer_names.items():
            for kind in ("weight", "bias"):
                name = f"model.layers.{i}.{hf}.{kind}"
                if name not in state:
                    continue
                array = state[name] + (1 if plus_one and "norm" in hf else 0)
                if arch == "llama" and ggml in ("attn_q", "attn_k"):
                    heads = cfg.num_attention_heads if ggml == "attn_q" else cfg.num_key_value_heads
                    array = _llama_cpp_permute(array, heads)
                if q8_0 and array.ndim == 2:
                    writer.add_tensor(f"blk.{i}.{ggml}.{kind}", gguf.quants.quantize(array, Q8_0), raw_dtype=Q8_0)
                else:
                    writer.add_tensor(f"blk.{i}.{ggml}.{kind}", np.ascontiguousarray(array))
    writer.add_tensor("output_norm.weight", state["model.norm.weight"] + (1 if plus_one else 0))
    if not cfg.tie_word_embeddings:
        writer.add_tensor("output.weight", state["lm_head.weight"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
