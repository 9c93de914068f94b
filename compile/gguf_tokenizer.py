"""A Hugging Face ``tokenizers.Tokenizer`` rebuilt from a GGUF's tokenizer metadata, or refused with one sentence.

``GGUFVocab.from_metadata(meta)`` reads and checks the ``tokenizer.ggml.*`` keys (``read_gguf_metadata(path)`` reads
them from a file without its tensors; ``vocab_of(model)`` from a loaded ``GGUFModel``); ``build_tokenizer`` turns the
vocabulary into a tokenizer that encodes as llama.cpp does. Supported (``SUPPORTED``):

* ``tokenizer.ggml.model == "gpt2"``: byte-level BPE (GPT-2's byte-to-unicode alphabet, merges by rank) with the
  pre-tokenizer named by ``tokenizer.ggml.pre``: ``llama-bpe`` / ``llama3`` / ``llama-v3`` (Llama 3: the
  ``\\p{N}{1,3}`` regex; a word already in the vocabulary is one token, merges are not applied to it), ``qwen2``
  (Qwen2 / Qwen2.5 / Qwen3: one digit a piece, NFC-normalised input), ``smollm`` (digits one by one, then GPT-2's
  regex), ``gpt-2`` / ``gpt2`` / ``default`` (GPT-2's regex);
* ``tokenizer.ggml.model == "llama"``: SentencePiece BPE (Llama 2, Mistral, Phi-3): the merges are derived from the
  token scores (the pair whose concatenation scores highest merges first), characters outside the vocabulary fall back
  to the ``<0xNN>`` byte tokens, a space is ``▁``, and ``tokenizer.ggml.add_space_prefix`` (default true) puts a
  ``▁`` before the text and after every special token, as llama.cpp does;
* ``tokenizer.ggml.model == "gemma4"``: the same text handling (``▁``, byte fallback; Gemma 4 sets
  ``add_space_prefix`` false) with the GGUF's own merges instead of scores.

Token types (``tokenizer.ggml.token_type``, ``TokenType``): control and unknown tokens become *special* added tokens
(parsed only from trusted text: ``encode(..., add_special_tokens=...)`` with ``encode_special_tokens`` off),
user-defined tokens become non-special added tokens (always matched first, as in llama.cpp). ``encode(text)`` adds
BOS when ``tokenizer.ggml.add_bos_token`` says so (absent: true for SentencePiece and Llama 3, false otherwise, the
defaults of llama.cpp), EOS when ``tokenizer.ggml.add_eos_token`` does; ``encode(text, add_special_tokens=False)``
adds neither.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from enum import IntEnum
from typing import TYPE_CHECKING, Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

from .gguf_metadata import read_metadata

if TYPE_CHECKING:
    from .gguf_model import GGUFModel


class TokenType(IntEnum):
    """llama.cpp's token types (``tokenizer.ggml.token_type``)."""

    NORMAL = 1
    UNKNOWN = 2
    CONTROL = 3
    USER_DEFINED = 4
    UNUSED = 5
    BYTE = 6


# The pre-tokenizers' regexes (llama.cpp's llama-vocab.cpp and the models' own tokenizer.json agree on them).
_GPT2_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                 r"\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_REGEX = _LLAMA3_REGEX.replace(r"\p{N}{1,3}", r"\p{N}")

#: GGUF ``tokenizer.ggml.pre`` values of byte-level BPE vocabularies, by the pre-tokenizer they name.
BPE_PRE_TOKENIZERS = {
    "llama-bpe": "llama3", "llama3": "llama3", "llama-v3": "llama3",
    "qwen2": "qwen2",
    "smollm": "smollm",
    "gpt-2": "gpt2", "gpt2": "gpt2", "default": "gpt2",
}
#: GGUF ``tokenizer.ggml.model`` values rebuilt here.
SUPPORTED = {"gpt2": "byte-level BPE", "llama": "SentencePiece BPE", "gemma4": "SentencePiece-style BPE with merges"}

_SPACE = "\u2581"  # SentencePiece's "▁"
#: the special tokens of a ``special_rstrip`` vocabulary that keep the whitespace after them
_NO_RSTRIP = ("<unk>", "<s>", "<|endoftext|>")


