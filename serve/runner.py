"""The model-runner interface the engine drives (``Runner``), with its bookkeeping and input checks written once.

``Runner`` is the typed Protocol: everything the engine uses of a model, and nothing else. ``ModelRunner`` keeps
the sequences (id -> length) and validates every call, raising ``ValueError`` naming the offending argument;
subclasses implement the six ``_``-methods on their own KV cache. Implementations:
``logitproc.serve.compiled_model.CompiledModel`` (TVM) and ``logitproc.serve.numpy_llama.NumpyRunner`` (reference).

Interface::

    runner.add_sequence(seq_id)                 a new, empty sequence
    runner.remove_sequence(seq_id)              forget it (its id can be added again)
    runner.fork_sequence(parent_id, child_id, length=None)
                                                child starts as a copy of the parent's first ``length`` tokens
                                                (all by default; the KV cache shares them)
    runner.popn(seq_id, n)                      drop the last n tokens (0 <= n <= length)
    runner.sequence_length(seq_id)              tokens in the KV cache
    runner.prefill(seq_ids, token_ids)          append token_ids[i] to seq_ids[i]; logits [len(seq_ids), vocab]
    runner.decode(seq_ids, token_ids)           append one token to each; logits [len(seq_ids), vocab]

Logits are float32 numpy arrays, row i after the last token appended to ``seq_ids[i]``, each call's a new array the
caller owns (no later call writes it; the engine processes a step's logits in place). A call rejected with
ValueError leaves every sequence as it was (the checks run before the KV cache is touched).
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol

import numpy as np
from logitproc.compile.gguf_model import LlamaConfig
from logitproc.runtime.kernel_library import KernelLibrary

from .chat_template import ChatTemplate
from .chat_tokens import ChatEncoder


class Runner(Protocol):
    """What the engine needs of a model: its sizes, tokenizer, chat rendering and kernels, and the KV cache calls."""

    name: str
    vocab_size: int
    context_length: int
    max_num_sequences: int
    max_total_tokens: int
    eos_token_ids: tuple[int, ...]
    #: A Hugging Face ``tokenizers.Tokenizer`` (encode, decode, token_to_id).
    tokenizer: Any
    #: The kernel library the engine's processor and sampler load (CPU).
    kernel_library: KernelLibrary
    #: The jinja chat template chats are rendered with (the server reads what it supports: tools, a think block).
    chat_template: ChatTemplate

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                            **kwargs: Any) -> str: ...

    def chat_token_ids(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                       **kwargs: Any) -> list[int]: ...

    @property
    def sequence_ids(self) -> tuple[int, ...]: ...

    def sequence_length(self, seq_id: int) -> int: ...

    def add_sequence(self, seq_id: int) -> None: ...

    def remove_sequence(self, seq_id: int) -> None: ...

    def fork_sequence(self, parent_id: int, child_id: int, length: int | None = None) -> None: ...

    def popn(self, seq_id: int, n: int) -> None: ...

    def prefill(self, seq_ids: Sequence[int], token_ids: Sequence[Sequence[int]]) -> np.ndarray: ...

    def decode(self, seq_ids: Sequence[int], token_ids: Sequence[int]) -> np.ndarray: ...

    def verify(self, seq_ids: Sequence[int], token_ids: Sequence[Sequence[int]]) -> list[np.ndarray]: ...


def _seq_id(value: Any, name: str = "seq_id") -> int:
    try:
        seq_id = operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be an int, got {value!r}") from None
    if seq_id < 0:
        raise ValueError(f"{name} must be >= 0, got {seq_id}")
    return seq_id


class ModelRunner:
    """Sequences, their lengths, and the checks of the runner interface (see the module doc); subclasses set
    ``kernel_library``."""

    kernel_library: KernelLibrary

    def __init__(self, *, config: LlamaConfig, tokenizer: Any, eos_token_ids: Iterable[int], name: str,
                 max_num_sequences: int, context_length: int, max_total_tokens: int,
                 chat_template: ChatTemplate) -> None:
        self.config = config
        self.vocab_size = int(config.vocab)
        self.tokenizer = tokenizer
        self.eos_token_ids = tuple(int(i) for i in eos_token_ids)
        self.name = name
        self.max_num_sequences = int(max_num_sequences)
        self.context_length = int(context_length)
        self.max_total_tokens = int(max_total_tokens)
        self.use_chat_template(chat_template)
        self._lengths: dict[int, int] = {}

    # ---------------------------------------------------------------- chat template
    def use_chat_template(self, template: ChatTemplate) -> None:
        """Render chats with ``template`` from now on (``--chat-template FILE``)."""
        self.chat_template = template
        self._chat_encoder = ChatEncoder(self.tokenizer, template)

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                            **kwargs: Any) -> str:
        """The prompt text of ``messages`` (dicts with ``role``, ``content``, ...) in the model's chat template;
        ``kwargs`` (``tools``, ``documents``, ``enable_thinking``, ...) go to the template. ChatTemplateError (a
        ValueError) when the template fails on them."""
        return self.chat_template.render(messages, add_generation_prompt, **kwargs)

    def chat_token_ids(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                       **kwargs: Any) -> list[int]:
        """The prompt token ids of ``messages``: the template's markup may hold control tokens, the messages' text
        never becomes one (``logitproc.serve.chat_tokens``)."""
        return self._chat_encoder.encode(messages, add_generation_prompt, **kwargs)

    # ---------------------------------------------------------------- sequences
    @property
    def sequence_ids(self) -> tuple[int, ...]:
        """Ids of the sequences that exist, in the order they were added."""
        return tuple(self._lengths)

    def _known(self, value: Any, name: str = "seq_id") -> int:
        seq_id = _seq_id(value, name)
        if seq_id not in self._lengths:
            raise ValueError(f"unknown {name} {seq_id}: add_sequence({seq_id}) first")
        return seq_id

    def _fresh(self, value: Any, name: str = "seq_id") -> int:
        seq_id = _seq_id(value, name)
        if seq_id in self._lengths:
            raise ValueError(f"{name} {seq_id} already exists")
        if len(self._lengths) >= self.max_num_sequences:
            raise ValueError(f"too many sequences: {self.max_num_sequences} exist (max_num_sequences); remove one")
        return seq_id

    def add_sequence(self, seq_id: int) -> None:
        """Start the empty sequence ``seq_id``."""
        seq_id = self._fresh(seq_id)
        self._add(seq_id)
        self._lengths[seq_id] = 0

    def remove_sequence(self, seq_id: int) -> None:
        """Forget ``seq_id`` and free its KV cache."""
        seq_id = self._known(seq_id)
        self._remove(seq_id)
        del self._lengths[seq_id]

    def fork_sequence(self, parent_id: int, child_id: int, length: int | None = None) -> None:
        """Start ``child_id`` as a copy of the first ``length`` tokens of ``parent_id`` (all of them by default;
        the KV cache shares them where it can)."""
        parent = self._known(parent_id, "parent_id")
        child = self._fresh(child_id, "child_id")
        size = self._lengths[parent]
        if length is not None:
            try:
                length = operator.index(length)
            except TypeError:
                raise ValueError(f"length must be an int, got {length!r}") from None
            if not 0 <= length <= size:
                raise ValueError(f"fork length must lie in [0, {size}] for sequence {parent}, got {length}")
            size = length
        if size + sum(self._lengths.values()) > self.max_total_tokens:
            raise ValueError(f"forking {parent} would exceed the KV cache's {self.max_total_tokens} tokens")
        self._fork(parent, child, size)
        self._lengths[child] = size

    def popn(self, seq_id: int, n: int) -> None:
        """Drop the last ``n`` tokens of ``seq_id`` from the KV cache."""
        seq_id = self._known(seq_id)
        n = operator.index(n)
        if not 0 <= n <= self._lengths[seq_id]:
            raise ValueError(f"popn: n must lie in [0, {self._lengths[seq_id]}] for sequence {seq_id}, got {n}")
        if n:
            self._popn(seq_id, n)
            self._lengths[seq_id] -= n

    def sequence_length(self, seq_id: int) -> int:
        """Number of tokens of ``seq_id`` in the KV cache."""
        return self._lengths[self._known(seq_id)]

    # ---------------------------------------------------------------- forward
    def _check_batch(self, seq_ids: Sequence[int], counts: Sequence[int]) -> list[int]:
        ids = [self._known(s) for s in seq_ids]
        if not ids:
            raise ValueError("seq_ids is empty")
        if len(set(ids)) != len(ids):
            raise ValueError(f"seq_ids must be distinct, got {ids}")
        for seq_id, count in zip(ids, counts, strict=True):
            if self._lengths[seq_id] + count > self.context_length:
                raise ValueError(f"sequence {seq_id}: {self._lengths[seq_id]} + {count} tokens exceed the context "
                                 f"length {self.context_length}")
        total = sum(self._lengths.values()) + sum(counts)
        if total > self.max_total_tokens:
            raise ValueError(f"{total} tokens in all would exceed the KV cache's {self.max_total_tokens} tokens")
        return ids

    def _tokens(self, values: Any, name: str) -> np.ndarray:
        try:
            array = np.asarray(values)
        except (TypeError, ValueError):
            raise ValueError(f"{name} must be a list of token ids") from None
        if array.ndim != 1 or not (array.size == 0 or np.issubdtype(array.dtype, np.integer)):
            raise ValueError(f"{name} must be a flat list of int token ids, got {values!r:.80}")
        if array.size and (array.min() < 0 or array.max() >= self.vocab_size):
            raise ValueError(f"{name}: token ids must lie in [0, {self.vocab_size}), got {values!r:.80}")
        return array.astype(np.int32)

    def prefill(self, seq_ids: Sequence[int], token_ids: Sequence[Sequence[int]]) -> np.ndarray:
        """Append ``token_ids[i]`` (non-empty) to ``seq_ids[i]``; logits ``[len(seq_ids), vocab]`` after each."""
        if len(seq_ids) != len(token_ids):
            raise ValueError(f"{len(seq_ids)} seq_ids but {len(token_ids)} token lists")
        lists = [self._tokens(t, f"token_ids[{i}]") for i, t in enumerate(token_ids)]
        for i, tokens in enumerate(lists):
            if tokens.size == 0:
                raise ValueError(f"token_ids[{i}] is empty")
        ids = self._check_batch(seq_ids, [t.size for t in lists])
        logits = self._prefill(ids, lists)
        for seq_id, tokens in zip(ids, lists, strict=True):
            self._lengths[seq_id] += tokens.size
        return logits

    def decode(self, seq_ids: Sequence[int], token_ids: Sequence[int]) -> np.ndarray:
        """Append ``token_ids[i]`` to ``seq_ids[i]``; logits ``[len(seq_ids), vocab]``."""
        if len(seq_ids) != len(token_ids):
            raise ValueError(f"{len(seq_ids)} seq_ids but {len(token_ids)} token ids")
        tokens = self._tokens(token_ids, "token_ids")
        ids = self._check_batch(seq_ids, [1] * len(seq_ids))
        logits = self._decode(ids, tokens)
        for seq_id in ids:
            self._lengths[seq_id] += 1
        return logits

    def verify(self, seq_ids: Sequence[int], token_ids: Sequence[Sequence[int]]) -> list[np.ndarray]:
        """Append ``token_ids[i]`` (non-empty) to ``seq_ids[i]`` in one forward pass; the logits after *each* token,
        ``[len(token_ids[i]), vocab]`` per sequence (speculative decoding: the last committed token and the drafts,
        checked at once; ``popn`` takes back what is rejected)."""
        if len(seq_ids) != len(token_ids):
            raise ValueError(f"{len(seq_ids)} seq_ids but {len(token_ids)} token lists")
        lists = [self._tokens(t, f"token_ids[{i}]") for i, t in enumerate(token_ids)]
        for i, tokens in enumerate(lists):
            if tokens.size == 0:
                raise ValueError(f"token_ids[{i}] is empty")
        ids = self._check_batch(seq_ids, [t.size for t in lists])
        logits = self._verify(ids, lists)
        for seq_id, tokens in zip(ids, lists, strict=True):
            self._lengths[seq_id] += tokens.size
        return logits

    # ---------------------------------------------------------------- implementation
    def _verify(self, seq_ids: list[int], token_ids: list[np.ndarray]) -> list[np.ndarray]:
        raise NotImplementedError

    def _add(self, seq_id: int) -> None:
        raise NotImplementedError

    def _remove(self, seq_id: int) -> None:
        raise NotImplementedError

    def _fork(self, parent: int, child: int, length: int) -> None:
        raise NotImplementedError

    def _popn(self, seq_id: int, n: int) -> None:
        raise NotImplementedError

    def _prefill(self, seq_ids: list[int], token_ids: list[np.ndarray]) -> np.ndarray:
        raise NotImplementedError

    def _decode(self, seq_ids: list[int], token_ids: np.ndarray) -> np.ndarray:
        raise NotImplementedError
