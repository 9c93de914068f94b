"""The declarative description of a decoder family (``ModelFamily``) that every loader, the numpy reference and the
Relax builder read instead of special cases.

A family is what differs between the decoders this project runs: the optional q/k/v biases, the per-head RMS norm
of q and k (QK-norm), whether llama.cpp stores q/k rows permuted for adjacent-pair RoPE, the MLP's activation (SiLU
or gelu-tanh), where the norms sit (before, or before and after: Gemma), ``(1 + w)`` norms stored as ``w`` by
Hugging Face, the scaled embedding, per-layer sliding windows and a local RoPE (Gemma 2/3), the tensor names in
Hugging Face checkpoints, the ``config.json`` / GGUF keys the family understands (with transformers' defaults for
the keys a checkpoint leaves out), and a multimodal checkpoint class whose text model is read (Gemma 3). Numbers
(attention scale, soft-caps, windows) are the config's (``LlamaConfig``). Everything else is shared
(``docs/model.md``): RMSNorm blocks, a gated MLP, RoPE rotating the two halves of each head, grouped-query attention,
an optional separate output head. A family is one small file in ``compile/families/`` naming a ``ModelFamily``;
``compile/families/__init__.py`` lists them.

Canonical weights: every loader gives tensors by llama.cpp's GGUF names (``token_embd.weight``,
``blk.{i}.attn_q.weight``, ...), ``[out, in]``, with q/k rows in Hugging Face's half-rotation order (a ``llama``
GGUF's adjacent-pair rows are un-permuted when read) and Gemma's norm weights as ``w + 1``, as llama.cpp stores them.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class Activation(enum.Enum):
    """The MLP's gate activation: ``SILU`` (SwiGLU) or ``GELU_TANH`` (GeGLU, gelu's tanh approximation)."""

    SILU = "silu"
    GELU_TANH = "gelu_pytorch_tanh"


class NormPlacement(enum.Enum):
    """Where the RMS norms sit in a block: ``PRE`` = before attention and before the MLP (Llama); ``SANDWICH`` =
    also after each, on its output before the residual add (Gemma 2/3: ``post_attention_norm``, ``post_ffw_norm``)."""

    PRE = "pre"
    SANDWICH = "sandwich"


#: Per-layer tensors every family has: GGUF suffix -> Hugging Face suffix (under ``model.layers.{i}.``).
BASE_LAYER_TENSORS: dict[str, str] = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
QKV_BIAS_TENSORS: dict[str, str] = {
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
}
QK_NORM_TENSORS: dict[str, str] = {
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
}
#: The norms after attention and after the MLP of a ``SANDWICH`` block, and Gemma's names for all four norms.
SANDWICH_TENSORS: dict[str, str] = {
    "attn_norm.weight": "input_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
#: Model-level tensors: GGUF name -> Hugging Face name (``output.weight`` only without tied embeddings).
TOP_TENSORS: dict[str, str] = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}

#: ``config.json`` keys every family reads (``hf_config.config_from_hf``).
HF_COMMON_KEYS = frozenset({
    "architectures", "model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
    "intermediate_size", "vocab_size", "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings",
    "bos_token_id", "eos_token_id", "head_dim", "hidden_act", "rope_theta", "rope_scaling", "rope_parameters",
    "partial_rotary_factor", "_name_or_path",
})
#: ``config.json`` keys that never change the maths of inference (bookkeeping, training-only settings).
HF_INERT_KEYS = frozenset({
    "torch_dtype", "dtype", "transformers_version", "use_cache", "initializer_range", "attention_dropout",
    "pad_token_id", "pretraining_tp", "output_attentions", "output_hidden_states", "return_dict", "is_decoder",
    "tokenizer_class", "unsloth_version", "auto_map",
})
#: The canonical tensors a fused one splits into, by rows in this order (``ModelFamily.hf_fused`` / ``gguf_fused``).
QKV_SPLIT = ("attn_q.weight", "attn_k.weight", "attn_v.weight")
GATE_UP_SPLIT = ("ffn_gate.weight", "ffn_up.weight")

#: GGUF keys (``{arch}.`` prefix) every family reads (``gguf_config.config_from_gguf``).
GGUF_COMMON_KEYS = frozenset({
    "context_length", "embedding_length", "block_count", "feed_forward_length", "attention.head_count",
    "attention.head_count_kv", "attention.layer_norm_rms_epsilon", "rope.freq_base", "rope.dimension_count",
    "vocab_size", "attention.key_length", "attention.value_length", "rope.scaling.type", "rope.scaling.factor",
    "rope.scaling.original_context_length",
})


@dataclass(frozen=True)
class MultimodalCheckpoint:
    """A Hugging Face class holding a family's text model beside an image encoder (Gemma 3 4B-27B's
    ``Gemma3ForConditionalGeneration``), of which only the text model is read (``compile/hf_multimodal.py``): its
    ``config.json`` nests the text model's config under ``text_config``; its tensors name the text model under a
    prefix that moved between transformers versions, and the image side's under prefixes of their own (skipped)."""

    #: ``architectures[0]`` of such a checkpoint
    architecture: str
    #: the ``model_type`` of its ``text_config`` (absent: taken as this)
    text_model_type: str
    #: top-level ``config.json`` keys of the image side (its encoder's config, the image token ids), read past
    image_keys: frozenset[str]
    #: a prefix of the text model's tensors -> the text-only checkpoint's prefix (one pair per transformers layout)
    text_prefixes: dict[str, str]
    #: prefixes of the image side's tensors (the encoder, the projector into the text model), skipped
    image_prefixes: tuple[str, ...]


