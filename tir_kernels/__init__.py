"""TIR kernels of logitproc: one module per kernel, each with a factory ``get_<name>(target) -> PrimFunc``.

``KERNEL_FACTORIES`` lists them in pipeline order; ``reference`` holds the numpy definition of each.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import tvm
    from tvm import tirx

    KernelFactory = Callable[[tvm.target.Target], tirx.PrimFunc]
else:
    KernelFactory = Callable[[Any], Any]


def _kernel_factories() -> dict[str, KernelFactory]:
    """Name -> factory of every kernel, in pipeline order (importing the kernel modules needs TVM's compiler, so it
    happens on first use: ``reference`` and the runtime's ``kernel_abi`` do not need it)."""
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

    return {
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


def __getattr__(name: str) -> Any:
    if name == "KERNEL_FACTORIES":
        factories = _kernel_factories()
        globals()["KERNEL_FACTORIES"] = factories
        return factories
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["KERNEL_FACTORIES", "KernelFactory"]
