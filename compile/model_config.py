"""The hyper-parameters of a loaded model (``LlamaConfig``): one frozen dataclass of plain Python values, whatever
the file format and family; its ``architecture`` names the ``ModelFamily`` (``compile/families/``)."""

from __future__ import annotations

from dataclasses import dataclass, fields
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
    #: RoPE's per-frequency divisors (``rope.RopeScaling``; empty: none) and the scaling they came from
    rope_factors: tuple[float, ...] = ()
    rope_scaling: str = "default"
    #: cos and sin multiplied by it (LongRoPE)
    rope_attention_factor: float = 1.0
    #: every id that ends a turn: ``eos_token_id`` lists, ``generation_config.json``, GGUF ``eos``/``eot``/``eom``
    eos_ids: tuple[int, ...] = ()

    @property
    def n_rep(self) -> int:
        """Query heads per KV head (grouped-query attention)."""
        return self.n_heads // self.n_kv_heads

    @property
    def rope(self) -> RopeScaling:
        """RoPE's base and per-frequency divisors."""
        return RopeScaling(self.rope_theta, self.rope_factors, self.rope_scaling, self.rope_attention_factor)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> LlamaConfig:
        """The config from ``dataclasses.asdict`` output read back from JSON (lists become tuples); an unknown key
        is refused."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"model config: unknown field(s) {unknown}")
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in values.items()})
