"""The supported model families (``ModelFamily``, one file each) and lookups by name, by Hugging Face architecture
and by GGUF architecture; an unknown one is refused naming what is supported."""

from __future__ import annotations

from collections.abc import Callable

from ..model_family import ModelFamily
from .gemma2 import GEMMA2
from .gemma3 import GEMMA3
from .llama import LLAMA
from .phi3 import PHI3
from .qwen2 import QWEN2
from .qwen3 import QWEN3

#: Every supported family, in the order ``logitproc models`` lists them.
FAMILIES: tuple[ModelFamily, ...] = (LLAMA, QWEN2, QWEN3, PHI3, GEMMA2, GEMMA3)


def family_named(name: str) -> ModelFamily:
    """The family called ``name`` (a config's ``architecture``)."""
    for family in FAMILIES:
        if family.name == name:
            return family
    raise ValueError(f"model family {name!r} is not supported (supported: {', '.join(f.name for f in FAMILIES)})")


def family_for_hf(architecture: str) -> ModelFamily:
    """The family of a Hugging Face ``config.json``'s ``architectures[0]`` (a multimodal class: its text model's)."""
    return _family_by(architecture, "Hugging Face", lambda family: family.hf_classes)


def family_for_gguf(architecture: str) -> ModelFamily:
    """The family of a GGUF's ``general.architecture``."""
    return _family_by(architecture, "GGUF", lambda family: family.gguf_architectures)


def _family_by(architecture: str, source: str, names: Callable[[ModelFamily], tuple[str, ...]]) -> ModelFamily:
    """The family whose ``names`` hold ``architecture``; ValueError listing the supported names of ``source``."""
    for family in FAMILIES:
        if architecture in names(family):
            return family
    known = ", ".join(name for family in FAMILIES for name in names(family))
    raise ValueError(f"{source} architecture {architecture!r} is not supported (supported: {known})")
