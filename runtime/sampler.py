"""Sampler: min-p / top-k / top-p renormalisation, seeded multinomial sampling, and logprobs.

Sampling draws one uniform number per row from the row's own request stream (``RequestState.rng``, seeded by
``GenerationConfig.seed``), so a seeded request gets the same tokens whatever else is in the batch and at whichever
row. Greedy rows (temperature 0) arrive as one-hot distributions and draw nothing. A row whose every token was
masked has all-zero probabilities: it samples token -1 and is flagged in ``SampleResult.no_valid_token``.

Logprobs are "processed" (of the distribution sampled from, after every stage) or "raw" (the model's own log-softmax
before any processing), as each request's ``GenerationConfig.logprobs_mode`` says. Raw logprobs need the logits
before processing: pass ``raw_logits`` (a numpy copy of those rows, or of the whole batch).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from logitproc.compile import KernelLibrary

from .device import Device, PrefixViews
from .logits_io import LogitsStaging
from .paired_buffer import PairedBuffer
from .request_state import RequestState
from .rows import RowPlan, plan_for_array

DEFAULT_MAX_ROWS = 256


@dataclass
class SampleResult:
    """One sampled token per row. ``logprobs[r]`` is NaN and ``top_logprobs[r]`` None where not requested."""

    token_ids: np.ndarray
    logprobs: np.ndarray
    top_logprobs: list[list[tuple[int, float]] | None]
    no_valid_token: np.ndarray

    def finish_reason(self, row: int) -> str | None:
        """'no_valid_token' for a row whose every token was masked, else None."""
        return "no_valid_token" if self.no_valid_token[row] else None


class Sampler:
    """Renormalises and samples batches of probabilities with per-request parameters."""

    def __init__(self, library: KernelLibrary, vocab_size: int, device: str | Device = "cpu",
                 max_num_token: int = DEFAULT_MAX_ROWS) -> None:
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1:
            raise ValueError(f"vocab_size must be an int >= 1, got {vocab_size!r}")
        if isinstance(max_num_token, bool) or not isinstance(max_num_token, int) or max_num_token < 1:
            raise ValueError(f"max_num_token must be an int >= 1, got {max_num_token!r}")
        self.vocab_size = vocab_size
        self.max_num_token = max_num_token
        self.device = device if isinstance(device, Device) else Device(device)
        self.kernels = self.device.load(library)
        cap, dev = max_num_token, self.device
        self._top_k = PairedBuffer(dev, "top_k", cap, dtype="int32")
        self._top_p = PairedBuffer(dev, "top_p", cap, dtype="float32")
        self._min_p = PairedBuffer(dev, "min_p", cap, dtype="float32")
        self._uniform = PairedBuffer(dev, "uniform", cap, dtype="float32")
        self._renormalized = PrefixViews(dev, dev.empty((cap, vocab_size), "float32"))
        self._tokens = PrefixViews(dev, dev.empty((cap,), "int32"))
        self._chosen = PrefixViews(dev, dev.empty((cap,), "float32"))
        # The top_n kernel takes n from its outputs' width: one pair of buffers per width used, at capacity.
        self._top_buffers: dict[int, tuple[PrefixViews, PrefixViews]] = {}
        self._probs = LogitsStaging(dev, cap, vocab_size)

    def _plan(self, probs: Any, states: Sequence[RequestState], cum_num_token: Any, draft_trees: Any) -> RowPlan:
        return plan_for_array(probs, "probs", self.vocab_size, self.max_num_token, "the sampler's ",
                              states, cum_num_token, draft_trees)

    def renormalize(self, probs: Any, states: Sequence[RequestState], cum_num_token: Any = None,
                    draft_trees: Any = None) -> Any:
        """min-p, then top-k, then top-p of each row with its request's values; the kept tokens rescaled to sum 1.

        Returns ``probs`` itself when no row filters anything (nothing is launched), else the sampler's buffer
        (numpy for numpy input, valid until the next call).
        """
        plan = self._plan(probs, states, cum_num_token, draft_trees)
        if not any(s.config.has_filters for s in plan.states):
            return probs
        rows = plan.num_rows
        top_k, top_p, min_p = (b.host_prefix(rows) for b in (self._top_k, self._top_p, self._min_p))
        for r, state in enumerate(plan.states):
            cfg = state.config
            on = cfg.has_filters
            top_k[r] = cfg.top_k if on and cfg.top_k > 0 else 0
            top_p[r] = cfg.top_p if on else 1.0
            min_p[r] = cfg.min_p if on else 0.0
        args = [b.to_device(rows) for b in (self._top_k, self._top_p, self._min_p)]
        on_device, _ = self._probs.to_device(probs)
        self.device.wait_for_copies()
        out = self._renormalized(rows)
        self.kernels["renormalize_probs"](on_device, *args, out)
        return self._probs.from_device(out, probs)

    def sample(self, probs: Any, states: Sequence[RequestState], cum_num_token: Any = None,
               draft_trees: Any = None, raw_logits: np.ndarray | None = None) -> SampleResult:
        """Draw one token per row from ``probs`` ``[N, V]`` (after ``renormalize``), with logprobs as requested."""
        plan = self._plan(probs, states, cum_num_token, draft_trees)
        rows = plan.num_rows
        uniform = self._uniform.host_prefix(rows)
        for r, state in enumerate(plan.states):
            uniform[r] = 0.0 if state.config.greedy else state.rng.random(dtype=np.float32)
        u = self._uniform.to_device(rows)
        on_device, _ = self._probs.to_device(probs)
        self.device.wait_for_copies()
        tokens = self._tokens(rows)
        chosen = self._chosen(rows)
        self.kernels["multinomial_from_uniform"](on_device, u, tokens, chosen)
        token_ids = self.device.download(tokens).astype(np.int32)
        chosen_p = self.device.download(chosen)
        no_valid = token_ids < 0
        logprobs = np.full(rows, np.nan, np.float32)
        top: list[list[tuple[int, float]] | None] = [None] * rows
        wanted = [(r, s.config.logprobs_mode) for r, s in enumerate(plan.states) if s.config.logprobs]
        processed = [r for r, mode in wanted if mode == "processed"]
        raw = [r for r, mode in wanted if mode == "raw"]
        if processed:
            with np.errstate(divide="ignore"):
                logprobs[processed] = np.log(chosen_p[processed])
            n = max(plan.states[r].config.top_logprobs for r in processed)
            if n:
                values, ids = self._top_n(on_device, rows, n)
                with np.errstate(divide="ignore"):
                    logs = np.log(values)
                for r in processed:
                    k = plan.states[r].config.top_logprobs
                    top[r] = [(int(ids[r, j]), float(logs[r, j])) for j in range(k)] if k else None
        if raw:
            self._raw_logprobs(raw, plan, token_ids, raw_logits, logprobs, top)
        logprobs[no_valid] = np.nan
        return SampleResult(token_ids, logprobs, top, no_valid)

    def _top_n(self, on_device: Any, rows: int, n: int) -> tuple[np.ndarray, np.ndarray]:
        if n not in self._top_buffers:
            self._top_buffers[n] = (PrefixViews(self.device, self.device.empty((self.max_num_token, n), "float32")),
                                    PrefixViews(self.device, self.device.empty((self.max_num_token, n), "int32")))
        values, ids = (views(rows) for views in self._top_buffers[n])
        self.kernels["top_n"](on_device, values, ids)
        return self.device.download(values), self.device.download(ids)

    def _raw_logprobs(self, raw_rows: list[int], plan: RowPlan, token_ids: np.ndarray, raw_logits: Any,
                      logprobs: np.ndarray, top: list[list[tuple[int, float]] | None]) -> None:
        if raw_logits is None:
            raise ValueError("logprobs_mode='raw' needs raw_logits: a copy of the logits before inplace_update_logits")
        raw = np.asarray(raw_logits, dtype=np.float32)
        if raw.shape != (plan.num_rows, self.vocab_size):
            raise ValueError(f"raw_logits must have shape [{plan.num_rows}, {self.vocab_size}], got {list(raw.shape)}")
        sub = raw[raw_rows].astype(np.float64)
        m = sub.max(axis=1, keepdims=True)
        lse = np.log(np.exp(sub - m).sum(axis=1, keepdims=True)) + m
        log_softmax = sub - lse
        for i, r in enumerate(raw_rows):
            if token_ids[r] >= 0:
                logprobs[r] = log_softmax[i, token_ids[r]]
            k = plan.states[r].config.top_logprobs
            if k:
                best = np.lexsort((np.arange(self.vocab_size), -log_softmax[i]))[:k]
                top[r] = [(int(t), float(log_softmax[i, t])) for t in best]
