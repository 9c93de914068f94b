"""Gemma 2: GeGLU (gelu's tanh approximation), ``(1 + w)`` RMS norms before and after attention and the MLP, the
embedding scaled by ``sqrt(hidden)``, q scaled by ``query_pre_attn_scalar ** -0.5``, attention and final logit
soft-capping, sliding-window layers alternating with global ones (even layers slide), tied embeddings. llama.cpp's
``gemma2`` GGUFs keep Hugging Face's q/k order and store every norm weight plus 1 (the canonical form here); they
do not store ``query_pre_attn_scalar``: llama.cpp takes ``hidden / heads`` for the 46-layer 27B, ``head_dim``
otherwise."""

from ..model_family import Activation, ModelFamily, NormPlacement

GEMMA2 = ModelFamily(
    name="gemma2",
    models="Gemma 2",
    hf_architectures=("Gemma2ForCausalLM",),
    gguf_architectures=("gemma2",),
    activation=Activation.GELU_TANH,
    norm_placement=NormPlacement.SANDWICH,
    hf_keys=frozenset({"query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping",
                       "hidden_activation", "cache_implementation"}),
    hf_fixed_keys={"attention_bias": (False,), "use_bidirectional_attention": (None, False)},
    gguf_keys=frozenset({"attention.sliding_window", "attention.sliding_window_pattern", "attn_logit_softcapping",
                         "final_logit_softcapping"}),
    gguf_required_keys=frozenset({"attention.sliding_window", "attn_logit_softcapping", "final_logit_softcapping"}),
    hf_norm_offset=1.0,
    embed_scaled=True,
    window_pattern=2,
    gguf_wide_scale_layers=(46,),
)