@dataclass(frozen=True)
class GGUFVocab:
    """A GGUF's tokenizer metadata, checked: the tokenizer model, pre-tokenizer, tokens and what ``encode`` adds."""

    model: str
    pre: str
    tokens: list[str]
    token_types: list[int]
    scores: list[float]
    merges: list[str]
    bos_id: int | None
    eos_id: int | None
    unk_id: int | None
    add_bos: bool
    add_eos: bool
    add_space_prefix: bool
    #: the special tokens take the whitespace after them (``rstrip``): Phi-3/3.5's SentencePiece vocabulary (a
    #: ``phi3`` GGUF whose tokenizer model is ``llama``), all but ``<unk>``, ``<s>`` and ``<|endoftext|>``, as its
    #: ``tokenizer.json`` says and llama.cpp sets them (``llama_vocab::impl::load``, by the model's name)
    special_rstrip: bool = False

    @classmethod
    def from_metadata(cls, meta: Mapping[str, Any], source: str = "the GGUF") -> GGUFVocab:
        """Read the ``tokenizer.ggml.*`` keys; ValueError (one sentence naming the key and value) for what is not
        understood."""
        model = meta.get("tokenizer.ggml.model")
        if model not in SUPPORTED:
            known = ", ".join(f"{k!r} ({v})" for k, v in SUPPORTED.items())
            raise ValueError(f"{source}: tokenizer model (tokenizer.ggml.model) {model!r} is not supported "
                             f"(supported: {known})")
        pre = str(meta.get("tokenizer.ggml.pre", "default"))
        if model == "gpt2" and pre not in BPE_PRE_TOKENIZERS:
            raise ValueError(f"{source}: pre-tokenizer (tokenizer.ggml.pre) {pre!r} is not supported "
                             f"(supported: {', '.join(sorted(BPE_PRE_TOKENIZERS))})")
        tokens = list(meta.get("tokenizer.ggml.tokens") or [])
        if not tokens:
            raise ValueError(f"{source}: tokenizer.ggml.tokens is missing or empty")
        if len(set(tokens)) != len(tokens):
            raise ValueError(f"{source}: tokenizer.ggml.tokens holds duplicate tokens")
        types = [int(t) for t in meta.get("tokenizer.ggml.token_type") or [TokenType.NORMAL] * len(tokens)]
        unknown_types = sorted(set(types) - {int(t) for t in TokenType})
        if len(types) != len(tokens) or unknown_types:
            raise ValueError(f"{source}: tokenizer.ggml.token_type must give one of {[int(t) for t in TokenType]} "
                             f"per token ({len(types)} types for {len(tokens)} tokens, unknown {unknown_types})")
        scores = [float(s) for s in meta.get("tokenizer.ggml.scores") or []]
        merges = list(meta.get("tokenizer.ggml.merges") or [])
        if model == "llama" and len(scores) != len(tokens):
            raise ValueError(f"{source}: a SentencePiece vocabulary needs tokenizer.ggml.scores, one per token "
                             f"({len(scores)} for {len(tokens)} tokens)")
        if model in ("gpt2", "gemma4") and not merges:
            raise ValueError(f"{source}: a {SUPPORTED[model]} vocabulary needs tokenizer.ggml.merges")

        def token_id(key: str) -> int | None:
            value = meta.get(key)
            if value is None:
                return None
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < len(tokens):
                raise ValueError(f"{source}: {key} {value!r} is not a token id in [0, {len(tokens)})")
            return value

        def flag(key: str, default: bool) -> bool:
            value = meta.get(key, default)
            if not isinstance(value, bool):
                raise ValueError(f"{source}: {key} must be a boolean, got {value!r}")
            return value

        bos_id = token_id("tokenizer.ggml.bos_token_id")
        add_bos = flag("tokenizer.ggml.add_bos_token",
                       model != "gpt2" or BPE_PRE_TOKENIZERS.get(pre) == "llama3")
        add_eos = flag("tokenizer.ggml.add_eos_token", False)
        eos_id = token_id("tokenizer.ggml.eos_token_id")
        for wanted, key, value in ((add_bos, "bos", bos_id), (add_eos, "eos", eos_id)):
            if wanted and value is None:
                raise ValueError(f"{source}: tokenizer.ggml.add_{key}_token is true but tokenizer.ggml.{key}_token_id "
                                 "is missing")
        return cls(model=model, pre=pre, tokens=tokens, token_types=types, scores=scores, merges=merges,
                   bos_id=bos_id, eos_id=eos_id, unk_id=token_id("tokenizer.ggml.unknown_token_id"),
                   add_bos=add_bos, add_eos=add_eos,
                   add_space_prefix=flag("tokenizer.ggml.add_space_prefix", model != "gpt2"),
                   special_rstrip=model == "llama" and meta.get("general.architecture") == "phi3")


