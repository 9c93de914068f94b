"""What the engine hands back: streamed deltas, finished outputs, and per-request and per-engine statistics."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum


class FinishReason(StrEnum):
    """Why a sequence ended. Its members are strings ("stop" == FinishReason.STOP), so the server's JSON, the metrics'
    labels and comparisons with plain strings are unchanged."""

    #: EOS, one of stop_token_ids, or a stop string
    STOP = "stop"
    #: max_tokens, or the context is full
    LENGTH = "length"
    #: the constraints allowed no token at all
    GRAMMAR_DEAD_END = "grammar_dead_end"
    #: the request was cancelled
    ABORT = "abort"
    #: one of its constraints failed at run time, or the model's logits held NaN / +inf (``Output.error`` says which);
    #: the other requests go on
    ERROR = "error"


#: Every finish reason, as strings.
FINISH_REASONS = tuple(FinishReason)


def _rate(count: float, seconds: float) -> float:
    return count / seconds if seconds > 0 else 0.0


class DraftCounts:
    """Speculative decoding's figures, from the counts both statistics classes keep: ``drafts`` (verifies of a
    sequence's drafts), ``draft_tokens`` (draft tokens checked), ``accepted_draft_tokens`` (those accepted)."""

    drafts: int
    draft_tokens: int
    accepted_draft_tokens: int

    @property
    def acceptance_rate(self) -> float:
        """Share of the draft tokens checked that were accepted (0 when none were checked)."""
        return _rate(self.accepted_draft_tokens, self.draft_tokens)

    @property
    def mean_accepted_tokens(self) -> float:
        """Draft tokens accepted per verify (each verify also commits one token of the model's own)."""
        return _rate(self.accepted_draft_tokens, self.drafts)

    def draft_summary(self) -> str:
        """One phrase for people, empty when nothing was drafted."""
        if not self.drafts:
            return ""
        return (f"speculation: {self.accepted_draft_tokens}/{self.draft_tokens} draft tokens accepted "
                f"({100 * self.acceptance_rate:.0f}%), {self.mean_accepted_tokens:.2f} per verify of {self.drafts}")


@dataclass
class RequestStats(DraftCounts):
    """Usage and timing of one request (shared by its n sequences). Times are seconds of wall clock.

    ``prefill_seconds`` is the time of the model prefill calls that held its prompt (shared with whatever else was
    prefilled in the same call); ``step_seconds`` and ``processing_seconds`` add up, over the steps the request
    took part in, the whole step and the logit processing + sampling part of it.
    """

    prompt_tokens: int = 0
    completion_tokens: int = 0
    arrival: float = 0.0
    first_token_time: float | None = None
    finish_time: float | None = None
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    processing_seconds: float = 0.0
    step_seconds: float = 0.0
    jump_forward_tokens: int = 0
    #: Times the request was preempted (its KV cache freed, prompt and output prefilled again later).
    preemptions: int = 0
    #: Prompt tokens whose KV cache came from the prefix cache instead of a prefill.
    cached_tokens: int = 0
    #: Speculative decoding (``DraftCounts``): verifies, draft tokens checked, draft tokens accepted.
    drafts: int = 0
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival

    @property
    def prefill_tokens_per_s(self) -> float:
        """Prompt tokens prefilled (those from the prefix cache are not) per second of the prefill call."""
        return _rate(self.prompt_tokens - self.cached_tokens, self.prefill_seconds)

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens generated after the first one, per second from the first token to the end."""
        if self.first_token_time is None or self.finish_time is None:
            return 0.0
        return _rate(max(self.completion_tokens - 1, 0), self.finish_time - self.first_token_time)

    @property
    def processing_share(self) -> float:
        """Share of the request's step time spent in logit processing and sampling."""
        return _rate(self.processing_seconds, self.step_seconds)

    @property
    def usage(self) -> dict[str, int]:
        """OpenAI-style usage counts."""
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}


