"""A Hugging Face ``config.json`` (and ``generation_config.json``) read into a ``LlamaConfig`` through the model's
``ModelFamily`` (a multimodal checkpoint's: its text model's, ``hf_multimodal``); every key is either read, known not
to change the maths, or refused naming it; a key left out takes the family's transformers default
(``ModelFamily.hf_defaults``), else the common one of transformers' Llama."""

from __future__ import annotations

from typing import Any

from .families import family_for_hf
from .hf_multimodal import multimodal_of, text_config
from .model_config import LlamaConfig
from .model_family import HF_COMMON_KEYS, HF_INERT_KEYS, ModelFamily
from .rope import RopeScaling, rope_from_hf, rotary_dim_from_hf


def _ids(value: Any, key: str) -> list[int]:
    """A token id or a list of them (``eos_token_id`` may be either); None gives none."""
    if value is None:
        return []
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        raise ValueError(f"config.json: {key} must be a token id or a list of them, got {value!r}")
    return list(values)


def _int(cfg: dict[str, Any], key: str, default: int | None = None) -> int:
    value = cfg.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"config.json: {key} must be a positive integer, got {value!r}")
    return value


#: Sliding-window keys, read for every family (``_context``, ``layer_types`` below); ``max_window_layers`` only
#: matters with ``use_sliding_window``, which a family that reads it fixes to false.
_WINDOW_KEYS = ("sliding_window", "use_sliding_window", "layer_types", "max_window_layers")
#: a layer's attention kind in ``layer_types`` (the sliding ones for a family with ``window_pattern``)
_LAYER_TYPES = ("sliding_attention", "full_attention")


#: keys that spell a RoPE base the transformers 4 way: a family's defaults for them apply without ``rope_parameters``
_LEGACY_ROPE_KEYS = ("rope_theta", "rope_local_base_freq")


def _with_defaults(cfg: dict[str, Any], family: ModelFamily) -> dict[str, Any]:
    """``cfg`` with the family's defaults (``ModelFamily.hf_defaults``) for the keys it leaves out."""
    spelled = "rope_parameters" in cfg
    return {**{k: v for k, v in family.hf_defaults.items() if not (spelled and k in _LEGACY_ROPE_KEYS)}, **cfg}


def _check_keys(cfg: dict[str, Any], family: ModelFamily) -> None:
    """Refuse a key the family does not read, or a fixed key with another value (see ``ModelFamily``)."""
    for key, value in cfg.items():
        if key in HF_COMMON_KEYS or key in HF_INERT_KEYS:
            continue
        if key not in family.hf_fixed_keys and key not in family.hf_keys and key not in _WINDOW_KEYS:
            raise ValueError(f"config.json: key {key!r} (= {value!r}) is not understood for the {family.name} "
                             f"family; refusing rather than guessing what it changes")
        allowed = family.hf_fixed_keys.get(key)
        if allowed is not None and value not in allowed:
            raise ValueError(f"config.json: {key} = {value!r} is not supported for the {family.name} family "
                             f"(supported: {', '.join(map(repr, allowed))})")
    activation = family.activation.value
    for key in ("hidden_act", "hidden_activation"):
        if cfg.get(key, activation) != activation:
            raise ValueError(f"config.json: {key} {cfg[key]!r} is not supported for the {family.name} family "
                             f"({activation})")
    layer_types = cfg.get("layer_types")
    if layer_types is not None and not family.window_pattern and set(layer_types) != {"full_attention"}:
        raise ValueError(f"config.json: layer_types {sorted(set(layer_types))} are not supported (full_attention)")


