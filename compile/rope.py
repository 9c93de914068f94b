"""RoPE's frequencies, scaled or not, read from a Hugging Face config (``rope_parameters``, or ``rope_theta`` and
``rope_scaling``) or a GGUF (``rope.freq_base``, ``rope.scaling.*``, the ``rope_freqs`` tensor).

The model rotates the pair ``(x[i], x[i + d/2])`` of each head (``d`` = the rotary dimension) by the angle
``position * inv_freq[i]``, ``inv_freq[i] = theta ** (-2 i / d) / factors[i]``: ``factors`` is llama.cpp's
``rope_freqs`` tensor (one divisor per frequency; all ones without scaling). The scalings read:

* ``default``: no factors;
* ``linear`` (factor ``f``): every factor ``f`` (positions interpolated);
* ``llama3`` (``factor``, ``low_freq_factor``, ``high_freq_factor``, ``original_max_position_embeddings``, the
  formula of Llama 3.1's reference code): wavelengths ``2 pi / inv_freq`` shorter than ``original / high`` keep
  factor 1, longer than ``original / low`` get ``factor``, the band between ``1 / ((1 - s) / factor + s)`` with
  ``s = (original / wavelength - low) / (high - low)``.

Anything else (YaRN, LongRoPE, dynamic NTK, an unknown key in the scaling's dictionary) is refused, naming it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

#: Scaling types read, and the keys each takes besides ``rope_type``/``type`` and ``rope_theta``.
SCALING_KEYS: dict[str, frozenset[str]] = {
    "default": frozenset(),
    "linear": frozenset({"factor"}),
    "llama3": frozenset({"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}),
}


@dataclass(frozen=True)
class RopeScaling:
    """RoPE's base and per-frequency divisors (see the module doc); ``kind`` names the scaling they came from."""

    theta: float
    factors: tuple[float, ...] = ()
    kind: str = "default"

    def inverse_frequencies(self, rope_dim: int) -> np.ndarray:
        """``inv_freq[i] = theta ** (-2 i / rope_dim) / factors[i]`` for ``i < rope_dim / 2``, float64."""
        inv = self.theta ** (-np.arange(0, rope_dim, 2, dtype=np.float64) / rope_dim)
        if self.factors:
            if len(self.factors) != rope_dim // 2:
                raise ValueError(f"{len(self.factors)} RoPE frequency factors for rotary dimension {rope_dim} "
                                 f"(need {rope_dim // 2})")
            inv = inv / np.asarray(self.factors, dtype=np.float64)
        return inv


def llama3_factors(theta: float, rope_dim: int, factor: float, low_freq_factor: float, high_freq_factor: float,
                   original_max_position_embeddings: int) -> tuple[float, ...]:
    """The per-frequency divisors of Llama 3.1's RoPE scaling (the module doc's formula), as llama.cpp's converter
    writes them into the ``rope_freqs`` tensor."""
    if not high_freq_factor > low_freq_factor:
        raise ValueError(f"llama3 rope scaling: high_freq_factor {high_freq_factor} must exceed low_freq_factor "
                         f"{low_freq_factor}")
    low_wavelength = original_max_position_embeddings / low_freq_factor
    high_wavelength = original_max_position_embeddings / high_freq_factor
    out = []
    for inv in RopeScaling(theta).inverse_frequencies(rope_dim):
        wavelength = 2 * math.pi / inv
        if wavelength < high_wavelength:
            out.append(1.0)
        elif wavelength > low_wavelength:
            out.append(float(factor))
        else:
            smooth = (original_max_position_embeddings / wavelength - low_freq_factor) / (
                high_freq_factor - low_freq_factor)
            out.append(1.0 / ((1 - smooth) / factor + smooth))
    return tuple(out)


def _number(params: dict[str, Any], key: str, where: str) -> float:
    value = params.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{where}: {key} must be a number, got {value!r}")
    return float(value)


