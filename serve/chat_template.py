"""Rendering chat messages into a model's prompt text: ChatML (SmolLM2's format) in plain Python, without jinja."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from logitproc.compile.gguf_model import IM_END, IM_START, GGUFModel

SMOLLM2_DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


def apply_chat_template(
    messages: Iterable[Mapping[str, str]],
    add_generation_prompt: bool = True,
    *,
    default_system: str | None = SMOLLM2_DEFAULT_SYSTEM,
) -> str:
    """Render ChatML the way SmolLM2's template does.

    Each message becomes ``<|im_start|>{role}\\n{content}<|im_end|>\\n``; when the first message is not a system
    message, ``default_system`` (unless None) is inserted before it as one; ``add_generation_prompt`` appends
    ``<|im_start|>assistant\\n``.
    """
    parts: list[str] = []
    for index, message in enumerate(messages):
        role, content = message["role"], message["content"]
        if index == 0 and role != "system" and default_system is not None:
            parts.append(f"{IM_START}system\n{default_system}{IM_END}\n")
        parts.append(f"{IM_START}{role}\n{content}{IM_END}\n")
    if add_generation_prompt:
        parts.append(f"{IM_START}assistant\n")
    return "".join(parts)


@dataclass(frozen=True)
class ChatTemplate:
    """A model's ChatML template: its default system prompt (None when it inserts none)."""

    default_system: str | None

    @classmethod
    def for_model(cls, model: GGUFModel) -> ChatTemplate:
        """The template of a loaded GGUF (ValueError when it is not ChatML, the only format rendered here)."""
        return cls(model.chat_default_system())

    def render(self, messages: Iterable[Mapping[str, str]], add_generation_prompt: bool = True) -> str:
        return apply_chat_template(messages, add_generation_prompt, default_system=self.default_system)
