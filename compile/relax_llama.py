"""The Llama decoder in ``tvm.relax.frontend.nn``, attention through TVM's paged KV cache, matmuls as TIR kernels.

The module (``LlamaModule``) exports five functions (``export_llama``):

* ``create_paged_kv_cache(max_batch_size, max_total_seq_len, prefill_chunk_size, page_size, support_sliding_window)``
  builds a ``TIRPagedKVCache`` for the target (for llvm it picks TVM's CPU attention kernels);
* ``embed(input_ids[n] int32) -> [n, hidden] float32``;
* ``prefill(input_ids[n] int32, logit_positions[b] int32, kv_cache, params) -> logits[b, vocab] float32``: the
  packed tokens of the sequences named by the KV cache's ``begin_forward`` (their lengths sum to ``n``); logits at
  the packed positions ``logit_positions`` (each sequence's last token);
* ``decode(input_ids[b] int32, kv_cache, params) -> logits[b, vocab] float32``: one token for each of ``b`` sequences;
* ``verify(input_ids[n] int32, kv_cache, params) -> logits[n, vocab] float32``: packed tokens as for ``prefill``, with
  the logits after every token, the matmuls run as decode runs them (speculative decoding's check of drafts).

Per layer (as ``serve/numpy_llama.py``; what differs between families is read from the ``LlamaSpec``, which
``from_model`` fills from the model's ``ModelFamily``)::

    h = rmsnorm(x) * attn_norm;  q, k, v = split(h @ Wqkv.T [+ bqkv])
    [q, k = rmsnorm(q) * q_norm, rmsnorm(k) * k_norm over each head]       (QK-norm: Qwen3)
    x += attention(rope(q), rope(k), v) @ Wo.T        the KV cache applies RoPE (rotating halves, ``rope_kernel``
                                                      with the spec's inverse frequencies) and stores k, v
    h = rmsnorm(x) * ffn_norm;   g, u = split(h @ Wgate_up.T)
    x += (silu(g) * u) @ Wdown.T

Gemma (the spec's ``sandwich_norms``, ``activation``, ``embed_scale``, ``sm_scale``, soft-caps, ``window_layers``,
``local_rope_inv_freq``): the embedding times ``sqrt(hidden)``; each block's attention and MLP outputs normed again
before the add; ``gelu_tanh(g) * u``; the attention scale ``query_pre_attn_scalar ** -0.5``, its scores soft-capped
and a sliding layer's window applied in the attention kernels (``decode_attention.py``: the layer passes its scale
negated, ``attention_mode.py``); Gemma 3's layers rotate q and k themselves, each by its own frequencies; the
logits soft-capped.

Layout: the loaders give q/k rows in Hugging Face's half-rotation order (``model_family``), the order the KV
cache's RoPE rotates; ``llama_weights.relax_weights`` (the weight loader, a module of its own) fuses q, k, v into
one projection, gate and up into another.

Matmuls and the embedding lookup are the TIR kernels of ``linear_kernels.py``, one per weight storage format:
``float32``, ``float16``, or the GGUF's own quantised blocks (``GGUF_FORMATS``: Q8_0, Q4_1 and the
``quant_formats`` types) read by integer-dot kernels (``weight_dtype="auto"`` keeps a GGUF's quantised tensors as
blocks, formats per layer where the layers differ, and stores float tensors as float16). Norms, activations, the KV
cache and the accumulation are float32. The KV cache holds ``LlamaSpec.kv_dtype`` (float32 by default; float16, as
llama.cpp's, or q8_0 blocks, on request): q, k and v are rounded to its element type (float16 for q8_0) before RoPE,
k and v quantised after it for q8_0, and the attention's output comes back in that type.
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

from . import attention_mode
from .attention_kernels import replace_attention_kernels, rope_kernel
from .families import family_named
from .gguf_model import GGUFModel
from .gguf_tensors import RawTensors
from .kv_layout import KV_DTYPES as KV_LAYOUT_DTYPES
from .kv_layout import KVLayout
from .linear_kernels import embed_kernel, integer_linear_kernel, linear_kernel, param_shapes, swiglu_kernel
from .model_family import Activation, NormPlacement
from .norm_kernels import rms_norm_kernel
from .packed_matvec import DEFAULT_ACTIVATION_BITS, packed_q8_0_embed_kernel, packed_q8_0_kernel, packed_q8_0_shapes
from .quant_formats import BY_FORMAT, LAYOUTS, Q4_1, QuantLayout, common_type
from .quant_matvec import quant_embed_kernel, quant_matmul_kernel
from .rope import RopeScaling
from .row_copies import first_columns_kernel, pad_rows_kernel

#: Weight formats stored as the GGUF's quantised blocks.
QUANTISED = ("q4_1", "q8_0")
#: The weight matrices of the model, by kind, and the GGUF tensors each is made of (``{i}``: every layer).
WEIGHT_KINDS: dict[str, tuple[str, ...]] = {
    "embed": ("token_embd.weight",),
    "qkv": ("blk.{i}.attn_q.weight", "blk.{i}.attn_k.weight", "blk.{i}.attn_v.weight"),
    "o": ("blk.{i}.attn_output.weight",),
    "gate_up": ("blk.{i}.ffn_gate.weight", "blk.{i}.ffn_up.weight"),
    "down": ("blk.{i}.ffn_down.weight",),
    "lm_head": ("output.weight",),
}
#: Element types of the KV cache: float32 (the default: SmolLM2's logits within 1e-3 of the reference), float16
#: (llama.cpp's default: half the bytes a decode step reads at long context; logits about 4e-2 away on SmolLM2) or
#: q8_0 (8-bit blocks with float16 scales, as llama.cpp's ``-ctk q8_0 -ctv q8_0``: ``kv_layout.py``).
KV_DTYPES = KV_LAYOUT_DTYPES
DEFAULT_KV_DTYPE = "float32"
#: GGML types kept as their blocks, and the weight format each becomes (``quant_formats.LAYOUTS``: the packed
#: integer-dot kernels of ``quant_matvec``)
GGUF_FORMATS = {"Q8_0": "q8_0", "Q4_1": "q4_1", **{name: layout.fmt for name, layout in LAYOUTS.items()}}
#: the GGML type of each quantised weight format
FORMAT_TYPES = {fmt: name for name, fmt in GGUF_FORMATS.items()}
#: joins the formats of a fused weight's parts where no one format holds them all exactly (``_stored_format``)
SPLIT = "+"


@dataclass(frozen=True)
class LlamaSpec:
    """What the compiled module depends on: the architecture's sizes, RoPE, and each weight kind's storage format."""

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
    #: RMS norm of each q and k head before RoPE (``ModelFamily.qk_norm``)
    qk_norm: bool = False
    #: RoPE's inverse frequencies, ``head_dim / 2`` of them (``RopeScaling.inverse_frequencies``); empty: unscaled
    #: ``rope_theta ** (-2 i / head_dim)``
    rope_inv_freq: tuple[float, ...] = ()
    #: the rotated values of each head (``rope_dim`` <= ``head_dim``; 0: all) and cos/sin's factor (LongRoPE)
    rope_dim: int = 0
    rope_attention_factor: float = 1.0
    formats: tuple[tuple[str, str], ...] = ()
    #: decode matvecs of quantised weights by integer dot products (``integer_matvec``: the target has AVX2)
    int8_dot: bool = False
    #: the KV cache's element type (``KV_DTYPES``): q, k, v are rounded to it before RoPE and the attention, whose
    #: output is widened back to float32
    kv_dtype: str = "float32"
    #: the bits of the packed matmuls' activation codes (``packed_matvec.ACTIVATION_BITS``)
    activation_bits: int = DEFAULT_ACTIVATION_BITS
    #: the target has AVX512-VNNI (``packed_matvec.has_vnni``): the packed matmuls' VNNI tiles (the same outputs,
    #: fewer instructions; ``quant_matvec``'s wide and pair tiles), a packed Q8_0 output head (``packed``) and a
    #: q8_0 KV cache's integer scores by ``vpdpbusd`` (``decode_attention.RowAttention``, the same outputs)
    vnni: bool = False
    #: the MLP's gate activation (``model_family.Activation`` value: ``silu`` or ``gelu_pytorch_tanh``)
    activation: str = "silu"
    #: RMS norms also after attention and after the MLP (``NormPlacement.SANDWICH``: Gemma)
    sandwich_norms: bool = False
    #: the embeddings' factor (Gemma: ``sqrt(hidden)``), the attention's scale (0: ``1 / sqrt(head_dim)``) and the
    #: soft-caps of the attention scores and of the logits (0: none)
    embed_scale: float = 1.0
    sm_scale: float = 0.0
    attn_softcap: float = 0.0
    final_softcap: float = 0.0
    #: the sliding window of the layers ``window_layers`` (``LlamaConfig``); 0: none
    sliding_window: int = 0
    window_layers: tuple[int, ...] = ()
    #: the inverse frequencies of the ``window_layers``' own RoPE (Gemma 3's local base); set, every layer rotates q
    #: and k itself (``attention_kernels.rope_kernel(in_model=True)``) and the cache's RoPE only copies
    local_rope_inv_freq: tuple[float, ...] = ()

    def kv_layout(self) -> KVLayout:
        """What the KV cache stores per token (``kv_layout.KVLayout``)."""
        return KVLayout(self.kv_dtype, self.n_kv_heads, self.head_dim)

    def packed(self, kind: str, layer: int | None = None, fmt: str | None = None) -> bool:
        """Whether weight kind ``kind`` (of ``layer``; stored in ``fmt``, by default its format) is stored
        repacked: the ``quant_formats`` types always (``quant_matvec``); Q4_1 on an AVX2 target (``quant_formats.Q4_1``,
        ``quant_matvec`` too; not the embedding, whose rows the lookup reads, nor a tied output head, which is the
        embedding); on an AVX512-VNNI target also Q8_0 (``packed_matvec``), except an untied embedding."""
        fmt = fmt or self.fmt(kind, layer)
        if fmt in BY_FORMAT:
            return True
        if self.int8_dot and fmt == "q4_1":
            return kind != "embed" and not (kind == "lm_head" and self.tied_embeddings)
        if self.vnni and fmt == "q8_0":
            return kind != "embed" or self.tied_embeddings
        return False

    def fmt(self, kind: str, layer: int | None = None) -> str:
        """Storage format of weight kind ``kind`` (``WEIGHT_KINDS``) in ``layer`` (a per-layer entry ``kind.i``
        where the layers differ, else the kind's); the tied output head uses the embedding's. A fused weight whose
        parts keep formats of their own (``SPLIT``) reads ``fmt1+fmt2+...``, one per part."""
        if kind == "lm_head" and self.tied_embeddings:
            kind = "embed"
        formats = dict(self.formats)
        return formats.get(f"{kind}.{layer}", formats.get(kind, "float16"))

    def parts(self, kind: str, layer: int | None = None) -> list[tuple[int, bool]] | None:
        """A fused kind's parts, ``(rows, packed)`` each, where its parts keep formats of their own (``SPLIT``)."""
        fmt = self.fmt(kind, layer)
        if SPLIT not in fmt:
            return None
        rows = {"qkv": [self.n_heads * self.head_dim] + [self.n_kv_heads * self.head_dim] * 2,
                "gate_up": [self.ffn, self.ffn]}[kind]
        return [(n, self.packed(kind, layer, f)) for n, f in zip(rows, fmt.split(SPLIT), strict=True)]

    @classmethod
    def from_model(cls, model: GGUFModel, weight_dtype: str = "auto", raw: RawTensors | None = None) -> LlamaSpec:
        """The spec of a loaded model. ``weight_dtype``: ``float16`` or ``float32`` for every matrix, or ``auto``:
        a kind whose GGUF tensors are all Q8_0 (or all Q4_1) and present in ``raw`` keeps that format, the others
        are float16. Biases, QK-norm and RoPE's frequencies from the model's family and config."""
        cfg = model.config
        family = family_named(cfg.architecture)
        if weight_dtype not in ("auto", "float16", "float32"):
            raise ValueError(f"weight_dtype {weight_dtype!r} is not supported (auto, float16 or float32)")
        formats: list[tuple[str, str]] = []
        for kind, patterns in WEIGHT_KINDS.items():
            if kind == "lm_head" and cfg.tied_embeddings:
                continue  # the embedding's arrays
            layers = range(cfg.n_layers) if "{i}" in patterns[0] else [None]
            chosen = [_stored_format([p.format(i=i) for p in patterns], weight_dtype, raw) for i in layers]
            if len(set(chosen)) == 1:
                formats.append((kind, chosen[0]))
            else:  # the layers differ (a Q4_K_M file's Q4_K and Q6_K ffn_down)
                formats += [(f"{kind}.{i}", fmt) for i, fmt in zip(layers, chosen, strict=True)]
        return cls(
            n_layers=cfg.n_layers, hidden=cfg.hidden, n_heads=cfg.n_heads, n_kv_heads=cfg.n_kv_heads,
            head_dim=cfg.head_dim, ffn=cfg.ffn, vocab=cfg.vocab, rope_theta=float(cfg.rope_theta),
            rms_eps=float(cfg.rms_eps), tied_embeddings=cfg.tied_embeddings,
            qkv_bias=family.qkv_bias, qk_norm=family.qk_norm,
            rope_inv_freq=tuple(float(f) for f in cfg.rope.inverse_frequencies(cfg.rope_dim)),
            rope_dim=cfg.rope_dim, rope_attention_factor=float(cfg.rope_attention_factor),
            formats=tuple(formats), activation=family.activation.value,
            sandwich_norms=family.norm_placement is NormPlacement.SANDWICH,
            embed_scale=float(np.float32(np.sqrt(cfg.hidden))) if family.embed_scaled else 1.0,
            sm_scale=cfg.sm_scale, attn_softcap=float(cfg.attn_softcap), final_softcap=float(cfg.final_softcap),
            sliding_window=cfg.sliding_window if cfg.window_layers else 0, window_layers=cfg.window_layers,
            local_rope_inv_freq=tuple(float(f) for f in RopeScaling(cfg.local_rope_theta).inverse_frequencies(
                cfg.rope_dim)) if cfg.local_rope_theta and cfg.window_layers else (),
        )

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def inverse_frequencies(self) -> tuple[float, ...]:
        """RoPE's inverse frequencies (``rope_inv_freq``, or the unscaled ones of ``rope_theta``)."""
        if self.rope_inv_freq:
            return self.rope_inv_freq
        rope_dim = self.rope_dim or self.head_dim
        return tuple(float(f) for f in self.rope_theta ** (-np.arange(0, rope_dim, 2) / rope_dim))



def _stored_format(names: list[str], weight_dtype: str, raw: RawTensors | None) -> str:
    """The format of one weight (the GGUF tensors ``names``, fused): ``weight_dtype`` unless it is "auto"; then
    the GGUF's type when every part is kept as blocks (``raw``), parts of different types together in a type every
    one of them widens to exactly (``quant_formats.common_type``: Q5_0 + Q8_0 as Q8_0), else each part in its own
    (``SPLIT``: a Q4_K_M file's Q4_K q/k beside a Q6_K v, one matmul each); float16 when a part is not
    quantised."""
    if weight_dtype != "auto":
        return weight_dtype
    if raw is None or not all(n in raw for n in names):
        return "float16"
    common, exact = common_type({raw[n][0] for n in names})
    if exact:
        return GGUF_FORMATS[common]
    return SPLIT.join(GGUF_FORMATS[raw[n][0]] for n in names)


def packed_layout(fmt: str, packed: bool) -> QuantLayout | None:
    """The ``quant_formats`` layout that a weight of format ``fmt`` (``packed`` or not) is stored in for
    ``quant_matvec``, or None (GGUF blocks or float for ``linear_kernels``, or packed Q8_0 for ``packed_matvec``)."""
    if fmt in BY_FORMAT:
        return BY_FORMAT[fmt]
    return Q4_1 if packed and fmt == Q4_1.fmt else None


class _Weights(nn.Module):
    """The arrays storing one ``[out, in]`` weight matrix in format ``fmt`` (``linear_kernels.param_shapes``), or
    with ``packed`` repacked (``packed_layout``'s ``quant_formats`` layout, or Q8_0's ``packed_q8_0_shapes``)."""

    def __init__(self, out_features: int, in_features: int, fmt: str, int8_dot: bool = False,
                 packed: bool = False, activation_bits: int = DEFAULT_ACTIVATION_BITS, vnni: bool = False) -> None:
        if packed and fmt not in ("q4_1", "q8_0", *BY_FORMAT):
            raise ValueError(f"only quantised weights are packed, got {fmt!r}")
        if fmt in BY_FORMAT and not int8_dot:
            raise ValueError(f"{fmt} weights need a CPU with AVX2 (the packed integer-dot kernels); convert the "
                             f"model to another type or compile with weight_dtype='float16'")
        self.out_features, self.in_features, self.fmt, self.int8_dot = out_features, in_features, fmt, int8_dot
        self.packed, self.activation_bits, self.vnni = packed, activation_bits, vnni
        self.layout = packed_layout(fmt, packed)
        self.suffixes = []
        shapes = (self.layout.shapes if self.layout else packed_q8_0_shapes if packed
                  else functools.partial(param_shapes, fmt=fmt))
        for suffix, shape, dtype in shapes(out_features, in_features):
            setattr(self, suffix, nn.Parameter(shape, dtype))
            self.suffixes.append(suffix)

    def arrays(self) -> list[nn.Tensor]:
        return [getattr(self, suffix) for suffix in self.suffixes]

    def matmul(self, x: nn.Tensor, mode: str, out_dtype: str = "float32") -> nn.Tensor:
        """``x[..., in] @ W.T`` -> ``[..., out]`` of ``out_dtype`` (leading axes flattened into tokens); ``mode``
        "decode" or "prefill" (``linear_kernels.linear_kernel``: one schedule at every token count, for batch
        invariance). ``x`` float32 or float16: the integer dot products read and write either type themselves
        (``integer_linear_kernel``), the other kernels get cast kernels around them."""
        lead = list(x.shape[:-1])
        flat = x.reshape(-1, self.in_features) if len(lead) != 1 else x
        if self.packed:  # one kernel for every token count (integer dots, 8 rows a vector; Q8_0: the VNNI tile)
            shape, types = (self.out_features, self.in_features), (flat.dtype, out_dtype, self.activation_bits)
            kernel = (quant_matmul_kernel(self.layout, *shape, *types, self.vnni) if self.layout
                      else packed_q8_0_kernel(*shape, *types))
            vnni = "_vnni" if self.vnni and self.fmt != "q8_0" else ""
            y = nn.op.tensor_ir_op(kernel, f"packed_{self.fmt}_{shape[0]}x{shape[1]}_{'_'.join(map(str, types))}{vnni}",
                                   args=[flat, *self.arrays()],
                                   out=nn.Tensor.placeholder([flat.shape[0], self.out_features], out_dtype))
            return y if len(lead) == 1 else y.reshape(*lead, self.out_features)
        integer = self.int8_dot and self.fmt in QUANTISED
        if mode == "prefill" and integer:
            mode = "decode"  # the integer dot products (tokens in groups) beat the GEMM at every token count here
        shape = [self.out_features, self.in_features]
        if integer and (flat.dtype != "float32" or out_dtype != "float32"):
            kernel = integer_linear_kernel(*shape, self.fmt, flat.dtype, out_dtype)
            name, y_dtype = f"linear_{self.fmt}_{shape[0]}x{shape[1]}_{flat.dtype}_{out_dtype}", out_dtype
        else:
            flat = flat if flat.dtype == "float32" else flat.astype("float32")
            kernel = linear_kernel(*shape, self.fmt, self.int8_dot, mode=mode)
            name, y_dtype = f"linear_{self.fmt}_{shape[0]}x{shape[1]}_{mode}", "float32"
        y = nn.op.tensor_ir_op(kernel, name, args=[flat, *self.arrays()],
                               out=nn.Tensor.placeholder([flat.shape[0], self.out_features], y_dtype))
        y = y if y_dtype == out_dtype else y.astype(out_dtype)
        return y if len(lead) == 1 else y.reshape(*lead, self.out_features)

    def rows(self, ids: nn.Tensor) -> nn.Tensor:
        """``W[ids]`` -> ``[n, in]`` float32 (the embedding lookup)."""
        if self.fmt in BY_FORMAT:
            return nn.op.tensor_ir_op(
                quant_embed_kernel(BY_FORMAT[self.fmt], self.out_features, self.in_features),
                f"embed_{self.fmt}_{self.out_features}x{self.in_features}", args=[ids, *self.arrays()],
                out=nn.Tensor.placeholder([ids.shape[0], self.in_features], "float32"))
        if self.packed and self.fmt != "q8_0":
            raise ValueError("the rows of packed Q4_1 weights are not looked up (such an embedding is never packed)")
        if self.packed:
            return nn.op.tensor_ir_op(
                packed_q8_0_embed_kernel(self.out_features, self.in_features),
                f"embed_packed_q8_0_{self.out_features}x{self.in_features}", args=[ids, *self.arrays()],
                out=nn.Tensor.placeholder([ids.shape[0], self.in_features], "float32"))
        return nn.op.tensor_ir_op(
            embed_kernel(self.out_features, self.in_features, self.fmt),
            f"embed_{self.fmt}_{self.out_features}x{self.in_features}",
            args=[ids, *self.arrays()],
            out=nn.Tensor.placeholder([ids.shape[0], self.in_features], "float32"),
        )


class _SplitWeights(nn.Module):
    """A fused weight whose parts (``sizes`` rows each) keep formats of their own (``SPLIT``): one matmul per part,
    the outputs joined."""

    def __init__(self, sizes: list[int], in_features: int, formats: list[str], packed: list[bool], int8_dot: bool,
                 activation_bits: int, vnni: bool) -> None:
        self.parts = nn.ModuleList([_Weights(n, in_features, fmt, int8_dot, p, activation_bits, vnni)
                                    for n, fmt, p in zip(sizes, formats, packed, strict=True)])

    def matmul(self, x: nn.Tensor, mode: str, out_dtype: str = "float32") -> nn.Tensor:
        return nn.op.concat([part.matmul(x, mode, out_dtype) for part in self.parts], dim=-1)


class Linear(nn.Module):
    """A bias-optional projection; the weight in ``fmt`` (split: ``parts`` gives the fused parts' rows and whether
    each is packed), the bias float32, the output float32."""

    def __init__(self, in_features: int, out_features: int, fmt: str, bias: bool = False,
                 int8_dot: bool = False, packed: bool = False,
                 activation_bits: int = DEFAULT_ACTIVATION_BITS, vnni: bool = False,
                 parts: list[tuple[int, bool]] | None = None) -> None:
        if SPLIT in fmt:
            if parts is None or len(parts) != len(fmt.split(SPLIT)):
                raise ValueError(f"a weight stored as {fmt!r} needs the rows of its {len(fmt.split(SPLIT))} parts")
            self.w: _Weights | _SplitWeights = _SplitWeights(
                [n for n, _ in parts], in_features, fmt.split(SPLIT), [p for _, p in parts], int8_dot,
                activation_bits, vnni)
        else:
            self.w = _Weights(out_features, in_features, fmt, int8_dot, packed, activation_bits, vnni)
        self.bias = nn.Parameter((out_features,), "float32") if bias else None

    def forward(self, x: nn.Tensor, mode: str, out_dtype: str = "float32") -> nn.Tensor:
        if self.bias is None:
            return self.w.matmul(x, mode, out_dtype)
        y = self.w.matmul(x, mode) + self.bias
        return y if out_dtype == "float32" else y.astype(out_dtype)


class RMSNorm(nn.Module):
    """``x / sqrt(mean(x^2) + eps) * weight`` over the last axis, float32: of the hidden states ``[tokens,
    hidden]`` by ``norm_kernels.rms_norm_kernel`` (tokens in parallel, bit for bit what Relax's ``rms_norm``
    computes), of a 3-D input (QK-norm's heads) by Relax's ``rms_norm``."""

    def __init__(self, hidden: int, eps: float) -> None:
        self.hidden = hidden
        self.weight = nn.Parameter((hidden,), "float32")
        self.eps = eps

    def forward(self, x: nn.Tensor) -> nn.Tensor:
        if x.ndim != 2:
            return nn.op.rms_norm(x, self.weight, axes=[-1], epsilon=self.eps)
        return nn.op.tensor_ir_op(rms_norm_kernel(self.hidden, self.eps, False), f"rms_norm_{self.hidden}",
                                  args=[x, self.weight], out=nn.Tensor.placeholder(x.shape, "float32"))

    def add(self, x: nn.Tensor, r: nn.Tensor) -> tuple[nn.Tensor, nn.Tensor]:
        """``(x + r, norm(x + r))`` for ``[tokens, hidden]`` inputs, in one pass (``rms_norm_kernel``'s ``add``)."""
        total, out = nn.op.tensor_ir_op(
            rms_norm_kernel(self.hidden, self.eps, True), f"add_rms_norm_{self.hidden}", args=[x, r, self.weight],
            out=[nn.Tensor.placeholder(x.shape, "float32"), nn.Tensor.placeholder(x.shape, "float32")])
        return total, out


class Attention(nn.Module):
    """Fused q/k/v projection, attention (with RoPE) in the paged KV cache, output projection."""

    def __init__(self, spec: LlamaSpec, layer: int | None = None) -> None:
        self.spec = spec
        qkv_rows = (spec.n_heads + 2 * spec.n_kv_heads) * spec.head_dim
        self.qkv = Linear(spec.hidden, qkv_rows, spec.fmt("qkv", layer), bias=spec.qkv_bias, int8_dot=spec.int8_dot,
                          packed=spec.packed("qkv", layer), activation_bits=spec.activation_bits,
                          vnni=spec.vnni, parts=spec.parts("qkv", layer))
        self.o = Linear(spec.n_heads * spec.head_dim, spec.hidden, spec.fmt("o", layer), int8_dot=spec.int8_dot,
                        packed=spec.packed("o", layer), activation_bits=spec.activation_bits,
                          vnni=spec.vnni)
        self.q_norm = RMSNorm(spec.head_dim, spec.rms_eps) if spec.qk_norm else None
        self.k_norm = RMSNorm(spec.head_dim, spec.rms_eps) if spec.qk_norm else None

    def forward(self, x: nn.Tensor, kv_cache: PagedKVCache, layer: int, b: Any, t: Any, mode: str,
                positions: nn.Tensor | None = None, exact: bool = False) -> nn.Tensor:
        """``x[b t, hidden]`` (the tokens of ``b`` sequences of ``t`` each, flat) -> ``[b t, hidden]``;
        ``positions``: the tokens' positions when the model applies RoPE itself (``spec.local_rope_inv_freq``).
        ``exact`` (the verify forward): each token's attention is computed as a decode step computes it (the
        kernels' exact mode, asked for through ``sm_scale``: ``attention_mode.py``,
        ``prefill_attention.paged_prefill_kernel``)."""
        s = self.spec
        layout = s.kv_layout()
        # The cache takes q, k, v in its own type (TVM checks qkv's against its pages') and returns that type.
        heads = s.n_heads + 2 * s.n_kv_heads
        if self.q_norm is not None and self.k_norm is not None:  # QK-norm in float32, then the cache's type
            q, k, v = nn.op.split(self.qkv(x, mode).reshape(x.shape[0], heads, s.head_dim),
                                  [s.n_heads, s.n_heads + s.n_kv_heads], axis=1)
            qkv = nn.op.concat([self.q_norm(q), self.k_norm(k), v], dim=1)
            qkv = qkv if layout.dtype == "float32" else qkv.astype(layout.dtype)
        else:  # [tokens, heads * head_dim]: as the padding kernel takes it (no reshapes there and back)
            qkv = self.qkv(x, mode, layout.dtype)
        if positions is not None:  # this layer's RoPE (the sliding layers' own frequencies, or the model's)
            qkv = qkv if qkv.ndim == 3 else qkv.reshape(x.shape[0], heads, s.head_dim)
            local = layer in s.window_layers
            inv_freq = s.local_rope_inv_freq if local else s.inverse_frequencies()
            factor = 1.0 if local else s.rope_attention_factor
            n = x.shape[0]
            q, k, v = nn.op.tensor_ir_op(
                rope_kernel(s.n_kv_heads, s.n_heads, s.head_dim, inv_freq, s.kv_dtype, factor, in_model=True),
                f"rope_{'local' if local else 'global'}", args=[qkv, positions],
                out=[nn.Tensor.placeholder([n, h, s.head_dim], layout.dtype)
                     for h in (s.n_heads, s.n_kv_heads, s.n_kv_heads)])
            qkv = nn.op.concat([q, k, v], dim=1)
        # The cache's query heads carry each token's stored k and v too (``KVLayout.query_heads``), and it stores
        # ``layout.heads`` rows per token: qkv gets heads of padding up to their count.
        query_heads = layout.query_heads(s.n_heads)
        padded = query_heads + 2 * layout.heads
        n = x.shape[0]
        qkv = nn.op.tensor_ir_op(  # the same values, padded with zeros (row_copies: tokens in parallel)
            pad_rows_kernel(heads * s.head_dim, padded * s.head_dim, layout.dtype), "pad_heads",
            args=[qkv if qkv.ndim == 2 else qkv.reshape(n, heads * s.head_dim)],
            out=nn.Tensor.placeholder([n, padded * s.head_dim], layout.dtype)).reshape(b, t, padded, s.head_dim)
        # the scale carries the kernels' window switch and exact mode (``attention_mode.py``)
        sm_scale = attention_mode.encode(s.sm_scale or 1.0 / math.sqrt(s.head_dim), windowed=layer in s.window_layers,
                                         exact=exact)
        out = kv_cache.attention_with_fused_qkv(layer, qkv, query_heads, sm_scale=sm_scale)
        out = nn.op.tensor_ir_op(  # the query heads' rows of each token
            first_columns_kernel(query_heads * s.head_dim, s.n_heads * s.head_dim, layout.dtype), "query_heads",
            args=[out.reshape(n, query_heads * s.head_dim)],
            out=nn.Tensor.placeholder([n, s.n_heads * s.head_dim], layout.dtype))
        return self.o(out, mode)


class MLP(nn.Module):
    """SwiGLU: ``(silu(h @ Wgate.T) * (h @ Wup.T)) @ Wdown.T`` with gate and up fused into one projection and the
    activation one kernel (``swiglu_kernel``); GeGLU (``spec.activation``: gelu's tanh approximation) the same
    with Relax's ``gelu(approximate="tanh")``."""

    def __init__(self, spec: LlamaSpec, layer: int | None = None) -> None:
        self.ffn = spec.ffn
        self.activation = Activation(spec.activation)
        self.gate_up = Linear(spec.hidden, 2 * spec.ffn, spec.fmt("gate_up", layer), int8_dot=spec.int8_dot,
                             packed=spec.packed("gate_up", layer), activation_bits=spec.activation_bits,
                             vnni=spec.vnni, parts=spec.parts("gate_up", layer))
        self.down = Linear(spec.ffn, spec.hidden, spec.fmt("down", layer), int8_dot=spec.int8_dot,
                          packed=spec.packed("down", layer), activation_bits=spec.activation_bits,
                          vnni=spec.vnni)

    def forward(self, x: nn.Tensor, mode: str) -> nn.Tensor:
        """``x[tokens, hidden]`` -> ``[tokens, hidden]``."""
        gate_up = self.gate_up(x, mode)
        if self.activation is Activation.GELU_TANH:
            gate, up = nn.op.split(gate_up, 2, axis=-1)
            return self.down(nn.op.gelu(gate, approximate="tanh") * up, mode)
        act = nn.op.tensor_ir_op(swiglu_kernel(self.ffn), f"swiglu_{self.ffn}", args=[gate_up],
                                 out=nn.Tensor.placeholder([gate_up.shape[0], self.ffn], "float32"))
        return self.down(act, mode)


class Block(nn.Module):
    """One decoder layer: pre-norm attention and pre-norm MLP, each added to the residual (sandwich norms: each
    output normed again before the add)."""

    def __init__(self, spec: LlamaSpec, layer: int) -> None:
        self.layer = layer
        self.attn_norm = RMSNorm(spec.hidden, spec.rms_eps)
        self.attn = Attention(spec, layer)
        self.ffn_norm = RMSNorm(spec.hidden, spec.rms_eps)
        self.mlp = MLP(spec, layer)
        self.post_attn_norm = RMSNorm(spec.hidden, spec.rms_eps) if spec.sandwich_norms else None
        self.post_ffn_norm = RMSNorm(spec.hidden, spec.rms_eps) if spec.sandwich_norms else None

    def forward(self, x: nn.Tensor, pending: nn.Tensor | None, kv_cache: PagedKVCache, b: Any, t: Any, mode: str,
                positions: nn.Tensor | None = None, exact: bool = False) -> tuple[nn.Tensor, nn.Tensor]:
        """This layer on the residual stream ``x[b t, hidden]`` (flat: no reshapes between the kernels) plus
        ``pending`` (the previous layer's MLP output, not yet added; None before the first layer): ``(x, out)``,
        the stream after the attention's add and this layer's MLP output, which the next norm adds (each add is
        one pass with the norm after it: ``RMSNorm.add``)."""
        x, h = (x, self.attn_norm(x)) if pending is None else self.attn_norm.add(x, pending)
        out = self.attn(h, kv_cache, self.layer, b, t, mode, positions, exact)
        x, h = self.ffn_norm.add(x, out if self.post_attn_norm is None else self.post_attn_norm(out))
        out = self.mlp(h, mode)
        return x, (out if self.post_ffn_norm is None else self.post_ffn_norm(out))


class LlamaModule(nn.Module):
    """The whole decoder; see the module docstring for the exported functions."""

    def __init__(self, spec: LlamaSpec) -> None:
        self.spec = spec
        self.embed_tokens = _Weights(spec.vocab, spec.hidden, spec.fmt("embed"), spec.int8_dot, spec.packed("embed"),
                                     spec.activation_bits, spec.vnni)
        self.layers = nn.ModuleList([Block(spec, i) for i in range(spec.n_layers)])
        self.norm = RMSNorm(spec.hidden, spec.rms_eps)
        self.lm_head = None if spec.tied_embeddings else Linear(spec.hidden, spec.vocab, spec.fmt("lm_head"),
                                                                int8_dot=spec.int8_dot, packed=spec.packed("lm_head"),
                                                                activation_bits=spec.activation_bits,
                          vnni=spec.vnni)

    def embed(self, input_ids: nn.Tensor) -> nn.Tensor:
        rows = self.embed_tokens.rows(input_ids)
        return rows if self.spec.embed_scale == 1.0 else rows * self.spec.embed_scale

    def _logits(self, x: nn.Tensor, pending: nn.Tensor, mode: str) -> nn.Tensor:
        """The logits of the rows of ``x + pending`` (the residual stream and the last layer's MLP output)."""
        _, hidden = self.norm.add(x, pending)
        logits = self.lm_head(hidden, mode) if self.lm_head is not None else self.embed_tokens.matmul(hidden, mode)
        cap = self.spec.final_softcap
        return logits if not cap else nn.op.tanh(logits / cap) * cap

    def _layers(self, x: nn.Tensor, kv_cache: PagedKVCache, b: Any, t: Any, mode: str,
                exact: bool = False) -> tuple[nn.Tensor, nn.Tensor]:
        """``(x, out)``: the residual stream before the last layer's MLP output ``out`` is added (``Block``)."""
        positions = kv_cache.get_query_positions(x.shape[0]) if self.spec.local_rope_inv_freq else None
        pending = None
        for block in self.layers:
            x, pending = block(x, pending, kv_cache, b, t, mode, positions, exact)
        return x, pending

    # Batch invariance: prefill runs the layers' matmuls as the GEMM and decode as dot products whatever the token
    # count, so a sequence's logits do not depend on the other sequences of the pass (linear_kernel's modes). The
    # logits of a prefill (a row or a few per sequence) take the dot products, as decode's do. Quantised weights on
    # a CPU with the integer dot products take them in the prefill too (``_Weights.matmul``): on the AVX2 machines
    # here they are faster than the GEMM at every token count (no per-call decode of every weight into float), and
    # a prompt's matmuls are then those of decoding it token by token.
    def prefill(self, input_ids: nn.Tensor, logit_positions: nn.Tensor, kv_cache: PagedKVCache) -> nn.Tensor:
        x, out = self._layers(self.embed(input_ids), kv_cache, 1, input_ids.shape[0], "prefill")
        return self._logits(nn.op.take(x, logit_positions, axis=0), nn.op.take(out, logit_positions, axis=0),
                            "decode")

    def verify(self, input_ids: nn.Tensor, kv_cache: PagedKVCache) -> nn.Tensor:
        """A prefill whose matmuls are decode's dot products and whose attention is decode's algorithm per token
        (the kernels' exact mode), with the logits after every token: each token's logits are bit for bit those a
        decode step gives it (speculative decoding checks drafts with it)."""
        x, out = self._layers(self.embed(input_ids), kv_cache, 1, input_ids.shape[0], "decode", exact=True)
        return self._logits(x, out, "decode")

    def decode(self, input_ids: nn.Tensor, kv_cache: PagedKVCache) -> nn.Tensor:
        x, out = self._layers(self.embed(input_ids), kv_cache, input_ids.shape[0], 1, "decode")
        return self._logits(x, out, "decode")

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
            num_attention_heads=s.kv_layout().query_heads(s.n_heads),
            num_key_value_heads=s.kv_layout().heads,
            qk_head_dim=s.head_dim,
            v_head_dim=s.head_dim,
            mla_original_qk_head_dim=0,
            mla_original_v_head_dim=0,
            rope_mode=RopeMode.NONE if s.local_rope_inv_freq else RopeMode.NORMAL,  # NONE: the model rotates
            rope_scale=1,
            rope_theta=s.rope_theta,
            rope_scaling={},
            rope_ext_factors=tvm.relax.prim_value(0),
            rotary_dim=s.head_dim,
            enable_disaggregation=False,
            dtype=s.kv_layout().dtype,
            target=tvm.target.Target.current(),
        )

    def export_spec(self) -> dict[str, Any]:
        """The ``nn.spec`` of the five exported functions (weights passed packed, no effects)."""
        packed = {"param_mode": "packed", "effect_mode": "none"}
        return {
            "embed": {"input_ids": nn.spec.Tensor(["n"], "int32"), "$": packed},
            "prefill": {
                "input_ids": nn.spec.Tensor(["n"], "int32"),
                "logit_positions": nn.spec.Tensor(["batch"], "int32"),
                "kv_cache": nn.spec.Object(object_type=PagedKVCache),
                "$": packed,
            },
            "verify": {
                "input_ids": nn.spec.Tensor(["n"], "int32"),
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
    mod = replace_attention_kernels(mod, spec.n_kv_heads, spec.n_heads, spec.head_dim, spec.inverse_frequencies(),
                                    spec.kv_dtype, spec.rope_attention_factor, spec.attn_softcap, spec.sliding_window,
                                    spec.vnni)
    return mod, [name for name, _ in named_params]
