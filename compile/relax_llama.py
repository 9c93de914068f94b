"""The Llama decoder in ``tvm.relax.frontend.nn``, attention through TVM's paged KV cache, matmuls as TIR kernels.

The module (``LlamaModule``) exports four functions (``export_llama``):

* ``create_paged_kv_cache(max_batch_size, max_total_seq_len, prefill_chunk_size, page_size, support_sliding_window)``
  builds a ``TIRPagedKVCache`` for the target (for llvm it picks TVM's CPU attention kernels);
* ``embed(input_ids[n] int32) -> [n, hidden] float32``;
* ``prefill(input_ids[n] int32, logit_positions[b] int32, kv_cache, params) -> logits[b, vocab] float32``: the
  packed tokens of the sequences named by the KV cache's ``begin_forward`` (their lengths sum to ``n``); logits at
  the packed positions ``logit_positions`` (each sequence's last token);
* ``decode(input_ids[b] int32, kv_cache, params) -> logits[b, vocab] float32``: one token for each of ``b`` sequences.

Per layer (as ``serve/numpy_llama.py``)::

    h = rmsnorm(x) * attn_norm;  q, k, v = split(h @ Wqkv.T [+ bqkv])
    x += attention(rope(q), rope(k), v) @ Wo.T        the KV cache applies RoPE (rotating halves) and stores k, v
    h = rmsnorm(x) * ffn_norm;   g, u = split(h @ Wgate_up.T)
    x += (silu(g) * u) @ Wdown.T

Layout: a GGUF's q/k rows are permuted for GGML's adjacent-pair RoPE; ``relax_weights`` un-permutes them into the
Hugging Face half-rotation order that the KV cache's RoPE uses, so the model rotates exactly the pairs the numpy
reference rotates. q, k, v are fused into one projection, gate and up into another.

Matmuls are ``linear`` TIR kernels (``y[t, o] = sum_k x[t, k] * W[o, k]``) written for the CPU: output rows in
parallel, the reduction vectorised over 16 lanes with float32 accumulation, a block of tokens per weight row so that
a prefill reads each weight row once per block. Weights are stored as ``weight_dtype`` (float16 by default, half the
memory traffic of float32; float32 for exact comparisons), norms and activations are float32.
"""

# fmt: off
from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import tvm
from tvm import tirx
from tvm.relax.frontend import nn
from tvm.relax.frontend.nn.llm.kv_cache import PagedKVCache, RopeMode, TIRPagedKVCache
from tvm.script import tirx as T

from .gguf_model import GGUFModel

_LANES = 16          # float32 lanes of the vectorised reduction (one AVX-512 register, two AVX2 registers)
_TOKEN_BLOCK = 4     # tokens computed per weight row visit
_CHUNKS = 64         # parallel chunks of output rows


