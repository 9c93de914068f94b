"""The whole processing pipeline in numpy, from plain token lists (independent of RequestState's incremental arrays).

Stages in the adopted order: logit bias -> penalties -> masks -> temperature softmax -> min-p -> top-k -> top-p.
Every stage runs on every row (none of the runtime's "nothing to do" predicates is reused here), except that a
greedy row (temperature 0) is not filtered.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import numpy as np
from logitproc.runtime import GenerationConfig
from logitproc.tir_kernels import reference as ref


def process_row(logits_row: np.ndarray, cfg: GenerationConfig, prompt: Sequence[int], output: Sequence[int],
                allowed: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(processed logits, final probabilities) of one row whose sequence is ``prompt + output``."""
    x = logits_row.astype(np.float32)[None, :].copy()
    vocab = x.shape[1]
    if cfg.logit_bias:
        toks = np.array(list(cfg.logit_bias), np.int32)
        x = ref.apply_logit_bias(x, np.zeros(toks.size, np.int32), toks,
                                 np.array(list(cfg.logit_bias.values()), np.float32))
    # every row: presence 0, frequency 0 and repetition 1 leave a logit exactly as it is
    counts = Counter(output)
    appeared = sorted(set(prompt) | set(output))
    toks = np.array(appeared, np.int32)
    cnt = np.array([counts[t] for t in appeared], np.int32)
    pen = np.array([[cfg.presence_penalty, cfg.frequency_penalty, cfg.repetition_penalty]], np.float32)
    x = ref.apply_penalty(x, np.zeros(toks.size, np.int32), toks, cnt, pen)
    if allowed is not None:
        x = ref.apply_bitmask(x, np.array([0], np.int32), ref.pack_bitmask(allowed[None, :vocab]))
    probs = ref.softmax_with_temperature(x, np.array([cfg.temperature], np.float32))
    if cfg.temperature > 0:  # a greedy row stays one-hot; filters that drop nothing only rescale (sum 1)
        probs = ref.renormalize(probs, np.array([cfg.top_k if cfg.top_k > 0 else 0], np.int32),
                                np.array([cfg.top_p], np.float32), np.array([cfg.min_p], np.float32))
    return x[0], probs[0]
