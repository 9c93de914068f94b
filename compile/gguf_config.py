"""A GGUF's metadata and tensor list read into a ``LlamaConfig`` through the model's ``ModelFamily``: every
``{arch}.*`` key is read or refused, every tensor is one the family has (or ``rope_freqs.weight``), none missing."""

from __future__ import annotations

from typing import Any

import numpy as np

from .families import family_for_gguf
from .model_config import LlamaConfig
from .model_family import GGUF_COMMON_KEYS, ModelFamily
from .rope import rope_from_gguf

#: The tensor of Llama 3's RoPE scaling and Phi-3's LongRoPE factors (read into the config, not weights).
ROPE_FREQS = "rope_freqs.weight"
ROPE_FACTORS_SHORT = "rope_factors_short.weight"
ROPE_FACTORS_LONG = "rope_factors_long.weight"
#: Token ids that end a turn, in this order.
_EOS_KEYS = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")


def _positive(meta: dict[str, Any], key: str, default: int | None = None, source: str = "GGUF") -> int:
    value = meta.get(key, default)
    if value is None:
        raise ValueError(f"{source}: {key} is missing")
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{source}: {key} must be a positive integer, got {value!r}")
    return value


def _windows(meta: dict[str, Any], family: ModelFamily, prefix: str, n_layers: int,
             source: str) -> tuple[tuple[int, ...], int]:
    """The sliding-window layers and window of a family with per-layer windows: ``attention.sliding_window`` and
    ``attention.sliding_window_pattern`` (a layer count or one flag per layer, as llama.cpp reads it; absent: the
    family's pattern); ``((), 0)`` for other families."""
    if not family.window_pattern:
        return (), 0
    window = _positive(meta, prefix + "attention.sliding_window", source=source)
    pattern = meta.get(prefix + "attention.sliding_window_pattern", family.window_pattern)
    if isinstance(pattern, list):
        if len(pattern) != n_layers or not all(isinstance(p, bool) for p in pattern):
            raise ValueError(f"{source}: {prefix}attention.sliding_window_pattern must hold a flag for each of the "
                             f"{n_layers} layers, got {pattern!r}")
        return tuple(i for i, sliding in enumerate(pattern) if sliding), window
    if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern < 1:
        raise ValueError(f"{source}: {prefix}attention.sliding_window_pattern must be a positive layer count or "
                         f"a list of flags, got {pattern!r}")
    return family.window_layers(n_layers, pattern), window


