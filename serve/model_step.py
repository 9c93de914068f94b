"""Carrying out one step's plan on the model (``StepRunner.run``): prefill chunks (with forks), decode, verify, giving
the rows to sample and their logits.

Rows are in this order: each sequence whose prefill chunk completes its feed, followed by the sequences forked from
it (a request with n > 1 prefills once), then every decoding sequence, then the sequences that check drafts
(speculative decoding): their last token and drafts go through ``Runner.verify`` in one forward, one row per token
(``1 + len(drafts)`` rows). A chunk that leaves part of a prompt for later steps gives no row. Every chunk goes
through one ``Runner.prefill`` call (the paged KV cache takes sequences with different appended lengths in one
forward); decode rows keep their own ``Runner.decode`` call: the compiled prefill runs its matmuls and attention
with other kernels, so a decode row inside it would get other floats than decoding gives it.
The step's ``Batch`` is made from those rows before the model runs, and sequences with mask sources start filling
their masks on worker threads while the model computes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
from logitproc.runtime import LogitProcessor, empty_aligned
from logitproc.runtime.batch import Batch
from logitproc.runtime.mask_filler import MaskJob

from .runner import Runner
from .scheduler import StepPlan
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
    prefilled: set[str] = field(default_factory=set)  # requests that fed a prompt chunk
    chunked: list[GeneratedSequence] = field(default_factory=list)  # sequences whose chunk left part of their feed
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
        self.prefilled |= other.prefilled
        self.chunked.extend(other.chunked)
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


class StepRunner:
    """Carries out a step's plan on the model: ``run(plan)`` makes the step's Batch from the rows to sample (starting
    their masks on worker threads), then runs prefill, decode and verify, and returns the ``ModelStep``. Every
    sequence the plan feeds is in the model already (``Scheduler.schedule`` placed it); the runner changes the KV
    bookkeeping only as the forward does (``fed``, and ``fork_into`` for a completed prompt's n > 1 forks)."""

    def __init__(self, model: Runner, processor: LogitProcessor) -> None:
        self.model = model
        self.processor = processor

    def run(self, plan: StepPlan, step: ModelStep | None = None) -> ModelStep:
        """Feed the ``plan``'s tokens through the model; return the step's rows and logits. ``step`` is filled in as
        the call goes (given by a caller that needs to see how far a failed call got). A prefill chunk that leaves
        part of its sequence's feed for a later step gives no row."""
        step = ModelStep() if step is None else step
        model, processor = self.model, self.processor
        for seq, take in plan.chunks:
            if not seq.in_model:
                raise ValueError(f"the plan feeds sequence {seq.index} of {seq.request_id!r}, which is not in the "
                                 "model: Scheduler.schedule places every sequence it plans a chunk for")
            if not 0 < take <= len(seq.feed):
                raise ValueError(f"the plan feeds {take} tokens to sequence {seq.index} of {seq.request_id!r}, "
                                 f"which has {len(seq.feed)} to feed")
        chunks = plan.chunks
        decode, verify, drafts = plan.decode, list(plan.drafts), plan.drafts
        order = [r for s, take in chunks if take == len(s.feed)
                 for r in [s, *(c for c in s.request.sequences if c.forked_from is s)]] + decode + verify
        if order:
            trees = [drafts.get(s) for s in order] if verify else None
            step.batch = processor.batch([s.state for s in order], draft_trees=trees)
            if step.batch.any_masks:  # grammar masks fill on worker threads during the forward
                step.masks = processor.start_masks(step.batch)
        blocks: list[np.ndarray] = []
        if chunks:
            blocks += _prefill(model, chunks, step)
        if decode:
            t0 = time.perf_counter()
            out = np.asarray(model.decode([s.seq_id for s in decode], [s.feed[0] for s in decode]))
            step.decode_seconds = time.perf_counter() - t0
            step.decode_tokens = len(decode)
            for seq in decode:
                seq.fed(1)
            step.sequences.extend(decode)
            blocks.append(out)
        if verify:
            t0 = time.perf_counter()
            outs = model.verify([s.seq_id for s in verify], [s.feed + drafts[s] for s in verify])
            step.verify_seconds = time.perf_counter() - t0
            for seq, out in zip(verify, outs, strict=True):
                step.verify_tokens += len(out)
                seq.fed(len(out))  # its token and its drafts
                step.sequences.append(seq)
                step.drafts[seq] = drafts[seq]
                blocks.append(np.asarray(out))
        if step.batch is not None:
            step.logits = _joined(blocks, (step.batch.num_rows, processor.vocab_size))
        return step


def _joined(blocks: list[np.ndarray], shape: tuple[int, int]) -> np.ndarray:
    """The step's logits, its rows in the batch's order: the one block the runner returned when it holds them all as
    they are (a decode-only step: the kernels process it in place, no copy), else the blocks copied once into one
    array."""
    if len(blocks) == 1 and blocks[0].shape == shape and blocks[0].dtype == np.float32 and \
            blocks[0].flags.c_contiguous and blocks[0].flags.writeable:
        return blocks[0]
    out = empty_aligned(shape)
    np.concatenate(blocks, axis=0, out=out)
    return out


def _prefill(model: Runner, chunks: list[tuple[GeneratedSequence, int]], step: ModelStep) -> list[np.ndarray]:
    """One prefill call over every chunk; the rows of the sequences whose feed is now all in (each followed by
    the sequences forked from it)."""
    t0 = time.perf_counter()
    out = np.asarray(model.prefill([s.seq_id for s, _ in chunks], [s.feed[:take] for s, take in chunks]))
    step.prefill_seconds = time.perf_counter() - t0
    blocks = []
    for i, (seq, take) in enumerate(chunks):
        step.prefill_tokens += take
        step.prefilled.add(seq.request_id)
        seq.fed(take)
        if seq.feed:  # more of its prompt goes in at a later step
            step.chunked.append(seq)
            continue
        step.sequences.append(seq)
        blocks.append(out[i : i + 1])
        for child in [c for c in seq.request.sequences if c.forked_from is seq]:
            seq.fork_into(model, child)
            step.sequences.append(child)
            blocks.append(out[i : i + 1])
    return blocks
