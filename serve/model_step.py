"""The model runner calls of one step: prefill (with forks), decode, verify, giving the rows to sample and their logits.

Rows are in this order: each prefilled sequence followed by the sequences forked from it (a request with n > 1
prefills once), then every decoding sequence, then the sequences that check drafts (speculative decoding): their
last token and drafts go through ``Runner.verify`` in one forward, one row per token (``1 + len(drafts)`` rows).
The step's ``Batch`` is made from those rows before the model runs, and sequences with mask sources start filling
their masks on worker threads while the model computes.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
from logitproc.runtime import LogitProcessor, empty_aligned
from logitproc.runtime.batch import Batch
from logitproc.runtime.mask_filler import MaskJob

from .runner import Runner
from .sequence import GeneratedSequence


@dataclass
class ModelStep:
    """What one step's forward pass did: the sequences to sample (in row order), their drafts, the Batch and logits,
    the timings."""

    sequences: list[GeneratedSequence] = field(default_factory=list)
    #: The drafts each verified sequence checks (its rows: the first predicts the first draft).
    drafts: dict[GeneratedSequence, list[int]] = field(default_factory=dict)
    batch: Batch | None = None
    logits: np.ndarray | None = None
    started: set[str] = field(default_factory=set)  # requests prefilled for the first time
    prefill_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_tokens: int = 0
    decode_seconds: float = 0.0
    verify_tokens: int = 0  # fed to the verify call: each drafting sequence's last token and drafts
    verify_seconds: float = 0.0
    verify_committed: int = 0  # tokens the verified sequences committed (set by the engine)
    masks: MaskJob | None = None  # the grammar masks filling on worker threads, if any

    def add(self, other: ModelStep) -> None:
        """Count ``other`` (a step over other rows, e.g. one request run alone) as part of this step."""
        self.sequences.extend(other.sequences)
        self.drafts.update(other.drafts)
        self.started |= other.started
        self.prefill_tokens += other.prefill_tokens
        self.prefill_seconds += other.prefill_seconds
        self.decode_tokens += other.decode_tokens
        self.decode_seconds += other.decode_seconds
        self.verify_tokens += other.verify_tokens
        self.verify_seconds += other.verify_seconds
        self.verify_committed += other.verify_committed

    @property
    def rows(self) -> int:
        """Rows sampled: one per sequence, plus one per draft token checked."""
        return len(self.sequences) + sum(len(d) for d in self.drafts.values())


def run_model(model: Runner, processor: LogitProcessor, live: list[GeneratedSequence],
              place: Callable[[GeneratedSequence], None], step: ModelStep | None = None,
              drafts: dict[GeneratedSequence, list[int]] | None = None) -> ModelStep:
    """Feed every live sequence's pending tokens through the model; return the step's rows and logits.
    ``place(seq)`` starts a sequence that is not in the model yet (empty, or forked from the prefix cache).
    ``step`` is filled in as the call goes (given by a caller that needs to see how far a failed call got).
    ``drafts``: decoding sequences that check draft tokens this step, with their drafts."""
    step = ModelStep() if step is None else step
    drafts = drafts or {}
    prefill = [s for s in live if s.forked_from is None and (len(s.feed) > 1 or not s.in_model)]
    decoding = [s for s in live if s.in_model and len(s.feed) == 1]
    decode = [s for s in decoding if s not in drafts]
    verify = [s for s in decoding if s in drafts]
    order = [r for s in prefill for r in [s, *(c for c in s.request.sequences if c.forked_from is s)]] + decode
    order += verify
    if not order:
        return step
    trees = [drafts.get(s) for s in order] if verify else None
    step.batch = processor.batch([s.state for s in order], draft_trees=trees)
    if step.batch.any_masks:  # grammar masks fill on worker threads during the forward
        step.masks = processor.start_masks(step.batch)
    blocks: list[np.ndarray] = []
    if prefill:
        blocks += _prefill(model, prefill, step, place)
    if decode:
        t0 = time.perf_counter()
        out = np.asarray(model.decode([s.seq_id for s in decode], [s.feed[0] for s in decode]))
        step.decode_seconds = time.perf_counter() - t0
        step.decode_tokens = len(decode)
        for seq in decode:
            seq.kv_len += 1
            seq.feed = []
        step.sequences.extend(decode)
        blocks.append(out)
    if verify:
        t0 = time.perf_counter()
        outs = model.verify([s.seq_id for s in verify], [s.feed + drafts[s] for s in verify])
        step.verify_seconds = time.perf_counter() - t0
        for seq, out in zip(verify, outs, strict=True):
            step.verify_tokens += len(out)
            seq.kv_len += len(out)
            seq.feed = []
            step.sequences.append(seq)
            step.drafts[seq] = drafts[seq]
            blocks.append(np.asarray(out))
    step.logits = empty_aligned((step.batch.num_rows, processor.vocab_size))
    np.concatenate(blocks, axis=0, out=step.logits)
    return step


def _prefill(model: Runner, prefill: list[GeneratedSequence], step: ModelStep,
             place: Callable[[GeneratedSequence], None]) -> list[np.ndarray]:
    for seq in prefill:
        if not seq.in_model:
            place(seq)
            step.started.add(seq.request_id)
    t0 = time.perf_counter()
    out = np.asarray(model.prefill([s.seq_id for s in prefill], [s.feed for s in prefill]))
    step.prefill_seconds = time.perf_counter() - t0
    blocks = []
    for i, seq in enumerate(prefill):
        step.prefill_tokens += len(seq.feed)
        seq.kv_len += len(seq.feed)
        seq.feed = []
        step.sequences.append(seq)
        blocks.append(out[i : i + 1])
        for child in [c for c in seq.request.sequences if c.forked_from is seq]:
            model.fork_sequence(seq.seq_id, child.seq_id)
            child.in_model, child.kv_len, child.forked_from = True, seq.kv_len, None
            step.sequences.append(child)
            blocks.append(out[i : i + 1])
    return blocks
