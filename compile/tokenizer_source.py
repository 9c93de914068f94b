"""The tokenizer and chat template a model brings (a GGUF's metadata, a Hugging Face folder's files, an in-memory
model), read and checked before anything is compiled.

``ModelTokenizer`` holds what the compiled model keeps: the Hugging Face tokenizer as JSON, the model's jinja chat
template (None when it has none) and the BOS/EOS token texts the template sees as ``bos_token`` / ``eos_token``.

* GGUF: the tokenizer is rebuilt by ``gguf_tokenizer`` (refused there with one sentence when not understood); the
  template is ``tokenizer.chat_template``.
* Hugging Face folder: ``tokenizer.json`` as is; the template is ``chat_template.jinja`` when present, else
  ``tokenizer_config.json``'s ``chat_template`` (a string, or a list of ``{"name", "template"}`` of which the one
  named ``default`` is used), else ``chat_template.json``'s (a multimodal processor's); ``bos_token`` /
  ``eos_token`` from ``tokenizer_config.json`` (a string or an added-token object). When ``tokenizer_config.json``
  sets ``add_bos_token`` / ``add_eos_token``, the tokenizer's post-processor is rebuilt to add exactly those (as
  transformers' Llama and Gemma tokenizers do); otherwise the post-processor of ``tokenizer.json`` decides.

Every template is compiled once here, so a template with a syntax error is refused before the compile.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenizers import Tokenizer, processors

from .gguf_tokenizer import GGUFVocab, build_tokenizer, read_gguf_metadata, vocab_of

if TYPE_CHECKING:
    from .gguf_model import GGUFModel

#: The metadata key of a GGUF's (default) chat template.
GGUF_TEMPLATE_KEY = "tokenizer.chat_template"


@dataclass(frozen=True)
class ModelTokenizer:
    """A model's tokenizer (JSON), chat template (None: the model has none) and BOS/EOS texts for the template."""

    tokenizer_json: str
    chat_template: str | None
    bos_token: str | None
    eos_token: str | None

    def tokenizer(self) -> Tokenizer:
        return Tokenizer.from_str(self.tokenizer_json)


def check_template(template: Any, origin: str) -> str | None:
    """``template`` when it is None or a jinja template that compiles (sandboxed); ValueError otherwise."""
    if template is None:
        return None
    if not isinstance(template, str):
        raise ValueError(f"{origin}: the chat template must be a string, got {type(template).__name__}")
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    try:
        ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"]).parse(template)
    except jinja2.TemplateSyntaxError as err:
        raise ValueError(f"{origin}: the chat template is not valid jinja (line {err.lineno}: {err.message})") \
            from None
    return template


def from_gguf_metadata(meta: dict[str, Any], origin: str) -> ModelTokenizer:
    """The tokenizer and template of a GGUF's metadata (see the module doc)."""
    vocab = GGUFVocab.from_metadata(meta, origin)
    return _from_vocab(vocab, meta.get(GGUF_TEMPLATE_KEY), origin)


def from_gguf_file(path: str | os.PathLike[str]) -> ModelTokenizer:
    """``from_gguf_metadata`` of a GGUF file (its tensors are not read)."""
    return from_gguf_metadata(read_gguf_metadata(path), Path(path).name)


def from_model(model: GGUFModel) -> ModelTokenizer:
    """The tokenizer and template of a loaded model: a Hugging Face folder's own files when it was read from one,
    else rebuilt from its GGUF vocabulary."""
    if "tokenizer.huggingface.json" in model.metadata and model.path.is_dir():
        return from_hf_dir(model.path)
    return _from_vocab(vocab_of(model), model.metadata.get(GGUF_TEMPLATE_KEY, model.config.chat_template),
                       model.path.name)


def _from_vocab(vocab: GGUFVocab, template: Any, origin: str) -> ModelTokenizer:
    def text(index: int | None) -> str | None:
        return None if index is None else vocab.tokens[index]

    return ModelTokenizer(build_tokenizer(vocab).to_str(), check_template(template, origin), text(vocab.bos_id),
                          text(vocab.eos_id))


