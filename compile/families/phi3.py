"""Phi-3 / Phi-3.5-mini / Phi-4-mini: the Llama decoder with q/k/v and gate/up stored fused (split on reading),
LongRoPE (``rope.py``) and, in Phi-4-mini, partial rotary; llama.cpp's ``phi3`` GGUFs keep Hugging Face's q/k order,
store the gate and up rows together in ``ffn_up`` and the LongRoPE factors as ``rope_factors_short/long``. A
``sliding_window`` (Phi-3-mini-4k's 2047; the GGUF's 0: none) is every layer's."""

from ..model_family import GATE_UP_SPLIT, QKV_SPLIT, ModelFamily

PHI3 = ModelFamily(
    name="phi3",
    models="Phi-3-mini, Phi-3.5-mini, Phi-4-mini",
    hf_architectures=("Phi3ForCausalLM",),
    gguf_architectures=("phi3",),
    # dropout rates (inference ignores them) and the original context LongRoPE reads
    hf_keys=frozenset({"embd_pdrop", "resid_pdrop", "original_max_position_embeddings"}),
    # Phi-4-mini's config carries its original code's switches, at their neutral values
    hf_fixed_keys={"attention_bias": (False,), "mlp_bias": (False,), "lm_head_bias": (False,),
                   "full_attn_mod": (1,), "interpolate_factor": (1,)},
    gguf_keys=frozenset({"attention.sliding_window", "rope.scaling.attn_factor"}),
    hf_fused={"self_attn.qkv_proj.weight": QKV_SPLIT, "mlp.gate_up_proj.weight": GATE_UP_SPLIT},
    gguf_fused={"attn_qkv.weight": QKV_SPLIT, "ffn_up.weight": GATE_UP_SPLIT},
    gguf_rope_tensors=("rope_factors_short.weight", "rope_factors_long.weight"),
    hf_window_architectures=("Phi3ForCausalLM",),
    gguf_window_all_layers=True,
)
