"""Qwen2 / Qwen2.5: the Llama decoder with biases on the q, k and v projections (llama.cpp's ``qwen2`` GGUFs keep
Hugging Face's q/k row order)."""

from ..model_family import ModelFamily

QWEN2 = ModelFamily(
    name="qwen2",
    models="Qwen2, Qwen2.5",
    hf_architectures=("Qwen2ForCausalLM",),
    gguf_architectures=("qwen2",),
    qkv_bias=True,
    hf_fixed_keys={"use_sliding_window": (False,)},
)
