"""One generated sequence inside the engine: its RequestState, KV bookkeeping, text and finish rules.

The engine keeps every running sequence in one invariant: ``kv_len`` tokens (a prefix of prompt + output) are in
the model's KV cache and ``feed`` holds the rest, which go in before the next logits are computed: the prompt for a
new sequence, the last sampled token for a decoding one, more after a jump-forward. A sequence ``in_prefill`` puts
its prompt (after a preemption: prompt and output) into the KV cache in chunks, one per step within the step's token
budget; it is sampled only once its whole feed is in.

This module is the one owner of that bookkeeping (``seq_id``, ``in_model``, ``kv_len``, ``feed``, ``in_prefill``,
``forked_from``): the other modules read it and change it only through ``GeneratedSequence``'s methods, each of
which makes the model's KV cache and the bookkeeping agree (``take_slot`` / ``give_slot_back``: the model slot the
scheduler lends; ``enter_model``, ``fed``, ``fork_into``, ``feed_sampled``, ``keep_in_cache``, ``rewind_cache``,
``leave_model``, ``hand_over_cache``, ``recompute``, ``kv_snapshot`` / ``restore_kv``). The only other writer of the
model's KV cache is the scheduler, for the prefix cache's entries (a finished sequence's cache, handed over), which
belong to no sequence.

``commit(token)`` applies the finish rules to a token that is already in the state, in this order: EOS or a
stop token id ("stop", the token kept in ``token_ids`` but not in the text), then the text (UTF-8 safe, through the
stop strings: "stop" when one appears), then ``max_tokens`` and a full context ("length").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING

from logitproc.runtime import RequestState
from logitproc.runtime.answer_check import AnswerCheck, check_answer
from logitproc.runtime.grammar.source import GrammarSource
from logitproc.runtime.think_mode import ThinkBudget

from .detokenizer import IncrementalDetokenizer
from .outputs import Delta, FinishReason, Output, RequestStats
from .stop_strings import StopStringFilter

if TYPE_CHECKING:
    from .detokenizer import Decoder
    from .runner import Runner
    from .speculation import Drafter


class SequenceStatus(StrEnum):
    """Where a sequence stands between steps (``GeneratedSequence.status``)."""

    #: no model slot: waiting in the queue (or preempted, back in it)
    WAITING = "waiting"
    #: admitted (n > 1); waits for its request's first sequence's prompt, to be forked from it
    FORKING = "forking"
    #: its feed (a prompt, the rest of one, or the tokens a jump-forward left) goes in by prefill
    PREFILLING = "prefilling"
    #: its feed is its one last sampled token (decode, or verify with drafts)
    DECODING = "decoding"
    #: ended (``finish_reason`` says why)
    FINISHED = "finished"


#: One step's deltas, by sequence (``delta_of`` makes each on first use).
Deltas = dict["GeneratedSequence", Delta]


def delta_of(deltas: Deltas, seq: GeneratedSequence) -> Delta:
    """The step's delta of ``seq`` (made on first use)."""
    return deltas.setdefault(seq, Delta(seq.request_id, seq.index))


