"""The per-call attention mode that the model packs into the ``sm_scale`` TVM's KV cache hands its kernels.

TVM's paged KV cache passes a kernel nothing per layer and per forward but ``sm_scale``; two switches travel in it,
both exact in floating point (a sign and a power-of-two factor, so the scale itself comes back bit for bit):

- the sign: negative in a sliding-window layer (Gemma 2/3: ``decode_attention.py``'s ``window``);
- the magnitude: the scale times ``EXACT_FACTOR`` in the exact (verify) mode of the paged prefill kernel
  (``prefill_attention.paged_prefill_kernel``), the scale itself otherwise. A real scale lies in
  ``[MIN_SCALE, MAX_SCALE)``, so a magnitude of at least ``MAX_SCALE`` can only be an exact-mode one.
"""

from __future__ import annotations

from typing import Any

#: The factor of the exact mode (a power of two: multiplying and dividing by it loses no bit).
EXACT_FACTOR = 2.0**16
#: The scales the encoding carries: ``[MIN_SCALE, MAX_SCALE)`` (head sizes up to 2^20 with ``1 / sqrt(d)``).
MAX_SCALE = 2.0**6
MIN_SCALE = MAX_SCALE / EXACT_FACTOR


def encode(scale: float, windowed: bool = False, exact: bool = False) -> float:
    """The ``sm_scale`` a layer passes to the cache: ``scale`` with its window and exact-mode switches."""
    if not MIN_SCALE <= scale < MAX_SCALE:
        raise ValueError(f"attention scale {scale} is outside [{MIN_SCALE}, {MAX_SCALE}) (attention_mode.py)")
    value = scale * EXACT_FACTOR if exact else scale
    return -value if windowed else value


def windowed(sm_scale: Any) -> Any:
    """TIR: whether the layer is a sliding-window one."""
    from tvm.script import tirx as T  # here: the encoding is used without importing TVM

    return sm_scale < T.float32(0)


def exact(sm_scale: Any) -> Any:
    """TIR: whether the exact (verify) mode is asked for."""
    from tvm.script import tirx as T

    return T.fabs(sm_scale) >= T.float32(MAX_SCALE)


def scale(sm_scale: Any) -> Any:
    """TIR: the scale itself (float32)."""
    from tvm.script import tirx as T

    return T.Select(exact(sm_scale), T.fabs(sm_scale) * T.float32(1.0 / EXACT_FACTOR), T.fabs(sm_scale))
