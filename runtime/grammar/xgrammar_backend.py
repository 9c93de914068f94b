"""The xgrammar engine (optional extra ``xgrammar``; it imports torch): pushdown automaton with an adaptive token-mask
cache, compiled once per grammar by a ``GrammarCompiler`` (itself caching).

The vocabulary given to xgrammar has "" for special tokens and padded ids (so they are never allowed) and the
model's EOS ids as stop tokens. JSON follows the response format's whitespace policy as the llguidance backend does:
compact (no whitespace), indented (xgrammar's own ``indent=2``) or flexible (any whitespace, at most
``MAX_JSON_WHITESPACE`` characters in a row), so that both engines allow the same tokens.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..response_format import ResponseFormat
from .backend import GrammarBackend, GrammarError, GrammarMatcher
from .llguidance_backend import MAX_JSON_WHITESPACE
from .tokenizer_adapter import BYTE_LEVEL, TokenizerAdapter


def _xgrammar() -> Any:
    try:
        import xgrammar
    except ImportError as err:
        raise ImportError(f"the xgrammar grammar backend needs the optional extra: pip install 'logitproc[xgrammar]' "
                          f"({err})") from None
    return xgrammar


class XGrammarMatcher(GrammarMatcher):
    __slots__ = ("_m", "_adapter")

    def __init__(self, matcher: Any, adapter: TokenizerAdapter) -> None:
        self._m = matcher
        self._adapter = adapter

    def fill_next_token_bitmask(self, row: np.ndarray) -> None:
        self._m.fill_next_token_bitmask(row[None, :])
        self._adapter.clear_padding(row)

    def try_accept_token(self, token_id: int) -> bool:
        return bool(self._m.accept_token(int(token_id)))

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self._m.rollback(num_tokens)

    def is_accepting(self) -> bool:
        return self._m.is_completed()

    def is_terminated(self) -> bool:
        return self._m.is_terminated()

    def forced_bytes(self) -> bytes:
        return self._m.find_jump_forward_string().encode()


class XGrammarBackend(GrammarBackend):
    name = "xgrammar"

    def __init__(self, tokenizer: TokenizerAdapter) -> None:
        super().__init__(tokenizer)
        xgr = self._xgr = _xgrammar()
        eos = set(tokenizer.eos_token_ids)
        vocab = ["" if (i in tokenizer.special_ids and i not in eos) else t for i, t in enumerate(tokenizer.raw_tokens)]
        vocab_type = xgr.VocabType.BYTE_LEVEL if tokenizer.vocab_type == BYTE_LEVEL else xgr.VocabType.BYTE_FALLBACK
        info = xgr.TokenizerInfo(vocab, vocab_type, vocab_size=tokenizer.vocab_size, stop_token_ids=sorted(eos))
        self.compiler = xgr.GrammarCompiler(info, max_threads=2)

    def compile(self, response_format: ResponseFormat) -> Any:
        fmt = response_format
        try:
            if fmt.kind in ("json_object", "json_schema"):
                if fmt.whitespace == "flexible":
                    return self.compiler.compile_json_schema(fmt.text, any_whitespace=True,
                                                             max_whitespace_cnt=MAX_JSON_WHITESPACE,
                                                             strict_mode=False)
                indent = 2 if fmt.whitespace == "indented" else None  # its indentation is json.dumps's
                return self.compiler.compile_json_schema(fmt.text, any_whitespace=False, indent=indent,
                                                         separators=(",", ": " if indent else ":"),
                                                         strict_mode=False)
            if fmt.kind == "regex":
                return self.compiler.compile_regex(fmt.text)
            if fmt.syntax == "lark":
                return self.compiler.compile_lark(fmt.text)
            return self.compiler.compile_grammar(fmt.text)
        except Exception as err:  # xgrammar raises RuntimeError / its own errors on bad input
            raise GrammarError(f"xgrammar cannot compile this {fmt.kind}: {err}") from None

    def matcher(self, compiled: Any) -> XGrammarMatcher:
        return XGrammarMatcher(self._xgr.GrammarMatcher(compiled),
                               self.tokenizer)
