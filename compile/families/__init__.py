"""The supported model families (``ModelFamily``, one file each) and lookups by name, by Hugging Face architecture
and by GGUF architecture; an unknown one is refused naming what is supported."""

from __future__ import annotations

from ..model_family import ModelFamily
from .llama import LLAMA
from .phi3 import PHI3
from .qwen2 import QWEN2
from .qwen3 import QWEN3

#: Every supported family, in the order ``logitproc models`` lists them.
FAMILIES: tuple[ModelFamily, ...] = (LLAMA, QWEN2, QWEN3, PHI3)


def family_named(name: str) -> ModelFamily:
    """The family called ``name`` (a config's ``architecture``)."""
    for family in FAMILIES:
        if family.name == name:
            return family
    raise ValueError(f"model family {name!r} is not supported (supported: {', '.join(f.name for f in FAMILIES)})")


def family_for_hf(architecture: str) -> ModelFamily:
    """The family of a Hugging Face ``config.json``'s ``architectures[0]``."""
    for family in FAMILIES:
        if architecture in family.hf_architectures:
            return family
    known = ", ".join(a for f in FAMILIES for a in f.hf_architectures)
    raise ValueError(f"Hugging Face architecture {architecture!r} is not supported (supported: {known})")


def family_for_gguf(architecture: str) -> ModelFamily:
    """The family of a GGUF's ``general.architecture``."""
    for family in FAMILIES:
        if architecture in family.gguf_architectures:
            return family
    known = ", ".join(a for f in FAMILIES for a in f.gguf_architectures)
    raise ValueError(f"GGUF architecture {architecture!r} is not supported (supported: {known})")
