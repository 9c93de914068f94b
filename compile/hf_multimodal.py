"""The text model of a Hugging Face multimodal checkpoint (``ModelFamily.hf_multimodal``: Gemma 3's
``Gemma3ForConditionalGeneration``): its ``config.json`` read as the text model's, and its tensors named as a
text-only checkpoint names them, the image side's set aside. llama.cpp does the same for text-only use: its converter
writes the text model to the GGUF and the image encoder to a separate ``mmproj`` file."""

from __future__ import annotations

from typing import Any

from .model_family import HF_INERT_KEYS, ModelFamily, MultimodalCheckpoint

#: top-level keys that are the text model's too: where both levels name one, they must agree
_SHARED_KEYS = ("bos_token_id", "tie_word_embeddings")
#: top-level keys read here (besides the image side's ``MultimodalCheckpoint.image_keys`` and ``HF_INERT_KEYS``)
_TOP_KEYS = frozenset({"architectures", "model_type", "text_config", "eos_token_id", "_name_or_path", *_SHARED_KEYS})


def multimodal_of(cfg: dict[str, Any], family: ModelFamily) -> MultimodalCheckpoint | None:
    """The family's multimodal class when the ``config.json`` ``cfg`` names it, else None."""
    wrapper = family.hf_multimodal
    return wrapper if wrapper is not None and cfg.get("architectures") == [wrapper.architecture] else None


def _listed(value: Any) -> list[Any]:
    return [] if value is None else value if isinstance(value, list) else [value]


def text_config(cfg: dict[str, Any], family: ModelFamily, wrapper: MultimodalCheckpoint) -> dict[str, Any]:
    """The text model's ``config.json``: the ``text_config`` (``model_type`` the wrapper's text type) under the
    family's text class, the top level's EOS ids added to its own, the top level's BOS and tie flag where given (a
    text config naming another is refused); any other top-level key that is neither the image side's
    (``image_keys``) nor bookkeeping (``HF_INERT_KEYS``) is refused, naming it."""
    for key, value in cfg.items():
        if key not in _TOP_KEYS and key not in wrapper.image_keys and key not in HF_INERT_KEYS:
            raise ValueError(f"config.json: key {key!r} (= {value!r:.60}) of {wrapper.architecture} is not "
                             f"understood; refusing rather than guessing what it changes")
    text = cfg.get("text_config")
    if not isinstance(text, dict):
        raise ValueError(f"config.json: {wrapper.architecture} needs its text model's config as text_config (an "
                         f"object), got {text!r:.60}")
    kind = text.get("model_type", wrapper.text_model_type)
    if kind != wrapper.text_model_type:
        raise ValueError(f"config.json: text_config model_type {kind!r} is not supported in "
                         f"{wrapper.architecture} ({wrapper.text_model_type})")
    if text.get("architectures") not in (None, [family.hf_architectures[0]]):
        raise ValueError(f"config.json: text_config architectures {text['architectures']!r} are not "
                         f"{family.hf_architectures[0]}")
    out = {**text, "architectures": [family.hf_architectures[0]]}
    for key in _SHARED_KEYS:
        if key in cfg and key in text and cfg[key] != text[key]:
            raise ValueError(f"config.json: {key} {cfg[key]!r} disagrees with text_config's {text[key]!r}")
        if key in cfg:
            out[key] = cfg[key]
    own = _listed(text.get("eos_token_id"))
    eos = own + [i for i in _listed(cfg.get("eos_token_id")) if i not in own]
    if eos:
        out["eos_token_id"] = eos
    if "_name_or_path" in cfg:
        out["_name_or_path"] = cfg["_name_or_path"]
    return out


def text_tensor_name(name: str, wrapper: MultimodalCheckpoint) -> str | None:
    """A multimodal checkpoint's tensor ``name`` as the text-only checkpoint names it; None for the image side's;
    ValueError for a tensor of neither."""
    for prefix, text_prefix in wrapper.text_prefixes.items():
        if name.startswith(prefix):
            return text_prefix + name[len(prefix):]
    if name.startswith(wrapper.image_prefixes):
        return None
    raise ValueError(f"tensor {name} is neither the text model's (under {', '.join(wrapper.text_prefixes)}) nor "
                     f"the image side's (under {', '.join(wrapper.image_prefixes)}) of {wrapper.architecture}")
