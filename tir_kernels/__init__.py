"""TIR kernels of logitproc: one module per kernel, each with a factory ``get_<name>(target) -> PrimFunc``.

``KERNEL_FACTORIES`` lists them in pipeline order; ``reference`` holds the numpy definition of each.
"""

from __future__ import annotations

from collections.abc import Callable

import tvm
from tvm import tirx

from . import (
    argmax,
    bitmask,
    log_softmax,
    logit_bias,
    multinomial,
    penalty,
    renormalize,
    sample_from_logits,
    softmax,
    top_n,
)

KernelFactory = Callable[[tvm.target.Target], tirx.PrimFunc]

KERNEL_FACTORIES: dict[str, KernelFactory] = {
    logit_bias.NAME: logit_bias.get_apply_logit_bias_inplace,
    penalty.NAME: penalty.get_apply_penalty_inplace,
    bitmask.NAME: bitmask.get_apply_bitmask_inplace,
    softmax.NAME: softmax.get_softmax_with_temperature,
    renormalize.NAME: renormalize.get_renormalize_probs,
    multinomial.NAME: multinomial.get_multinomial_from_uniform,
    argmax.NAME: argmax.get_argmax,
    top_n.NAME: top_n.get_top_n,
    log_softmax.NAME: log_softmax.get_log_softmax_gather,
    sample_from_logits.NAME: sample_from_logits.get_sample_from_logits,
}

__all__ = ["KERNEL_FACTORIES", "KernelFactory"]
