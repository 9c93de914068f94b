"""A prompt's token ids from text, token ids or chat messages, given the model's tokenizer and chat template.

Shared by the ``Engine`` and by a server front that tokenizes without an engine of its own (the Ray ingress,
``ray_client.py``): both answer the same ids, and the same errors, for the same prompt.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import numpy as np
from logitproc.runtime.field_error import FieldTypeError, FieldValueError


class PromptModel(Protocol):
    """What tokenizing needs of a model: its tokenizer, its chat template's encoder and its vocabulary size."""

    tokenizer: Any
    vocab_size: int

    def chat_token_ids(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                       **kwargs: Any) -> list[int]: ...


def prompt_token_ids(model: PromptModel, prompt: Any, chat: bool | None = None) -> list[int]:
    """Token ids of a prompt: text, token ids, or chat messages (rendered with the model's chat template); ``chat``
    wraps a text prompt as one user message. TypeError for a prompt of another type, ValueError for bad items."""
    if isinstance(prompt, (bytes, bytearray, memoryview, Mapping)) or not isinstance(prompt, (str, Sequence,
                                                                                            np.ndarray)):
        raise FieldTypeError("prompt", "prompt must be text (str), token ids (a list of ints) or chat messages (a "
                             f"list of {{'role': ..., 'content': ...}} dicts), got {type(prompt).__name__}"
                             + (" (decode bytes to str first)" if isinstance(prompt, (bytes, bytearray)) else ""))
    if isinstance(prompt, str):
        if chat:
            prompt = [{"role": "user", "content": prompt}]
        else:
            # BOS/EOS as the model's tokenizer adds them; encode_batch lets other threads run while it works
            # (encode holds the GIL: an 8 MB prompt stalled the stepping thread for seconds)
            return list(model.tokenizer.encode_batch([prompt])[0].ids)
    items = list(prompt)
    if items and all(isinstance(m, Mapping) for m in items):
        for m in items:
            if not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise FieldValueError("prompt", f"chat messages need string 'role' and 'content', got {dict(m)!r}")
        return model.chat_token_ids(items, add_generation_prompt=True)  # content never becomes control tokens
    vocab_size = int(model.vocab_size)
    ids = []
    for t in items:
        if isinstance(t, bool) or not isinstance(t, (int, np.integer)):
            raise FieldValueError("prompt", f"a prompt is text, token ids or chat messages; got an item {t!r}")
        if not 0 <= t < vocab_size:
            raise FieldValueError("prompt", f"prompt token id {t} is outside the vocabulary [0, {vocab_size})")
        ids.append(int(t))
    return ids
