"""The hyper-parameters of a loaded model (``LlamaConfig``): one frozen dataclass of plain Python values, whatever
the file format and family; its ``architecture`` names the ``ModelFamily`` (``compile/families/``)."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

from .rope import RopeScaling


@dataclass(frozen=True)
class LlamaConfig:
    """Hyper-parameters of a model (all families: see ``model_family``), as plain Python numbers."""

    #: the family's name (``families.family_named``)
    architecture: str
    n_layers: int
    hidden: int
    n_heads: int
    n_kv_heads: int
    ffn: int
    vocab: int
    context: int
    rope_theta: float
    rms_eps: float
    tied_embeddings: bool
    bos_id: int
    #: the first end-of-sequence id (``eos_ids`` has them all)
    eos_id: int
    head_dim: int
    rope_dim: int
    chat_template: str | None
    name: str = ""
    #: RoPE's per-frequency divisors (``rope.RopeScaling``; empty: none; LongRoPE: ``short_factor``, the ``rope``
    #: property takes ``rope_long_factors`` instead for a longer ``context``) and the scaling they came from
    rope_factors: tuple[float, ...] = ()
    rope_scaling: str = "default"
    #: cos and sin multiplied by it (LongRoPE)
    rope_attention_factor: float = 1.0
    #: every id that ends a turn: ``eos_token_id`` lists, ``generation_config.json``, GGUF ``eos``/``eot``/``eom``
    eos_ids: tuple[int, ...] = ()
    #: the attention's scale of q k (Gemma's ``query_pre_attn_scalar ** -0.5``); None: ``head_dim ** -0.5``
    query_scale: float | None = None
    #: attention scores become ``cap * tanh(score / cap)`` (Gemma 2's ``attn_logit_softcapping``); 0: none
    attn_softcap: float = 0.0
    #: the logits become ``cap * tanh(logit / cap)`` (Gemma 2's ``final_logit_softcapping``); 0: none
    final_softcap: float = 0.0
    #: the layers (indices) whose queries see only the last ``sliding_window`` positions, their own included
    #: (a key at position j is seen from position i when ``i - j < sliding_window``); the others see every position
    window_layers: tuple[int, ...] = ()
    sliding_window: int = 0
    #: the RoPE base of the ``window_layers``, unscaled (Gemma 3's local base); 0: every layer takes ``rope``
    local_rope_theta: float = 0.0
    #: the longest ``context`` the model serves (``max_position_embeddings`` / ``{arch}.context_length``, as RoPE
    #: scaling and windows allow: ``with_context``); 0: ``context``
    context_limit: int = 0
    #: LongRoPE: the original context (``rope_factors`` serve contexts up to it) and the factors that serve longer
    #: ones (``rope.RopeScaling.for_context``: chosen by ``context``); 0 and empty otherwise
    rope_original_context: int = 0
    rope_long_factors: tuple[float, ...] = ()

    def with_context(self, context: int) -> LlamaConfig:
        """This model serving ``context`` tokens per sequence (the compile's ``context`` option): any positive
        count up to ``context_limit``; beyond LongRoPE's original context the long factors apply (``rope``).
        ValueError naming the limit otherwise."""
        limit = self.context_limit or self.context
        if isinstance(context, bool) or not isinstance(context, int) or not 0 < context <= limit:
            raise ValueError(f"context {context!r} is not supported by {self.name or self.architecture}: a positive "
                             f"token count up to {limit} (max_position_embeddings, as its RoPE scaling and "
                             f"sliding window allow)")
        self._base_rope.for_context(context)  # refuses what the scaling cannot serve
        return replace(self, context=context)

    @property
    def sm_scale(self) -> float:
        """The factor of the attention scores ``q . k`` (``query_scale``, else ``1 / sqrt(head_dim)``)."""
        return float(self.query_scale) if self.query_scale is not None else 1.0 / float(self.head_dim) ** 0.5

    def layer_rope(self, layer: int) -> RopeScaling:
        """The RoPE of layer ``layer``: the local one of a sliding layer (``local_rope_theta``), else ``rope``."""
        if self.local_rope_theta and layer in self.window_layers:
            return RopeScaling(self.local_rope_theta)
        return self.rope

    def layer_window(self, layer: int) -> int:
        """The sliding window of layer ``layer`` (0: it sees every earlier position)."""
        return self.sliding_window if layer in self.window_layers else 0

    @property
    def n_rep(self) -> int:
        """Query heads per KV head (grouped-query attention)."""
        return self.n_heads // self.n_kv_heads

    @property
    def rope(self) -> RopeScaling:
        """RoPE's base and per-frequency divisors for the served ``context`` (LongRoPE's long factors beyond its
        original context, ``RopeScaling.for_context``)."""
        return self._base_rope.for_context(self.context)

    @property
    def _base_rope(self) -> RopeScaling:
        return RopeScaling(self.rope_theta, self.rope_factors, self.rope_scaling, self.rope_attention_factor,
                           self.rope_original_context or None, self.rope_long_factors,
                           self.context_limit or None)

    def tensor_shape(self, name: str) -> tuple[int, ...]:
        """The shape of canonical weight ``name`` (a GGUF name, ``[out, in]``); a name no family has is refused."""
        suffix = name.split(".", 2)[-1] if name.startswith("blk.") else name
        h, f, d = self.hidden, self.ffn, self.head_dim
        q, kv = self.n_heads * d, self.n_kv_heads * d
        shapes = {"token_embd.weight": (self.vocab, h), "output.weight": (self.vocab, h), "output_norm.weight": (h,),
                  "attn_norm.weight": (h,), "ffn_norm.weight": (h,), "attn_q.weight": (q, h), "attn_k.weight": (kv, h),
                  "attn_v.weight": (kv, h), "attn_output.weight": (h, q), "ffn_gate.weight": (f, h),
                  "ffn_up.weight": (f, h), "ffn_down.weight": (h, f), "attn_q.bias": (q,), "attn_k.bias": (kv,),
                  "attn_v.bias": (kv,), "attn_q_norm.weight": (d,), "attn_k_norm.weight": (d,),
                  "post_attention_norm.weight": (h,), "post_ffw_norm.weight": (h,)}
        if suffix not in shapes:
            raise ValueError(f"{name} is not a weight of any supported family")
        return shapes[suffix]

    def stored_shape(self, parts: tuple[str, ...]) -> tuple[int, ...]:
        """The shape of a stored tensor holding the canonical ``parts`` by rows (one part: its own shape)."""
        shapes = [self.tensor_shape(part) for part in parts]
        return (sum(shape[0] for shape in shapes), *shapes[0][1:])

    def check_shape(self, stored: str, parts: tuple[str, ...], shape: tuple[int, ...], source: str) -> None:
        """Refuse a stored tensor whose shape is not the config's, naming both (``source``: the file, first)."""
        want = self.stored_shape(parts)
        if tuple(shape) != want:
            raise ValueError(f"{source}: tensor {stored} has shape {list(shape)}, the config gives {list(want)}")

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> LlamaConfig:
        """The config from ``dataclasses.asdict`` output read back from JSON (lists become tuples); an unknown key
        is refused."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"model config: unknown field(s) {unknown}")
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in values.items()})
