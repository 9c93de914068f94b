"""One generated sequence inside the engine: its RequestState, KV bookkeeping, text and finish rules.

The engine keeps every running sequence in one invariant: ``kv_len`` tokens (a prefix of prompt + output) are in
the model's KV cache and ``feed`` holds the rest, which go in before the next logits are computed: the prompt for a
new sequence, the last sampled token for a decoding one, more after a jump-forward. A sequence ``in_prefill`` puts
its prompt (after a preemption: prompt and output) into the KV cache in chunks, one per step within the step's token
budget; it is sampled only once its whole feed is in.

``commit(token)`` applies the finish rules to a token that is already in the state, in this order: EOS or a
stop token id ("stop", the token kept in ``token_ids`` but not in the text), then the text (UTF-8 safe, through the
stop strings: "stop" when one appears), then ``max_tokens`` and a full context ("length").
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from logitproc.runtime import RequestState
from logitproc.runtime.answer_check import AnswerCheck, check_answer
from logitproc.runtime.grammar.source import GrammarSource
from logitproc.runtime.think_mode import ThinkBudget

from .detokenizer import IncrementalDetokenizer
from .outputs import Delta, Output, RequestStats
from .stop_strings import StopStringFilter

if TYPE_CHECKING:
    from .detokenizer import Decoder
    from .speculation import Drafter


class Request:
    """A request: its prompt, config, statistics and its n sequences."""

    def __init__(self, request_id: str, prompt_token_ids: list[int], stats: RequestStats, arrival_order: int) -> None:
        self.request_id = request_id
        self.arrival_order = arrival_order  # the engine preempts the latest-arrived request first
        self.prompt_token_ids = prompt_token_ids
        self.stats = stats
        self.sequences: list[GeneratedSequence] = []
        self.jump_forward = False  # append the tokens its constraints force without a decode step each

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.sequences)


class GeneratedSequence:
    """One of a request's sequences: state, cache bookkeeping, detokenizer and stop strings."""

    def __init__(self, request: Request, index: int, state: RequestState, tokenizer: Decoder,
                 eos_token_ids: Sequence[int], context_length: int) -> None:
        self.request = request
        self.index = index
        self.state = state
        self.seq_id: int | None = None  # the model's sequence id, while it holds one
        self.in_model = False
        self.kv_len = 0
        self.feed: list[int] = list(state.prompt_token_ids) if index == 0 else []
        self.forked_from: GeneratedSequence | None = None
        #: The feed is a prompt going in by prefill chunks (the rest of it goes through prefill, however short).
        self.in_prefill = index == 0
        cfg = state.config
        #: Tokens that end the sequence (kept in token_ids, not in the text; the state is not advanced by them).
        self.stop_token_ids = frozenset(cfg.stop_token_ids) | frozenset(() if cfg.ignore_eos else eos_token_ids)
        self._max_tokens = cfg.max_tokens
        self._min_tokens = cfg.min_tokens
        self._context = context_length
        self.detok = IncrementalDetokenizer(tokenizer, cfg.skip_special_tokens)
        self.stops = StopStringFilter(cfg.stop)
        self.token_ids: list[int] = []  # reported output (equals state.output_token_ids until a finish trims it)
        self.text = ""
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.error: str | None = None  # what failed, for finish_reason "error"
        self.logprobs: list[float] | None = [] if cfg.logprobs else None
        self.top_logprobs: list[list[tuple[int, float]]] | None = [] if cfg.top_logprobs else None
        #: The finished answer checked against its JSON response format (None: not one, or not finished).
        self.check: AnswerCheck | None = None
        #: The sequence's final delta (finish reason and Output) has been made.
        self.reported = False
        #: Speculative decoding's prompt-lookup drafter (made by the engine on first use).
        self.drafter: Drafter | None = None

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def kv_need(self) -> int:
        """KV cache tokens this sequence holds once its feed is in (a sequence still to fork: the prompt)."""
        if self.forked_from is not None:
            return len(self.request.prompt_token_ids)
        return self.kv_len + len(self.feed)

    @property
    def prefilling(self) -> bool:
        """Whether the next forward feeds this sequence by prefill: a prompt (or part of one) or a jump-forward's
        tokens; a sequence still to fork from its request's first sequence is not (it is forked after that one)."""
        return self.forked_from is None and (self.in_prefill or len(self.feed) > 1 or not self.in_model)

    @property
    def decoding(self) -> bool:
        """Whether the next forward feeds this sequence its one last sampled token (by decode, or verify)."""
        return self.in_model and not self.prefilling and len(self.feed) == 1

    @property
    def tokens_left(self) -> int:
        """Tokens the sequence may still generate before ``max_tokens`` or its context ends it."""
        left = self._context - len(self.request.prompt_token_ids) - len(self.token_ids)
        if self._max_tokens is not None:
            left = min(left, self._max_tokens - len(self.token_ids))
        return left

    # ----------------------------------------------------------------------------------------------------------
    def commit(self, token: int, delta: Delta) -> None:
        """Record ``token`` (already appended to the state) in the output and text; finish if a rule says so."""
        self.token_ids.append(token)
        delta.token_ids.append(token)
        if token in self.stop_token_ids:
            self.finish("stop", delta, stop_reason=token)
            return
        text = self.detok.add_tokens([token])
        # Stop strings count from the text after the first min_tokens tokens (vLLM's rule).
        self._emit(self.stops.feed(text) if len(self.token_ids) > self._min_tokens else text, delta)
        if self.stops.stopped:
            self.finish("stop", delta, stop_reason=self.stops.matched)
        elif self._max_tokens is not None and len(self.token_ids) >= self._max_tokens:
            self.finish("length", delta)
        elif len(self.request.prompt_token_ids) + len(self.token_ids) >= self._context:
            self.finish("length", delta)

    def rollback(self, count: int, delta: Delta) -> None:
        """Forget the last ``count`` output tokens (jump-forward re-tokenization); emitted text stays."""
        if count:
            del self.token_ids[len(self.token_ids) - count :]
            self.detok.rollback(count)
            if delta.token_ids:
                undone = min(count, len(delta.token_ids))
                del delta.token_ids[len(delta.token_ids) - undone :]
                count -= undone
            delta.rollback += count

    def finish(self, reason: str, delta: Delta, stop_reason: str | int | None = None, error: str | None = None) -> None:
        """End the sequence: release the text held back (unless a stop string ended it) and build the Output."""
        if self.finish_reason is not None:
            return
        self.error = error
        if reason != "stop" or not self.stops.stopped:
            self._emit(self.stops.feed(self.detok.flush()), delta)
            if self.stops.stopped:  # the last bytes completed a stop string
                reason, stop_reason = "stop", self.stops.matched
            self._emit(self.stops.flush(), delta)
        # checked before the sequence counts as finished: whatever raises up to here, fail() can still end it
        check = check_answer(self.state.config.response_format, self._answer_text()) if reason not in (
            "abort", "error") else None
        self.finish_reason, self.stop_reason, self.check = reason, stop_reason, check
        delta.finish_reason = reason
        delta.output = self.output()
        self.reported = True

    def fail(self, delta: Delta, error: str) -> None:
        """End the sequence with "error" and the message ``error``, even when its text cannot be flushed (a failing
        detokenizer is one of the things that end a sequence this way) or when ``finish`` failed after setting the
        finish reason: the sequence gets exactly one final delta whatever failed (none more once it has one)."""
        if self.reported:
            return
        if self.finish_reason is None:
            try:
                self.finish("error", delta, error=error)
                return
            except Exception as err:  # the held-back text is lost; the sequence still ends, with both messages
                error = f"{error}; and its text could not be flushed: {type(err).__name__}: {err}"
        self.finish_reason = delta.finish_reason = "error"
        self.error, self.check = error, None
        delta.output = self.output()
        self.reported = True

    def _answer_text(self) -> str:
        """The answer the response format applies to: after the think block, when the request has one."""
        cfg = self.state.config
        if cfg.max_thinking_tokens is not None and cfg.think_end in self.text:
            return self.text.split(cfg.think_end, 1)[1]
        return self.text

    @property
    def relaxed_keywords(self) -> tuple[str, ...]:
        """Schema keywords the sequence's grammar does not enforce (a relaxed compile)."""
        for source in self.state.mask_sources:
            inner = source.inner if isinstance(source, ThinkBudget) else source
            if isinstance(inner, GrammarSource):
                return inner.relaxed_keywords
        return ()

    def _emit(self, text: str, delta: Delta) -> None:
        if text:
            self.text += text
            delta.text += text

    def output(self) -> Output:
        return Output(
            request_id=self.request_id, index=self.index, text=self.text, token_ids=list(self.token_ids),
            finish_reason=self.finish_reason, prompt_token_ids=self.request.prompt_token_ids,
            stats=self.request.stats, stop_reason=self.stop_reason, error=self.error,
            logprobs=None if self.logprobs is None else list(self.logprobs),
            top_logprobs=None if self.top_logprobs is None else list(self.top_logprobs),
            schema_valid=None if self.check is None else self.check.valid,
            schema_error=None if self.check is None else self.check.error,
            relaxed_keywords=self.relaxed_keywords,
            grammar_complete=None if self.finish_reason in (None, "abort", "error") or self.stops.stopped
            else self.state.grammar_complete,
            closed_at_max_tokens=self.state.closed_at_max_tokens,
        )