def read_gguf_metadata(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Every metadata key of a GGUF file as Python values (str, int, float, bool, lists of them), in file order; no
    tensor is read (``gguf_metadata.read_metadata``: the key/value section parsed from a memory map, about 100x less
    CPU than gguf-py's ``GGUFReader``; ValueError naming the file, offset and key for a malformed file)."""
    return read_metadata(path)


def vocab_of(model: GGUFModel) -> GGUFVocab:
    """The vocabulary of a loaded ``GGUFModel`` (its tokens, types and merges, plus the ``tokenizer.ggml.*``
    metadata: scores, pre-tokenizer, BOS/EOS and their flags)."""
    meta = dict(model.metadata)
    meta.update({"tokenizer.ggml.tokens": model.tokens, "tokenizer.ggml.token_type": model.token_types,
                 "tokenizer.ggml.merges": model.merges})
    return GGUFVocab.from_metadata(meta, model.path.name)


def build_tokenizer(source: GGUFVocab | GGUFModel) -> Tokenizer:
    """The ``tokenizers.Tokenizer`` of a GGUF vocabulary (see the module doc); ValueError when it is not supported."""
    vocab = source if isinstance(source, GGUFVocab) else vocab_of(source)
    tokenizer = _bpe_tokenizer(vocab) if vocab.model == "gpt2" else _spm_tokenizer(vocab)
    added = []
    for index, (token, kind) in enumerate(zip(vocab.tokens, vocab.token_types, strict=True)):
        rstrip = vocab.special_rstrip and token not in _NO_RSTRIP
        if kind in (TokenType.CONTROL, TokenType.UNKNOWN) or index in (vocab.bos_id, vocab.eos_id):
            added.append(AddedToken(token, special=True, normalized=False, rstrip=rstrip))
        elif kind == TokenType.USER_DEFINED:  # matched in any text; a SentencePiece one holding "▁" (Gemma's runs
            # of spaces) matches the spaces it stands for, as llama.cpp matches a token's piece: on the normalized text
            added.append(AddedToken(token, special=False, normalized=vocab.model != "gpt2" and _SPACE in token,
                                    rstrip=rstrip))
    tokenizer.add_tokens(added)
    tokenizer.post_processor = _post_processor(vocab)
    return tokenizer


def _bpe_tokenizer(vocab: GGUFVocab) -> Tokenizer:
    ids = {token: index for index, token in enumerate(vocab.tokens)}
    merges = _gguf_merges(vocab)
    kind = BPE_PRE_TOKENIZERS[vocab.pre]
    tokenizer = Tokenizer(models.BPE(vocab=ids, merges=merges, unk_token=None, fuse_unk=False, byte_fallback=False,
                                     ignore_merges=kind == "llama3"))
    if kind in ("llama3", "qwen2"):
        regex = _LLAMA3_REGEX if kind == "llama3" else _QWEN2_REGEX
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False),
        ])
    else:
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
        tokenizer.pre_tokenizer = byte_level if kind == "gpt2" else pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level])
    if kind == "qwen2":
        tokenizer.normalizer = normalizers.NFC()
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _gguf_merges(vocab: GGUFVocab) -> list[tuple[str, str]]:
    merges = []
    for merge in vocab.merges:
        left, sep, right = merge.partition(" ")
        if not sep:
            raise ValueError(f"malformed merge {merge!r} in tokenizer.ggml.merges (two tokens separated by a space)")
        merges.append((left, right))
    return merges


def _spm_merges(vocab: GGUFVocab) -> list[tuple[str, str]]:
    """SentencePiece BPE as merges: every split of a normal token into two normal tokens, the best-scoring merged token
    first (ties: by the parts' ids), which is the order llama.cpp's SentencePiece tokenizer merges in."""
    normal = {token: index for index, (token, kind) in enumerate(zip(vocab.tokens, vocab.token_types, strict=True))
              if kind == TokenType.NORMAL}
    ranked = []
    for token, index in normal.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in normal and right in normal:
                ranked.append((-vocab.scores[index], normal[left], normal[right], left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def _spm_tokenizer(vocab: GGUFVocab) -> Tokenizer:
    bytes_missing = [f"<0x{b:02X}>" for b in range(256) if f"<0x{b:02X}>" not in vocab.tokens]
    if bytes_missing:
        raise ValueError(f"a SentencePiece vocabulary needs the 256 byte tokens for byte fallback; "
                         f"{bytes_missing[0]} is missing")
    ids = {token: index for index, token in enumerate(vocab.tokens)}
    unk = vocab.tokens[vocab.unk_id] if vocab.unk_id is not None else None
    merges = _spm_merges(vocab) if vocab.model == "llama" else _gguf_merges(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=ids, merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=True))
    steps: list[Any] = [normalizers.Prepend(_SPACE)] if vocab.add_space_prefix else []
    tokenizer.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", _SPACE)])
    undo: list[Any] = [decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if vocab.add_space_prefix:
        undo.append(decoders.Strip(" ", 1, 0))
    tokenizer.decoder = decoders.Sequence(undo)
    return tokenizer


def _post_processor(vocab: GGUFVocab) -> Any:
    """BOS/EOS added by ``encode(..., add_special_tokens=True)`` as the GGUF says (byte-level offsets kept)."""
    steps: list[Any] = [processors.ByteLevel(trim_offsets=False)] if vocab.model == "gpt2" else []
    if vocab.add_bos or vocab.add_eos:
        bos = [vocab.tokens[vocab.bos_id]] if vocab.add_bos and vocab.bos_id is not None else []
        eos = [vocab.tokens[vocab.eos_id]] if vocab.add_eos and vocab.eos_id is not None else []
        single = " ".join([*bos, "$A", *eos])
        pair = " ".join([*bos, "$A", *eos, *bos, "$B:1", *eos])
        special = [(t, vocab.tokens.index(t)) for t in dict.fromkeys(bos + eos)]
        steps.append(processors.TemplateProcessing(single=single, pair=pair, special_tokens=special))
    return processors.Sequence(steps) if len(steps) != 1 else steps[0]
