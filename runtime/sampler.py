"""Sampler: min-p / top-k / top-p renormalisation, seeded multinomial sampling, and logprobs.

Two ways to sample: staged (``renormalize`` then ``sample``, on probabilities from
``LogitProcessor.compute_probs_from_logits``; each stage writes a full ``[N, V]`` array) for callers who want the
probabilities, and fused (``sample_from_logits``: one kernel from the processed logits to the tokens, nothing
``[N, V]`` written; with ``processor=`` it runs that LogitProcessor's stages first: the whole step in one call) for
everyone else. With the same seeds both give the same tokens and the same logprobs (chosen token and top-n,
processed or raw). Inputs are the caller's arrays (numpy, torch, ...), read in place (``logits_io``).

Sampling draws one uniform number per row from the row's own request stream (``RequestState.draw_uniforms``: the
state owns its stream, seeded by ``GenerationConfig.seed``; a step that checked drafts keeps the draws of the rows it
committed with ``RequestState.keep_draws``), so a seeded request gets the same tokens whatever else is in the batch
and at whichever row. Greedy rows (temperature 0) arrive as one-hot distributions and draw nothing. A row whose every
token was masked has all-zero probabilities: it samples token -1 and is flagged in ``SampleResult.no_valid_token``.

Logprobs are "processed" (of the distribution sampled from, after every stage) or "raw" (the model's own log-softmax
before any processing), as each request's ``GenerationConfig.logprobs_mode`` says ("auto", the default: raw when
greedy, processed when sampling). Raw logprobs need the logits before processing: pass ``raw_logits`` (a numpy copy
of the whole batch); they are computed by the ``log_softmax_gather`` and ``top_n`` kernels, the one way logprobs are
computed in this package.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from . import kernel_abi
from .batch import Batch, DraftArg
from .device import Device, PrefixViews
from .kernel_library import KernelLibrary, require_kernels
from .logits_io import LogitsStaging, caller_array
from .paired_buffer import PairedBuffer
from .processed_batch import DeferredMasks, ProcessedBatch
from .request_state import RequestState

if TYPE_CHECKING:
    from .logit_processor import LogitProcessor

DEFAULT_MAX_ROWS = 256
#: The kernels this sampler launches.
KERNELS = (kernel_abi.RENORMALIZE, kernel_abi.MULTINOMIAL, kernel_abi.TOP_N, kernel_abi.LOG_SOFTMAX,
           kernel_abi.SAMPLE_FROM_LOGITS)
#: A step's rows: its Batch, the ProcessedBatch the processor returned for it (the masks it deferred, the logits on
#: the device), or its states (a Batch is made of them).
BatchArg = Batch | ProcessedBatch | Sequence[RequestState]


@dataclass
class SampleResult:
    """One sampled token per row. ``logprobs[r]`` is NaN and ``top_logprobs[r]`` None where not requested.

    ``non_finite_logits`` (bool ``[N]``, or None when nobody looked) flags rows whose logits held a NaN or a +inf:
    their token is -1, never a sample. ``sample_from_logits`` looks (its kernel flags them as it reads the row);
    ``sample`` does not (staged callers check with ``logits_io.non_finite_rows``).
    """

    token_ids: np.ndarray
    logprobs: np.ndarray
    top_logprobs: list[list[tuple[int, float]] | None]
    no_valid_token: np.ndarray
    non_finite_logits: np.ndarray | None = None
    #: Row -> ``"ExceptionType: message"`` of the mask source that failed for it (the row allowed no token): the
    #: ``mask_errors`` of the ProcessedBatch sampled from (empty when given a Batch or states).
    mask_errors: Mapping[int, str] = field(default_factory=dict)

    def finish_reason(self, row: int) -> str | None:
        """'non_finite_logits' for a row whose logits held NaN or +inf, 'no_valid_token' for a row whose every
        token was masked, else None."""
        if self.non_finite_logits is not None and self.non_finite_logits[row]:
            return "non_finite_logits"
        return "no_valid_token" if self.no_valid_token[row] else None

    def flag_non_finite(self, rows: np.ndarray) -> None:
        """Mark ``rows`` (bool ``[N]``) as having had NaN / +inf logits: token -1, no logprobs."""
        self.non_finite_logits = rows
        if rows.any():
            self.token_ids[rows] = -1
            self.logprobs[rows] = np.nan
            for r in np.flatnonzero(rows):
                self.top_logprobs[r] = None


def _processed_top_counts(batch: Batch) -> list[int]:
    """Per row, how many processed top-n logprobs it asks for (0: none)."""
    if not batch.any_logprobs:
        return [0] * batch.num_rows
    return [s.config.top_logprobs if s.config.logprobs and s.config.effective_logprobs_mode == "processed" else 0
            for s in batch.row_states]


class Sampler:
    """Renormalises and samples batches of probabilities with per-request parameters."""

    def __init__(self, library: KernelLibrary, vocab_size: int, max_num_token: int = DEFAULT_MAX_ROWS,
                 device: str | Device = "cpu") -> None:
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1:
            raise ValueError(f"vocab_size must be an int >= 1, got {vocab_size!r}")
        if isinstance(max_num_token, bool) or not isinstance(max_num_token, int) or max_num_token < 1:
            raise ValueError(f"max_num_token must be an int >= 1, got {max_num_token!r}")
        self.vocab_size = vocab_size
        self.max_num_token = max_num_token
        self.device = device if isinstance(device, Device) else Device(device)
        self.kernels = self.device.load(library)
        require_kernels(self.kernels, "Sampler", KERNELS)
        cap, dev = max_num_token, self.device
        self._top_k = PairedBuffer(dev, "top_k", cap, dtype="int32")
        self._top_p = PairedBuffer(dev, "top_p", cap, dtype="float32")
        self._min_p = PairedBuffer(dev, "min_p", cap, dtype="float32")
        self._uniform = PairedBuffer(dev, "uniform", cap, dtype="float32")
        self._temperature = PairedBuffer(dev, "temperature", cap, dtype="float32")
        self._renorm = PairedBuffer(dev, "renorm", cap, dtype="int32")
        self._renormalized = PrefixViews(dev, dev.empty((cap, vocab_size), "float32"))
        self._tokens = PrefixViews(dev, dev.empty((cap,), "int32"))
        self._chosen = PrefixViews(dev, dev.empty((cap,), "float32"))
        self._logsumexp = PrefixViews(dev, dev.empty((cap,), "float32"))
        self._gather_ids = PairedBuffer(dev, "raw logprob ids", cap, dtype="int32")
        # numpy views of the outputs where the device is the host (None elsewhere): results are read without TVM
        self._tokens_host = dev.host_view(self._tokens.array)
        self._chosen_host = dev.host_view(self._chosen.array)
        # the fused kernel's masks: per row the bitmask row it reads (-1: none), and the bitmask a batch without
        # deferred masks passes (one all-allowed row: the kernel's bitmask has at least one row)
        self._mask_index = PairedBuffer(dev, "mask index", cap, dtype="int32")
        self._top_count = PairedBuffer(dev, "top count", cap, dtype="int32")
        self._no_masks = dev.upload(np.full((1, (vocab_size + 31) // 32), -1, np.int32))
        self._raw: LogitsStaging | None = None
        # The top_n kernel takes n from its outputs' width: one pair of buffers per width used, at capacity.
        self._top_buffers: dict[int, tuple[PrefixViews, PrefixViews]] = {}
        self._probs = LogitsStaging(dev, cap, vocab_size)

    def _batch_for(self, probs: Any, states: BatchArg, cum_num_token: Any, draft_trees: DraftArg, stage: str,
                   what: str = "probs") -> Batch:
        if isinstance(states, ProcessedBatch):
            states = states.batch
        elif isinstance(states, Batch):
            states.refuse_if_masks_deferred(f"Sampler.{stage}")
        if isinstance(states, Batch):
            if cum_num_token is not None or draft_trees is not None:
                raise ValueError("cum_num_token and draft_trees belong to the Batch: it already has its rows")
            batch = states
        else:
            batch = Batch(states, cum_num_token, draft_trees)
        batch.check_array(probs, what, self.vocab_size, self.max_num_token, "the sampler's ")
        return batch

    def _on_device(self, probs: Any, states: BatchArg, array: Any) -> Any:
        """The device array of the caller's ``probs`` (``array``: it as ``caller_array`` gives it): the processor's,
        when ``states`` is the ProcessedBatch of those very logits, else copied (on the CPU: a view where it can)."""
        on_device = states.device_array_of(probs) if isinstance(states, ProcessedBatch) else None
        if on_device is None:
            on_device, _ = self._probs.to_device(array, writes=False)
        return on_device

    def renormalize(self, probs: Any, states: BatchArg, cum_num_token: Any = None, draft_trees: DraftArg = None) -> Any:
        """min-p, then top-k, then top-p of each row with its request's values; the kept tokens rescaled to sum 1.

        ``states`` is the step's Batch (``LogitProcessor.batch``) or its states (and drafts). Returns ``probs``
        itself when no row filters anything (nothing is launched), else the sampler's buffer (numpy for numpy input,
        valid until the next call).
        """
        array = caller_array(probs, "probs")
        batch = self._batch_for(array, states, cum_num_token, draft_trees, "renormalize")
        if not batch.any_filters:
            return probs
        rows = batch.num_rows
        args = self._filters_to_device(batch)
        on_device = self._on_device(probs, states, array)
        self.device.wait_for_copies()
        out = self._renormalized(rows)
        self.kernels[kernel_abi.RENORMALIZE](on_device, *args, out)
        return self._probs.from_device(out, probs)

    def _filters_to_device(self, batch: Batch, temperature: bool = False) -> list[Any]:
        """top_k, top_p, min_p of each row (off values for rows without filters), copied to the device; with
        ``temperature``, each row's temperature first (the batch's ``sampling_columns``)."""
        rows = batch.num_rows
        buffers = (self._temperature, self._top_k, self._top_p, self._min_p)
        for buffer, values in zip(buffers, batch.sampling_columns, strict=True):
            buffer.host_prefix(rows)[:] = values
        return [b.to_device(rows) for b in buffers[0 if temperature else 1:]]

    def _uniform_to_device(self, batch: Batch) -> Any:
        """One uniform number per row from its request's stream (0 for greedy rows, which draw nothing)."""
        rows = batch.num_rows
        uniform = self._uniform.host_prefix(rows)
        if batch.all_greedy:
            uniform[:] = 0.0
        else:
            cum, sampling = batch.cum_num_token, batch.sampling_rows
            for i, state in enumerate(batch.states):
                lo, hi = cum[i], cum[i + 1]
                uniform[lo:hi] = 0.0 if sampling[lo][0] == 0.0 else state.draw_uniforms(hi - lo)  # [0]: temperature
        return self._uniform.to_device(rows)

    def _masks_to_device(self, batch: Batch, deferred: DeferredMasks | None) -> tuple[Any, Any]:
        """mask_index (the row of the bitmask each row reads, -1 for none) and the bitmask, for the fused kernel:
        the ``deferred`` masks, else none."""
        rows = batch.num_rows
        index = self._mask_index.host_prefix(rows)
        index[:] = -1
        if deferred is None or len(deferred.row_ids) == 0:
            return self._mask_index.to_device(rows), self._no_masks
        index[deferred.row_ids] = np.arange(len(deferred.row_ids), dtype=np.int32)
        return self._mask_index.to_device(rows), deferred.bitmask

    def sample(self, probs: Any, states: BatchArg, cum_num_token: Any = None, draft_trees: DraftArg = None,
               raw_logits: np.ndarray | None = None) -> SampleResult:
        """Draw one token per row from ``probs`` ``[N, V]`` (after ``renormalize``), with logprobs as requested."""
        array = caller_array(probs, "probs")
        batch = self._batch_for(array, states, cum_num_token, draft_trees, "sample")
        rows = batch.num_rows
        u = self._uniform_to_device(batch)
        on_device = self._on_device(probs, states, array)
        self.device.wait_for_copies()
        tokens = self._tokens(rows)
        chosen = self._chosen(rows)
        self.kernels[kernel_abi.MULTINOMIAL](on_device, u, tokens, chosen)
        result = self._result(batch, tokens, chosen, raw_logits, lambda n: self._top_n(on_device, rows, n))
        if isinstance(states, ProcessedBatch):
            result.mask_errors = states.mask_errors
        return result

    def sample_from_logits(self, logits: Any, states: BatchArg, cum_num_token: Any = None,
                           draft_trees: DraftArg = None, raw_logits: np.ndarray | None = None, *,
                           processor: LogitProcessor | None = None) -> SampleResult:
        """One token per row straight from the processed logits ``[N, V]`` (after ``inplace_update_logits``).

        With ``processor``, the whole step in one call: ``processor.inplace_update_logits(logits, batch,
        defer_masks=True)`` first (bias and penalties written into ``logits`` in place, the masks left to this
        kernel), on one Batch made by that processor (or ``states`` when it is one). Without it, ``states`` is the
        ``ProcessedBatch`` that ``inplace_update_logits`` returned (it holds the masks it deferred), or a Batch or
        states whose logits need no deferred masks (a Batch whose masks were deferred is refused with a ValueError:
        it would be sampled without them).

        The same tokens as ``sample(renormalize(compute_probs_from_logits(logits)))`` with the same seeds: the
        ``sample_from_logits`` kernel runs each row's temperature softmax, min-p / top-k / top-p and the draw in one
        kernel, writing no probabilities; masks the processor deferred (``inplace_update_logits(defer_masks=True)``,
        kept on the batch) are read by the same kernel. Logprobs are given as by ``sample``: the processed top-n ones
        come from the same kernel, which selects them from the row it sampled from (in cache on the CPU) for the rows
        that ask for them. A row whose logits hold a NaN or a +inf is flagged by the kernel as it reads it
        (``SampleResult.non_finite_logits``, token -1, no logprobs) rather than sampled.
        """
        if processor is not None:
            if not isinstance(states, Batch | ProcessedBatch):
                states = processor.batch(states, cum_num_token, draft_trees)
                cum_num_token = draft_trees = None
            states = processor.inplace_update_logits(logits, states, defer_masks=True)
        array = caller_array(logits)
        batch = self._batch_for(array, states, cum_num_token, draft_trees, "sample_from_logits", "logits")
        deferred = states.deferred_masks if isinstance(states, ProcessedBatch) else None
        rows = batch.num_rows
        self._renorm.host_prefix(rows)[:] = 1 if batch.any_filters else 0  # where the staged path renormalizes
        args = [*self._filters_to_device(batch, temperature=True), self._renorm.to_device(rows),
                self._uniform_to_device(batch), *self._masks_to_device(batch, deferred)]
        on_device = self._on_device(logits, states, array)
        self.device.wait_for_copies()
        tokens = self._tokens(rows)
        chosen = self._chosen(rows)
        counts = self._top_count.host_prefix(rows)
        counts[:] = _processed_top_counts(batch) if batch.any_logprobs else 0
        top_values, top_ids = self._top_views(rows, max(1, int(counts.max())))
        self.kernels[kernel_abi.SAMPLE_FROM_LOGITS](on_device, *args, tokens, chosen, self._top_count.to_device(rows),
                                              top_values, top_ids)
        # (_result reads the processed top-n before any raw top-n, which may reuse these buffers)
        result = self._result(batch, tokens, chosen, raw_logits,
                              lambda n: (self.device.download(top_values), self.device.download(top_ids)))
        result.flag_non_finite(result.token_ids == kernel_abi.NON_FINITE)  # token -1, no logprobs
        if isinstance(states, ProcessedBatch):
            result.mask_errors = states.mask_errors
        return result

    def _result(self, batch: Batch, tokens: Any, chosen: Any, raw_logits: np.ndarray | None,
                processed_top: Callable[[int], tuple[np.ndarray, np.ndarray]]) -> SampleResult:
        """The SampleResult of a draw: tokens, chosen-token probabilities, and the logprobs the rows asked for
        (``processed_top(n)``: the values and ids of the n most probable tokens of each row sampled from)."""
        rows = batch.num_rows
        token_ids = self._download(self._tokens_host, tokens, rows).astype(np.int32, copy=False)
        chosen_p = self._download(self._chosen_host, chosen, rows)
        no_valid = token_ids < 0
        logprobs = np.full(rows, np.nan, np.float32)
        top: list[list[tuple[int, float]] | None] = [None] * rows
        wanted = [(r, s.config.effective_logprobs_mode) for r, s in enumerate(batch.row_states)
                  if s.config.logprobs] if batch.any_logprobs else []
        processed = [r for r, mode in wanted if mode == "processed"]
        raw = [r for r, mode in wanted if mode == "raw"]
        if processed:
            with np.errstate(divide="ignore"):
                logprobs[processed] = np.log(chosen_p[processed])
            n = max(batch.row_states[r].config.top_logprobs for r in processed)
            if n:
                values, ids = processed_top(n)
                # (invalid: the slots of a row the fused kernel flagged as non-finite are not written; dropped later)
                with np.errstate(divide="ignore", invalid="ignore"):
                    logs = np.log(values)
                for r in processed:
                    k = batch.row_states[r].config.top_logprobs
                    top[r] = [(int(ids[r, j]), float(logs[r, j])) for j in range(k)] if k else None
        if raw:
            self._raw_logprobs(raw, batch, token_ids, raw_logits, logprobs, top)
        logprobs[no_valid] = np.nan
        return SampleResult(token_ids, logprobs, top, no_valid)

    def _download(self, host: np.ndarray | None, view: Any, rows: int) -> np.ndarray:
        """A numpy copy of the first ``rows`` entries of an output: from its host view where there is one."""
        return host[:rows].copy() if host is not None else self.device.download(view)

    def _top_views(self, rows: int, n: int) -> tuple[Any, Any]:
        """Device buffers ``[rows, n]`` for top-n values and ids (one pair per width used, at capacity)."""
        if n not in self._top_buffers:
            self._top_buffers[n] = (PrefixViews(self.device, self.device.empty((self.max_num_token, n), "float32")),
                                    PrefixViews(self.device, self.device.empty((self.max_num_token, n), "int32")))
        values, ids = (views(rows) for views in self._top_buffers[n])
        return values, ids

    def _top_n(self, on_device: Any, rows: int, n: int) -> tuple[np.ndarray, np.ndarray]:
        values, ids = self._top_views(rows, n)
        self.kernels[kernel_abi.TOP_N](on_device, values, ids)
        return self.device.download(values), self.device.download(ids)

    def _raw_logprobs(self, raw_rows: list[int], batch: Batch, token_ids: np.ndarray, raw_logits: Any,
                      logprobs: np.ndarray, top: list[list[tuple[int, float]] | None]) -> None:
        """Raw logprobs through the same kernels as the processed ones: ``log_softmax_gather`` of the raw logits at the
        sampled tokens (and their log-sum-exp), ``top_n`` of the raw logits minus that log-sum-exp."""
        if raw_logits is None:
            raise ValueError("logprobs_mode='raw' (or 'auto' on a greedy request) needs raw_logits: a copy of the "
                             "logits before inplace_update_logits")
        raw = np.asarray(raw_logits, dtype=np.float32)
        rows = batch.num_rows
        if raw.shape != (rows, self.vocab_size):
            raise ValueError(f"raw_logits must have shape [{rows}, {self.vocab_size}], got {list(raw.shape)}")
        if self._raw is None:  # [capacity, V] more memory only for batches that ask for raw logprobs
            self._raw = LogitsStaging(self.device, self.max_num_token, self.vocab_size)
        on_device, _ = self._raw.to_device(raw, writes=False)
        self._gather_ids.host_prefix(rows)[:] = np.maximum(token_ids, 0)
        ids = self._gather_ids.to_device(rows)
        self.device.wait_for_copies()
        chosen, lse = self._chosen(rows), self._logsumexp(rows)
        self.kernels[kernel_abi.LOG_SOFTMAX](on_device, ids, chosen, lse)
        gathered, logsumexp = self.device.download(chosen), self.device.download(lse)
        for r in raw_rows:
            if token_ids[r] >= 0:
                logprobs[r] = gathered[r]
        n = max(batch.row_states[r].config.top_logprobs for r in raw_rows)
        if n:
            values, top_ids = self._top_n(on_device, rows, n)
            for r in raw_rows:
                k = batch.row_states[r].config.top_logprobs
                if k:
                    top[r] = [(int(top_ids[r, j]), float(values[r, j] - logsumexp[r])) for j in range(k)]
