"""LogitProcessor: logit bias -> penalties -> masks, in place, then the temperature softmax.

Every step, per stage: fill host arrays (prefixes of paired buffers allocated once at capacity), queue their copies
on the copy stream, make the compute stream wait for them, launch the kernel. A stage with nothing to do launches
nothing. The order is fixed here, and masks come last so that nothing is subtracted from a masked (-inf) logit:
a masked token's probability is exactly 0, and a row with every token masked has all-zero probabilities.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np

from . import kernel_abi
from .batch import Batch, DraftArg
from .config import MAX_LOGIT_BIAS_ENTRIES
from .device import Device, PrefixViews
from .kernel_library import KernelLibrary, require_kernels
from .logits_io import LogitsStaging, caller_array, refuse_read_only
from .mask_filler import MaskFiller, MaskJob
from .mask_source import JumpForward, TokenMaskSource
from .paired_buffer import PairedBuffer
from .penalty_layout import PenaltyLayout
from .processed_batch import DeferredMasks, ProcessedBatch
from .request_state import RequestState

#: A request's logit_bias may name at most this many tokens.

BatchArg = Batch | ProcessedBatch | Sequence[RequestState]
#: The kernels this processor launches.
KERNELS = (kernel_abi.LOGIT_BIAS, kernel_abi.PENALTY, kernel_abi.BITMASK, kernel_abi.SOFTMAX)


def _all_allow(sources: Sequence[TokenMaskSource], token_ids: Sequence[int], words: int) -> bool:
    """Every source allows ``token_ids[i]`` after ``token_ids[:i]``, for every i."""
    row = np.empty(words, np.int32)
    for i, token in enumerate(token_ids):
        for source in sources:
            row[:] = -1
            if source.fill_bitmask(row, list(token_ids[:i])) and not (int(row[token >> 5]) >> (token & 31)) & 1:
                return False
    return True


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    return value


class LogitProcessor:
    """Applies each request's logit bias, penalties and token masks to a batch of logits, then the softmax.

    ``max_num_token`` bounds the rows of one call (sequences plus their draft tokens). ``max_penalty_entries``
    bounds the distinct (row, token) pairs penalised in one call; by default every row may hold the whole vocabulary.
    """

    def __init__(self, library: KernelLibrary, vocab_size: int, max_num_token: int,
                 device: str | Device = "cpu", max_penalty_entries: int | None = None,
                 mask_workers: int = 2) -> None:
        self.vocab_size = _positive_int("vocab_size", vocab_size)
        self.max_num_token = _positive_int("max_num_token", max_num_token)
        self.device = device if isinstance(device, Device) else Device(device)
        self.kernels = self.device.load(library)
        require_kernels(self.kernels, "LogitProcessor", KERNELS)
        cap, dev = self.max_num_token, self.device
        bias_cap = cap * min(vocab_size, MAX_LOGIT_BIAS_ENTRIES)
        pen_cap = _positive_int("max_penalty_entries", max_penalty_entries or cap * vocab_size)
        self._bias = [PairedBuffer(dev, "logit_bias rows", bias_cap, dtype="int32"),
                      PairedBuffer(dev, "logit_bias tokens", bias_cap, dtype="int32"),
                      PairedBuffer(dev, "logit_bias values", bias_cap, dtype="float32")]
        self._penalty = PenaltyLayout(dev, pen_cap)
        self._penalty_values = PairedBuffer(dev, "penalty values", cap, (3,), "float32")
        self.bitmask_words = (vocab_size + 31) // 32
        self._mask_rows = PairedBuffer(dev, "mask rows", cap, dtype="int32")
        self._bitmask = PairedBuffer(dev, "bitmask", cap, (self.bitmask_words,), "int32")
        self._temperature = PairedBuffer(dev, "temperature", cap, dtype="float32")
        self._logits = LogitsStaging(dev, cap, vocab_size)
        self._probs = PrefixViews(dev, dev.empty((cap, vocab_size), "float32"))
        self._masks = MaskFiller(self._bitmask.host, self._mask_rows.host, mask_workers)
        self._pending_masks: MaskJob | None = None
        self._last_batch: Batch | None = None
        # Batches whose masks inplace_update_logits(defer_masks=True) left to the sampler, not applied since: a later
        # stage given one of them rather than its ProcessedBatch is refused (it would miss the masks).
        self._deferred: weakref.WeakSet[Batch] = weakref.WeakSet()
        #: Seconds spent filling masks (summed over workers) and waiting for them, for statistics.
        self.mask_fill_seconds = 0.0
        self.mask_wait_seconds = 0.0

    # ----------------------------------------------------------------------------------------------------------
    def batch(self, states: Sequence[RequestState], cum_num_token: Any = None, draft_trees: DraftArg = None) -> Batch:
        """Validate one step's sequences (and drafts) once: the Batch every stage of the step takes.

        The batch records what changed since the previous one made here (``batch.update``); sequences that joined
        are checked against the vocabulary, those that left release their penalty entries.
        """
        batch = Batch(states, cum_num_token, draft_trees, previous=self._last_batch, made_by=self)
        if batch.num_rows > self.max_num_token:
            raise ValueError(f"{batch.num_rows} rows exceed max_num_token={self.max_num_token}")
        for state in batch.update.joined:
            self._check_joined(state)
        for state in batch.states:  # O(1) each: ids appended since the request joined are checked here
            if state.max_token_id >= self.vocab_size:
                raise ValueError(f"token id {state.max_token_id} (appended to a sequence) is outside the vocabulary "
                                 f"[0, {self.vocab_size})")
        for path in batch.paths:
            if path and not 0 <= min(path) <= max(path) < self.vocab_size:
                bad = next(t for t in path if not 0 <= t < self.vocab_size)
                raise ValueError(f"draft token id {bad} is outside the vocabulary [0, {self.vocab_size})")
        self._penalty.forget(batch.update.left)
        self._last_batch = batch
        return batch

    def masks_deferred(self, batch: Batch) -> bool:
        """Whether ``inplace_update_logits(batch, defer_masks=True)`` left ``batch``'s masks to the sampler and they
        have not been applied since (``compute_probs_from_logits`` given its ProcessedBatch applies them)."""
        return batch in self._deferred

    def _check_joined(self, state: RequestState) -> None:
        state.config.check_vocab(self.vocab_size)
        if not state.mask_sources and state.config.needs_mask_sources:
            raise ValueError("the config sets response_format, max_thinking_tokens, min_tokens, "
                             "allowed_token_ids or bad_words, but the RequestState has no mask sources: make "
                             "them with ConstraintFactory(tokenizer, vocab_size, eos_ids).sources_for(config)")
        for path in (state.prompt_token_ids, state.output_token_ids, state.draft_token_ids):
            if path and not 0 <= min(path) <= max(path) < self.vocab_size:
                bad = next(t for t in path if not 0 <= t < self.vocab_size)
                raise ValueError(f"token id {bad} is outside the vocabulary [0, {self.vocab_size})")

    def _batch_for(self, logits: Any, states: BatchArg, cum_num_token: Any, draft_trees: DraftArg) -> Batch:
        if isinstance(states, ProcessedBatch):
            states = states.batch
        if isinstance(states, Batch):
            if states.made_by is not self:
                raise ValueError("the Batch was made by another LogitProcessor: make it with this one's batch()")
            if cum_num_token is not None or draft_trees is not None:
                raise ValueError("cum_num_token and draft_trees belong to batch(): a Batch already has its rows")
            batch = states
        else:
            batch = self.batch(states, cum_num_token, draft_trees)
        if logits is not None:
            batch.check_array(logits, "logits", self.vocab_size, self.max_num_token, "")
        return batch

    def start_masks(self, states: BatchArg, cum_num_token: Any = None, draft_trees: DraftArg = None) -> MaskJob:
        """Start filling the token masks of the next step on worker threads and return at once.

        Masks depend on the states only, not on the logits: call this before running the model, then
        ``inplace_update_logits`` with the same batch (or the same states and drafts) uses the filled rows, waiting
        for them if needed. States must not change in between. A later call with other rows refills synchronously.
        """
        batch = self._batch_for(None, states, cum_num_token, draft_trees)
        self._finish_pending_masks()
        self._pending_masks = self._masks.start(batch, asynchronous=True)
        return self._pending_masks

    def _finish_pending_masks(self) -> MaskJob | None:
        job, self._pending_masks = self._pending_masks, None
        if job is not None:
            waited = time.perf_counter()
            job.wait()
            self.mask_wait_seconds += time.perf_counter() - waited
            self.mask_fill_seconds += job.fill_seconds
        return job

    def jump_forward(self, state: RequestState) -> JumpForward | None:
        """Append what the grammar forces next to ``state`` without running the model (jump-forward).

        The forced text is re-tokenised with the tail of the output by the real tokenizer; when that changes the
        last tokens, they are rolled back first (``rollback``), then ``token_ids`` appended. The state (penalty
        counts and every mask source) is updated; the caller makes its KV cache agree: its first
        ``state.num_tokens - len(token_ids)`` tokens are unchanged. Returns None when nothing is forced or the
        request asked for logprobs (a jump has no distribution to report). The jump is
        also refused (None, state unchanged) when another mask source of the sequence (allowed_token_ids, bad
        words, a Tree Decode map, ...) would not allow one of its tokens.
        """
        if state.config.logprobs:
            return None
        for source in state.mask_sources:
            found = source.jump_forward(state.output_token_ids)
            if found is None:
                continue
            if found.token_ids and max(found.token_ids) >= self.vocab_size:
                raise ValueError(f"jump-forward token {max(found.token_ids)} is outside the vocabulary")
            removed = state.output_token_ids[len(state.output_token_ids) - found.rollback:] if found.rollback else []
            state.rollback(found.rollback)
            others = [s for s in state.mask_sources if s is not source]
            if others and not _all_allow(others, found.token_ids, self.bitmask_words):
                for token in removed:  # put back what the jump rolled back
                    state.append_token(token)
                return None
            for token in found.token_ids:
                state.append_token(token)
            return found
        return None

    def inplace_update_logits(self, logits: Any, states: BatchArg, cum_num_token: Any = None,
                              draft_trees: DraftArg = None, *, defer_masks: bool = False) -> ProcessedBatch:
        """Apply logit bias, then penalties, then every mask to ``logits`` ``[N, V]`` in place; return the step's
        ``ProcessedBatch`` (its Batch, the logits on the device, the masks' errors), which the later stages take in
        place of the Batch.

        ``defer_masks=True`` fills the masks but leaves them to ``Sampler.sample_from_logits``, which reads them as it
        samples (one pass over the logits fewer): the returned ``ProcessedBatch`` holds them (``deferred_masks``;
        pass it, not the Batch, to the sampler: a later stage given the Batch is refused with a ValueError, until
        ``compute_probs_from_logits`` given the ProcessedBatch applies them, if the step takes the staged path after
        all).

        ``states`` is this step's Batch (``batch()``), or its states (and ``cum_num_token`` / ``draft_trees``), from
        which a Batch is made. ``logits`` is a float32 numpy array, a CPU tensor with ``__dlpack__`` (torch, ...)
        or a device array of this processor's device; a C-contiguous one is written in place without a copy,
        another one is copied once and written back (``logits_io``). A read-only array is refused.
        Row j of a sequence is processed as if its draft ancestors had been appended; every state is left exactly as
        it was. Masks started by ``start_masks`` for the same rows are used; the returned ``mask_errors`` says which
        rows' mask sources failed (those rows allow no token).
        """
        array = caller_array(logits)  # (a numpy view of a torch tensor, once per call)
        refuse_read_only(array)
        batch = self._batch_for(array, states, cum_num_token, draft_trees)
        on_device, write_back = self._logits.to_device(array)
        if batch.any_bias:
            self._apply_logit_bias(on_device, batch)
        if batch.any_penalties:
            self._apply_penalties(on_device, batch)
        deferred, errors = self._apply_masks(on_device, batch, defer_masks)
        if defer_masks:
            self._deferred.add(batch)
        else:
            self._deferred.discard(batch)
        if write_back is not None:
            self.device.synchronize()
            write_back()
        return ProcessedBatch(batch, logits, on_device, deferred, errors)

    def compute_probs_from_logits(self, logits: Any, states: BatchArg, cum_num_token: Any = None,
                                  draft_trees: DraftArg = None) -> Any:
        """Temperature softmax of each row with its request's temperature (0 = one-hot on the argmax).

        Returns probabilities ``[N, V]`` in the processor's output buffer: a numpy view for numpy input on the CPU
        (valid until the next call), a numpy copy from other devices, else a device array. Given the step's
        ``ProcessedBatch`` (``inplace_update_logits``), logits already on the device are not copied again, and masks
        it deferred are applied first.
        """
        array = caller_array(logits)
        batch = self._batch_for(array, states, cum_num_token, draft_trees)
        processed = states if isinstance(states, ProcessedBatch) else None
        if processed is None:
            batch.refuse_if_masks_deferred("compute_probs_from_logits")
        on_device = None if processed is None else processed.device_array_of(logits)
        if on_device is None:
            on_device, _ = self._logits.to_device(array, writes=False)
        if processed is not None and processed.deferred_masks is not None:  # defer_masks=True, then the staged path
            deferred = processed.deferred_masks
            self.kernels[kernel_abi.BITMASK](on_device, deferred.row_ids_on_device, deferred.bitmask)
        if processed is not None:
            self._deferred.discard(batch)  # (applied: the later stages may take the Batch)
        rows = batch.num_rows
        temperature = self._temperature.host_prefix(rows)
        temperature[:] = [s.config.temperature for s in batch.row_states]
        args = self._temperature.to_device(rows)
        self.device.wait_for_copies()
        probs = self._probs(rows)
        self.kernels[kernel_abi.SOFTMAX](on_device, args, probs)
        return self._logits.from_device(probs, logits)

    # ----------------------------------------------------------------------------------------------------------
    def _apply_logit_bias(self, logits: Any, batch: Batch) -> None:
        rows = [(r, s.config.logit_bias) for r, s in enumerate(batch.row_states) if s.config.logit_bias]
        n = sum(len(bias) for _, bias in rows)
        pos, tok, val = (buf.host_prefix(n) for buf in self._bias)
        start = 0
        for r, bias in rows:
            end = start + len(bias)
            pos[start:end] = r
            tok[start:end], val[start:end] = batch.row_states[r].config.logit_bias_arrays
            start = end
        args = [buf.to_device(n) for buf in self._bias]
        self.device.wait_for_copies()
        self.kernels[kernel_abi.LOGIT_BIAS](logits, *args)

    def _apply_penalties(self, logits: Any, batch: Batch) -> None:
        n = self._penalty.prepare(batch)  # incremental: host work does not grow with sequence length
        if n == 0:
            return
        values = self._penalty_values.host_prefix(batch.num_rows)
        for r, state in enumerate(batch.row_states):
            cfg = state.config
            if cfg.has_penalties:
                values[r] = (cfg.presence_penalty, cfg.frequency_penalty, cfg.repetition_penalty)
        penalties = self._penalty_values.to_device(batch.num_rows)
        self.device.wait_for_copies()
        self.kernels[kernel_abi.PENALTY](logits, *self._penalty.device_arrays(n), penalties)

    def _apply_masks(self, logits: Any, batch: Batch, defer: bool = False) -> tuple[DeferredMasks | None,
                                                                                    dict[int, str]]:
        """Fill (or take the started job's) masks and apply them, or with ``defer`` return them for the sampling
        kernel; and the errors of failing mask sources, by row."""
        job = self._finish_pending_masks()
        if job is None or not job.matches(batch):
            if not batch.any_masks:
                return None, {}
            job = self._masks.start(batch, asynchronous=False)
            job.wait()
            self.mask_fill_seconds += job.fill_seconds
        masked = job.count
        if masked == 0:
            return None, job.errors
        args = (self._mask_rows.to_device(masked), self._bitmask.to_device(masked))
        self.device.wait_for_copies()
        if defer:
            return DeferredMasks(self._mask_rows.host[:masked].copy(), *args), job.errors
        self.kernels[kernel_abi.BITMASK](logits, *args)
        return None, job.errors