def rope_from_hf(cfg: dict[str, Any], rope_dim: int) -> RopeScaling:
    """RoPE of a ``config.json``: transformers 5's ``rope_parameters`` or transformers 4's ``rope_theta`` and
    ``rope_scaling`` (when both spellings are present they must agree). Refuses what ``SCALING_KEYS`` lacks."""
    params = cfg.get("rope_parameters")
    legacy = cfg.get("rope_scaling")
    if params is not None and not isinstance(params, dict):
        raise ValueError(f"config.json: rope_parameters must be an object, got {params!r}")
    if legacy is not None and not isinstance(legacy, dict):
        raise ValueError(f"config.json: rope_scaling must be an object or null, got {legacy!r}")
    if params is None:
        params = {"rope_theta": cfg.get("rope_theta", 10000.0), **(legacy or {})}
    else:
        if "rope_theta" in cfg and cfg["rope_theta"] != params.get("rope_theta"):
            raise ValueError(f"config.json: rope_theta {cfg['rope_theta']} disagrees with rope_parameters "
                             f"{params}")
        if legacy and any(params.get(k) != v for k, v in legacy.items() if k != "type"):
            raise ValueError(f"config.json: rope_scaling {legacy} disagrees with rope_parameters {params}")
    kind = params.get("rope_type", params.get("type", "default"))
    if "rope_type" in params and "type" in params and params["type"] != kind:
        raise ValueError(f"config.json: rope type {params['type']!r} and rope_type {kind!r} disagree")
    if kind not in SCALING_KEYS:
        raise ValueError(f"config.json: rope type {kind!r} is not supported (supported: {', '.join(SCALING_KEYS)})")
    unknown = sorted(set(params) - SCALING_KEYS[kind] - {"rope_type", "type", "rope_theta"})
    if unknown:
        raise ValueError(f"config.json: rope {kind} parameter(s) {unknown} are not supported (read: "
                         f"{sorted(SCALING_KEYS[kind]) or 'none'})")
    where = f"config.json rope {kind}"
    theta = _number(params, "rope_theta", where)
    if kind == "linear":
        return RopeScaling(theta, (_number(params, "factor", where),) * (rope_dim // 2), kind)
    if kind == "llama3":
        factors = llama3_factors(theta, rope_dim, *(_number(params, k, where) for k in (
            "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")))
        return RopeScaling(theta, factors, kind)
    return RopeScaling(theta)


def rope_from_gguf(meta: dict[str, Any], arch: str, rope_dim: int, rope_freqs: np.ndarray | None) -> RopeScaling:
    """RoPE of a GGUF: ``{arch}.rope.freq_base``, ``{arch}.rope.scaling.type`` (``none`` or ``linear`` with
    ``.factor``) and the ``rope_freqs`` tensor's divisors (Llama 3's scaling: the converter writes only the tensor)."""
    theta = float(meta.get(f"{arch}.rope.freq_base", 10000.0))
    kind = meta.get(f"{arch}.rope.scaling.type", "none")
    if kind not in ("none", "linear"):
        raise ValueError(f"GGUF: {arch}.rope.scaling.type {kind!r} is not supported (none, linear)")
    factors = np.ones(rope_dim // 2, np.float64)
    name = "default"
    if kind == "linear":
        factor = float(meta.get(f"{arch}.rope.scaling.factor", 1.0))
        factors *= factor
        name = "linear" if factor != 1.0 else name
    if rope_freqs is not None:
        if rope_freqs.shape != (rope_dim // 2,):
            raise ValueError(f"GGUF: rope_freqs has shape {rope_freqs.shape}, need ({rope_dim // 2},)")
        factors *= rope_freqs.astype(np.float64)
        name = "rope_freqs" if name == "default" else f"{name}+rope_freqs"
    if name == "default":
        return RopeScaling(theta)
    return RopeScaling(theta, tuple(float(f) for f in factors), name)
