"""The processing step on one step's Batch: logit processor then sampler, once over every row of the batch.

``inplace_update_logits`` (bias -> penalties; the masks are filled but deferred, returned in its ``ProcessedBatch``),
then ``Sampler.sample_from_logits`` on that ProcessedBatch (the masks, temperature softmax, min-p, top-k, top-p and
the draw fused in one kernel, no probabilities written); each row with its own request's config (temperature 0 is
greedy), and the processed logprobs (chosen token and top-n) from the same kernel where asked for: no probabilities
are ever written. Raw logprobs, when a row asks for them, read a copy of the logits taken first. Rows whose logits
hold NaN or +inf are flagged by the same kernel as it reads them (``SampleResult.non_finite_logits``, token -1) rather
than sampled: the step makes no other pass over the logits.
"""

from __future__ import annotations

import numpy as np
from logitproc.runtime import LogitProcessor, Sampler, SampleResult
from logitproc.runtime.batch import Batch


def process(processor: LogitProcessor, sampler: Sampler, batch: Batch, logits: np.ndarray) -> SampleResult:
    """One token per row of ``batch`` from ``logits`` (modified in place); the rows whose mask source failed are in
    the result's ``mask_errors``."""
    raw = logits.copy() if batch.any_raw_logprobs else None
    processed = processor.inplace_update_logits(logits, batch, defer_masks=True)  # the fused kernel reads the masks
    return sampler.sample_from_logits(logits, processed, raw_logits=raw)
