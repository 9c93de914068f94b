"""ConstraintFactory: the TokenMaskSources of one sequence, made from its GenerationConfig.

One factory per model (tokenizer, vocabulary size, EOS ids, grammar engine, optional Tree Decode map). For every
sequence (each sequence of an n > 1 request separately) ``sources_for(config)`` gives:

* the grammar of ``config.response_format``, compiled once per (engine, tokenizer, format) in a shared cache; a
  format the engine cannot compile raises :class:`GrammarError` (a ValueError) for that request only; a JSON
  schema with ``uniqueItems`` gets its grammar wrapped so that arrays keep their scalar items unique
  (``grammar/unique_items.py``); when the engine fails mid-answer, the sequence goes on with the engine's next
  grammar (the failed one leaves the cache), its tokens replayed, or ends with "error" (``grammar/recovery.py``);
* with a grammar and ``config.max_tokens``, a :class:`DocumentClosing` after it (or after its think block), which
  closes the document in time so that max_tokens never ends it mid-document (``grammar/closing.py``), with the
  schema's completion hints and the sequence's other sources (its plans use only tokens they allow); inside a
  think block, it ends thinking in time for the document to close;
* with ``config.max_thinking_tokens`` set, a :class:`ThinkBudget` that starts inside the think block (the prompt is
  opened with ``config.think_begin``: see :meth:`open_think_block`), forces ``config.think_end`` when the budget is
  spent, and applies the grammar only after thinking ends;
* the Tree Decode constraint when the factory has a map;
* the token rules ``allowed_token_ids``, ``bad_words`` and ``min_tokens`` (see ``token_rules.py``); min_tokens bans
  the factory's EOS ids (unless ``ignore_eos``) and ``stop_token_ids``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tokenizers import Tokenizer

from .config import GenerationConfig
from .grammar import (
    GLOBAL_CACHE,
    GRAMMAR_BACKENDS,
    CompiledGrammarCache,
    GrammarBackend,
    GrammarEngineError,
    GrammarSource,
    TokenizerAdapter,
    get_backend,
)
from .grammar.closing import DocumentClosing
from .grammar.completion_hints import completion_hints
from .grammar.recovery import RecoveringMatcher
from .grammar.unique_items import UniqueItemsCache
from .mask_source import TokenMaskSource
from .think_mode import ThinkBudget
from .token_rules import AllowedTokens, BadWords, MinTokens, bad_word_token_ids
from .tree_decode import TreeDecodeConfig, TreeDecodeSource


class ConstraintFactory:
    """Makes each sequence's mask sources for one model."""

    def __init__(self, tokenizer: Tokenizer | TokenizerAdapter, vocab_size: int, eos_token_ids: Sequence[int],
                 backend: str | GrammarBackend = "llguidance", tree_decode: TreeDecodeConfig | None = None,
                 cache: CompiledGrammarCache | None = None) -> None:
        """``backend``: an engine's name (``GRAMMAR_BACKENDS``; made once per tokenizer in the process), or an
        engine made for this tokenizer (e.g. llguidance with other limits)."""
        self.tokenizer = tokenizer if isinstance(tokenizer, TokenizerAdapter) else TokenizerAdapter(
            tokenizer, vocab_size, eos_token_ids)
        self._backend: GrammarBackend | None = None
        if isinstance(backend, GrammarBackend):
            if backend.tokenizer.fingerprint != self.tokenizer.fingerprint:
                raise ValueError(f"the grammar backend {backend.name!r} was made for another tokenizer than this "
                                 "factory's")
            self._backend, backend = backend, backend.name
        if backend not in GRAMMAR_BACKENDS:
            raise ValueError(f"grammar backend must be one of {list(GRAMMAR_BACKENDS)}, got {backend!r}")
        self.backend_name = backend
        self.tree_decode = tree_decode
        self.cache = cache if cache is not None else GLOBAL_CACHE
        #: ``uniqueItems`` while generating: the rules of each schema that requires it (``grammar/unique_items.py``).
        self.unique_items = UniqueItemsCache(self.tokenizer)

    @property
    def backend(self) -> GrammarBackend:
        """The engine, made on first use (llguidance reads a 129k tokenizer in about 1 s)."""
        if self._backend is None:
            self._backend = get_backend(self.backend_name, self.tokenizer)
        return self._backend

    def prepare(self) -> None:
        """Make now what the first constrained request would otherwise make while the engine steps: the grammar
        engine for this tokenizer (llguidance reads a 49k vocabulary in about 1 s and holds Python's GIL all that
        time, so every thread of the process, the stepping one included, waits) and the tokenizer's tables that
        masks, closings and jump-forward read (``TokenizerAdapter.build_tables``)."""
        _ = self.backend  # made once per (engine, tokenizer) in the process
        self.tokenizer.build_tables()

    def grammar_source(self, config: GenerationConfig) -> GrammarSource | None:
        fmt = config.response_format
        if fmt is None:
            return None
        backend = self.backend
        key = (backend.cache_name, self.tokenizer.fingerprint, fmt.key)
        compiled = self.cache.get(key, lambda: backend.compile(fmt))
        rules = self.unique_items.rules(fmt.text) if fmt.kind == "json_schema" else None

        def replacement(failed: Any, error: GrammarEngineError) -> Any:
            return self.cache.replace(key, failed, lambda: backend.after_failure(fmt, failed, error))

        recovering = RecoveringMatcher(backend, compiled, replacement,
                                       rules.relaxed_keywords if rules is not None else None)
        # arrays whose scalar items must be unique: kept so while generating
        matcher = self.unique_items.wrap(recovering, fmt.text) if rules is not None else recovering
        return GrammarSource(matcher, self.tokenizer, backend.name, recovery=recovering)

    def marker_ids(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def sources_for(self, config: GenerationConfig) -> list[TokenMaskSource]:
        """Fresh mask sources for one sequence of a request with ``config``."""
        sources: list[TokenMaskSource] = []
        grammar = self.grammar_source(config)
        think = None
        if config.max_thinking_tokens is not None:
            think = ThinkBudget((), self.marker_ids(config.think_end), config.max_thinking_tokens, inner=grammar,
                                starts_in_thinking=True)
            sources.append(think)
        elif grammar is not None:
            sources.append(grammar)
        others: list[TokenMaskSource] = [TreeDecodeSource(self.tree_decode)] if self.tree_decode is not None else []
        others.extend(self.token_rules(config))
        if grammar is not None and config.max_tokens is not None:  # after the grammar (or its think block)
            sources.append(DocumentClosing(grammar, config.max_tokens, completion_hints(config.response_format),
                                           rules=others, think=think))
        return sources + others

    def token_rules(self, config: GenerationConfig) -> list[TokenMaskSource]:
        """The mask sources of ``allowed_token_ids``, ``bad_words`` and ``min_tokens`` (none when they are unset)."""
        vocab = self.tokenizer.vocab_size
        rules: list[TokenMaskSource] = []
        if config.allowed_token_ids is not None:
            rules.append(AllowedTokens(config.allowed_token_ids, vocab))
        if config.bad_words:
            rules.append(BadWords(bad_word_token_ids(config.bad_words, self.tokenizer.encode), vocab))
        if config.min_tokens:
            eos = () if config.ignore_eos else self.tokenizer.eos_token_ids
            rules.append(MinTokens(config.min_tokens, sorted({*eos, *config.stop_token_ids}), vocab))
        return rules

    def open_think_block(self, prompt_ids: Sequence[int], config: GenerationConfig) -> list[int]:
        """The prompt, followed by the ids of ``config.think_begin`` when a thinking budget is set and the prompt does
        not already end with them (generation then starts inside the think block)."""
        ids = list(prompt_ids)
        if config.max_thinking_tokens is None:
            return ids
        begin = self.marker_ids(config.think_begin)
        return ids if ids[len(ids) - len(begin):] == begin else ids + begin
