"""The contract between the compiled kernels and the runtime that launches them, readable without TVM's compiler.

The kernel factories (``logitproc.tir_kernels``) build their PrimFuncs under these names and with these values; the
runtime (``LogitProcessor``, ``Sampler``, ``logprobs``, ``logits_io``) calls and reads them by the same names, so it
runs with TVM's runtime library alone (``TVM_USE_RUNTIME_LIB=1``), without importing a kernel definition.
"""

from __future__ import annotations

LOGIT_BIAS = "apply_logit_bias_inplace"
PENALTY = "apply_penalty_inplace"
BITMASK = "apply_bitmask_inplace"
SOFTMAX = "softmax_with_temperature"
RENORMALIZE = "renormalize_probs"
MULTINOMIAL = "multinomial_from_uniform"
ARGMAX = "argmax"
TOP_N = "top_n"
LOG_SOFTMAX = "log_softmax_gather"
SAMPLE_FROM_LOGITS = "sample_from_logits"

#: The token ``sample_from_logits`` writes for a row holding a NaN or +inf (``-1``: a row of only -inf).
NON_FINITE = -2

#: Declared alignment, in bytes, of the ``[batch, vocab]`` float32 arrays a caller may hand the runtime (logits, and
#: probabilities given to the sampler): float32's own, so that any C-contiguous numpy array or torch tensor is used in
#: place (numpy allocates at 16 bytes, a slice of rows may start at any multiple of 4). TVM's default (64) would let
#: LLVM assume more than such arrays give; the CPU nests load these rows at row offsets anyway (any multiple of 4), so
#: the machine code is the same instruction for instruction (objdump of the znver4 library with 64 and with 4).
CALLER_ARRAY_ALIGN = 4