def _token_text(value: Any, key: str, origin: str) -> str | None:
    """A tokenizer_config.json special token: a string, an added-token object ``{"content": ...}`` or null."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    raise ValueError(f"{origin}: tokenizer_config.json {key} {value!r} is neither a string nor an added token")


def hf_template(directory: Path, config: dict[str, Any]) -> str | None:
    """A folder's chat template: ``chat_template.jinja``, else tokenizer_config.json's ``chat_template``, else the
    ``chat_template`` of ``chat_template.json`` (where a multimodal checkpoint's processor keeps it)."""
    origin = directory.name
    file = directory / "chat_template.jinja"
    if file.is_file():
        return check_template(file.read_text(encoding="utf-8"), f"{origin}/chat_template.jinja")
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {}
        for entry in template:
            if not (isinstance(entry, dict) and isinstance(entry.get("name"), str) and "template" in entry):
                raise ValueError(f"{origin}: tokenizer_config.json chat_template list entries need 'name' and "
                                 f"'template', got {entry!r:.80}")
            named[entry["name"]] = entry["template"]
        if "default" not in named:
            raise ValueError(f"{origin}: tokenizer_config.json has chat templates {sorted(named)} but none named "
                             "'default'; pass one with --chat-template FILE")
        template = named["default"]
    if template is None and (directory / "chat_template.json").is_file():  # a multimodal processor's (Gemma 3 4B+)
        processor = json.loads((directory / "chat_template.json").read_text(encoding="utf-8"))
        if not isinstance(processor, dict) or "chat_template" not in processor:
            raise ValueError(f"{origin}/chat_template.json holds no 'chat_template'")
        return check_template(processor["chat_template"], f"{origin}/chat_template.json")
    return check_template(template, f"{origin}/tokenizer_config.json")


def from_hf_dir(directory: str | os.PathLike[str]) -> ModelTokenizer:
    """The tokenizer and template of a Hugging Face folder (see the module doc)."""
    path = Path(directory)
    tokenizer_file = path / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise FileNotFoundError(f"{path} has no tokenizer.json (a Hugging Face model folder needs one)")
    try:
        tokenizer = Tokenizer.from_file(str(tokenizer_file))
    except Exception as err:  # the tokenizers library raises plain Exception for files it does not understand
        raise ValueError(f"{path.name}/tokenizer.json is not a tokenizer the tokenizers library reads: {err}") \
            from None
    config_file = path / "tokenizer_config.json"
    config = json.loads(config_file.read_text(encoding="utf-8")) if config_file.is_file() else {}
    bos = _token_text(config.get("bos_token"), "bos_token", path.name)
    eos = _token_text(config.get("eos_token"), "eos_token", path.name)
    if "add_bos_token" in config or "add_eos_token" in config:
        tokenizer.post_processor = _special_tokens_processor(tokenizer, config, bos, eos, path.name)
    return ModelTokenizer(tokenizer.to_str(), hf_template(path, config), bos, eos)


def _special_tokens_processor(tokenizer: Tokenizer, config: dict[str, Any], bos: str | None, eos: str | None,
                              origin: str) -> Any:
    add: list[tuple[str, str | None]] = []
    for key, token in (("add_bos_token", bos), ("add_eos_token", eos)):
        flag = config.get(key, False)
        if not isinstance(flag, bool):
            raise ValueError(f"{origin}: tokenizer_config.json {key} must be a boolean, got {flag!r}")
        add.append((key, token) if flag else ("", None))
    specials = []
    for key, token in add:
        if key and (token is None or tokenizer.token_to_id(token) is None):
            raise ValueError(f"{origin}: tokenizer_config.json sets {key} but its token {token!r} is not in "
                             "tokenizer.json")
        if token is not None:
            specials.append(token)
    bos_part = [add[0][1]] if add[0][1] else []
    eos_part = [add[1][1]] if add[1][1] else []
    single = " ".join([*bos_part, "$A", *eos_part])
    pair = " ".join([*bos_part, "$A", *eos_part, *bos_part, "$B:1", *eos_part])
    ids = [(t, tokenizer.token_to_id(t)) for t in dict.fromkeys(specials)]
    template = processors.TemplateProcessing(single=single, pair=pair, special_tokens=ids)
    current = json.loads(tokenizer.to_str()).get("post_processor") or {}
    if current.get("type") == "ByteLevel":
        return processors.Sequence([processors.ByteLevel(trim_offsets=False), template])
    if current.get("type") == "Sequence" and any(p.get("type") == "ByteLevel" for p in current["processors"]):
        return processors.Sequence([processors.ByteLevel(trim_offsets=False), template])
    return template