def _windows(cfg: dict[str, Any], family: ModelFamily, n_layers: int) -> tuple[tuple[int, ...], int]:
    """The sliding-window layers and the window of a family with per-layer windows (``ModelFamily.window_pattern``):
    ``layer_types`` when given, else ``sliding_window_pattern`` or the family's pattern; ``((), 0)`` otherwise."""
    if not family.window_pattern:
        return (), 0
    window = cfg.get("sliding_window")
    if isinstance(window, bool) or not isinstance(window, int) or window <= 0:
        raise ValueError(f"config.json: sliding_window must be a positive integer for the {family.name} family, "
                         f"got {window!r}")
    patterns = {key: _int(cfg, key) for key in ("sliding_window_pattern", "_sliding_window_pattern") if key in cfg}
    if len(set(patterns.values())) > 1:
        raise ValueError(f"config.json: sliding-window patterns {patterns} disagree")
    layer_types = cfg.get("layer_types")
    if layer_types is None:
        return family.window_layers(n_layers, next(iter(patterns.values()), family.window_pattern)), window
    if not isinstance(layer_types, list) or len(layer_types) != n_layers or not set(layer_types) <= set(_LAYER_TYPES):
        raise ValueError(f"config.json: layer_types must list {' or '.join(_LAYER_TYPES)} for each of the {n_layers} "
                         f"layers, got {layer_types!r}")
    layers = tuple(i for i, kind in enumerate(layer_types) if kind == "sliding_attention")
    for key, pattern in patterns.items():  # transformers 5 writes both; they must say the same
        if family.window_layers(n_layers, pattern) != layers:
            raise ValueError(f"config.json: {key} {pattern} disagrees with layer_types {layer_types}")
    return layers, window


#: transformers' local RoPE base of Gemma 3 when ``rope_local_base_freq`` is absent (``Gemma3TextConfig``)
_LOCAL_ROPE_THETA = 10000.0


def _layer_type_ropes(cfg: dict[str, Any], rope_dim: int) -> tuple[RopeScaling, float]:
    """The global layers' RoPE and the sliding layers' (unscaled) base of a family with a local RoPE: transformers
    5's ``rope_parameters`` per layer type, or transformers 4's ``rope_theta`` / ``rope_scaling`` (global) and
    ``rope_local_base_freq`` (local; absent: transformers' 10000). Refuses a scaled local RoPE."""
    params = cfg.get("rope_parameters")
    if params is None:
        rope = rope_from_hf({k: v for k, v in cfg.items() if k != "rope_local_base_freq"}, rope_dim)
        local = RopeScaling(float(cfg.get("rope_local_base_freq", _LOCAL_ROPE_THETA)))
    else:
        if not isinstance(params, dict) or set(params) != set(_LAYER_TYPES):
            raise ValueError(f"config.json: rope_parameters must hold {' and '.join(_LAYER_TYPES)} (one RoPE per "
                             f"layer type), got {params!r}")
        rest = {k: v for k, v in cfg.items() if k not in ("rope_parameters", "rope_local_base_freq")}
        rope = rope_from_hf({**rest, "rope_parameters": params["full_attention"]}, rope_dim)
        bare = {k: v for k, v in rest.items() if k not in ("rope_theta", "rope_scaling")}
        local = rope_from_hf({**bare, "rope_parameters": params["sliding_attention"]}, rope_dim)
        if "rope_local_base_freq" in cfg and cfg["rope_local_base_freq"] != local.theta:
            raise ValueError(f"config.json: rope_local_base_freq {cfg['rope_local_base_freq']} disagrees with "
                             f"rope_parameters {params['sliding_attention']}")
    if local.kind != "default" or local.factors:
        raise ValueError(f"config.json: a scaled RoPE for the sliding layers ({local.kind}) is not supported")
    return rope, local.theta


def _positive_number(cfg: dict[str, Any], key: str) -> float | None:
    """A positive number at ``key``, or None when absent or null."""
    value = cfg.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise ValueError(f"config.json: {key} must be a positive number or null, got {value!r}")
    return float(value)


def _context(cfg: dict[str, Any], rope: RopeScaling, family: ModelFamily, architecture: str,
             n_layers: int) -> tuple[int, int, tuple[int, ...], int]:
    """The default context, the longest one (``LlamaConfig.context_limit``) and, for a family without per-layer
    windows, the window and its layers. ``max_position_embeddings`` is the longest; LongRoPE's original context the
    default (``rope.RopeScaling.for_context``). A ``sliding_window`` (``use_sliding_window`` not false) shorter than
    that applies to every layer where transformers' class applies it (``ModelFamily.hf_window_architectures``:
    Mistral v0.1's 4096 in 32768), else caps both contexts (Llama: transformers ignores the key; within the window
    attention is exact either way)."""
    longest = _int(cfg, "max_position_embeddings", 2048)
    default = min(longest, rope.max_context or longest)
    if not rope.long_factors:
        longest = default
    window = cfg.get("sliding_window")
    if family.window_pattern or window is None or not cfg.get("use_sliding_window", True):
        return default, longest, (), 0
    if isinstance(window, bool) or not isinstance(window, int) or window <= 0:
        raise ValueError(f"config.json: sliding_window must be a positive integer or null, got {window!r}")
    if window >= longest:  # never bites
        return default, longest, (), 0
    if architecture in family.hf_window_architectures:
        return default, longest, tuple(range(n_layers)), window
    return min(default, window), window, (), 0


