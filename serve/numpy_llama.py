"""A plain numpy float32 Llama forward pass with a KV cache: the reference the compiled model is checked against.

For a model of any supported family (``logitproc.compile.families``) read by ``load_gguf`` or ``load_hf_dir``
(weights ``[out, in]``, float32, the canonical layout of ``model_family``). ``x = token_embd[ids]`` (times
``sqrt(hidden)``: the family's ``embed_scaled``), then per layer, for the tokens ``x`` ``[T, hidden]`` at positions
``p0 .. p0+T-1``::

    h = rmsnorm(x) * attn_norm                        rmsnorm(x) = x / sqrt(mean(x*x, last axis) + eps)
    q, k, v = h @ Wq.T, h @ Wk.T, h @ Wv.T            [T, n_heads, d], [T, n_kv, d], [T, n_kv, d]
                                                      (+ bq, bk, bv: the family's ``qkv_bias``)
    q, k = rmsnorm(q) * q_norm, rmsnorm(k) * k_norm   over each head (the family's ``qk_norm``)
    q, k = rope(q), rope(k)                            pairs (i, i + r/2) of the first r = rope_dim values
                                                      rotated by pos * inv_freq[i], cos and sin times the
                                                      attention factor (``RopeScaling``; ``layer_rope``: the
                                                      layer's own); the rest unrotated
    append k, v to the cache; query head j reads KV head j // (n_heads / n_kv)   (grouped-query attention)
    s = q k^T * sm_scale                              (``config.sm_scale``: 1 / sqrt(d) or Gemma's scalar)
    s = cap * tanh(s / cap)                           (``config.attn_softcap``; Gemma 2)
    a = softmax(s, causal; a windowed layer's query at i sees keys at j > i - window) v @ Wo.T
    x += a            (SANDWICH norms: x += rmsnorm(a) * post_attention_norm)
    h = rmsnorm(x) * ffn_norm
    m = (act(h @ Wgate.T) * (h @ Wup.T)) @ Wdown.T    act: silu, or gelu's tanh approximation (the family's)
    x += m            (SANDWICH norms: x += rmsnorm(m) * post_ffw_norm)

then ``logits = (rmsnorm(x[-1]) * output_norm) @ token_embd.T`` (tied output embedding; ``output.weight`` when the
model has one; then ``cap * tanh(logits / cap)`` with ``config.final_softcap``). Everything stays float32: the scalars
taken from the GGUF metadata are Python numbers, which NumPy 2 does not let promote float32 arrays to float64.

``kv_dtype="float16"`` rounds q, k and v to float16 before RoPE, q and k again after it, and the attention's output
(``"q8_0"`` as float16, but k after RoPE and v go through q8_0 blocks, ``q8_0_roundtrip``, and the attention scores
q through q8_0 blocks too, as llama.cpp and the kernels do: ``q8_0_query``),
as the compiled model's float16 KV cache does; ``"float32"`` (the default, as the compiled model's) keeps everything
float32. ``activation_bits=8`` (or 16) rounds the input of every layer matmul (q/k/v, o, gate/up, down) to 8-bit
(16-bit) codes in blocks of 32 as the compiled model's integer-dot kernels do on AVX2 CPUs
(``compile/packed_matvec.py``: ``round_activations``); the output head is not rounded. ``None`` (the default) keeps
them float32.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np
from logitproc.compile.families import family_named
from logitproc.compile.gguf_model import GGUFModel, load_default_model, load_gguf
from logitproc.compile.model_family import Activation, NormPlacement
from logitproc.compile.packed_matvec import ACTIVATION_BITS, quantise_activations, round_activations
from logitproc.compile.relax_llama import DEFAULT_KV_DTYPE, KV_DTYPES
from logitproc.runtime.kernel_library import KernelLibrary

from .chat_template import ChatTemplate
from .runner import ModelRunner

_INITIAL_CACHE = 256


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """``x / sqrt(mean(x^2) + eps) * weight`` over the last axis, float32."""
    scale = 1.0 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    return (x * scale) * weight


def silu(x: np.ndarray) -> np.ndarray:
    """``x * sigmoid(x)``, written with tanh so that large negative inputs do not overflow exp."""
    return x * (0.5 + 0.5 * np.tanh(0.5 * x))


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    """gelu's tanh approximation: ``0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3)))``."""
    return 0.5 * x * (1 + np.tanh(np.float32(np.sqrt(2 / np.pi)) * (x + np.float32(0.044715) * x * x * x)))


