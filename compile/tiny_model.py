"""A tiny random Llama with a real byte-level BPE tokenizer, for fast tests of the compiled model and the engine.

``make_tiny_model(...)`` returns a ``GGUFModel`` (the structure ``load_gguf`` produces) that holds no file: float32
random weights by GGUF name in the canonical layout (``model_family``: ``[out, in]``, q/k rows in Hugging Face's
half-rotation order), a ``LlamaConfig``, and a vocabulary that ``build_tokenizer`` turns into a working tokenizer:

* ids 0, 1, 2: the special tokens ``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>`` (as in SmolLM2);
* ids 3 .. 258: the 256 byte tokens, spelled with the GPT-2 byte-to-unicode alphabet (``Ġ`` is the space byte);
* then one token per merge of ``_MERGES`` (so common English pieces become single tokens); the vocabulary size
  (by default 3 + 256 + 18 = 277) is deliberately not a multiple of 32.

The chat template is ChatML with a default system prompt, so ``apply_chat_template`` works as for SmolLM2.
Weights are scaled so that the logits are neither flat nor one-hot (standard deviation of a few units): projections
have standard deviation ``1/sqrt(fan_in)``, the embedding ``embed_scale / sqrt(hidden)``, norms are 1 plus noise.
The model is deterministic in ``seed``; two calls with the same arguments give bitwise equal weights.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .gguf_model import IM_END, IM_START, GGUFModel, LlamaConfig

TINY_DEFAULT_SYSTEM = "You are a tiny test model."
# ChatML as SmolLM2 writes it (real newlines inside the jinja strings), with this model's default system prompt.
TINY_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    f"{{{{ '{IM_START}system\n{TINY_DEFAULT_SYSTEM}{IM_END}\n' }}}}{{% endif %}}"
    f"{{{{ '{IM_START}' + message['role'] + '\n' + message['content'] + '{IM_END}' + '\n' }}}}{{% endfor %}}"
    f"{{% if add_generation_prompt %}}{{{{ '{IM_START}assistant\n' }}}}{{% endif %}}"
)

SPECIAL_TOKENS = ("<|endoftext|>", IM_START, IM_END)
# Merges in the GPT-2 byte alphabet ("Ġ" = space, "Ċ" = newline); each merge adds the concatenation as a token.
_MERGES = (
    "Ġ t", "h e", "Ġt he", "i n", "a n", "e r", "o n", "Ġ a", "r e", "Ġ s",
    "a t", "e n", "o r", "Ġ o", "Ġ w", "i s", "e s", "Ġ c",
)  # fmt: skip


def bytes_to_unicode() -> dict[int, str]:
    """The GPT-2 byte-level alphabet: printable Latin-1 bytes map to themselves, the others to U+0100 onwards."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def tiny_vocabulary(merges: tuple[str, ...] = _MERGES) -> tuple[list[str], list[int], list[str]]:
    """Tokens, token types (3 control, 6 byte, 1 normal) and merges of the tiny byte-level BPE vocabulary."""
    tokens = list(SPECIAL_TOKENS)
    types = [3] * len(SPECIAL_TOKENS)
    byte_chars = bytes_to_unicode()
    tokens += [byte_chars[b] for b in range(256)]
    types += [6] * 256
    for merge in merges:
        left, _, right = merge.partition(" ")
        if left + right in tokens:
            raise ValueError(f"merge {merge!r} produces a token already in the vocabulary")
        tokens.append(left + right)
        types.append(1)
    return tokens, types, list(merges)