@dataclass(frozen=True)
class KVSnapshot:
    """A sequence's KV bookkeeping at one moment (``GeneratedSequence.kv_snapshot``)."""

    in_model: bool
    kv_len: int
    feed: tuple[int, ...]
    forked_from: GeneratedSequence | None
    in_prefill: bool


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
                 eos_token_ids: Sequence[int], context_length: int,
                 forked_from: GeneratedSequence | None = None) -> None:
        self.request = request
        self.index = index
        self.state = state
        self.seq_id: int | None = None  # the model's sequence id, while it holds one
        self.in_model = False
        self.kv_len = 0
        self.feed: list[int] = list(state.prompt_token_ids) if index == 0 else []
        #: The sequence whose prefilled prompt this one is forked from (n > 1), until it is.
        self.forked_from = forked_from
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
        self.finish_reason: FinishReason | None = None
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
    def status(self) -> SequenceStatus:
        """The sequence's status, from its finish reason, model slot and KV bookkeeping."""
        if self.finish_reason is not None:
            return SequenceStatus.FINISHED
        if self.seq_id is None:
            return SequenceStatus.WAITING
        if self.forked_from is not None:
            return SequenceStatus.FORKING
        return SequenceStatus.PREFILLING if self.prefilling else SequenceStatus.DECODING

    @property
    def decoding(self) -> bool:
        """Whether the next forward feeds this sequence its one last sampled token (by decode, or verify)."""
        return self.in_model and not self.prefilling and len(self.feed) == 1

    # ---- KV bookkeeping: every change of seq_id, in_model, kv_len, feed, in_prefill and forked_from is one of these
    def take_slot(self, seq_id: int) -> None:
        """The scheduler gives the sequence a model slot (admission); it enters the model at placement."""
        if self.seq_id is not None or self.in_model:
            raise RuntimeError(f"sequence {self.request.request_id}/{self.index} already has slot {self.seq_id}")
        self.seq_id = seq_id

    def give_slot_back(self) -> int:
        """The sequence, out of the model, gives its slot back to the scheduler (returned)."""
        if self.seq_id is None or self.in_model:
            raise RuntimeError(f"sequence {self.request.request_id}/{self.index} has no slot to give back, or is "
                               "still in the model")
        seq_id, self.seq_id = self.seq_id, None
        return seq_id

    def enter_model(self, model: Runner, prefix: tuple[int, int] | None = None) -> None:
        """Start the sequence in the model (its ``seq_id`` given): empty, or forked from ``prefix`` = (the model
        sequence holding the prefix, its length), whose tokens then leave the feed."""
        if prefix is None:
            model.add_sequence(self.seq_id)
        else:
            model.fork_sequence(prefix[0], self.seq_id, prefix[1])
            self.kv_len, self.feed = prefix[1], self.feed[prefix[1]:]
        self.in_model = True

    def fed(self, count: int) -> None:
        """``count`` tokens went into the KV cache: the feed's first ones, and for a verify the drafts after them
        (``keep_in_cache`` then trims the rejected ones). A prompt whose feed is all in is no longer in prefill."""
        self.kv_len += count
        self.feed = self.feed[count:]
        if not self.feed:
            self.in_prefill = False

    def fork_into(self, model: Runner, child: GeneratedSequence) -> None:
        """``child`` (a sequence of the same request) becomes a fork of this one's KV cache, its prompt."""
        model.fork_sequence(self.seq_id, child.seq_id)
        child.in_model, child.kv_len, child.forked_from = True, self.kv_len, None

    def feed_sampled(self, token: int) -> None:
        """The token just committed is the next to go in (a decoding sequence's feed)."""
        self.feed = [token]

    def keep_in_cache(self, model: Runner, keep: int) -> None:
        """The KV cache keeps its first ``keep`` tokens (a verify's rejected drafts leave it)."""
        if self.in_model and self.seq_id is not None and model.sequence_length(self.seq_id) > keep:
            model.popn(self.seq_id, model.sequence_length(self.seq_id) - keep)
        self.kv_len = keep

    def rewind_cache(self, model: Runner, unchanged: int) -> None:
        """After a jump-forward re-tokenized the output: the KV cache keeps the first ``unchanged`` tokens of prompt +
        output that it holds, the rest of the state's tokens become the feed (at least one: with nothing new to
        feed, the last cached token goes in again, for the logits)."""
        state = self.state
        if self.kv_len > unchanged:
            model.popn(self.seq_id, self.kv_len - unchanged)
            self.kv_len = unchanged
        self.feed = list(state.output_token_ids[self.kv_len - len(state.prompt_token_ids):])
        if not self.feed:
            model.popn(self.seq_id, 1)
            self.kv_len -= 1
            self.feed = [(state.prompt_token_ids + state.output_token_ids)[self.kv_len]]

    def leave_model(self, model: Runner) -> None:
        """The sequence's KV cache is freed (its ``seq_id`` stays until it gives it back, ``give_slot_back``)."""
        if self.in_model:
            model.remove_sequence(self.seq_id)
            self.in_model = False

    def hand_over_cache(self) -> int:
        """The sequence's KV cache and its slot now belong to another owner (the prefix cache keeps them, under the
        returned slot); the sequence is out."""
        self.in_model = False
        return self.give_slot_back()

    def recompute(self) -> None:
        """Preempted, out of the model: everything it has (prompt and output) goes in again as a prompt."""
        state = self.state
        self.feed, self.kv_len, self.forked_from = state.prompt_token_ids + state.output_token_ids, 0, None
        self.in_prefill = True

    def kv_snapshot(self) -> KVSnapshot:
        """The bookkeeping as it is now, for ``restore_kv`` (before a step that may fail)."""
        return KVSnapshot(self.in_model, self.kv_len, tuple(self.feed), self.forked_from, self.in_prefill)

    def restore_kv(self, model: Runner, snapshot: KVSnapshot) -> None:
        """Put the bookkeeping and the model's KV cache back as ``snapshot`` found them: a sequence placed (or forked)
        since leaves the model, one that was in loses the tokens added since."""
        if self.in_model and self.seq_id is not None:
            if not snapshot.in_model:
                model.remove_sequence(self.seq_id)
                self.in_model = False
            else:
                extra = model.sequence_length(self.seq_id) - snapshot.kv_len
                if extra > 0:
                    model.popn(self.seq_id, extra)
        self.kv_len, self.feed, self.forked_from = snapshot.kv_len, list(snapshot.feed), snapshot.forked_from
        self.in_prefill = snapshot.in_prefill

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
            self.finish(FinishReason.STOP, delta, stop_reason=token)
            return
        text = self.detok.add_tokens([token])
        # Stop strings count from the text after the first min_tokens tokens (vLLM's rule).
        self._emit(self.stops.feed(text) if len(self.token_ids) > self._min_tokens else text, delta)
        if self.stops.stopped:
            self.finish(FinishReason.STOP, delta, stop_reason=self.stops.matched)
        elif self._max_tokens is not None and len(self.token_ids) >= self._max_tokens:
            self.finish(FinishReason.LENGTH, delta)
        elif len(self.request.prompt_token_ids) + len(self.token_ids) >= self._context:
            self.finish(FinishReason.LENGTH, delta)

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

    def finish(self, reason: FinishReason | str, delta: Delta, stop_reason: str | int | None = None,
               error: str | None = None) -> None:
        """End the sequence: release the text held back (unless a stop string ended it) and build the Output.
        ``reason`` is a FinishReason (or its string; another string is a ValueError)."""
        if self.finish_reason is not None:
            return
        reason = FinishReason(reason)
        self.error = error
        if reason is not FinishReason.STOP or not self.stops.stopped:
            self._emit(self.stops.feed(self.detok.flush()), delta)
            if self.stops.stopped:  # the last bytes completed a stop string
                reason, stop_reason = FinishReason.STOP, self.stops.matched
            self._emit(self.stops.flush(), delta)
        # checked before the sequence counts as finished: whatever raises up to here, fail() can still end it
        check = check_answer(self.state.config.response_format, self._answer_text()) if reason not in (
            FinishReason.ABORT, FinishReason.ERROR) else None
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
                self.finish(FinishReason.ERROR, delta, error=error)
                return
            except Exception as err:  # the held-back text is lost; the sequence still ends, with both messages
                error = f"{error}; and its text could not be flushed: {type(err).__name__}: {err}"
        self.finish_reason = delta.finish_reason = FinishReason.ERROR
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
            grammar_complete=None if self.finish_reason in (None, FinishReason.ABORT, FinishReason.ERROR)
            or self.stops.stopped else self.state.grammar_complete,
            closed_at_max_tokens=self.state.closed_at_max_tokens,
        )
