"""OpenAI-shaped response bodies: chat completions and their stream chunks, text completions and theirs, logprobs.

Choices are numbered ``prompt_index * n + sequence_index`` (one prompt for chat). Finish reasons are the engine's:
"stop" and "length" as OpenAI's; "abort", "error" and "grammar_dead_end" (the constraints allowed no token) as they
are, the way vLLM passes "abort" through. ``stop_reason`` (vLLM's extension) is the stop string or token id that
ended a sequence. A log-probability of -inf is written as -9999.0 (as vLLM does): JSON has no infinity. A JSON
response format adds the answer's check to its choice (our extension): ``schema_valid`` (the whole schema accepts
the answer; null when it could not be checked), ``schema_error`` (why not) and ``relaxed_keywords`` (the schema
keywords the grammar did not enforce while generating). Any response format adds ``grammar_complete`` (the answer is
a whole match of its grammar) and ``closed_at_max_tokens`` (the closing chose the last tokens so that the document
ended complete within max_tokens; finish_reason stays "length").
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .answer_parser import AnswerDelta
from .chat_turn import ChatAnswer
from .outputs import Delta, Output

TokenText = Callable[[int], str]


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """OpenAI's usage object; ``prompt_tokens_details.cached_tokens`` counts the prompt tokens whose KV cache came
    from the prefix cache."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


#: What a log-probability of -inf (a token the processing ruled out) is written as: JSON has no infinity.
MIN_LOGPROB = -9999.0


def _finite(logprob: float) -> float:
    return max(float(logprob), MIN_LOGPROB)


def _entry(token_text: TokenText, token: int, logprob: float) -> dict[str, Any]:
    text = token_text(token)
    return {"token": text, "logprob": _finite(logprob), "bytes": list(text.encode("utf-8"))}


def chat_logprobs(token_text: TokenText, token_ids: Sequence[int], logprobs: Sequence[float] | None,
                  top: Sequence[Sequence[tuple[int, float]]] | None) -> dict[str, Any] | None:
    """``choices[i].logprobs`` of a chat completion: {"content": [{token, logprob, bytes, top_logprobs}]}."""
    if logprobs is None:
        return None
    content = []
    for i, (token, logprob) in enumerate(zip(token_ids, logprobs, strict=False)):
        entry = _entry(token_text, token, logprob)
        entry["top_logprobs"] = [_entry(token_text, t, lp) for t, lp in (top[i] if top else [])]
        content.append(entry)
    return {"content": content, "refusal": None}


def completion_logprobs(token_text: TokenText, token_ids: Sequence[int], logprobs: Sequence[float] | None,
                        top: Sequence[Sequence[tuple[int, float]]] | None, offset: int = 0) -> dict[str, Any] | None:
    """``choices[i].logprobs`` of a text completion: tokens, token_logprobs, top_logprobs, text_offset."""
    if logprobs is None:
        return None
    tokens = [token_text(t) for t in token_ids[: len(logprobs)]]
    offsets = []
    for text in tokens:
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": [_finite(lp) for lp in logprobs],
            "top_logprobs": [{token_text(t): _finite(lp) for t, lp in row} for row in top] if top else None,
            "text_offset": offsets}


@dataclass
class ResponseHead:
    """What every body and chunk of one response shares."""

    chat: bool
    model: str
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        self.id = self.id or new_id("chatcmpl" if self.chat else "cmpl")

    def body(self, kind: str) -> dict[str, Any]:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}


def full_response(head: ResponseHead, outputs: Sequence[tuple[int, Output]], token_text: TokenText,
                  prompt_tokens: int, echo_texts: Sequence[str] = (), cached_tokens: int = 0,
                  answers: Mapping[int, ChatAnswer] | None = None) -> dict[str, Any]:
    """The whole (non-streamed) response: ``outputs`` are (choice index, finished Output); a chat's ``answers``
    (by choice index) are its messages split into content, reasoning and tool calls."""
    choices = []
    for index, out in sorted(outputs, key=lambda item: item[0]):
        choice: dict[str, Any] = {"index": index}
        answer = answers.get(index) if answers is not None else None
        if head.chat:
            choice["message"] = answer.message if answer is not None else {
                "role": "assistant", "content": out.text, "refusal": None, "tool_calls": []}
            choice["logprobs"] = chat_logprobs(token_text, out.token_ids, out.logprobs, out.top_logprobs)
        else:
            echo = echo_texts[index] if echo_texts else ""
            choice["text"] = echo + out.text
            choice["logprobs"] = completion_logprobs(token_text, out.token_ids, out.logprobs, out.top_logprobs)
        choice["finish_reason"] = out.finish_reason if answer is None else answer.finish_reason
        choice["stop_reason"] = out.stop_reason
        choice.update(answer_check(out))
        if answer is not None:
            choice.update(answer.fields)
        choices.append(choice)
    completion_tokens = sum(len(out.token_ids) for _, out in outputs)
    body = head.body("chat.completion" if head.chat else "text_completion")
    body.update(choices=choices, usage=usage(prompt_tokens, completion_tokens, cached_tokens),
                system_fingerprint=None)
    return body