def config_from_gguf(meta: dict[str, Any], tensor_shapes: dict[str, tuple[int, ...]],
                     rope_tensors: dict[str, np.ndarray], *, vocab_size: int, source: str = "GGUF") -> LlamaConfig:
    """The ``LlamaConfig`` of a GGUF's metadata ``meta`` (Python values), its tensors' shapes (``[out, in]``: a
    ``GGUFReader`` tensor's ``shape`` reversed; each checked against the config), its RoPE tensors
    (``rope_freqs``, ``rope_factors_*``: name -> float32 values) and the token count of its vocabulary; ``source``
    (the file name) starts every error. Raises ValueError naming an unsupported architecture, key, value or
    tensor."""
    arch = meta.get("general.architecture")
    family = family_for_gguf(str(arch))
    prefix = f"{arch}."
    known = GGUF_COMMON_KEYS | family.gguf_keys
    unknown = sorted(k for k in meta if k.startswith(prefix) and k[len(prefix):] not in known)
    if unknown:
        raise ValueError(f"{source}: key(s) {unknown} are not understood for the {family.name} family; refusing "
                         f"rather than guessing what they change")
    missing = sorted(k for k in family.gguf_required_keys if prefix + k not in meta)
    if missing:
        raise ValueError(f"{source}: key(s) {[prefix + k for k in missing]} are missing (a {family.name} GGUF "
                         f"needs them)")
    hidden = _positive(meta, prefix + "embedding_length", source=source)
    n_heads = _positive(meta, prefix + "attention.head_count", source=source)
    n_kv = _positive(meta, prefix + "attention.head_count_kv", n_heads, source=source)
    if n_heads % n_kv:
        raise ValueError(f"{source}: {n_heads} attention heads are not a multiple of {n_kv} KV heads")
    head_dim = _positive(meta, prefix + "attention.key_length", hidden // n_heads, source=source)
    value_dim = _positive(meta, prefix + "attention.value_length", head_dim, source=source)
    if value_dim != head_dim:
        raise ValueError(f"{source}: value length {value_dim} differs from key length {head_dim} (not supported)")
    rope_dim = _positive(meta, prefix + "rope.dimension_count", head_dim, source=source)
    if rope_dim > head_dim or rope_dim % 2:
        raise ValueError(f"{source}: {prefix}rope.dimension_count {rope_dim} must be even and at most the head size "
                         f"{head_dim}")
    unread = sorted(set(rope_tensors) - set(family.gguf_rope_tensors))
    if unread:
        raise ValueError(f"{source}: tensor(s) {unread} are not part of the {family.name} family")
    rope = rope_from_gguf(meta, str(arch), rope_dim, rope_tensors.get(ROPE_FREQS),
                          rope_tensors.get(ROPE_FACTORS_SHORT), rope_tensors.get(ROPE_FACTORS_LONG))
    n_layers = _positive(meta, prefix + "block_count", source=source)
    tied = "output.weight" not in tensor_shapes
    stored = family.gguf_file_tensors(n_layers, tied)
    expected = set(stored)
    present = set(tensor_shapes) - set(rope_tensors)
    if present - expected:
        raise ValueError(f"{source}: tensor(s) {sorted(present - expected)[:5]} are not part of the {family.name} "
                         f"family (expected e.g. {sorted(expected)[:3]})")
    if expected - present:
        raise ValueError(f"{source}: tensor(s) {sorted(expected - present)[:5]} are missing")
    eos: list[int] = []
    for key in _EOS_KEYS:
        if key in meta and int(meta[key]) not in eos:
            eos.append(int(meta[key]))
    if not eos:
        raise ValueError(f"{source}: tokenizer.ggml.eos_token_id is missing")
    vocab = _positive(meta, prefix + "vocab_size", vocab_size, source=source)
    window_layers, window = _windows(meta, family, prefix, n_layers, source)
    longest = _positive(meta, prefix + "context_length", source=source)
    context = min(longest, rope.max_context or longest)
    if not rope.long_factors:
        longest = context
    if family.gguf_window_all_layers and meta.get(prefix + "attention.sliding_window", 0) != 0:
        # Phi-3's converter writes 0 for a model without one (Phi-4-mini); llama.cpp runs none for Phi-3 at all
        all_window = _positive(meta, prefix + "attention.sliding_window", source=source)
        if all_window < longest:  # else it never bites
            window_layers, window = tuple(range(n_layers)), all_window
    query_scale = None
    if family.gguf_wide_scale_layers:  # llama.cpp's rule (``ModelFamily.gguf_wide_scale_layers``)
        query_scale = float(hidden // n_heads if n_layers in family.gguf_wide_scale_layers else head_dim) ** -0.5
    config = LlamaConfig(
        architecture=family.name,
        n_layers=n_layers,
        hidden=hidden,
        n_heads=n_heads,
        n_kv_heads=n_kv,
        ffn=_positive(meta, prefix + "feed_forward_length", source=source),
        vocab=vocab,
        context=context,
        rope_theta=rope.theta,
        rms_eps=float(meta[prefix + "attention.layer_norm_rms_epsilon"]),
        tied_embeddings=tied,
        bos_id=int(meta.get("tokenizer.ggml.bos_token_id", 0)),
        eos_id=eos[0],
        head_dim=head_dim,
        rope_dim=rope_dim,
        chat_template=meta.get("tokenizer.chat_template"),
        name=str(meta.get("general.name", "")),
        rope_factors=rope.factors,
        rope_scaling=rope.kind,
        rope_attention_factor=rope.attention_factor,
        eos_ids=tuple(eos),
        query_scale=query_scale,
        attn_softcap=float(meta.get(prefix + "attn_logit_softcapping", 0.0)),
        final_softcap=float(meta.get(prefix + "final_logit_softcapping", 0.0)),
        window_layers=window_layers,
        sliding_window=window,
        # llama.cpp's default base of the sliding layers (``rope_freq_base_train_swa``), unscaled
        local_rope_theta=float(meta.get(prefix + "rope.freq_base_swa", 10000.0)) if family.local_rope else 0.0,
        context_limit=longest,
        rope_original_context=rope.max_context or 0,
        rope_long_factors=rope.long_factors,
    )
    for name, parts in stored.items():
        config.check_shape(name, parts, tensor_shapes[name], source)
    return config
