"""The sampling settings a model answers with when the user sets none: its own ``generation_config.json``, else a
per-model table, else one measured fallback (``scripts/measure_defaults.py``; figures in docs/serving.md).

Only the standard library is imported, so that ``logitproc --help`` can print these defaults without loading TVM.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: A Hugging Face folder's generation defaults (read as vLLM does: these fields, ``do_sample`` ignored).
GENERATION_CONFIG_FILE = "generation_config.json"
GENERATION_CONFIG_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                            "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}

#: ``chat`` and ``generate`` stop an answer after this many tokens unless told otherwise (``--max-tokens``,
#: ``/max_tokens off``): a small model that loses its way would otherwise write until the context is full.
DEFAULT_MAX_TOKENS = 512

#: Measured on the question set of scripts/measure_defaults.py (docs/serving.md): greedy with a mild repetition
#: penalty answered as well as any setting, never ran on or repeated itself, and gave the shortest answers. Used for
#: every model without its own generation config or table entry.
FALLBACK: dict[str, float] = {"temperature": 0.0, "repetition_penalty": 1.05}

#: Models (GGUF files carry no generation config) by a normalised name prefix -> their settings.
PER_MODEL: dict[str, dict[str, float]] = {
    "smollm2-135m-instruct": {"temperature": 0.0, "repetition_penalty": 1.05},
}


@dataclass(frozen=True)
class ModelDefaults:
    """GenerationConfig values for a model, and where they come from (said in ``/settings`` and ``--help``)."""

    values: dict[str, Any]
    source: str

    def describe(self) -> str:
        settings = ", ".join(f"{name} {value}" for name, value in self.values.items())
        return f"{settings} ({self.source})"


def _normalised(name: str) -> str:
    return re.sub(r"[\s_.]+", "-", name.strip().lower())


def read_generation_config(folder: Path) -> dict[str, Any] | None:
    """The sampling fields of ``folder/generation_config.json`` as GenerationConfig values; None without any."""
    path = folder / GENERATION_CONFIG_FILE
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict):
        return None
    values = {ours: data[theirs] for theirs, ours in GENERATION_CONFIG_FIELDS.items()
              if isinstance(data.get(theirs), int | float) and not isinstance(data.get(theirs), bool)}
    return values or None


def model_defaults(name: str, folders: Iterable[Path] = ()) -> ModelDefaults:
    """The defaults of the model called ``name`` whose files are in ``folders`` (its source, its compiled copy)."""
    for folder in folders:
        found = read_generation_config(folder)
        if found is not None:
            return ModelDefaults({"max_tokens": DEFAULT_MAX_TOKENS, **found}, f"{folder / GENERATION_CONFIG_FILE}")
    key = _normalised(name)
    for prefix, values in PER_MODEL.items():
        if key.startswith(prefix):
            return ModelDefaults({**values, "max_tokens": DEFAULT_MAX_TOKENS}, f"measured for {prefix}")
    return ModelDefaults({**FALLBACK, "max_tokens": DEFAULT_MAX_TOKENS}, "measured fallback")


def help_text() -> str:
    """What ``--help`` says about the defaults."""
    table = "; ".join(f"{prefix}: " + ", ".join(f"{k} {v}" for k, v in values.items())
                      for prefix, values in PER_MODEL.items())
    fallback = ", ".join(f"{k} {v}" for k, v in FALLBACK.items())
    return (f"Unset sampling options take the model's defaults: its {GENERATION_CONFIG_FILE} (Hugging Face folders), "
            f"else a measured table ({table}), else {fallback}; --max-tokens defaults to {DEFAULT_MAX_TOKENS}. "
            "Everything else is off: top-p 1, top-k 0, min-p 0, penalties 0 (repetition 1), no seed.")
