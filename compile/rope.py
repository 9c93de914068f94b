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
  ``s = (original / wavelength - low) / (high - low)``;
* ``longrope`` (Phi-3, ``short_factor``, ``long_factor``, ``original_max_position_embeddings``, optional ``factor``
  and ``attention_factor``): cos and sin are multiplied by ``attention_factor`` (by default
  ``sqrt(1 + ln(f) / ln(original))`` with ``f = factor`` or ``max_position_embeddings / original``; 1 if f <= 1)
  whichever factors apply; the factors are ``short_factor`` or ``long_factor``, chosen once for the served context
  (``for_context``, the compile's ``context`` option): ``short_factor`` for a context within ``original`` (the
  default context), ``long_factor`` for a longer one, up to ``max_position_embeddings`` (``longest_context``).
  That is llama.cpp's rule (``long_factor`` for every position whenever its configured context exceeds
  ``original``). transformers chooses per forward: ``long_factor`` once the sequence passes ``original`` (every
  position's angle recomputed: its ``generate`` recomputes the whole cache at the crossing), ``short_factor``
  below. So a sequence longer than ``original`` is rotated as transformers rotates it; one within ``original``
  under a long context is rotated by ``long_factor`` where transformers would take ``short_factor``.

Partial rotary (``partial_rotary_factor``, Phi-4-mini): only the first ``rope_dim`` of each head's ``head_dim``
values rotate (pairs ``(i, i + rope_dim/2)``); the rest pass through. Anything else (YaRN, dynamic NTK, an unknown
key in the scaling's dictionary) is refused, naming it.
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
    "longrope": frozenset({"short_factor", "long_factor", "original_max_position_embeddings", "factor",
                           "attention_factor"}),
}


@dataclass(frozen=True)
class RopeScaling:
    """RoPE's base and per-frequency divisors (see the module doc); ``kind`` names the scaling they came from."""

    theta: float
    factors: tuple[float, ...] = ()
    kind: str = "default"
    #: cos and sin are multiplied by it (LongRoPE's attention factor)
    attention_factor: float = 1.0
    #: the longest context these factors serve (LongRoPE's original context), or None: any
    max_context: int | None = None
    #: LongRoPE's ``long_factor`` (empty: none), served by a context beyond ``max_context`` up to
    #: ``longest_context`` (``for_context``)
    long_factors: tuple[float, ...] = ()
    longest_context: int | None = None

    def for_context(self, context: int) -> RopeScaling:
        """The scaling that serves ``context`` tokens: itself within ``max_context``; beyond it (up to
        ``longest_context``), LongRoPE's long factors. ValueError naming the limit otherwise."""
        if self.max_context is None or context <= self.max_context:
            return self
        if not self.long_factors or self.longest_context is None or context > self.longest_context:
            limit = self.longest_context if self.long_factors else self.max_context
            raise ValueError(f"a context of {context} tokens is beyond what the {self.kind} RoPE scaling serves "
                             f"({limit}{'' if self.long_factors else ': no long_factor'})")
        return RopeScaling(self.theta, self.long_factors, self.kind, self.attention_factor, self.longest_context)

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


def rotary_dim_from_hf(cfg: dict[str, Any], head_dim: int) -> int:
    """The rotated part of each head: ``head_dim * partial_rotary_factor`` (top level or in ``rope_parameters``)."""
    params = cfg.get("rope_parameters") if isinstance(cfg.get("rope_parameters"), dict) else {}
    factor = cfg.get("partial_rotary_factor", params.get("partial_rotary_factor", 1.0))
    if "partial_rotary_factor" in cfg and params.get("partial_rotary_factor", factor) != factor:
        raise ValueError(f"config.json: partial_rotary_factor {factor} disagrees with rope_parameters {params}")
    if isinstance(factor, bool) or not isinstance(factor, int | float) or not 0 < factor <= 1:
        raise ValueError(f"config.json: partial_rotary_factor must lie in (0, 1], got {factor!r}")
    rope_dim = int(head_dim * factor)
    if rope_dim % 2 or rope_dim == 0:
        raise ValueError(f"config.json: partial_rotary_factor {factor} of head_dim {head_dim} gives {rope_dim} "
                         f"rotated values (need an even, positive count)")
    return rope_dim


def rope_from_hf(cfg: dict[str, Any], rope_dim: int) -> RopeScaling:
    """RoPE of a ``config.json`` (``rope_dim``: ``rotary_dim_from_hf``): transformers 5's ``rope_parameters`` or
    transformers 4's ``rope_theta`` and ``rope_scaling`` (when both spellings are present they must agree).
    Refuses what ``SCALING_KEYS`` lacks."""
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
    top = cfg.get("original_max_position_embeddings")
    if kind == "longrope" and top is not None:  # Phi-3 keeps it at the top level too; transformers takes that one
        if params.get("original_max_position_embeddings", top) != top:
            raise ValueError(f"config.json: original_max_position_embeddings {top} disagrees with the rope "
                             f"parameters' {params['original_max_position_embeddings']}")
        params = {**params, "original_max_position_embeddings": top}
    unknown = sorted(set(params) - SCALING_KEYS[kind] - {"rope_type", "type", "rope_theta", "partial_rotary_factor"})
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
    if kind == "longrope":
        return _longrope(params, rope_dim, theta, cfg.get("max_position_embeddings"), where)
    return RopeScaling(theta)


def _longrope(params: dict[str, Any], rope_dim: int, theta: float, max_positions: Any, where: str) -> RopeScaling:
    original = int(_number(params, "original_max_position_embeddings", where))
    short = params.get("short_factor")
    if not isinstance(short, list) or len(short) != rope_dim // 2:
        raise ValueError(f"{where}: short_factor must list {rope_dim // 2} numbers, got {short!r}")
    long = params.get("long_factor")
    if long is not None and (not isinstance(long, list) or len(long) != rope_dim // 2):
        raise ValueError(f"{where}: long_factor must list {rope_dim // 2} numbers, got {long!r:.80}")
    factor = params.get("factor")
    if factor is None:
        factor = (max_positions or original) / original
    attention = params.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return RopeScaling(theta, tuple(float(f) for f in short), "longrope", float(attention), original,
                       tuple(float(f) for f in long or ()), max(int(max_positions or original), original))


def rope_from_gguf(meta: dict[str, Any], arch: str, rope_dim: int, rope_freqs: np.ndarray | None,
                   short_factors: np.ndarray | None = None, long_factors: np.ndarray | None = None) -> RopeScaling:
    """RoPE of a GGUF: ``{arch}.rope.freq_base``, ``{arch}.rope.scaling.type`` (``none`` or ``linear`` with
    ``.factor``) and the ``rope_freqs`` tensor's divisors (Llama 3's scaling: the converter writes only the tensor);
    or Phi-3's LongRoPE: the ``rope_factors_short`` and ``rope_factors_long`` tensors,
    ``{arch}.rope.scaling.attn_factor``, ``.original_context_length`` and ``{arch}.context_length`` (the longest
    context, served by the long factors: see the module doc)."""
    theta = float(meta.get(f"{arch}.rope.freq_base", 10000.0))
    if short_factors is not None:
        if meta.get(f"{arch}.rope.scaling.type", "none") not in ("none", "longrope"):
            raise ValueError(f"GGUF: {arch}.rope.scaling.type {meta[f'{arch}.rope.scaling.type']!r} with LongRoPE "
                             f"factors is not supported")
        original = meta.get(f"{arch}.rope.scaling.original_context_length")
        if not isinstance(original, int) or original <= 0:
            raise ValueError(f"GGUF: LongRoPE factors need {arch}.rope.scaling.original_context_length, got "
                             f"{original!r}")
        for name, factors in (("short", short_factors), ("long", long_factors)):
            if factors is not None and factors.shape != (rope_dim // 2,):
                raise ValueError(f"GGUF: rope_factors_{name} has shape {factors.shape}, need ({rope_dim // 2},)")
        if rope_freqs is not None:
            raise ValueError("GGUF: rope_freqs beside LongRoPE factors is not supported")
        longest = meta.get(f"{arch}.context_length", original)
        return RopeScaling(theta, tuple(float(f) for f in short_factors), "longrope",
                           float(meta.get(f"{arch}.rope.scaling.attn_factor", 1.0)), original,
                           () if long_factors is None else tuple(float(f) for f in long_factors),
                           max(int(longest), original))
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
