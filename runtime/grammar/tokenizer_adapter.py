"""TokenizerAdapter: what the grammar engines need from a Hugging Face ``tokenizers`` tokenizer and the model.

The model's vocabulary (the width of its logits) may be larger than the tokenizer's: ids from the tokenizer's size up
to the model's are padding, with no text, and are never allowed by a grammar. Special tokens (added tokens marked
special or written like tags, ``<...>``) are never allowed by a grammar either, except the EOS tokens, which are
allowed exactly where the grammar accepts.

``token_bytes[i]`` is the text of token i as bytes (b"" for special and padded ids): byte-level BPE vocabularies
(GPT-2 style, the ``ByteLevel`` decoder: SmolLM2, Llama 3, Qwen2, DeepSeek-V3) and SentencePiece-style ones
(``Metaspace`` "▁" for spaces, ``<0xNN>`` byte-fallback tokens) are read exactly; other decoders are refused.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Sequence
from functools import cached_property
from typing import Any

import numpy as np
from tokenizers import Tokenizer

BYTE_LEVEL, BYTE_FALLBACK, RAW = "byte_level", "byte_fallback", "raw"


def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's printable stand-in characters back to the bytes they encode."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


def _decoder_types(decoder: Any) -> list[str]:
    if not decoder:
        return []
    if decoder.get("type") == "Sequence":
        return [t for d in decoder.get("decoders", []) for t in _decoder_types(d)]
    return [decoder.get("type", "")]


class TokenizerAdapter:
    """A tokenizer, the model's vocabulary size and its EOS ids, with the per-token data grammar engines read."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        if not isinstance(tokenizer, Tokenizer):
            raise TypeError(f"tokenizer must be a tokenizers.Tokenizer, got {type(tokenizer).__name__}")
        self.tokenizer = tokenizer
        self.tokenizer_size = tokenizer.get_vocab_size(with_added_tokens=True)
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < self.tokenizer_size:
            raise ValueError(f"vocab_size must be an int >= the tokenizer's {self.tokenizer_size} tokens "
                             f"(the model's logits width), got {vocab_size!r}")
        self.vocab_size = vocab_size
        eos = tuple(int(t) for t in eos_token_ids)
        if not eos:
            raise ValueError("eos_token_ids must name at least one token")
        bad = [t for t in eos if not 0 <= t < self.tokenizer_size]
        if bad:
            raise ValueError(f"eos token id {bad[0]} is outside the tokenizer's vocabulary [0, {self.tokenizer_size})")
        self.eos_token_ids = eos
        self.json = tokenizer.to_str()
        spec = json.loads(self.json)
        kinds = _decoder_types(spec.get("decoder"))
        if "ByteLevel" in kinds:
            self.vocab_type = BYTE_LEVEL
        elif "ByteFallback" in kinds or "Metaspace" in kinds:
            self.vocab_type = BYTE_FALLBACK
        else:
            raise ValueError(f"tokenizer decoder {kinds or 'none'} is not supported for grammars "
                             "(byte-level BPE or SentencePiece-style vocabularies)")
        # Control tokens for grammars, never allowed as text: added tokens marked special, and added tokens written
        # like tags, "<...>" (llguidance's rule; xgrammar is given "" for them so that both engines agree).
        self.special_ids = frozenset(int(t["id"]) for t in spec.get("added_tokens", []) if t.get("special") or (
            t["content"].startswith("<") and t["content"].endswith(">")))
        #: Raw vocabulary strings by id ("" for ids without a token).
        self.raw_tokens = [""] * vocab_size
        for token, index in tokenizer.get_vocab(with_added_tokens=True).items():
            self.raw_tokens[index] = token
        self._lock = threading.Lock()

    @cached_property
    def fingerprint(self) -> str:
        """Identity of (tokenizer, vocab size, EOS ids) for caches of compiled grammars."""
        material = json.dumps([self.vocab_size, self.eos_token_ids]).encode() + self.json.encode()
        return hashlib.sha256(material).hexdigest()[:16]

    @cached_property
    def token_bytes(self) -> list[bytes]:
        """Text of each id as bytes; b"" for special tokens and padded ids."""
        out: list[bytes] = []
        if self.vocab_type == BYTE_LEVEL:
            table = _byte_level_decoder()
            for index, token in enumerate(self.raw_tokens):
                if index in self.special_ids or not token:
                    out.append(b"")
                elif all(c in table for c in token):
                    out.append(bytes(table[c] for c in token))
                else:  # an added (non-special) token written as plain text
                    out.append(token.encode())
        else:
            for index, token in enumerate(self.raw_tokens):
                if index in self.special_ids or not token:
                    out.append(b"")
                elif len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
                    out.append(bytes([int(token[3:5], 16)]))
                else:
                    out.append(token.replace("\u2581", " ").encode())
        return out

    @cached_property
    def tokens_by_text(self) -> dict[bytes, int]:
        """Each token text -> the first id with exactly that text (special tokens and padded ids left out)."""
        out: dict[bytes, int] = {}
        for index, text in enumerate(self.token_bytes):
            if text and text not in out:
                out[text] = index
        return out

    @cached_property
    def longest_token(self) -> int:
        """The length in bytes of the longest token text."""
        return max(map(len, self.token_bytes), default=0)

    @cached_property
    def byte_tokens(self) -> dict[int, int]:
        """The one-byte tokens: byte value -> the first id whose text is exactly that byte."""
        out: dict[int, int] = {}
        for index, text in enumerate(self.token_bytes):
            if len(text) == 1 and text[0] not in out:
                out[text[0]] = index
        return out

    @cached_property
    def extendable(self) -> np.ndarray:
        """bool ``[vocab_size]``: token i's bytes are a strict prefix of another token's (a jump must not end there,
        or the model could never produce the longer token)."""
        order = sorted((b, i) for i, b in enumerate(self.token_bytes) if b)
        out = np.zeros(self.vocab_size, bool)
        for (text, index), (following, _) in zip(order, order[1:], strict=False):
            if following != text and following.startswith(text):
                out[index] = True
        return out

    @cached_property
    def padding_words(self) -> tuple[int, np.ndarray]:
        """(first word, int32 masks) that clear the bits of ids >= the tokenizer's size in a bitmask row."""
        first = self.tokenizer_size // 32
        words = (self.vocab_size + 31) // 32
        masks = np.zeros(max(0, words - first), np.uint32)
        if masks.size:
            masks[0] = (1 << (self.tokenizer_size % 32)) - 1
        return first, masks.view(np.int32)

    def build_tables(self) -> None:
        """Compute now the per-token tables otherwise built on first use (``token_bytes``, ``byte_tokens``,
        ``extendable``, ``padding_words``: 0.2-0.5 s of Python for a 49k vocabulary), so that no step builds them
        (``ConstraintFactory.prepare``)."""
        _ = self.token_bytes, self.byte_tokens, self.extendable, self.padding_words

    def clear_padding(self, row: np.ndarray) -> None:
        """Disallow the padded ids (tokenizer size .. vocab size) in a bitmask row."""
        first, masks = self.padding_words
        if masks.size:
            np.bitwise_and(row[first : first + masks.size], masks, out=row[first : first + masks.size])

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` with no special tokens added and special-token text not parsed."""
        with self._lock:  # tokenizers.Tokenizer is not documented as thread-safe for concurrent encode
            return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode_bytes(self, token_ids: Sequence[int]) -> bytes:
        return b"".join(self.token_bytes[t] for t in token_ids)
