"""A model's jinja chat template, rendered in a sandbox the way transformers' ``apply_chat_template`` renders it.

The environment is jinja2's ``ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)`` with the
``loopcontrols`` extension, and the names transformers gives templates: ``raise_exception(message)`` (the render
fails with that message), ``strftime_now(format)`` (the local time), a ``tojson`` filter that is ``json.dumps`` with
``ensure_ascii=False`` (and its ``indent``, ``separators``, ``sort_keys`` arguments; jinja's own escapes HTML). A
render sees ``messages``, ``tools``, ``documents``, ``add_generation_prompt``, ``bos_token``, ``eos_token`` and any
extra keyword (``enable_thinking=False``, ...). A model without a template gets ``CHATML`` (ChatML without a
system prompt of its own); ``ChatTemplate.from_file`` reads one given by ``--chat-template FILE``.

A template that fails (a syntax error, ``raise_exception``, an undefined operation) raises ``ChatTemplateError``
(a ValueError) that names the template and says why.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

#: The fallback for a model without a template: ChatML (``<|im_start|>{role}\n{content}<|im_end|>\n`` per message).
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>'"
    " + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class ChatTemplateError(ValueError):
    """A chat template failed to compile or to render."""


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:  # noqa: A002 - the name templates call it with
    return datetime.now().strftime(format)


@lru_cache(maxsize=16)
def _compiled(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


@dataclass(frozen=True)
class ChatTemplate:
    """A jinja chat template with the BOS/EOS texts it is rendered with; ``origin`` names it in errors."""

    source: str = CHATML
    bos_token: str | None = None
    eos_token: str | None = None
    origin: str = "the model's chat template"
    _template: jinja2.Template = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.source, str):
            raise TypeError(f"a chat template is a string, got {type(self.source).__name__}")
        try:
            template = _compiled(self.source)
        except jinja2.TemplateSyntaxError as err:
            raise ChatTemplateError(f"{self.origin} is not valid jinja (line {err.lineno}: {err.message})") from None
        object.__setattr__(self, "_template", template)

    @classmethod
    def for_model(cls, source: str | None, bos_token: str | None, eos_token: str | None) -> ChatTemplate:
        """The model's template, or ChatML when it has none."""
        if source is None:
            return cls(CHATML, bos_token, eos_token, "the ChatML fallback template (the model has none)")
        return cls(source, bos_token, eos_token)

    @classmethod
    def from_file(cls, path: str | os.PathLike[str], bos_token: str | None = None,
                  eos_token: str | None = None) -> ChatTemplate:
        """A template read from a file (``--chat-template FILE``)."""
        path = Path(path)
        try:
            source = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as err:
            raise ChatTemplateError(f"--chat-template {path}: cannot read it ({err})") from None
        return cls(source, bos_token, eos_token, f"the chat template {path}")

    def with_source(self, other: ChatTemplate) -> ChatTemplate:
        """``other``'s template with this one's BOS/EOS texts (an override keeps the model's special tokens)."""
        return ChatTemplate(other.source, self.bos_token, self.eos_token, other.origin)

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True, *,
               tools: Sequence[Mapping[str, Any]] | None = None, documents: Sequence[Mapping[str, Any]] | None = None,
               **kwargs: Any) -> str:
        """The prompt text of ``messages``; ChatTemplateError when the template fails on them."""
        specials = {"bos_token": self.bos_token, "eos_token": self.eos_token}  # passed when set, as transformers does
        values = {**{k: v for k, v in specials.items() if v is not None}, **kwargs}
        try:
            return self._template.render(messages=list(messages), tools=tools, documents=documents,
                                         add_generation_prompt=add_generation_prompt, **values)
        except jinja2.TemplateError as err:
            raise ChatTemplateError(f"{self.origin} failed to render these messages: {err}") from None
        except (TypeError, ValueError, KeyError, IndexError, AttributeError) as err:
            raise ChatTemplateError(f"{self.origin} failed to render these messages: {type(err).__name__}: {err}") \
                from None


def model_chat_template(model: Any) -> ChatTemplate:
    """The chat template of a loaded ``GGUFModel`` (its own with its BOS/EOS texts, or ChatML when it has none)."""
    from logitproc.compile.tokenizer_source import from_model

    own = from_model(model)
    return ChatTemplate.for_model(own.chat_template, own.bos_token, own.eos_token)