@dataclass(frozen=True)
class LlamaSpec:
    """What the compiled module depends on: the architecture's sizes, RoPE, and the weights' storage type."""

    n_layers: int
    hidden: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    rope_theta: float
    rms_eps: float
    tied_embeddings: bool
    qkv_bias: bool = False
    weight_dtype: str = "float16"

    @classmethod
    def from_model(cls, model: GGUFModel, weight_dtype: str = "float16") -> LlamaSpec:
        """The spec of a loaded model (``qkv_bias`` when it has ``blk.0.attn_q.bias``)."""
        cfg = model.config
        if weight_dtype not in ("float16", "float32"):
            raise ValueError(f"weight_dtype {weight_dtype!r} is not supported (float16 or float32)")
        has_bias = "blk.0.attn_q.bias" in model.weights or "blk.0.attn_q.bias" in model.tensor_types
        return cls(
            n_layers=cfg.n_layers, hidden=cfg.hidden, n_heads=cfg.n_heads, n_kv_heads=cfg.n_kv_heads,
            head_dim=cfg.head_dim, ffn=cfg.ffn, vocab=cfg.vocab, rope_theta=float(cfg.rope_theta),
            rms_eps=float(cfg.rms_eps), tied_embeddings=cfg.tied_embeddings, qkv_bias=has_bias,
            weight_dtype=weight_dtype,
        )

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@functools.cache
def linear_kernel(out_features: int, in_features: int, weight_dtype: str) -> tirx.PrimFunc:
    """``y[t, o] = sum_k x[t, k] * float32(w[o, k])`` for ``x`` float32 ``[n, K]``, ``w`` ``[N, K]``, ``y`` ``[n, N]``.

    CPU schedule: the output rows in 64 parallel chunks (the accumulators are allocated once per chunk: a buffer
    allocated inside a parallel loop is a heap allocation per iteration); per row, the tokens in blocks of 4 (four
    accumulators of 16 lanes, each weight vector loaded once for the four tokens), then the remaining tokens one by
    one; the ``K % 16`` tail is scalar; the lanes are summed at the end of each row.
    """
    n_vec = in_features // _LANES
    tail = in_features - n_vec * _LANES
    blk = _TOKEN_BLOCK
    chunks = min(_CHUNKS, out_features)
    rows_per_chunk = -(-out_features // chunks)

    @T.prim_func(private=True)
    def linear(var_x: T.handle, w: T.Buffer((out_features, in_features), weight_dtype), var_y: T.handle):
        T.func_attr({"tirx.noalias": True})
        n = T.int64()
        x = T.match_buffer(var_x, (n, in_features), "float32")
        y = T.match_buffer(var_y, (n, out_features), "float32")
        for chunk in T.parallel(chunks):
            acc = T.alloc_buffer((blk, _LANES), "float32", scope="local")
            total = T.alloc_buffer((blk,), "float32", scope="local")
            for row in range(rows_per_chunk):
                if chunk * rows_per_chunk + row < out_features:
                    o: T.let = chunk * rows_per_chunk + row
                    for tb in range(n // blk):
                        for b in range(blk):
                            for lane in T.vectorized(_LANES):
                                acc[b, lane] = T.float32(0)
                        for kb in range(n_vec):
                            for b in range(blk):
                                for lane in T.vectorized(_LANES):
                                    acc[b, lane] = acc[b, lane] + x[tb * blk + b, kb * _LANES + lane] * T.Cast(
                                        "float32", w[o, kb * _LANES + lane])
                        for b in range(blk):
                            total[b] = T.float32(0)
                            for lane in range(_LANES):
                                total[b] = total[b] + acc[b, lane]
                            for kt in range(tail):
                                total[b] = total[b] + x[tb * blk + b, n_vec * _LANES + kt] * T.Cast(
                                    "float32", w[o, n_vec * _LANES + kt])
                            y[tb * blk + b, o] = total[b]
                    for t in range(n - n // blk * blk):
                        for lane in T.vectorized(_LANES):
                            acc[0, lane] = T.float32(0)
                        for kb in range(n_vec):
                            for lane in T.vectorized(_LANES):
                                acc[0, lane] = acc[0, lane] + x[n // blk * blk + t, kb * _LANES + lane] * T.Cast(
                                    "float32", w[o, kb * _LANES + lane])
                        total[0] = T.float32(0)
                        for lane in range(_LANES):
                            total[0] = total[0] + acc[0, lane]
                        for kt in range(tail):
                            total[0] = total[0] + x[n // blk * blk + t, n_vec * _LANES + kt] * T.Cast(
                                "float32", w[o, n_vec * _LANES + kt])
                        y[n // blk * blk + t, o] = total[0]

    return linear


def _linear(x: nn.Tensor, weight: nn.Tensor, name: str) -> nn.Tensor:
    """``x[..., K] @ weight[N, K].T`` through ``linear_kernel`` (leading axes flattened into tokens)."""
    out_features, in_features = (int(d) for d in weight.shape)
    lead = list(x.shape[:-1])
    flat = x.reshape(-1, in_features) if len(lead) != 1 else x
    n = flat.shape[0]
    y = nn.op.tensor_ir_op(
        linear_kernel(out_features, in_features, weight.dtype),
        f"linear_{out_features}x{in_features}_{weight.dtype}",
        args=[flat, weight],
        out=nn.Tensor.placeholder([n, out_features], "float32"),
    )
    return y if len(lead) == 1 else y.reshape(*lead, out_features)


class Linear(nn.Module):
    """A bias-optional projection whose weight ``[out, in]`` is stored as ``dtype``; output float32."""

    def __init__(self, in_features: int, out_features: int, dtype: str, bias: bool = False) -> None:
        self.weight = nn.Parameter((out_features, in_features), dtype)
        self.bias = nn.Parameter((out_features,), "float32") if bias else None

    def forward(self, x: nn.Tensor) -> nn.Tensor:
        y = _linear(x, self.weight, "linear")
        return y + self.bias if self.bias is not None else y


class RMSNorm(nn.Module):
    """``x / sqrt(mean(x^2) + eps) * weight`` over the last axis, float32."""

    def __init__(self, hidden: int, eps: float) -> None:
        self.weight = nn.Parameter((hidden,), "float32")
        self.eps = eps

    def forward(self, x: nn.Tensor) -> nn.Tensor:
        return nn.op.rms_norm(x, self.weight, axes=[-1], epsilon=self.eps)


class Attention(nn.Module):
    """Fused q/k/v projection, attention (with RoPE) in the paged KV cache, output projection."""

    def __init__(self, spec: LlamaSpec) -> None:
        self.spec = spec
        qkv_rows = (spec.n_heads + 2 * spec.n_kv_heads) * spec.head_dim
        self.qkv = Linear(spec.hidden, qkv_rows, spec.weight_dtype, bias=spec.qkv_bias)
        self.o = Linear(spec.n_heads * spec.head_dim, spec.hidden, spec.weight_dtype)

    def forward(self, x: nn.Tensor, kv_cache: PagedKVCache, layer: int) -> nn.Tensor:
        s = self.spec
        b, t, _ = x.shape
        qkv = self.qkv(x).reshape(b, t, s.n_heads + 2 * s.n_kv_heads, s.head_dim)
        out = kv_cache.attention_with_fused_qkv(layer, qkv, s.n_heads, sm_scale=1.0 / math.sqrt(s.head_dim))
        return self.o(out.reshape(b, t, s.n_heads * s.head_dim))


class MLP(nn.Module):
    """SwiGLU: ``(silu(h @ Wgate.T) * (h @ Wup.T)) @ Wdown.T`` with gate and up fused into one projection."""

    def __init__(self, spec: LlamaSpec) -> None:
        self.ffn = spec.ffn
        self.gate_up = Linear(spec.hidden, 2 * spec.ffn, spec.weight_dtype)
        self.down = Linear(spec.ffn, spec.hidden, spec.weight_dtype)

    def forward(self, x: nn.Tensor) -> nn.Tensor:
        gate, up = nn.op.split(self.gate_up(x), 2, axis=-1)
        return self.down(nn.op.silu(gate) * up)


class Block(nn.Module):
    """One decoder layer: pre-norm attention and pre-norm MLP, each added to the residual."""

    def __init__(self, spec: LlamaSpec, layer: int) -> None:
        self.layer = layer
        self.attn_norm = RMSNorm(spec.hidden, spec.rms_eps)
        self.attn = Attention(spec)
        self.ffn_norm = RMSNorm(spec.hidden, spec.rms_eps)
        self.mlp = MLP(spec)

    def forward(self, x: nn.Tensor, kv_cache: PagedKVCache) -> nn.Tensor:
        x = x + self.attn(self.attn_norm(x), kv_cache, self.layer)
        return x + self.mlp(self.ffn_norm(x))


class LlamaModule(nn.Module):
    """The whole decoder; see the module docstring for the exported functions."""

    def __init__(self, spec: LlamaSpec) -> None:
        self.spec = spec
        self.embed_tokens = nn.Parameter((spec.vocab, spec.hidden), spec.weight_dtype)
        self.layers = nn.ModuleList([Block(spec, i) for i in range(spec.n_layers)])
        self.norm = RMSNorm(spec.hidden, spec.rms_eps)
        self.lm_head = None if spec.tied_embeddings else Linear(spec.hidden, spec.vocab, spec.weight_dtype)

    def embed(self, input_ids: nn.Tensor) -> nn.Tensor:
        return nn.op.take(self.embed_tokens, input_ids, axis=0).astype("float32")

    def _logits(self, hidden: nn.Tensor) -> nn.Tensor:
        hidden = self.norm(hidden)
        if self.lm_head is not None:
            return self.lm_head(hidden)
        return _linear(hidden, self.embed_tokens, "lm_head")

    def _layers(self, x: nn.Tensor, kv_cache: PagedKVCache) -> nn.Tensor:
        for block in self.layers:
            x = block(x, kv_cache)
        return x

    def prefill(self, input_ids: nn.Tensor, logit_positions: nn.Tensor, kv_cache: PagedKVCache) -> nn.Tensor:
        n = input_ids.shape[0]
        x = self._layers(self.embed(input_ids).reshape(1, n, self.spec.hidden), kv_cache)
        last = nn.op.take(x.reshape(n, self.spec.hidden), logit_positions, axis=0)
        return self._logits(last)

    def decode(self, input_ids: nn.Tensor, kv_cache: PagedKVCache) -> nn.Tensor:
        b = input_ids.shape[0]
        x = self._layers(self.embed(input_ids).reshape(b, 1, self.spec.hidden), kv_cache)
        return self._logits(x.reshape(b, self.spec.hidden))

    def create_paged_kv_cache(
        self,
        max_batch_size: tirx.Var,
        max_total_seq_len: tirx.Var,
        prefill_chunk_size: tirx.Var,
        page_size: tirx.Var,
        support_sliding_window: tirx.Var,
    ) -> PagedKVCache:
        s = self.spec
        return TIRPagedKVCache(
            attn_kind="mha",
            max_batch_size=max_batch_size,
            max_total_seq_len=max_total_seq_len,
            prefill_chunk_size=prefill_chunk_size,
            page_size=page_size,
            support_sliding_window=support_sliding_window,
            layer_partition=tvm.relax.ShapeExpr([0, s.n_layers]),
            num_hidden_layers=s.n_layers,
            num_attention_heads=s.n_heads,
            num_key_value_heads=s.n_kv_heads,
            qk_head_dim=s.head_dim,
            v_head_dim=s.head_dim,
            mla_original_qk_head_dim=0,
            mla_original_v_head_dim=0,
            rope_mode=RopeMode.NORMAL,
            rope_scale=1,
            rope_theta=s.rope_theta,
            rope_scaling={},
            rope_ext_factors=tvm.relax.prim_value(0),
            rotary_dim=s.head_dim,
            enable_disaggregation=False,
            dtype="float32",
            target=tvm.target.Target.current(),
        )

    def export_spec(self) -> dict[str, Any]:
        """The ``nn.spec`` of the four exported functions (weights passed packed, no effects)."""
        packed = {"param_mode": "packed", "effect_mode": "none"}
        return {
            "embed": {"input_ids": nn.spec.Tensor(["n"], "int32"), "$": packed},
            "prefill": {
                "input_ids": nn.spec.Tensor(["n"], "int32"),
                "logit_positions": nn.spec.Tensor(["batch"], "int32"),
                "kv_cache": nn.spec.Object(object_type=PagedKVCache),
                "$": packed,
            },
            "decode": {
                "input_ids": nn.spec.Tensor(["batch"], "int32"),
                "kv_cache": nn.spec.Object(object_type=PagedKVCache),
                "$": packed,
            },
            "create_paged_kv_cache": {
                "max_batch_size": int,
                "max_total_seq_len": int,
                "prefill_chunk_size": int,
                "page_size": int,
                "support_sliding_window": int,
                "$": {"param_mode": "none", "effect_mode": "none"},
            },
        }


def export_llama(spec: LlamaSpec, target: tvm.target.Target) -> tuple[tvm.IRModule, list[str]]:
    """The Relax IRModule of the model for ``target`` and the names of its packed parameters, in order."""
    module = LlamaModule(spec)
    with target:
        mod, named_params = module.export_tvm(spec=module.export_spec())
    return mod, [name for name, _ in named_params]


def _unpermute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Rows of a GGUF q/k projection (or bias) from GGML's adjacent-pair order back to half-rotation order."""
    head_dim = w.shape[0] // n_heads
    rest = w.shape[1:]
    return w.reshape(n_heads, head_dim // 2, 2, *rest).swapaxes(1, 2).reshape(w.shape)


def relax_weights(model: GGUFModel, spec: LlamaSpec) -> dict[str, np.ndarray]:
    """The module's parameters by name, from the GGUF-named float32 weights (un-permuted, fused, cast)."""
    w = model.weights
    wd = spec.weight_dtype

    def cast(a: np.ndarray, dtype: str = wd) -> np.ndarray:
        return np.ascontiguousarray(a, dtype=dtype)

    params = {"embed_tokens": cast(w["token_embd.weight"]), "norm.weight": cast(w["output_norm.weight"], "float32")}
    if not spec.tied_embeddings:
        params["lm_head.weight"] = cast(w["output.weight"])
    for i in range(spec.n_layers):
        p = f"blk.{i}."
        q = _unpermute_rope_rows(w[p + "attn_q.weight"], spec.n_heads)
        k = _unpermute_rope_rows(w[p + "attn_k.weight"], spec.n_kv_heads)
        params[f"layers.{i}.attn.qkv.weight"] = cast(np.concatenate([q, k, w[p + "attn_v.weight"]]))
        if spec.qkv_bias:
            qb = _unpermute_rope_rows(w[p + "attn_q.bias"], spec.n_heads)
            kb = _unpermute_rope_rows(w[p + "attn_k.bias"], spec.n_kv_heads)
            params[f"layers.{i}.attn.qkv.bias"] = cast(np.concatenate([qb, kb, w[p + "attn_v.bias"]]), "float32")
        params[f"layers.{i}.attn.o.weight"] = cast(w[p + "attn_output.weight"])
        params[f"layers.{i}.attn_norm.weight"] = cast(w[p + "attn_norm.weight"], "float32")
        params[f"layers.{i}.ffn_norm.weight"] = cast(w[p + "ffn_norm.weight"], "float32")
        params[f"layers.{i}.mlp.gate_up.weight"] = cast(
            np.concatenate([w[p + "ffn_gate.weight"], w[p + "ffn_up.weight"]]))
        params[f"layers.{i}.mlp.down.weight"] = cast(w[p + "ffn_down.weight"])
    return params