def make_tiny_model(
    seed: int = 0,
    n_layers: int = 2,
    hidden: int = 64,
    n_heads: int = 4,
    n_kv_heads: int = 2,
    ffn: int = 128,
    *,
    context: int = 512,
    rope_theta: float = 10000.0,
    rms_eps: float = 1e-5,
    tied_embeddings: bool = True,
    embed_scale: float = 2.0,
    name: str | None = None,
    control_tokens: tuple[str, ...] = (),
) -> GGUFModel:
    """A random Llama with the tiny byte-level BPE vocabulary, as a ``GGUFModel`` without a file (see module doc).

    ``embed_scale`` sets the logits' spread (their standard deviation is roughly ``embed_scale``); with
    ``tied_embeddings=False`` the model gets its own ``output.weight``. ``control_tokens`` are appended to the
    vocabulary as control (special) tokens, e.g. ``("<think>", "</think>")`` for a model whose chat markers are
    single tokens.
    """
    if hidden % n_heads or n_heads % n_kv_heads or (hidden // n_heads) % 2:
        raise ValueError(f"hidden {hidden}, {n_heads} heads, {n_kv_heads} KV heads: need whole, even head sizes")
    tokens, token_types, merges = tiny_vocabulary()
    if len(set(control_tokens)) != len(control_tokens) or set(control_tokens) & set(tokens):
        raise ValueError(f"control_tokens {control_tokens} repeat a token or one of the vocabulary's")
    tokens += list(control_tokens)
    token_types += [3] * len(control_tokens)
    vocab = len(tokens)
    head_dim = hidden // n_heads
    rng = np.random.default_rng(seed)

    def normal(shape: tuple[int, ...], std: float) -> np.ndarray:
        return (rng.standard_normal(shape) * std).astype(np.float32)

    def linear(out_f: int, in_f: int) -> np.ndarray:
        return normal((out_f, in_f), 1.0 / np.sqrt(in_f))

    def norm() -> np.ndarray:
        return (1.0 + normal((hidden,), 0.1)).astype(np.float32)

    weights: dict[str, np.ndarray] = {"token_embd.weight": normal((vocab, hidden), embed_scale / np.sqrt(hidden))}
    for i in range(n_layers):
        weights[f"blk.{i}.attn_norm.weight"] = norm()
        weights[f"blk.{i}.attn_q.weight"] = linear(n_heads * head_dim, hidden)
        weights[f"blk.{i}.attn_k.weight"] = linear(n_kv_heads * head_dim, hidden)
        weights[f"blk.{i}.attn_v.weight"] = linear(n_kv_heads * head_dim, hidden)
        weights[f"blk.{i}.attn_output.weight"] = linear(hidden, n_heads * head_dim)
        weights[f"blk.{i}.ffn_norm.weight"] = norm()
        weights[f"blk.{i}.ffn_gate.weight"] = linear(ffn, hidden)
        weights[f"blk.{i}.ffn_up.weight"] = linear(ffn, hidden)
        weights[f"blk.{i}.ffn_down.weight"] = linear(hidden, ffn)
    weights["output_norm.weight"] = norm()
    if not tied_embeddings:
        weights["output.weight"] = normal((vocab, hidden), embed_scale / np.sqrt(hidden))

    label = name or f"tiny-llama-s{seed}-l{n_layers}-h{hidden}"
    config = LlamaConfig(
        architecture="llama",
        n_layers=n_layers,
        hidden=hidden,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        ffn=ffn,
        vocab=vocab,
        context=context,
        rope_theta=float(rope_theta),
        rms_eps=float(rms_eps),
        tied_embeddings=tied_embeddings,
        bos_id=0,
        eos_id=SPECIAL_TOKENS.index(IM_END),
        eos_ids=(SPECIAL_TOKENS.index(IM_END),),
        head_dim=head_dim,
        rope_dim=head_dim,
        chat_template=TINY_CHAT_TEMPLATE,
        name=label,
    )
    metadata = {
        "general.architecture": "llama",
        "general.name": label,
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "gpt2",
        "tokenizer.ggml.bos_token_id": 0,
        "tokenizer.ggml.eos_token_id": config.eos_id,
        "tokenizer.chat_template": TINY_CHAT_TEMPLATE,
    }
    return GGUFModel(
        path=Path(f"{label}.gguf"),
        config=config,
        weights=weights,
        tensor_types={name: "F32" for name in weights},
        tokens=tokens,
        token_types=token_types,
        merges=merges,
        metadata=metadata,
    )