def chunk(head: ResponseHead, choices: list[dict[str, Any]], include_usage: bool) -> dict[str, Any]:
    body = head.body("chat.completion.chunk" if head.chat else "text_completion")
    body["choices"] = choices
    if include_usage:
        body["usage"] = None
    return body


def role_choice(index: int) -> dict[str, Any]:
    """The first chunk's choice of a chat stream: the assistant role, no content yet."""
    return {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}


def chat_delta(piece: AnswerDelta) -> dict[str, Any]:
    """A chat chunk's ``delta`` for a piece of a split answer: reasoning, content, tool-call pieces (a call's first
    piece carries its id, type and name, later ones argument text only: the openai client joins them by index)."""
    delta: dict[str, Any] = {}
    if piece.reasoning:
        delta["reasoning_content"] = piece.reasoning
    if piece.content:
        delta["content"] = piece.content
    if piece.calls:
        calls = []
        for call in piece.calls:
            item: dict[str, Any] = {"index": call.index}
            if call.id is not None:
                item.update(id=call.id, type="function", function={"name": call.name, "arguments": call.arguments})
            else:
                item["function"] = {"arguments": call.arguments}
            calls.append(item)
        delta["tool_calls"] = calls
    return delta


def delta_choice(head: ResponseHead, index: int, delta: Delta, token_text: TokenText,
                 text: str | None = None, offset: int = 0, piece: AnswerDelta | None = None,
                 answer: ChatAnswer | None = None) -> dict[str, Any]:
    """One chunk choice for an engine delta (``text`` replaces the delta's text, e.g. for echo; a chat's ``piece``
    is the delta's text split into message parts, and ``answer`` the finished answer on the last delta)."""
    text = delta.text if text is None else text
    choice: dict[str, Any] = {"index": index}
    if head.chat:
        if piece is not None:
            choice["delta"] = chat_delta(piece)
        else:
            choice["delta"] = {"content": text} if text or not delta.finish_reason else {}
        choice["logprobs"] = chat_logprobs(token_text, delta.token_ids, delta.logprobs, delta.top_logprobs)
    else:
        choice["text"] = text
        choice["logprobs"] = completion_logprobs(token_text, delta.token_ids, delta.logprobs, delta.top_logprobs,
                                                 offset)
    choice["finish_reason"] = delta.finish_reason if answer is None else answer.finish_reason
    if delta.finish_reason is not None:
        choice["stop_reason"] = delta.output.stop_reason if delta.output is not None else None
        if delta.output is not None:
            choice.update(answer_check(delta.output))
        if answer is not None:
            choice.update(answer.fields)
    return choice


def answer_check(out: Output) -> dict[str, Any]:
    """The choice fields of a constrained answer: its grammar's verdict (``grammar_complete``,
    ``closed_at_max_tokens``) and a JSON answer's check (none for unconstrained answers)."""
    fields: dict[str, Any] = {}
    if out.grammar_complete is not None:
        fields.update(grammar_complete=out.grammar_complete, closed_at_max_tokens=out.closed_at_max_tokens)
    if out.schema_valid is not None or out.schema_error is not None or out.relaxed_keywords:
        fields.update(schema_valid=out.schema_valid, schema_error=out.schema_error,
                      relaxed_keywords=list(out.relaxed_keywords))
    return fields


def usage_chunk(head: ResponseHead, prompt_tokens: int, completion_tokens: int,
                cached_tokens: int = 0) -> dict[str, Any]:
    """The last chunk of a stream with ``stream_options.include_usage``: no choices, the usage."""
    body = head.body("chat.completion.chunk" if head.chat else "text_completion")
    body.update(choices=[], usage=usage(prompt_tokens, completion_tokens, cached_tokens))
    return body