def config_from_hf(cfg: dict[str, Any], generation: dict[str, Any] | None = None, *, name: str = "",
                   chat_template: str | None = None) -> LlamaConfig:
    """The ``LlamaConfig`` of a ``config.json`` (``cfg``) and ``generation_config.json`` (``generation``, whose
    ``eos_token_id`` adds to the EOS list). Raises ValueError naming any architecture, key or value not supported."""
    architectures = cfg.get("architectures") or []
    if not isinstance(architectures, list) or len(architectures) != 1:
        raise ValueError(f"config.json: architectures must name one class, got {architectures!r}")
    family = family_for_hf(architectures[0])
    wrapper = multimodal_of(cfg, family)
    if wrapper is not None:
        cfg = text_config(cfg, family, wrapper)
    cfg = _with_defaults(cfg, family)
    _check_keys(cfg, family)
    n_heads = _int(cfg, "num_attention_heads")
    hidden = _int(cfg, "hidden_size")
    head_dim = _int(cfg, "head_dim", hidden // n_heads) if cfg.get("head_dim") is not None else hidden // n_heads
    if head_dim % 2:
        raise ValueError(f"config.json: head_dim {head_dim} must be even for RoPE")
    rope_dim = rotary_dim_from_hf(cfg, head_dim)
    rope, local_theta = _layer_type_ropes(cfg, rope_dim) if family.local_rope else (rope_from_hf(cfg, rope_dim), 0.0)
    eos = _ids(cfg.get("eos_token_id"), "eos_token_id")
    for extra in _ids((generation or {}).get("eos_token_id"), "generation_config.json eos_token_id"):
        if extra not in eos:
            eos.append(extra)
    bos = _ids(cfg.get("bos_token_id"), "bos_token_id")
    if len(bos) > 1:
        raise ValueError(f"config.json: bos_token_id must be one id, got {bos}")
    n_kv = _int(cfg, "num_key_value_heads", n_heads)
    if n_heads % n_kv:
        raise ValueError(f"config.json: {n_heads} attention heads are not a multiple of {n_kv} KV heads")
    n_layers = _int(cfg, "num_hidden_layers")
    window_layers, window = _windows(cfg, family, n_layers)
    context, context_limit, all_layers, all_window = _context(cfg, rope, family, cfg["architectures"][0], n_layers)
    if all_layers:
        window_layers, window = all_layers, all_window
    query_scalar = _positive_number(cfg, "query_pre_attn_scalar")
    return LlamaConfig(
        architecture=family.name,
        n_layers=n_layers,
        hidden=hidden,
        n_heads=n_heads,
        n_kv_heads=n_kv,
        ffn=_int(cfg, "intermediate_size"),
        vocab=_int(cfg, "vocab_size"),
        context=context,
        rope_theta=rope.theta,
        rms_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        bos_id=bos[0] if bos else 0,
        eos_id=eos[0] if eos else 0,
        head_dim=head_dim,
        rope_dim=rope_dim,
        chat_template=chat_template,
        name=name,
        rope_factors=rope.factors,
        rope_scaling=rope.kind,
        rope_attention_factor=rope.attention_factor,
        eos_ids=tuple(eos),
        query_scale=None if query_scalar is None else query_scalar ** -0.5,
        attn_softcap=_positive_number(cfg, "attn_logit_softcapping") or 0.0,
        final_softcap=_positive_number(cfg, "final_logit_softcapping") or 0.0,
        window_layers=window_layers,
        sliding_window=window,
        local_rope_theta=local_theta,
        context_limit=context_limit,
        rope_original_context=rope.max_context or 0,
        rope_long_factors=rope.long_factors,
    )
