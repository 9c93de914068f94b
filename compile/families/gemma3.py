"""Gemma 3 (``Gemma3ForCausalLM``: the 270M and 1B checkpoints; the text model of
``Gemma3ForConditionalGeneration``: 4B-27B): Gemma 2's block (GeGLU, ``(1 + w)`` sandwich norms, the scaled
embedding, ``query_pre_attn_scalar``) with QK-norm (``(1 + w)`` too) instead of soft-caps, five sliding-window layers
to one global, and a RoPE of their own for the sliding layers (``rope_local_base_freq``, 10000, unscaled) while the
global ones take ``rope_theta`` (1e6) and its scaling. llama.cpp's ``gemma3`` GGUFs keep Hugging Face's q/k order,
store the norms plus 1, the global RoPE as ``rope.freq_base`` / ``rope.scaling.*`` and the local base as
``rope.freq_base_swa`` (absent: llama.cpp's 10000); 62 layers (27B) scale q by ``(hidden / heads) ** -0.5``. The
multimodal checkpoints' ``text_config`` leaves most keys to ``Gemma3TextConfig``'s defaults (below); their language
model's tensors sit under ``language_model.model.`` (as ``save_pretrained`` writes them) or ``model.language_model.``
(the modules' names since transformers 4.52, as a state dict saved as is has them); the vision tower's and
projector's are skipped."""

from ..model_family import Activation, ModelFamily, MultimodalCheckpoint, NormPlacement

#: transformers' ``Gemma3TextConfig`` defaults (4.50 to 5.x) of the keys read here
GEMMA3_TEXT_DEFAULTS: dict[str, object] = {
    "vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "max_position_embeddings": 131_072,
    "rms_norm_eps": 1e-6, "bos_token_id": 2, "eos_token_id": 1, "tie_word_embeddings": True,
    "query_pre_attn_scalar": 256, "sliding_window": 4096, "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0,
}

GEMMA3 = ModelFamily(
    name="gemma3",
    models="Gemma 3 text (270M, 1B; 4B-27B: their text model)",
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
    hf_defaults=GEMMA3_TEXT_DEFAULTS,
    hf_multimodal=MultimodalCheckpoint(
        architecture="Gemma3ForConditionalGeneration",
        text_model_type="gemma3_text",
        image_keys=frozenset({"vision_config", "mm_tokens_per_image", "boi_token_index", "eoi_token_index",
                              "image_token_index", "image_token_id", "boi_token_id", "eoi_token_id"}),
        text_prefixes={"model.language_model.": "model.", "lm_head.": "lm_head.",
                       "language_model.model.": "model.", "language_model.lm_head.": "lm_head."},
        image_prefixes=("model.vision_tower.", "model.multi_modal_projector.", "vision_tower.",
                        "multi_modal_projector."),
    ),
)
