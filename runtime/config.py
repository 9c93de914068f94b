"""GenerationConfig: a request's sampling and processing parameters, validated once at construction.

Ranges follow OpenAI where it defines them (logit bias in [-100, 100], presence/frequency penalties in [-2, 2],
top_logprobs <= 20); the others are the widest sane ranges. Every error is a ValueError or TypeError naming the
field, the value and what is allowed. The same object serves the API, the CLI and the REPL.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np

from .field_error import FieldTypeError, FieldValueError
from .response_format import parse_response_format

LOGPROBS_MODES = ("auto", "processed", "raw")
MAX_TOP_LOGPROBS = 20
MAX_N = 128
MAX_STOP_STRINGS = 16
MAX_BAD_WORDS = 64
#: Entries of one request's logit_bias (OpenAI's limit is 300; the kernel's buffer holds this many per row).
MAX_LOGIT_BIAS_ENTRIES = 1024
#: Token ids and top_k reach the kernels as int32.
MAX_INT32 = 2**31 - 1
#: repetition_penalty's range: the float32 penalty kernel divides positive logits by it and multiplies negative ones,
#: so beyond 1000 either way (a thousandfold change of a logit) logits overflow or flush to 0, and a penalty too
#: small for float32 (1e-300 becomes 0.0) divides by zero.
MAX_REPETITION_PENALTY = 1000.0
MIN_REPETITION_PENALTY = 1.0 / MAX_REPETITION_PENALTY


def _number(name: str, value: Any, *, integer: bool = False, param: str | None = None) -> Any:
    """``value`` as a Python int (``integer``) or float/int; numpy scalars of the right kind are accepted alike.
    ``name`` is how the message calls the value, ``param`` the field it belongs to (default: ``name``)."""
    if isinstance(value, np.generic) and not isinstance(value, np.bool_):
        if isinstance(value, np.integer):
            value = int(value)
        elif isinstance(value, np.floating) and not integer:
            value = float(value)
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds):
        expected = "an int" if integer else "a number"
        raise FieldTypeError(param or name, f"{name} must be {expected}, got {value!r} ({type(value).__name__})")
    if not integer and not math.isfinite(value):
        raise FieldValueError(param or name, f"{name} must be finite, got {value!r}")
    return value


class FrozenMapping(Mapping):
    """An immutable mapping that can be hashed, copied and pickled (unlike ``types.MappingProxyType``)."""

    __slots__ = ("_items", "_hash")

    def __init__(self, items: Mapping[Any, Any] | None = None) -> None:
        self._items = dict(items or {})
        self._hash: int | None = None

    def __getitem__(self, key: Any) -> Any:
        return self._items[key]

    def __iter__(self) -> Iterator[Any]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __hash__(self) -> int:
        if self._hash is None:
            self._hash = hash(frozenset(self._items.items()))
        return self._hash

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Mapping) and dict(self._items) == dict(other)

    def __reduce__(self) -> tuple[Any, ...]:
        return (FrozenMapping, (self._items,))

    def __repr__(self) -> str:
        return repr(self._items)


def _in_range(name: str, value: float, low: float, high: float, *, low_open: bool = False,
              param: str | None = None) -> None:
    below = value <= low if low_open else value < low
    if below or value > high:
        bracket = "(" if low_open else "["
        raise FieldValueError(param or name, f"{name} must be in {bracket}{low}, {high}], got {value!r}")


@dataclass(frozen=True)
class GenerationConfig:
    """How one request's next tokens are chosen. Defaults leave the model's distribution untouched.

    temperature        >= 0; 0 = greedy (argmax, lowest id on ties)
    top_p              (0, 1]; 1 = off
    top_k              -1 or 0 = off, else keep the k most likely tokens (ties kept); at most 2**31 - 1
    min_p              [0, 1]; 0 = off; keep tokens with prob >= min_p * max prob
    presence_penalty   [-2, 2]: subtracted once from every token already in the output
    frequency_penalty  [-2, 2]: subtracted once per occurrence in the output
    repetition_penalty [0.001, 1000]; 1 = off; divides positive / multiplies negative logits of prompt and output tokens
    logit_bias         {token_id: bias in [-100, 100]}, at most 1024 entries; token ids are checked against the
                       vocabulary when a processor first sees the request
    seed               None, or an int in [0, 2**64): the same seed gives the same tokens whatever the batch
    logprobs           return the chosen token's log-probability
    top_logprobs       0..20 most likely alternatives per position (needs logprobs=True; at most the vocabulary)
    logprobs_mode      "processed" (the distribution sampled from), "raw" (the model's, before any processing) or
                       "auto" (the default): raw for greedy requests (the processed distribution of a greedy
                       choice is 0 for the token and -inf for every other), processed when sampling
    max_tokens         None or >= 1
    min_tokens         >= 0 (<= max_tokens): EOS (unless ignore_eos) and stop_token_ids are banned, and stop strings
                       not looked for, until this many tokens are out
    allowed_token_ids  None, or a non-empty list: only these tokens may be generated
    bad_words          up to 64 non-empty strings never generated: a word's last token is banned where the output
                       ends with its other tokens (tokenised as written and with one leading space)
    n                  1..128 sequences sampled for the request (each keeps its own state)
    stop               up to 16 non-empty strings; generation stops before the first one in the text (not included)
    stop_token_ids     extra token ids that end a sequence (included in the output, like EOS)
    ignore_eos         keep generating past EOS (until max_tokens or a stop)
    response_format    None, or as in the OpenAI API: {"type": "json_object"}, {"type": "json_schema",
                       "json_schema": {"name": ..., "schema": {...}}}, and {"type": "regex", "regex": ...} or
                       {"type": "grammar", "grammar": ..., "syntax": "lark"|"ebnf"} (see response_format.py)
    max_thinking_tokens None or >= 0: the thinking budget between the think markers (think_begin, think_end);
                       a grammar from response_format applies only after thinking ends
    think_begin        text of the marker opening a think block ("<think>")
    think_end          text of the marker closing it ("</think>")
    skip_special_tokens leave control tokens out of the text (the default, vLLM's); False keeps them, e.g. for a
                       reader of tool-call or think markers that are control tokens (``[TOOL_CALLS]``)
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: Mapping[int, float] = field(default_factory=dict)
    seed: int | None = None
    logprobs: bool = False
    top_logprobs: int = 0
    logprobs_mode: str = "auto"
    max_tokens: int | None = None
    min_tokens: int = 0
    allowed_token_ids: tuple[int, ...] | None = None
    bad_words: tuple[str, ...] = ()
    n: int = 1
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    response_format: Any = None
    max_thinking_tokens: int | None = None
    think_begin: str = "<think>"
    think_end: str = "</think>"
    skip_special_tokens: bool = True

    def _field(self, name: str, *, integer: bool = False) -> Any:
        """The field's value as a Python number (numpy scalars converted and stored back), type-checked."""
        value = _number(name, getattr(self, name), integer=integer)
        object.__setattr__(self, name, value)
        return value

    def __post_init__(self) -> None:
        _in_range("temperature", self._field("temperature"), 0.0, math.inf)
        _in_range("top_p", self._field("top_p"), 0.0, 1.0, low_open=True)
        top_k = self._field("top_k", integer=True)
        if not -1 <= top_k <= MAX_INT32:
            raise FieldValueError("top_k", f"top_k must be -1 or 0 (off) or in [1, {MAX_INT32}], got {top_k!r}")
        _in_range("min_p", self._field("min_p"), 0.0, 1.0)
        _in_range("presence_penalty", self._field("presence_penalty"), -2.0, 2.0)
        _in_range("frequency_penalty", self._field("frequency_penalty"), -2.0, 2.0)
        _in_range("repetition_penalty", self._field("repetition_penalty"), MIN_REPETITION_PENALTY,
                  MAX_REPETITION_PENALTY)
        object.__setattr__(self, "logit_bias", self._checked_bias(self.logit_bias))
        if self.seed is not None:
            _in_range("seed", self._field("seed", integer=True), 0, 2**64 - 1)
        if not isinstance(self.logprobs, (bool, np.bool_)):
            raise FieldTypeError("logprobs", f"logprobs must be a bool, got {self.logprobs!r}")
        object.__setattr__(self, "logprobs", bool(self.logprobs))
        _in_range("top_logprobs", self._field("top_logprobs", integer=True), 0, MAX_TOP_LOGPROBS)
        if self.top_logprobs and not self.logprobs:
            raise FieldValueError("top_logprobs", f"top_logprobs={self.top_logprobs} needs logprobs=True")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise FieldValueError("logprobs_mode",
                                  f"logprobs_mode must be one of {LOGPROBS_MODES}, got {self.logprobs_mode!r}")
        if self.max_tokens is not None:
            _in_range("max_tokens", self._field("max_tokens", integer=True), 1, math.inf)
        _in_range("min_tokens", self._field("min_tokens", integer=True), 0,
                  math.inf if self.max_tokens is None else self.max_tokens)
        if self.allowed_token_ids is not None:
            object.__setattr__(self, "allowed_token_ids", self._checked_ids("allowed_token_ids",
                                                                            self.allowed_token_ids))
            if not self.allowed_token_ids:
                raise FieldValueError("allowed_token_ids",
                                      "allowed_token_ids must name at least one token (None allows every token)")
        object.__setattr__(self, "bad_words", self._checked_strings("bad_words", self.bad_words, MAX_BAD_WORDS))
        _in_range("n", self._field("n", integer=True), 1, MAX_N)
        object.__setattr__(self, "stop", self._checked_strings("stop", self.stop, MAX_STOP_STRINGS))
        ids = (self.stop_token_ids,) if isinstance(self.stop_token_ids, int) else self.stop_token_ids
        object.__setattr__(self, "stop_token_ids", self._checked_ids("stop_token_ids", ids))
        if not isinstance(self.ignore_eos, (bool, np.bool_)):
            raise FieldTypeError("ignore_eos", f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        object.__setattr__(self, "ignore_eos", bool(self.ignore_eos))
        if not isinstance(self.skip_special_tokens, (bool, np.bool_)):
            raise FieldTypeError("skip_special_tokens",
                                 f"skip_special_tokens must be a bool, got {self.skip_special_tokens!r}")
        object.__setattr__(self, "skip_special_tokens", bool(self.skip_special_tokens))
        try:
            response_format = parse_response_format(self.response_format)
        except ValueError as err:
            raise FieldValueError("response_format", str(err)) from None
        except TypeError as err:
            raise FieldTypeError("response_format", str(err)) from None
        object.__setattr__(self, "response_format", response_format)
        if self.max_thinking_tokens is not None:
            _in_range("max_thinking_tokens", self._field("max_thinking_tokens", integer=True), 0, math.inf)
        for name in ("think_begin", "think_end"):
            marker = getattr(self, name)
            if not isinstance(marker, str) or not marker:
                raise FieldValueError(name, f"{name} must be a non-empty string, got {marker!r}")

    @staticmethod
    def _checked_strings(name: str, value: Any, most: int) -> tuple[str, ...]:
        if value is None:
            return ()
        items = (value,) if isinstance(value, str) else value
        if not isinstance(items, (list, tuple)):
            raise FieldTypeError(name, f"{name} must be a string or a list of strings, got {type(value).__name__}")
        if len(items) > most:
            raise FieldValueError(name, f"{name} holds {len(items)} strings; at most {most} are allowed")
        for item in items:
            if not isinstance(item, str) or not item:
                raise FieldValueError(name, f"{name} entries must be non-empty strings, got {item!r}")
        return tuple(items)

    @staticmethod
    def _checked_ids(name: str, ids: Any) -> tuple[int, ...]:
        if not isinstance(ids, (list, tuple)):
            raise FieldTypeError(name, f"{name} must be a list of ints, got {type(ids).__name__}")
        for t in ids:
            if not 0 <= _number(f"{name} entry", t, integer=True, param=name) <= MAX_INT32:
                raise FieldValueError(name, f"{name} entries must be token ids in [0, {MAX_INT32}], got {t!r}")
        return tuple(int(t) for t in ids)

    @staticmethod
    def _checked_bias(bias: Any) -> Mapping[int, float]:
        if bias is None:
            return FrozenMapping()
        if not isinstance(bias, Mapping):
            raise FieldTypeError("logit_bias",
                                 f"logit_bias must be a mapping {{token_id: bias}}, got {type(bias).__name__}")
        if len(bias) > MAX_LOGIT_BIAS_ENTRIES:
            raise FieldValueError("logit_bias",
                                  f"logit_bias holds {len(bias)} entries; at most {MAX_LOGIT_BIAS_ENTRIES} are allowed")
        checked: dict[int, float] = {}
        for key, value in bias.items():
            token = key
            if isinstance(key, str):  # JSON objects (the OpenAI API) carry token ids as strings of ASCII digits
                digits = key.strip()
                if not (digits.isascii() and digits.lstrip("-").isdigit()):
                    raise FieldTypeError("logit_bias",
                                         f"logit_bias key {key!r} must be a token id: an int, or a string of ASCII "
                                    "digits")
                token = int(digits)
            token = _number(f"logit_bias key {key!r}", token, integer=True, param="logit_bias")
            if not 0 <= token <= MAX_INT32:
                raise FieldValueError("logit_bias", f"logit_bias token id must be in [0, {MAX_INT32}], got {key!r}")
            _in_range(f"logit_bias[{token}]", _number(f"logit_bias[{token}]", value, param="logit_bias"), -100.0, 100.0,
                      param="logit_bias")
            checked[token] = float(value)
        return FrozenMapping(checked)

    # What each stage needs -------------------------------------------------------------------------------
    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def effective_logprobs_mode(self) -> str:
        """"processed" or "raw": ``logprobs_mode`` with "auto" decided by ``greedy``."""
        if self.logprobs_mode == "auto":
            return "raw" if self.greedy else "processed"
        return self.logprobs_mode

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def has_filters(self) -> bool:
        """min-p, top-k or top-p would drop something (always off for greedy requests)."""
        return not self.greedy and (self.top_p < 1 or self.top_k > 0 or self.min_p > 0)

    @cached_property
    def sampling_row(self) -> tuple[float, int, float, float]:
        """(temperature, top_k, top_p, min_p) as the sampler's kernels take them: the filters' off values (0, 1.0,
        0.0) where ``has_filters`` is false, top_k 0 for off; built once per config (a step reads one per row)."""
        on = self.has_filters
        return (self.temperature, self.top_k if on and self.top_k > 0 else 0, self.top_p if on else 1.0,
                self.min_p if on else 0.0)

    @cached_property
    def logit_bias_arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """logit_bias as (token ids int32, biases float32), built once per config."""
        return (np.fromiter(self.logit_bias.keys(), np.int32, len(self.logit_bias)),
                np.fromiter(self.logit_bias.values(), np.float32, len(self.logit_bias)))

    @property
    def needs_mask_sources(self) -> bool:
        """A response_format, a thinking budget, min_tokens, allowed_token_ids or bad_words is set: the request's
        RequestState needs the mask sources of ``ConstraintFactory.sources_for(config)``."""
        return (self.response_format is not None or self.max_thinking_tokens is not None or self.min_tokens > 0
                or self.allowed_token_ids is not None or bool(self.bad_words))

    def check_vocab(self, vocab_size: int) -> None:
        """Reject token ids outside ``[0, vocab_size)`` (logit_bias, allowed_token_ids, stop_token_ids); called when
        a processor or engine first sees the request."""
        for name, ids in (("logit_bias", self.logit_bias), ("allowed_token_ids", self.allowed_token_ids or ()),
                          ("stop_token_ids", self.stop_token_ids)):
            bad = [t for t in ids if t >= vocab_size]
            if bad:
                raise FieldValueError(name, f"{name} token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
        if self.top_logprobs > vocab_size:
            raise FieldValueError("top_logprobs",
                                  f"top_logprobs={self.top_logprobs} exceeds the vocabulary size {vocab_size}")
