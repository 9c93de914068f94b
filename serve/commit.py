"""Committing a step's sampled tokens to their sequences, and jump-forward: what the constraints force, appended.

``commit_row`` appends a row's token to its sequence's state (a stop token ends the sequence without advancing the
state), records its logprobs, and applies the finish rules (``GeneratedSequence.commit``). A row with no valid token
finishes with "grammar_dead_end", or "error" with the message of the mask source that failed; a row whose logits
held NaN or +inf finishes with "error" (the message says so) without a token.

``commit_verified`` commits a sequence that checked drafts (speculative decoding): its rows are committed in order
while each row's token equals the next draft, so the tokens are exactly those that sampling each row would give,
one row after the other (draft d is accepted with probability p(d), a rejection samples from p without d: exact
rejection sampling for a deterministic draft). The KV cache entries of rejected drafts are popped and the row's
random stream is put back to where one draw per committed token leaves it: a seeded request gets the tokens it gets
without speculation. Nothing else ever saw the rejected drafts (states, grammars, detokenizer, stop strings). With
jump-forward, the rows stop where the constraints force tokens, so the jump happens where it would without drafts.

``jump_forward`` (``Engine(jump_forward=True)``) appends the tokens the constraints force without a decode step
each, and makes the model's KV cache agree with the re-tokenised state: tokens the jump replaced are popped, and
what is not yet in the cache becomes the sequence's feed for the next forward.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

from logitproc.runtime import LogitProcessor, SampleResult

from .outputs import Delta, EngineStats, FinishReason
from .runner import Runner
from .sequence import Deltas, GeneratedSequence, delta_of


def commit_row(seq: GeneratedSequence, result: SampleResult, row: int, delta: Delta, error: str | None) -> None:
    """Commit row ``row`` of ``result`` to ``seq``; ``error`` is why the row's mask failed, if it did."""
    stats = seq.request.stats
    if stats.first_token_time is None:
        stats.first_token_time = time.perf_counter()
    if result.non_finite_logits is not None and result.non_finite_logits[row]:
        seq.finish(FinishReason.ERROR, delta, error="non_finite_logits: the model's logits for this sequence hold "
                                                    "NaN or +inf, so there is no distribution to sample from")
        return
    if result.no_valid_token[row]:
        seq.finish(FinishReason.ERROR if error else FinishReason.GRAMMAR_DEAD_END, delta, error=error)
        return
    sampled = int(result.token_ids[row])
    try:  # near max_tokens, a sample after which the document cannot close in time gives way to the closing's token
        token = seq.state.closable_token(sampled)
        if token not in seq.stop_token_ids:  # a stop token ends the sequence: its state is not advanced
            seq.state.append_token(token)
    except Exception as err:  # a constraint refusing the token ends this sequence, not the step
        seq.finish(FinishReason.ERROR, delta, error=f"{type(err).__name__}: {err}")
        return
    if token not in seq.stop_token_ids:
        seq.feed_sampled(token)
    stats.completion_tokens += 1
    if seq.logprobs is not None:
        # a token the closing put in the sample's place was chosen with certainty: 0.0, as a one-token mask gives
        logprob = float(result.logprobs[row]) if token == sampled else 0.0
        seq.logprobs.append(logprob)
        delta.logprobs = (delta.logprobs or []) + [logprob]
    if seq.top_logprobs is not None:
        top = result.top_logprobs[row] or []
        seq.top_logprobs.append(top)
        delta.top_logprobs = (delta.top_logprobs or []) + [top]
    seq.commit(token, delta)


def commit_verified(model: Runner, seq: GeneratedSequence, result: SampleResult, first: int, drafts: list[int],
                    delta: Delta, errors: Mapping[int, str]) -> tuple[int, int]:
    """Commit the rows ``first``, ``first + 1``, ... of a sequence that checked ``drafts`` while each row's token is
    the next draft (and the sequence goes on); pop the rejected drafts from the KV cache; the sequence's random
    stream keeps the draws of the rows examined only (``RequestState.keep_draws``). Returns (rows committed, drafts
    accepted)."""
    examined = accepted = 0
    try:
        for j in range(len(drafts) + 1):
            row = first + j
            before = len(seq.token_ids)
            commit_row(seq, result, row, delta, errors.get(row))
            examined += 1
            # the committed token (the closing may have replaced the sample) decides: the later rows assumed it
            hit = j < len(drafts) and len(seq.token_ids) > before and seq.token_ids[-1] == drafts[j]
            accepted += hit
            if not hit or seq.finish_reason is not None or jump_pending(seq):
                break  # (where jump-forward would append forced tokens, it does so before any further token)
    finally:
        state = seq.state
        seq.keep_in_cache(model, min(seq.kv_len, state.num_tokens - len(seq.feed)))  # all but the token to feed
        state.keep_draws(examined)  # the sampler drew one number per row: those of the rows examined stay drawn
    return examined, accepted


def jump_pending(seq: GeneratedSequence) -> bool:
    """Whether jump-forward would append tokens to ``seq`` now: it asks for it and a constraint forces some."""
    state = seq.state
    if not seq.request.jump_forward or not state.mask_sources or state.config.logprobs:
        return False
    return any(source.jump_forward(state.output_token_ids) is not None for source in state.mask_sources)


def jump_forward(model: Runner, processor: LogitProcessor, running: list[GeneratedSequence], deltas: Deltas,
                 stats: EngineStats) -> None:
    """Append the tokens the constraints force; make the KV cache agree with the re-tokenized state."""
    for seq in running:
        if (seq.finish_reason is not None or not seq.request.jump_forward or not seq.state.mask_sources
                or not seq.decoding):
            continue
        try:
            forced = processor.jump_forward(seq.state)
        except Exception as err:  # this sequence's constraint failed: it ends, the others go on
            seq.finish(FinishReason.ERROR, delta_of(deltas, seq), error=f"{type(err).__name__}: {err}")
            continue
        if forced is None or (not forced.rollback and not forced.token_ids):
            continue
        delta = delta_of(deltas, seq)
        seq.rewind_cache(model, seq.state.num_tokens - len(forced.token_ids))
        before = len(seq.token_ids)
        seq.rollback(forced.rollback, delta)
        for token in forced.token_ids:
            seq.commit(int(token), delta)
            if seq.finish_reason is not None:
                break
        seq.request.stats.completion_tokens += len(seq.token_ids) - before
        seq.request.stats.jump_forward_tokens += len(forced.token_ids)
        stats.jump_forward_tokens += len(forced.token_ids)
        stats.jump_forward_steps_saved += max(len(forced.token_ids) - forced.rollback, 0)