@dataclass(frozen=True)
class ModelFamily:
    """One decoder family (see the module doc). Frozen: shared by every model of the family."""

    #: the family's name (``logitproc models``, the manifest's ``config.architecture``)
    name: str
    #: what a user knows it by, for the support table (``"Llama 2/3.x, Mistral, SmolLM2"``)
    models: str
    #: Hugging Face ``architectures[0]`` values read as this family
    hf_architectures: tuple[str, ...]
    #: GGUF ``general.architecture`` values read as this family
    gguf_architectures: tuple[str, ...]
    #: q, k and v projections have biases (Qwen2)
    qkv_bias: bool = False
    #: an RMS norm over each head of q and of k before RoPE, weights ``[head_dim]`` shared by the heads (Qwen3)
    qk_norm: bool = False
    #: llama.cpp stores the q/k rows permuted for adjacent-pair RoPE (``llama``); other families store HF's order
    gguf_qk_permuted: bool = False
    activation: Activation = Activation.SILU
    norm_placement: NormPlacement = NormPlacement.PRE
    #: ``config.json`` keys this family reads besides ``HF_COMMON_KEYS``, with the values they must have (a key
    #: whose value is not listed is refused): e.g. ``{"attention_bias": (False,)}``
    hf_fixed_keys: dict[str, tuple[object, ...]] = field(default_factory=dict)
    #: ``config.json`` keys this family reads besides ``HF_COMMON_KEYS`` whatever their value (``hf_config``)
    hf_keys: frozenset[str] = frozenset()
    #: GGUF keys (after ``{arch}.``) this family reads besides ``GGUF_COMMON_KEYS``
    gguf_keys: frozenset[str] = frozenset()
    #: Hugging Face layer tensors that hold several canonical ones (rows in order): suffix -> canonical suffixes
    hf_fused: dict[str, tuple[str, ...]] = field(default_factory=dict)
    #: GGUF layer tensors that hold several canonical ones (rows in order): file suffix -> canonical suffixes
    gguf_fused: dict[str, tuple[str, ...]] = field(default_factory=dict)
    #: model-level GGUF tensors read into the config (RoPE factors), not weights
    gguf_rope_tensors: tuple[str, ...] = ("rope_freqs.weight",)
    #: added to every RMS norm weight read from a Hugging Face checkpoint: Gemma's norms multiply by ``1 + w`` and
    #: store ``w``; llama.cpp's converter stores ``w + 1`` in the GGUF, which is the canonical form (plain RMSNorm)
    hf_norm_offset: float = 0.0
    #: the token embeddings are multiplied by ``sqrt(hidden)`` before the first layer (Gemma)
    embed_scaled: bool = False
    #: Hugging Face architectures whose ``sliding_window`` applies to every layer (transformers' Mistral and Phi-3;
    #: its Llama ignores the key, so there a window caps the served context instead: exact under either reading)
    hf_window_architectures: tuple[str, ...] = ()
    #: the GGUF's ``attention.sliding_window`` applies to every layer (Phi-3's converter writes it)
    gguf_window_all_layers: bool = False
    #: layers have sliding windows of their own, by pattern (Gemma 2/3): by ``layer_types`` (Hugging Face) or the GGUF's
    #: ``attention.sliding_window_pattern``, else this default: in each run of ``window_pattern`` layers all but
    #: the last slide (transformers' and llama.cpp's rule); 0: no per-layer windows
    window_pattern: int = 0
    #: the sliding-window layers rotate by a RoPE of their own: an unscaled base (Gemma 3's ``rope_local_base_freq``;
    #: transformers 5: ``rope_parameters["sliding_attention"]``), the global layers by the model's RoPE
    local_rope: bool = False
    #: GGUF keys (after ``{arch}.``) a file of this family must have (where llama.cpp would fall back to a default)
    gguf_required_keys: frozenset[str] = frozenset()
    #: GGUF block counts whose q is scaled by ``(hidden / heads) ** -0.5`` rather than ``head_dim ** -0.5``
    #: (llama.cpp's rule for Gemma's 27B models, whose GGUFs do not store ``query_pre_attn_scalar``)
    gguf_wide_scale_layers: tuple[int, ...] = ()
    #: transformers' config-class defaults of the ``config.json`` keys a checkpoint may leave out (Gemma 3's
    #: ``Gemma3TextConfig``: the multimodal checkpoints' ``text_config`` names only a few keys); without them the
    #: common readers' defaults (``hf_config``) apply; ``rope_theta`` / ``rope_local_base_freq`` only where the
    #: config spells no ``rope_parameters``
    hf_defaults: dict[str, object] = field(default_factory=dict)
    #: the checkpoint class holding this family's text model beside an image encoder (read: its text model only)
    hf_multimodal: MultimodalCheckpoint | None = None

    @property
    def hf_classes(self) -> tuple[str, ...]:
        """Every Hugging Face ``architectures[0]`` read as this family (the multimodal class's text model too)."""
        return self.hf_architectures + ((self.hf_multimodal.architecture,) if self.hf_multimodal else ())

    def window_layers(self, n_layers: int, pattern: int | None = None) -> tuple[int, ...]:
        """The sliding-window layers of ``n_layers`` under ``pattern`` (default: the family's ``window_pattern``):
        in each run of ``pattern`` layers all but the last (``pattern`` 1: none)."""
        pattern = self.window_pattern if pattern is None else pattern
        if pattern < 1:
            raise ValueError(f"a sliding-window pattern must be a positive layer count, got {pattern}")
        return tuple(i for i in range(n_layers) if (i + 1) % pattern)

    @property
    def layer_tensors(self) -> dict[str, str]:
        """Per-layer tensors: GGUF suffix -> Hugging Face suffix."""
        tensors = dict(BASE_LAYER_TENSORS)
        if self.norm_placement is NormPlacement.SANDWICH:
            tensors.update(SANDWICH_TENSORS)
        if self.qkv_bias:
            tensors.update(QKV_BIAS_TENSORS)
        if self.qk_norm:
            tensors.update(QK_NORM_TENSORS)
        return tensors

    def tensor_names(self, n_layers: int, tied_embeddings: bool) -> list[str]:
        """Every tensor a model of this family has, by GGUF name."""
        names = [n for n in TOP_TENSORS if not (tied_embeddings and n == "output.weight")]
        return names + [f"blk.{i}.{suffix}" for i in range(n_layers) for suffix in self.layer_tensors]

    def hf_to_gguf_names(self, n_layers: int) -> dict[str, tuple[str, ...]]:
        """Hugging Face tensor name -> the canonical (GGUF) names it holds, for every tensor the family may have."""
        names = {hf: (gguf,) for gguf, hf in TOP_TENSORS.items()}
        fused_parts = {part for parts in self.hf_fused.values() for part in parts}
        layer = {hf: (gguf,) for gguf, hf in self.layer_tensors.items() if gguf not in fused_parts}
        layer.update(self.hf_fused)
        for i in range(n_layers):
            names.update({f"model.layers.{i}.{hf}": tuple(f"blk.{i}.{g}" for g in parts)
                          for hf, parts in layer.items()})
        return names

    def gguf_file_tensors(self, n_layers: int, tied_embeddings: bool) -> dict[str, tuple[str, ...]]:
        """Every weight tensor of this family's GGUF file -> the canonical names it holds."""
        names = {n: (n,) for n in TOP_TENSORS if not (tied_embeddings and n == "output.weight")}
        fused_parts = {part for parts in self.gguf_fused.values() for part in parts}
        layer = {g: (g,) for g in self.layer_tensors if g not in fused_parts}
        layer.update(self.gguf_fused)
        for i in range(n_layers):
            names.update({f"blk.{i}.{file}": tuple(f"blk.{i}.{p}" for p in parts) for file, parts in layer.items()})
        return names
