"""Statistics of one engine step, added to the engine's totals and to each request that had a row in it."""

from __future__ import annotations

from .model_step import ModelStep
from .outputs import EngineStats


def account_step(stats: EngineStats, step: ModelStep, processing_seconds: float, step_seconds: float) -> None:
    """Add a step's tokens and times: a request that fed a prompt chunk counts the prefill as its own, every other
    request in the step counts the step's forward time as decode time."""
    if not step.sequences and not step.prefill_tokens:
        return
    stats.steps += 1
    stats.prefill_tokens += step.prefill_tokens
    stats.prefill_seconds += step.prefill_seconds
    stats.decode_tokens += step.decode_tokens + step.verify_committed
    stats.decode_seconds += step.decode_seconds + step.verify_seconds
    stats.processing_seconds += processing_seconds
    stats.mask_seconds += step.masks.fill_seconds if step.masks is not None else 0.0
    stats.step_seconds += step_seconds
    stats.sampled_tokens += step.rows
    for request in {id(s.request): s.request for s in step.sequences + step.chunked}.values():
        if request.request_id in step.prefilled:
            request.stats.prefill_seconds += step.prefill_seconds
        else:
            request.stats.decode_seconds += step.decode_seconds + step.verify_seconds + step.prefill_seconds
        request.stats.processing_seconds += processing_seconds
        request.stats.step_seconds += step_seconds
