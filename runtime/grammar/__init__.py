"""Grammar-constrained decoding: engines (llguidance default, xgrammar optional), tokenizer adapter, cache, source."""

from __future__ import annotations

import threading

from .backend import GrammarBackend, GrammarEngineError, GrammarError, GrammarMatcher
from .cache import GLOBAL_CACHE, CompiledGrammarCache
from .source import GrammarSource, JumpForward
from .tokenizer_adapter import TokenizerAdapter

GRAMMAR_BACKENDS = ("llguidance", "xgrammar")
_backends: dict[tuple[str, str], GrammarBackend] = {}
_backends_lock = threading.Lock()


def get_backend(name: str, tokenizer: TokenizerAdapter) -> GrammarBackend:
    """The engine ``name`` bound to ``tokenizer``, made once per (engine, tokenizer) in this process."""
    if name not in GRAMMAR_BACKENDS:
        raise ValueError(f"grammar backend must be one of {list(GRAMMAR_BACKENDS)}, got {name!r}")
    key = (name, tokenizer.fingerprint)
    with _backends_lock:
        backend = _backends.get(key)
        if backend is None:
            if name == "llguidance":
                from .llguidance_backend import LLGuidanceBackend as cls
            else:
                from .xgrammar_backend import XGrammarBackend as cls  # type: ignore[assignment]
            backend = _backends[key] = cls(tokenizer)
    return backend


__all__ = [
    "GLOBAL_CACHE",
    "GRAMMAR_BACKENDS",
    "CompiledGrammarCache",
    "GrammarBackend",
    "GrammarEngineError",
    "GrammarError",
    "GrammarMatcher",
    "GrammarSource",
    "JumpForward",
    "TokenizerAdapter",
    "get_backend",
]
