"""Input limits derived from the model and the options, checked before any work (reading, tokenizing, queueing).

A token stands for at most ``token_bytes`` bytes of text: the longest vocabulary entry in UTF-8 (an upper bound of the
bytes a token covers in byte-level BPE, SentencePiece and WordPiece vocabularies, whose entries spell their bytes
with one or more characters each), times 4 when the tokenizer normalizes text first (NFKC may turn a 4-byte character
into one byte). So a prompt text longer than ``context_length * token_bytes`` bytes can never fit in the context:
it is refused by its byte length, before a tokenizer spends seconds on it (a chat template only adds to the text).
A request body may hold that much text JSON-escaped (at most 6 bytes per byte) and 1 MiB of everything else.
A request with more prompts than the waiting queue holds can never be queued: a 400, not the 429 of a full queue
(clients retry 429s).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .openai_protocol import APIError, ParsedRequest

#: A request body's room for what is not prompt text (schemas, stop strings, logit_bias, ...).
OTHER_BODY_BYTES = 1 << 20
#: Bytes of JSON one byte of text may take (``\u0001``).
JSON_ESCAPE_BYTES = 6


@dataclass(frozen=True)
class RequestLimits:
    """The limits of one served model: its context, its widest token, the waiting queue."""

    context_length: int
    token_bytes: int
    max_queue: int

    @classmethod
    def of(cls, tokenizer: Any, context_length: int, max_queue: int) -> RequestLimits:
        """From a ``tokenizers.Tokenizer`` (its vocabulary, added tokens included, and whether it normalizes)."""
        longest = max((len(entry.encode("utf-8")) for entry in tokenizer.get_vocab(with_added_tokens=True)),
                      default=1)
        return cls(context_length, longest * (4 if tokenizer.normalizer is not None else 1), max_queue)

    @property
    def prompt_bytes(self) -> int:
        """The most bytes of prompt text that could fit in the context."""
        return self.context_length * self.token_bytes

    @property
    def body_bytes(self) -> int:
        """The most bytes of a request body."""
        return JSON_ESCAPE_BYTES * self.prompt_bytes + OTHER_BODY_BYTES

    def check(self, parsed: ParsedRequest) -> None:
        """APIError(400) when the request can never be served: more prompts than the queue holds, or a prompt text
        too long for the context."""
        if len(parsed.prompts) > self.max_queue:
            raise APIError(400, f"the request has {len(parsed.prompts)} prompts; the waiting queue holds at most "
                                f"{self.max_queue} (the server's --max-queue)", param="prompt", code="queue_too_small")
        for prompt in parsed.prompts:
            self.check_text(text_bytes(prompt), "messages" if parsed.chat else "prompt")

    def check_text(self, size: int, param: str) -> None:
        if size > self.prompt_bytes:
            raise APIError(400, f"{param}: the text has {size} bytes; at most {self.prompt_bytes} bytes can fit in "
                                f"the context of {self.context_length} tokens (a token stands for at most "
                                f"{self.token_bytes} bytes)", param=param, code="context_length_exceeded")


def text_bytes(prompt: str | Sequence[Any]) -> int:
    """UTF-8 bytes of a prompt's text: a string, or chat messages' contents (token ids: 0)."""
    if isinstance(prompt, str):
        return len(prompt.encode("utf-8"))
    return sum(len(m["content"].encode("utf-8")) for m in prompt if isinstance(m, dict))