def soft_cap(x: np.ndarray, cap: float) -> np.ndarray:
    """``cap * tanh(x / cap)`` (``cap`` 0: ``x`` itself)."""
    return x if not cap else np.float32(cap) * np.tanh(x / np.float32(cap))


def rope_tables(positions: np.ndarray, inv_freq: np.ndarray,
                attention_factor: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin ``[T, len(inv_freq)]`` (float32) of ``position * inv_freq``, times ``attention_factor``,
    computed in float64."""
    angles = positions.astype(np.float64)[:, None] * np.asarray(inv_freq, dtype=np.float64)[None, :]
    return ((np.cos(angles) * attention_factor).astype(np.float32),
            (np.sin(angles) * attention_factor).astype(np.float32))


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Rotate the pairs ``(x[i], x[i + r/2])`` of the first ``r = 2 cos.shape[-1]`` values of each head of ``x``
    ``[T, heads, d]`` by the angles of ``cos``/``sin`` (Hugging Face's rotate-half RoPE); the rest unchanged."""
    half = cos.shape[-1]
    a, b, rest = x[..., :half], x[..., half:2 * half], x[..., 2 * half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return np.concatenate([a * c - b * s, b * c + a * s, rest], axis=-1)


def q8_0_roundtrip(x: np.ndarray) -> np.ndarray:
    """``x`` (float32, last axis a multiple of 32) through a q8_0 KV cache, in the kernel's float32 arithmetic: per
    block of 32, ``scale = max|x| / 127``, ``q = trunc(x / scale +- 0.5)`` (half away from zero), read back as
    ``q * float16(scale)`` (``compile/kv_layout.py``)."""
    blocks = x.astype(np.float32).reshape(*x.shape[:-1], x.shape[-1] // 32, 32)
    scale = np.abs(blocks).max(axis=-1, keepdims=True) / np.float32(127)
    inverse = np.where(scale > 0, np.float32(1) / np.where(scale > 0, scale, np.float32(1)), np.float32(0))
    y = (blocks * inverse.astype(np.float32)).astype(np.float32)
    q = np.trunc(y + np.where(y < 0, np.float32(-0.5), np.float32(0.5))).astype(np.float32)
    return (q * scale.astype(np.float16).astype(np.float32)).reshape(x.shape)


def q8_0_query(q: np.ndarray, sm_scale: float) -> np.ndarray:
    """``q`` (float32, last axis a multiple of 32) as the attention kernels score it on a q8_0 cache: the scaled
    query ``q * sm_scale * log2(e)`` (float32) in q8_0 blocks, quantised as the packed matmuls quantise activations
    (``packed_matvec.quantise_activations``: ``compile/decode_attention.py``'s ``quantise_query``), unscaled again."""
    if not q.size:
        return q.astype(np.float32)
    factor = np.float32(sm_scale) * np.float32(np.log2(np.e))
    x = (q.astype(np.float32) * factor).reshape(-1, q.shape[-1])
    codes, scales = quantise_activations(x, 8)
    held = codes.reshape(x.shape[0], -1, 32).astype(np.float32) * scales[:, :, None]
    return (held.reshape(q.shape) / factor).astype(np.float32)


class NumpyLlama:
    """Greedy-decodable Llama in numpy float32 with a growing KV cache.

    ``prefill(ids)`` starts a new sequence and returns the logits ``[vocab]`` after its last token; ``decode(id)``
    appends one token; ``extend(ids)`` appends several (chunked prefill); ``reset()`` empties the cache.
    """

    def __init__(self, model: GGUFModel, kv_dtype: str = DEFAULT_KV_DTYPE, *,
                 activation_bits: int | None = None) -> None:
        cfg = model.config
        if kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype {kv_dtype!r} is not supported ({' or '.join(KV_DTYPES)})")
        #: float16: q, k, v rounded as the compiled model's float16 KV cache rounds them (``_round_kv``)
        self.kv_dtype = kv_dtype
        if activation_bits not in (None, *ACTIVATION_BITS):
            raise ValueError(f"activation_bits {activation_bits!r} is not supported (None, 8 or 16)")
        #: the layer matmuls' inputs rounded to codes of these bits (``_act``), as the integer-dot kernels round them
        self.activation_bits = activation_bits
        if cfg.n_heads % cfg.n_kv_heads:
            raise ValueError(f"{cfg.n_heads} heads are not a multiple of {cfg.n_kv_heads} KV heads")
        if not model.weights:
            raise ValueError(f"{model.path.name} was read without weights: use load_gguf(path, load_weights=True)")
        self.config = cfg
        w = model.weights
        self._embed = w["token_embd.weight"]
        self._output = w.get("output.weight", self._embed)
        self._output_norm = w["output_norm.weight"]
        names = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate", "ffn_up", "ffn_down")
        self._layers = [tuple(w[f"blk.{i}.{name}.weight"] for name in names) for i in range(cfg.n_layers)]
        family = family_named(cfg.architecture)
        self._embed_scale = np.float32(np.sqrt(cfg.hidden)) if family.embed_scaled else np.float32(1)
        self._activation = gelu_tanh if family.activation is Activation.GELU_TANH else silu
        self._post_norms = [(w[f"blk.{i}.post_attention_norm.weight"], w[f"blk.{i}.post_ffw_norm.weight"])
                            if family.norm_placement is NormPlacement.SANDWICH else None for i in range(cfg.n_layers)]
        zero = np.float32(0)
        self._biases = [tuple(w[f"blk.{i}.attn_{p}.bias"] if family.qkv_bias else zero for p in "qkv")
                        for i in range(cfg.n_layers)]
        self._qk_norms = [(w[f"blk.{i}.attn_q_norm.weight"], w[f"blk.{i}.attn_k_norm.weight"]) if family.qk_norm
                          else None for i in range(cfg.n_layers)]
        #: each layer's RoPE (Gemma 3's sliding layers: a base of their own): inverse frequencies, attention factor
        self._ropes = [(cfg.layer_rope(i).inverse_frequencies(cfg.rope_dim), float(cfg.layer_rope(i).attention_factor))
                       for i in range(cfg.n_layers)]
        self._eps = float(cfg.rms_eps)
        self._scale = cfg.sm_scale
        self._k_cache = np.zeros((0,), np.float32)
        self._v_cache = np.zeros((0,), np.float32)
        self._length = 0
        self.reset()

    @property
    def position(self) -> int:
        """Number of tokens in the KV cache (the position the next token gets)."""
        return self._length

    def reset(self) -> None:
        """Forget the sequence (keeps the cache's memory)."""
        if self._k_cache.ndim != 4:
            self._allocate(_INITIAL_CACHE)
        self._length = 0

    def _allocate(self, capacity: int) -> None:
        cfg = self.config
        shape = (cfg.n_layers, cfg.n_kv_heads, capacity, cfg.head_dim)
        k, v = np.zeros(shape, np.float32), np.zeros(shape, np.float32)
        if self._k_cache.ndim == 4 and self._length:
            k[:, :, : self._length] = self._k_cache[:, :, : self._length]
            v[:, :, : self._length] = self._v_cache[:, :, : self._length]
        self._k_cache, self._v_cache = k, v

    def prefill(self, token_ids: Sequence[int] | np.ndarray) -> np.ndarray:
        """Start a new sequence with ``token_ids``; the logits ``[vocab]`` (float32) predicting the next token."""
        self.reset()
        return self.extend(token_ids)

    def decode(self, token_id: int) -> np.ndarray:
        """Append one token; the logits ``[vocab]`` predicting the one after it."""
        return self.extend([int(token_id)])

    def extend(self, token_ids: Sequence[int] | np.ndarray) -> np.ndarray:
        """Append ``token_ids`` to the current sequence; the logits ``[vocab]`` after the last of them."""
        return self.extend_all(token_ids)[-1]

    def extend_all(self, token_ids: Sequence[int] | np.ndarray) -> np.ndarray:
        """Append ``token_ids`` to the current sequence; the logits ``[len(token_ids), vocab]`` after each of them."""
        ids = np.asarray(token_ids, dtype=np.int64).reshape(-1)
        if ids.size == 0:
            raise ValueError("no tokens to process")
        if ids.min() < 0 or ids.max() >= self.config.vocab:
            raise ValueError(f"token ids must lie in [0, {self.config.vocab})")
        start, end = self._length, self._length + ids.size
        if end > self.config.context:
            raise ValueError(f"sequence of {end} tokens exceeds the model's context of {self.config.context}")
        capacity = self._k_cache.shape[2]
        if end > capacity:
            while capacity < end:
                capacity *= 2
            self._allocate(min(capacity, self.config.context))
        hidden = self._forward(ids, start)
        self._length = end
        return soft_cap(rms_norm(hidden, self._output_norm, self._eps) @ self._output.T, self.config.final_softcap)

    def _forward(self, ids: np.ndarray, start: int) -> np.ndarray:
        """Hidden states ``[T, hidden]`` after the last layer; writes the tokens' K and V into the cache."""
        cfg = self.config
        n_tok, n_kv, d, rep = ids.size, cfg.n_kv_heads, cfg.head_dim, cfg.n_rep
        end = start + n_tok
        tables = [rope_tables(np.arange(start, end), *rope) for rope in self._ropes]
        # Query t sits at position start + t and sees cached positions 0 .. start + t.
        behind = np.arange(start, end)[:, None] - np.arange(end)[None, :]  # query position - key position
        causal = np.where(behind >= 0, 0.0, -np.inf).astype(np.float32)
        windowed = np.where((behind >= 0) & (behind < cfg.sliding_window), 0.0, -np.inf).astype(np.float32)

        x = self._embed[ids] * self._embed_scale
        for layer, (attn_norm, wq, wk, wv, wo, ffn_norm, w_gate, w_up, w_down) in enumerate(self._layers):
            h = self._act(rms_norm(x, attn_norm, self._eps))
            bq, bk, bv = self._biases[layer]
            q = (h @ wq.T + bq).reshape(n_tok, cfg.n_heads, d)
            k = (h @ wk.T + bk).reshape(n_tok, n_kv, d)
            if self._qk_norms[layer] is not None:
                q_norm, k_norm = self._qk_norms[layer]
                q, k = rms_norm(q, q_norm, self._eps), rms_norm(k, k_norm, self._eps)
            cos, sin = tables[layer]
            q = self._round_kv(apply_rope(self._round_kv(q), cos, sin))
            if self.kv_dtype == "q8_0":
                q = q8_0_query(q, self._scale)
            k = self._store_kv(apply_rope(self._round_kv(k), cos, sin))
            v = self._store_kv(self._round_kv((h @ wv.T + bv).reshape(n_tok, n_kv, d)))
            self._k_cache[layer, :, start:end] = k.transpose(1, 0, 2)
            self._v_cache[layer, :, start:end] = v.transpose(1, 0, 2)
            keys = self._k_cache[layer, :, :end]  # [n_kv, S, d]
            values = self._v_cache[layer, :, :end]
            # Query head j = g * rep + r uses KV head g: group the queries by KV head.
            qg = q.reshape(n_tok, n_kv, rep, d).transpose(1, 2, 0, 3)  # [n_kv, rep, T, d]
            scores = soft_cap((qg @ keys[:, None].transpose(0, 1, 3, 2)) * self._scale, cfg.attn_softcap)
            scores = scores + (windowed if cfg.layer_window(layer) else causal)  # [n_kv, rep, T, S]
            scores -= scores.max(axis=-1, keepdims=True)
            probs = np.exp(scores)
            probs /= probs.sum(axis=-1, keepdims=True)
            attn = self._round_kv((probs @ values[:, None]).transpose(2, 0, 1, 3).reshape(n_tok, cfg.n_heads * d))
            post = self._post_norms[layer]
            out = self._act(attn) @ wo.T
            x = x + (out if post is None else rms_norm(out, post[0], self._eps))
            h = self._act(rms_norm(x, ffn_norm, self._eps))
            out = self._act(self._activation(h @ w_gate.T) * (h @ w_up.T)) @ w_down.T
            x = x + (out if post is None else rms_norm(out, post[1], self._eps))
        return x

    def _act(self, x: np.ndarray) -> np.ndarray:
        """A layer matmul's input as its kernel sees it (``activation_bits``), else ``x`` itself."""
        return x if self.activation_bits is None else round_activations(x, self.activation_bits)

    def _round_kv(self, x: np.ndarray) -> np.ndarray:
        """``x`` rounded to the KV cache's element type (and back to float32): float16 for float16 and q8_0."""
        return x.astype(np.float16).astype(np.float32) if self.kv_dtype in ("float16", "q8_0") else x

    def _store_kv(self, x: np.ndarray) -> np.ndarray:
        """What the KV cache holds of keys or values ``x`` (float32, k after RoPE): q8_0 blocks, dequantised."""
        return q8_0_roundtrip(x) if self.kv_dtype == "q8_0" else self._round_kv(x)

    def generate_greedy(
        self, prompt_ids: Sequence[int], max_new_tokens: int, stop_ids: Sequence[int] = ()
    ) -> list[int]:
        """Greedy continuation of ``prompt_ids`` (a new sequence): at most ``max_new_tokens``, ending at a stop id
        (included in the result)."""
        logits = self.prefill(prompt_ids)
        out: list[int] = []
        stops = set(int(s) for s in stop_ids)
        for step in range(max_new_tokens):
            token = int(np.argmax(logits))
            out.append(token)
            if token in stops or step == max_new_tokens - 1:
                break
            logits = self.decode(token)
        return out


class NumpyRunner(ModelRunner):
    """The runner interface (``logitproc.serve.runner.ModelRunner``) over ``NumpyLlama``: the reference the engine
    can be tested against. One ``NumpyLlama`` per sequence, all sharing the weights; a fork copies the parent's
    cache; ``popn`` shortens it. Slow (float32 numpy), exact."""

    def __init__(self, model: GGUFModel, *, kernel_library: KernelLibrary, max_num_sequences: int = 16,
                 max_total_tokens: int | None = None, kv_dtype: str = DEFAULT_KV_DTYPE) -> None:
        from logitproc.compile.model_compile import eos_token_ids
        from logitproc.compile.tokenizer_source import from_model

        own = from_model(model)
        cfg = model.config
        max_total = int(max_total_tokens or min(cfg.context, 8192))
        super().__init__(config=cfg, tokenizer=own.tokenizer(), eos_token_ids=eos_token_ids(model),
                         name=cfg.name or model.path.stem, max_num_sequences=max_num_sequences,
                         context_length=min(cfg.context, max_total), max_total_tokens=max_total,
                         chat_template=ChatTemplate.for_model(own.chat_template, own.bos_token, own.eos_token))
        self.model = model
        #: The CPU kernel library the engine's processor and sampler use (``logitproc.compile.build_kernels("cpu")``).
        self.kernel_library = kernel_library
        self._template = NumpyLlama(model, kv_dtype)
        self._llamas: dict[int, NumpyLlama] = {}

    @classmethod
    def open(cls, model: str | os.PathLike[str] | GGUFModel | None = "default", *, kernel_library: KernelLibrary,
             **kwargs: Any) -> NumpyRunner:
        """``"default"``/None (SmolLM2), a GGUF file, a Hugging Face directory, or a loaded ``GGUFModel``."""
        if isinstance(model, GGUFModel):
            loaded = model
        elif model is None or model == "default":
            loaded = load_default_model()
        elif os.path.isdir(model):
            from logitproc.compile.hf_model import load_hf_dir

            loaded = load_hf_dir(model)
        else:
            loaded = load_gguf(model)
        return cls(loaded, kernel_library=kernel_library, **kwargs)

    def _new_llama(self) -> NumpyLlama:
        llama = NumpyLlama.__new__(NumpyLlama)
        llama.__dict__.update(self._template.__dict__)  # shares the weights; the cache is replaced below
        llama._k_cache = np.zeros((0,), np.float32)
        llama._length = 0
        llama.reset()
        return llama

    def _add(self, seq_id: int) -> None:
        self._llamas[seq_id] = self._new_llama()

    def _remove(self, seq_id: int) -> None:
        del self._llamas[seq_id]

    def _fork(self, parent: int, child: int, length: int) -> None:
        source, llama = self._llamas[parent], self._new_llama()
        llama._k_cache, llama._v_cache = source._k_cache.copy(), source._v_cache.copy()
        llama._length = length
        self._llamas[child] = llama

    def _popn(self, seq_id: int, n: int) -> None:
        self._llamas[seq_id]._length -= n

    def _prefill(self, seq_ids: list[int], token_ids: list[np.ndarray]) -> np.ndarray:
        return np.stack([self._llamas[s].extend(t) for s, t in zip(seq_ids, token_ids, strict=True)])

    def _decode(self, seq_ids: list[int], token_ids: np.ndarray) -> np.ndarray:
        return np.stack([self._llamas[s].decode(int(t)) for s, t in zip(seq_ids, token_ids, strict=True)])

    def _verify(self, seq_ids: list[int], token_ids: list[np.ndarray]) -> list[np.ndarray]:
        return [self._llamas[s].extend_all(t) for s, t in zip(seq_ids, token_ids, strict=True)]
