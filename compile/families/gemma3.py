"""Gemma 3 (text: ``Gemma3ForCausalLM``, the 270M and 1B checkpoints): Gemma 2's block (GeGLU, ``(1 + w)`` sandwich
norms, the scaled embedding, ``query_pre_attn_scalar``) with QK-norm (``(1 + w)`` too) instead of soft-caps, five
sliding-window layers to one global, and a RoPE of their own for the sliding layers (``rope_local_base_freq``, 10000,
unscaled) while the global ones take ``rope_theta`` (1e6) and its scaling. llama.cpp's ``gemma3`` GGUFs keep Hugging
Face's q/k order, store the norms plus 1, the global RoPE as ``rope.freq_base`` / ``rope.scaling.*`` and the local
base as ``rope.freq_base_swa`` (absent: llama.cpp's 10000); 62 layers (27B) scale q by ``(hidden / heads) ** -0.5``."""

from ..model_family import Activation, ModelFamily, NormPlacement

GEMMA3 = ModelFamily(
    name="gemma3",
    models="Gemma 3 text (1B; 4B-27B from GGUF)",
    hf_architectures=("Gemma3ForCausalLM",),
    gguf_architectures=("gemma3",),
    qk_norm=True,
    activation=Activation.GELU_TANH,
    norm_placement=NormPlacement.SANDWICH,
    hf_keys=frozenset({"query_pre_attn_scalar", "final_logit_softcapping", "hidden_activation",
                       "cache_implementation", "sliding_window_pattern", "_sliding_window_pattern",
                       "rope_local_base_freq"}),
    hf_fixed_keys={"attention_bias": (False,), "use_bidirectional_attention": (None, False),
                   "attn_logit_softcapping": (None,)},
    gguf_keys=frozenset({"attention.sliding_window", "attention.sliding_window_pattern", "final_logit_softcapping",
                         "rope.freq_base_swa"}),
    gguf_required_keys=frozenset({"attention.sliding_window"}),
    hf_norm_offset=1.0,
    embed_scaled=True,
    window_pattern=6,
    local_rope=True,
    gguf_wide_scale_layers=(62,),
)
