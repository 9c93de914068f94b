"""Qwen3 (dense): the Llama decoder with an RMS norm over each head of q and k before RoPE (QK-norm) and a head size
of its own (``head_dim``, not ``hidden / heads``)."""

from ..model_family import ModelFamily

QWEN3 = ModelFamily(
    name="qwen3",
    models="Qwen3 (dense)",
    hf_architectures=("Qwen3ForCausalLM",),
    gguf_architectures=("qwen3",),
    qk_norm=True,
    hf_fixed_keys={"attention_bias": (False,), "use_sliding_window": (False,)},
)
