"""The tiny-model builds the tests compile besides ``--model tiny`` (``cli_options.tiny_model()``), in one place, so
that ``prebuild.py`` compiles exactly what the tests will ask for."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
from logitproc.compile.gguf_model import GGUFModel
from logitproc.compile.hf_model import write_hf_dir
from logitproc.compile.tiny_model import make_tiny_model
from logitproc.serve.cli_options import TINY_CONTEXT

#: compile options of the float16-KV-cache build of ``tiny_model()`` (test_compiled_model's ``m32h``)
FLOAT16_KV = {"weight_dtype": "float32", "kv_dtype": "float16"}
#: compile options of the Hugging Face directory's build (test_compiled_model's ``m32``)
FLOAT32 = {"weight_dtype": "float32", "kv_dtype": "float32"}
HF_DIRECTORY_NAME = "hf-tiny"
#: compile options of ``wide_tiny()``'s 8-bit KV cache build (test_kv_q8's ``q8``)
Q8_KV = {"weight_dtype": "float32", "kv_dtype": "q8_0"}


def wide_tiny() -> GGUFModel:
    """A tiny model whose heads hold two q8_0 blocks (head size 64; 2 query heads over 1 KV head)."""
    return make_tiny_model(seed=5, hidden=128, n_heads=2, n_kv_heads=1, context=TINY_CONTEXT)


def qwen_tiny() -> GGUFModel:
    """A tiny model with what the default one lacks: Qwen2-style q/k/v biases and an output head of its own."""
    model = make_tiny_model(seed=3, tied_embeddings=False, context=TINY_CONTEXT)
    model.config = replace(model.config, architecture="qwen2")
    model.metadata["general.architecture"] = "qwen2"
    rng = np.random.default_rng(7)
    for i in range(model.config.n_layers):
        for name in ("q", "k", "v"):
            rows = model.weights[f"blk.{i}.attn_{name}.weight"].shape[0]
            model.weights[f"blk.{i}.attn_{name}.bias"] = (rng.standard_normal(rows) * 0.5).astype(np.float32)
    return model


#: The chat markers the marker model has as control tokens of its own (Qwen's and Mistral's).
MARKER_TOKENS = ("<think>", "</think>", "<tool_call>", "</tool_call>", "[TOOL_CALLS]", "[ARGS]", "[THINK]", "[/THINK]")
MARKER_DIRECTORY_NAME = "marker-tiny"


def marker_tiny() -> GGUFModel:
    """The default tiny model's shape and seed with ``MARKER_TOKENS`` added as control tokens (ids 277 ...)."""
    return make_tiny_model(seed=0, context=TINY_CONTEXT, control_tokens=MARKER_TOKENS, name="tiny-markers")


def write_marker_tiny(parent: Path) -> Path:
    """``marker_tiny()`` as a Hugging Face directory under ``parent`` (its tokenizer.json marks the markers
    special)."""
    return write_hf_dir(marker_tiny(), parent / MARKER_DIRECTORY_NAME)


def write_qwen_tiny(model: GGUFModel, parent: Path) -> Path:
    """``model`` written as a Hugging Face directory (config.json, safetensors, tokenizer files) under ``parent``
    (the build cache knows it by its name and its files' contents, wherever it is)."""
    return write_hf_dir(model, parent / HF_DIRECTORY_NAME)