@dataclass
class EngineStats(DraftCounts):
    """Totals over the engine's steps since it was made (or since ``reset``)."""

    steps: int = 0
    prefill_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_tokens: int = 0
    decode_seconds: float = 0.0
    processing_seconds: float = 0.0
    #: Grammar masks: seconds the mask workers spent filling rows (summed over workers; they fill during the
    #: forward, and the processing waits for what is left).
    mask_seconds: float = 0.0
    step_seconds: float = 0.0
    sampled_tokens: int = 0
    jump_forward_tokens: int = 0
    jump_forward_steps_saved: int = 0
    preemptions: int = 0
    #: Tokens whose KV cache was forked from the prefix cache instead of prefilled.
    cached_tokens: int = 0
    #: Speculative decoding (``DraftCounts``): verifies, draft tokens checked, draft tokens accepted.
    drafts: int = 0
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0

    @property
    def prefill_tokens_per_s(self) -> float:
        return _rate(self.prefill_tokens, self.prefill_seconds)

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens generated by decode and verify calls per second of those calls (the model forward only)."""
        return _rate(self.decode_tokens, self.decode_seconds)

    @property
    def processing_share(self) -> float:
        """Share of step time spent in logit processing + sampling (bias, penalties, masks, softmax, filters,
        sampling, logprobs)."""
        return _rate(self.processing_seconds, self.step_seconds)

    def reset(self) -> None:
        for name, value in EngineStats().__dict__.items():
            setattr(self, name, value)

    def summary(self) -> str:
        """One line for people: rates and the share of step time in logit processing."""
        return (f"prefill {self.prefill_tokens} tok at {self.prefill_tokens_per_s:.1f} tok/s, "
                f"decode {self.decode_tokens} tok at {self.decode_tokens_per_s:.1f} tok/s, "
                f"{self.steps} steps, logit processing + sampling {100 * self.processing_share:.1f}% of step time"
                + (f", jump-forward {self.jump_forward_tokens} tok ({self.jump_forward_steps_saved} steps saved)"
                   if self.jump_forward_tokens else "")
                + (f", {self.preemptions} preemptions" if self.preemptions else "")
                + (f", {self.cached_tokens} tok from the prefix cache" if self.cached_tokens else "")
                + (f", {self.draft_summary()}" if self.drafts else ""))


@dataclass(frozen=True)
class Output:
    """One finished (or aborted) sequence of a request: built once, when the sequence ends (``GeneratedSequence``'s
    ``finish`` / ``fail``). ``stats`` is the request's own ``RequestStats``: complete once the whole request has
    ended (its last sequence's final delta)."""

    request_id: str
    index: int
    text: str
    token_ids: list[int]
    finish_reason: FinishReason | None
    prompt_token_ids: list[int]
    stats: RequestStats
    #: The stop string or stop token id that ended the sequence (None otherwise).
    stop_reason: str | int | None = None
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    #: What failed, when ``finish_reason`` is "error".
    error: str | None = None
    #: JSON response formats: whether the answer is a document the whole schema accepts (``jsonschema``), and why
    #: not; None for other requests and unfinished (aborted, failed) answers.
    schema_valid: bool | None = None
    schema_error: str | None = None
    #: Schema keywords the grammar did not enforce while generating (a relaxed compile); ``schema_valid`` checks them.
    relaxed_keywords: tuple[str, ...] = ()
    #: A response format's grammar: whether the output (after the think block, when there is one) is a whole match
    #: of it (a complete document); None without one, for aborted and failed answers, and when a stop string trimmed
    #: the text.
    grammar_complete: bool | None = None
    #: The closing chose at least one token so that the document ended complete within ``max_tokens`` (finish reason
    #: "length", or "stop" when it ended with EOS): the model did not end it; False when it did, or when no completion
    #: fitted in the budget (then ``grammar_complete`` is False: the document is cut).
    closed_at_max_tokens: bool = False

    @property
    def usage(self) -> dict[str, int]:
        return self.stats.usage

    @property
    def closing_note(self) -> str | None:
        """For people: how a constrained answer ended against ``max_tokens`` (None when it was not concerned)."""
        if self.closed_at_max_tokens and self.grammar_complete:
            if self.finish_reason is FinishReason.LENGTH:
                return ("closed to fit max_tokens: the closing chose the last tokens so that the document is "
                        "complete (the budget, not the model, ended it)")
            return ("closed to fit max_tokens: the closing chose some of the last tokens so that the document is "
                    "complete")
        if self.grammar_complete is False and self.finish_reason is FinishReason.LENGTH:
            return "cut mid-document: no completion of the document fitted in the tokens left"
        return None


@dataclass
class Delta:
    """What one sequence produced in one step.

    ``text`` is UTF-8 safe (never a partial character) and never holds a stop string or what follows it; text that
    might still become a stop string is held back until it cannot. ``rollback`` output tokens were removed (by
    jump-forward re-tokenization) before ``token_ids`` were appended. On the sequence's last delta ``finish_reason``
    is set and ``output`` holds the whole result.
    """

    request_id: str
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    rollback: int = 0
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    finish_reason: FinishReason | None = None
    output: Output | None = None
