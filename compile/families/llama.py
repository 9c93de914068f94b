"""Llama (Llama 2, Llama 3.x, Mistral, SmolLM2): the base decoder, no biases, no QK-norm; llama.cpp's ``llama``
GGUFs store q/k rows permuted for adjacent-pair RoPE; ``MistralForCausalLM``'s ``sliding_window`` (Mistral v0.1) is
every layer's."""

from ..model_family import ModelFamily

LLAMA = ModelFamily(
    name="llama",
    models="Llama 2, Llama 3.x, Mistral 7B, SmolLM2",
    hf_architectures=("LlamaForCausalLM", "MistralForCausalLM"),
    gguf_architectures=("llama",),
    gguf_qk_permuted=True,
    hf_window_architectures=("MistralForCausalLM",),
    # LlamaConfig's biases on all four attention projections / the MLP: not this family's maths.
    hf_fixed_keys={"attention_bias": (False,), "mlp_bias": (False,)},
)
