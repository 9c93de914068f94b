"""Chat messages to prompt token ids: the template's own markup may become control tokens, the messages' text never.

A client's text (message contents, names, tool results, tool definitions, documents: every string value, at any
depth) can spell a control token such as ``<|im_start|>``; tokenized with the rendered prompt, it would forge a
system or tool turn. ``ChatEncoder.encode`` prevents that:

1. In every string the client gave, each occurrence of a control token is wrapped in two Unicode noncharacters
   (``MARK_OPEN`` ... ``MARK_CLOSE``; any the client sent are removed first). Control tokens are the tokenizer's
   special added tokens (a GGUF's control tokens); non-special added tokens (a GGUF's user-defined ones, such as
   Qwen's ``<think>``) are text that the tokenizer matches wherever they appear, as llama.cpp and transformers do.
2. The template renders the marked messages; the marks are removed, remembering which spans of the prompt were
   marked, and where a lone mark stood (a template that cut a marked token apart, with ``split`` say).
3. The prompt is tokenized as usual. A control token that overlaps a marked span, or spans a lone mark, came from
   the client: then the prompt is cut at the other (the template's) control tokens, and each piece between them is
   tokenized with added tokens read as plain text. Pieces between control tokens are exactly what the tokenizer
   would tokenize on its own, so the ids differ from the plain encoding only inside the client's text.

The pieces after the first are encoded without a SentencePiece ``prepend_scheme: first`` space (the tokenizer adds it
only at the start of the whole text). If plain-text encoding still yields a control token, the request is refused.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from tokenizers import Tokenizer

from .chat_template import ChatTemplate

#: Noncharacters (never assigned, meant for a program's internal use) around client-spelled control tokens.
MARK_OPEN = "\ufdd0"
MARK_CLOSE = "\ufdd1"


class ChatEncoder:
    """Renders and tokenizes chats for one (tokenizer, template) pair (see the module doc)."""

    def __init__(self, tokenizer: Tokenizer, template: ChatTemplate) -> None:
        self.tokenizer = tokenizer
        self.template = template
        added = tokenizer.get_added_tokens_decoder()
        self.control_tokens = sorted({t.content for t in added.values() if t.special}, key=len, reverse=True)
        self.control_ids = {i for i, t in added.items() if t.content in self.control_tokens}
        self._pattern = re.compile("|".join(map(re.escape, self.control_tokens))) if self.control_tokens else None
        self._lock = threading.Lock()
        self._text_tokenizers: tuple[Tokenizer, Tokenizer] | None = None

    def mark(self, value: Any) -> Any:
        """``value`` with every control token in its strings wrapped in marks (dict keys are left alone)."""
        if isinstance(value, str):
            value = value.replace(MARK_OPEN, "").replace(MARK_CLOSE, "")
            return self._pattern.sub(lambda m: MARK_OPEN + m.group(0) + MARK_CLOSE, value) if self._pattern else value
        if isinstance(value, Mapping):
            return {key: self.mark(item) for key, item in value.items()}
        if isinstance(value, list | tuple):
            return [self.mark(item) for item in value]
        return value

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True, *,
               continue_final_message: bool = False, **kwargs: Any) -> tuple[str, list[tuple[int, int]], list[int]]:
        """The prompt text, the spans of client-spelled control tokens in it, and the positions of lone marks.
        ``continue_final_message``: the text ends with the last message's content (what the template writes after
        it is cut, as transformers does), so that the answer continues that message."""
        marked = self.template.render(self.mark(list(messages)), add_generation_prompt, **self.mark(kwargs))
        if continue_final_message:
            final = self.mark(messages[-1].get("content") or "")
            end = marked.rfind(final) if final else -1
            if end < 0:
                raise ValueError("continue_final_message: the chat template does not write the last message's content "
                                 "as it is, so it cannot be continued")
            marked = marked[: end + len(final)]
        text: list[str] = []
        spans: list[tuple[int, int]] = []
        breaks: list[int] = []
        size = 0
        for piece in re.split(f"({MARK_OPEN}[^{MARK_OPEN}{MARK_CLOSE}]*{MARK_CLOSE}|[{MARK_OPEN}{MARK_CLOSE}])",
                              marked):
            if piece in (MARK_OPEN, MARK_CLOSE):
                breaks.append(size)
                continue
            if piece.startswith(MARK_OPEN):
                piece = piece[1:-1]
                spans.append((size, size + len(piece)))
            text.append(piece)
            size += len(piece)
        return "".join(text), spans, breaks

    def encode(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True, *,
               continue_final_message: bool = False, **kwargs: Any) -> list[int]:
        """Prompt token ids of ``messages``; no control token comes from the client's text."""
        text, spans, breaks = self.render(messages, add_generation_prompt,
                                          continue_final_message=continue_final_message, **kwargs)
        with self._lock:  # a Tokenizer is not documented as safe for concurrent encodes
            # encode_batch releases the GIL while it works (encode does not): other threads, the stepping one
            # included, run meanwhile
            encoding = self.tokenizer.encode_batch([text], add_special_tokens=False)[0]
            ids, offsets = encoding.ids, encoding.offsets
            controls = [(i, offsets[k]) for k, i in enumerate(ids) if i in self.control_ids]
            forged = [(i, (s, e)) for i, (s, e) in controls
                      if any(s < b and a < e for a, b in spans) or any(s < b < e for b in breaks)]
            if not forged:
                return list(ids)
            return self._encode_as_text(text, [(s, e) for i, (s, e) in controls if (i, (s, e)) not in forged])

    def _encode_as_text(self, text: str, markup: list[tuple[int, int]]) -> list[int]:
        """``text`` tokenized with only the ``markup`` spans as control tokens, the rest as plain text."""
        first, rest = self._text_variants()
        out: list[int] = []
        position = 0
        for start, end in [*markup, (len(text), len(text))]:
            if start > position:
                piece = (first if position == 0 else rest).encode(text[position:start], add_special_tokens=False).ids
                leaked = self.control_ids.intersection(piece)
                if leaked:
                    raise ValueError(f"the message text {text[position:start]!r:.80} cannot be tokenized as plain text "
                                     f"(the tokenizer produces control token {sorted(leaked)[0]} from it)")
                out += piece
            if end > start:
                out += self.tokenizer.encode(text[start:end], add_special_tokens=False).ids
            position = end
        return out

    def _text_variants(self) -> tuple[Tokenizer, Tokenizer]:
        """Copies of the tokenizer that read every control token as text: (for the start of a prompt, for the
        pieces after a control token; the same copy unless a Metaspace adds a space only at the start). Made on the
        first prompt that needs them (a copy of a 128k-token BPE takes about 4 s on the 2-core machine)."""
        if self._text_tokenizers is None:
            spec = json.loads(self.tokenizer.to_str())
            first = Tokenizer.from_str(json.dumps(spec))
            rest = Tokenizer.from_str(json.dumps(spec)) if _no_first_space(spec.get("pre_tokenizer")) else first
            for variant in (first, rest):
                variant.encode_special_tokens = True
            self._text_tokenizers = (first, rest)
        return self._text_tokenizers


def _no_first_space(pre_tokenizer: dict[str, Any] | None) -> bool:
    """Turn a Metaspace ``prepend_scheme: first`` (anywhere in a Sequence) into ``never``, in place; whether it did."""
    if not pre_tokenizer:
        return False
    changed = False
    if pre_tokenizer.get("type") == "Metaspace" and pre_tokenizer.get("prepend_scheme") == "first":
        pre_tokenizer["prepend_scheme"] = "never"
        changed = True
    for inner in pre_tokenizer.get("pretokenizers", []):
        changed = _no_first_space(inner) or changed
    return changed
