"""logitproc's logit bias, penalties, token masks and sampling as Hugging Face ``LogitsProcessor``s for ``generate()``.

::

    from transformers import LogitsProcessorList
    from logitproc.integrations.transformers import LogitprocProcessor

    processor = LogitprocProcessor(build_kernels("cpu"), GenerationConfig(repetition_penalty=1.2,
                                   response_format=ResponseFormat.json_schema(schema), max_tokens=64),
                                   vocab_size=model.config.vocab_size, tokenizer=tokenizer, eos_token_ids=[eos])
    model.generate(ids, max_new_tokens=64, logits_processor=LogitsProcessorList([processor]))

Each call receives HF's ``input_ids`` ``[B, T]`` and float32 ``scores`` ``[B, V]`` (a torch tensor, processed in place
without a copy through DLPack) and returns ``scores``. The first call takes each row's ids as its prompt; later calls
append the tokens HF added (the grammar and the other mask sources advance with them), roll back rows whose earlier
tokens changed (assisted decoding, beam search reordering rows) and stop following a row once it produced an EOS
(HF then pads it). One processor serves one ``generate()`` call. With ``LogitprocProcessor`` sampling (temperature,
top-k, top-p, min-p) stays with HF's ``generate()`` arguments, whose warpers run after every custom processor; the
config's sampling fields must keep their defaults. ``LogitprocSampler`` samples too, with the config's sampling
fields and logitproc's fused kernel (no sort for top-p), and leaves only the sampled token to ``generate()``.
Jump-forward does not exist inside ``generate()`` (one token per step): a token the
grammar forces is the row's only allowed token.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

try:
    import torch
    from transformers import LogitsProcessor, PreTrainedTokenizerFast
except ImportError as exc:  # transformers is the user's (and torch with it): logitproc never requires it
    raise ImportError("logitproc.integrations.transformers needs Hugging Face transformers (and torch): "
                      "pip install 'logitproc[hf]'") from exc
from logitproc.runtime import GenerationConfig, KernelLibrary, LogitProcessor, RequestState, Sampler
from logitproc.runtime.constraints import ConstraintFactory
from logitproc.runtime.grammar.closing import DocumentClosing
from logitproc.runtime.mask_source import TokenMaskSource
from logitproc.runtime.tree_decode import TreeDecodeConfig
from tokenizers import Tokenizer

#: GenerationConfig fields that belong to HF's sampling (``generate(do_sample=..., temperature=..., ...)``) or to the
#: engine's requests: a processor refuses a config that sets them rather than ignore them.
NOT_PROCESSOR_FIELDS = ("temperature", "top_p", "top_k", "min_p", "seed", "logprobs", "top_logprobs", "n", "stop",
                        "stop_token_ids")
_DEFAULTS = GenerationConfig()


class LateDocumentClosing(DocumentClosing):
    """``DocumentClosing`` for a loop that cannot replace a sampled token (HF's ``generate()``: the model has already
    read it when a processor sees it): where the engine would replace a token that leaves no completion within
    ``max_tokens``, here the answer goes on, and once no completion fits (or ``max_tokens`` is reached) only the
    closing plan's next token is allowed, so that the document still closes, a few tokens late (give
    ``max_new_tokens`` a margin over ``max_tokens``). Within the budget it masks exactly as ``DocumentClosing``."""

    def fill_bitmask(self, row: np.ndarray, draft_path: Sequence[int]) -> bool:
        if self.max_tokens - self.generated - len(draft_path) > 0:  # within the budget
            if super().fill_bitmask(row, draft_path):
                return True
            if not self.cut:
                return False
        plan = self.plan(draft_path)
        if plan is None:  # no completion found: the grammar's own mask
            return False
        token = plan[0] if plan else self._eos[0]
        row.fill(0)
        row[token >> 5] = np.uint32(1 << (token & 31)).view(np.int32)
        return True


class LogitprocProcessor(LogitsProcessor):
    """Applies ``config``'s logit bias, presence / frequency / repetition penalties and masks (response_format:
    JSON schema, regex or grammar; max_thinking_tokens; allowed_token_ids; bad_words; min_tokens; a Tree Decode map)
    to HF's scores, in that order, in place.

    Parameters
    ----------
    library: a kernel library for ``device`` (``logitproc.compile.build_kernels("cpu")``).
    config: the processing fields of a ``GenerationConfig``; ``max_tokens`` lets a grammar close its document in
        time (give ``generate()``'s ``max_new_tokens`` a margin over it: see ``LateDocumentClosing``).
    vocab_size: the model's logits width (``model.config.vocab_size``).
    tokenizer: a ``tokenizers.Tokenizer`` or HF fast tokenizer; needed for masks (grammar, bad words, think budget,
        min_tokens, Tree Decode), with ``eos_token_ids``.
    constraints: a ``ConstraintFactory`` made once for the model (``ConstraintFactory(tokenizer, vocab_size,
        eos_token_ids, tree_decode=...)``), instead of ``tokenizer`` / ``eos_token_ids`` / ``tree_decode``: the
        grammar engine reads the tokenizer once (0.1-1 s) rather than once per processor.
    device: where the scores are ("cpu", or "cuda" for CUDA tensors with a CUDA kernel library).
    mask_workers: threads filling the rows' masks (``LogitProcessor``'s). 0, the default, fills them in the calling
        thread: inside ``generate()`` nothing runs meanwhile to overlap them with (the engine fills them during the
        model's forward), and a handoff to a thread waits for the GIL (measured: 1.3 ms a call with 0 workers, 2.7 ms
        with 2, B=8, V=128256, JSON schema, 2-core machine at load 4).

    Raises
    ------
    ValueError: a sampling field set in ``config``, or masks asked for without a tokenizer and EOS ids.
    """

    #: the config fields this class refuses to see set, and what to do instead
    refused_fields: tuple[str, ...] = NOT_PROCESSOR_FIELDS
    refusal_hint = ("pass sampling parameters to model.generate() (do_sample, temperature, top_k, top_p, min_p) or "
                    "use LogitprocSampler")

    def __init__(self, library: KernelLibrary, config: GenerationConfig, vocab_size: int, *,
                 tokenizer: Tokenizer | PreTrainedTokenizerFast | None = None, eos_token_ids: Sequence[int] = (),
                 tree_decode: TreeDecodeConfig | None = None, grammar_backend: str = "llguidance",
                 constraints: ConstraintFactory | None = None, device: str = "cpu", mask_workers: int = 0) -> None:
        if not isinstance(config, GenerationConfig):
            raise TypeError(f"config must be a logitproc GenerationConfig, got {type(config).__name__}")
        for name in self.refused_fields:
            if getattr(config, name) != getattr(_DEFAULTS, name):
                raise ValueError(f"GenerationConfig.{name}={getattr(config, name)!r} is not applied by "
                                 f"{type(self).__name__}: {self.refusal_hint} and leave {name} at its default")
        self.config = config
        self.library, self.vocab_size, self.device, self.mask_workers = library, vocab_size, device, mask_workers
        self.factory: ConstraintFactory | None = constraints
        if constraints is None and (config.needs_mask_sources or tree_decode is not None):
            if tokenizer is None or not eos_token_ids:
                raise ValueError("config asks for token masks (response_format, max_thinking_tokens, min_tokens, "
                                 "allowed_token_ids, bad_words or a Tree Decode map): pass tokenizer= and "
                                 "eos_token_ids=")
            if isinstance(tokenizer, PreTrainedTokenizerFast):
                tokenizer = tokenizer.backend_tokenizer
            self.factory = ConstraintFactory(tokenizer, vocab_size, eos_token_ids, backend=grammar_backend,
                                             tree_decode=tree_decode)
        config.check_vocab(vocab_size)
        eos = constraints.tokenizer.eos_token_ids if constraints is not None else eos_token_ids
        self.eos_token_ids = frozenset(int(t) for t in eos)
        self.processor: LogitProcessor | None = None  # made at the first call, with one row per sequence
        self.states: list[RequestState] = []
        self._ids: np.ndarray | None = None  # the input_ids of the previous call
        self._done: list[bool] = []  # rows that produced an EOS: HF pads them, the state stops there

    def __call__(self, input_ids: Any, scores: Any) -> Any:
        self._follow(input_ids, scores)
        self.processor.inplace_update_logits(scores, self.states)
        return scores

    def _follow(self, input_ids: Any, scores: Any) -> None:
        """Bring the rows' states up to ``input_ids`` (the first call: their prompts)."""
        ids = np.from_dlpack(input_ids.detach().cpu())
        if ids.ndim != 2 or ids.shape[0] != scores.shape[0]:
            raise ValueError(f"input_ids {list(ids.shape)} and scores {list(scores.shape)} disagree on the batch")
        if self._ids is None:
            self._start(ids)
        elif ids.shape[0] != len(self.states):
            raise ValueError(f"this processor followed {len(self.states)} sequences and now gets {ids.shape[0]}: "
                             f"make one {type(self).__name__} per generate() call")
        else:
            self._advance(ids)
        self._ids = ids.copy()

    def _new_state(self, prompt: np.ndarray) -> RequestState:
        ids = prompt.tolist()
        if self.factory is None:
            return RequestState(ids, self.config)
        if self.factory.open_think_block(ids, self.config) != ids:
            raise ValueError(f"max_thinking_tokens is set: the prompt must end with think_begin "
                             f"{self.config.think_begin!r} (generation starts inside the think block)")
        sources: list[TokenMaskSource] = [
            LateDocumentClosing(s.grammar, s.max_tokens, s.hints, s.rules, s.think) if isinstance(s, DocumentClosing)
            else s for s in self.factory.sources_for(self.config)]
        return RequestState(ids, self.config, mask_sources=sources)

    def _start(self, ids: np.ndarray) -> None:
        self.processor = LogitProcessor(self.library, self.vocab_size, ids.shape[0], device=self.device,
                                        mask_workers=self.mask_workers)
        self.states = [self._new_state(row) for row in ids]
        self._done = [False] * ids.shape[0]

    def _append(self, r: int, tokens: np.ndarray) -> None:
        state = self.states[r]
        for token in tokens.tolist():
            if self._done[r]:
                return
            state.append_token(token)
            self._done[r] = token in self.eos_token_ids

    def _advance(self, ids: np.ndarray) -> None:
        old = self._ids
        known = old.shape[1]
        if ids.shape[1] >= known and np.array_equal(ids[:, :known], old):  # the usual step: tokens appended
            for r in range(ids.shape[0]):
                self._append(r, ids[r, known:])
            return
        for r in range(ids.shape[0]):  # some row changed before its end: back to the common prefix, then forward
            width = min(known, ids.shape[1])
            differs = np.flatnonzero(ids[r, :width] != old[r, :width])
            same = int(differs[0]) if differs.size else width
            state = self.states[r]
            held = state.num_tokens
            if same >= held:  # the tokens the state holds are unchanged (a finished row's padding may differ)
                self._append(r, ids[r, held:])
            elif same < len(state.prompt_token_ids):
                self.states[r] = self._new_state(ids[r, :len(state.prompt_token_ids)])
                self._done[r] = False
                self._append(r, ids[r, len(state.prompt_token_ids):])
            else:
                state.rollback(held - same)
                self._done[r] = False
                self._append(r, ids[r, same:])


#: GenerationConfig fields a LogitprocSampler refuses: the engine's per-token outputs and stop rules.
NOT_SAMPLER_FIELDS = ("logprobs", "top_logprobs", "n", "stop", "stop_token_ids")


class LogitprocSampler(LogitprocProcessor):
    """A ``LogitprocProcessor`` that also samples: logitproc's whole step in place of HF's warpers and draw.

    Each call applies the config's bias, penalties and masks as ``LogitprocProcessor`` does, then its temperature,
    min-p, top-k, top-p and the seeded draw in one fused kernel (``Sampler.sample_from_logits(scores, states,
    processor=...)``: the masks are read by the sampling kernel, no probabilities are written), and returns the scores
    with only each row's sampled token finite (0; every other token -inf). ``generate()``'s own choice then takes that
    token: greedy (``do_sample=False``, the natural setting) picks it, and so would HF's warpers and draw, since no
    other token has any probability. It pays where HF's sampling costs most: its top-p warper sorts every row (at
    V=128256 milliseconds a row), the fused kernel needs no sort (see ``docs/benchmarks.md``).

    Put it last in the ``LogitsProcessorList``: a processor after it sees one-hot scores. The draws come from each
    row's own stream (``GenerationConfig.seed``: with a seed every row draws the same numbers, as requests with one
    seed do in the engine; without one each row's stream is fresh). Not for beam search (one-hot scores leave beams
    nothing to rank), and ``output_scores`` returns the one-hot scores.

    Parameters: as ``LogitprocProcessor``'s; the config may set temperature, top_k, top_p, min_p and seed.

    Raises
    ------
    ValueError: a config that sets logprobs, top_logprobs, n, stop or stop_token_ids (``__init__``); a live row whose
        scores hold NaN or +inf, or whose every token is masked (``__call__``: nothing can be sampled there).
    """

    refused_fields = NOT_SAMPLER_FIELDS
    refusal_hint = "generate() returns tokens only and stops at EOS or max_new_tokens"

    def __init__(self, library: KernelLibrary, config: GenerationConfig, vocab_size: int, **kwargs: Any) -> None:
        super().__init__(library, config, vocab_size, **kwargs)
        self.sampler: Sampler | None = None  # made at the first call, with one row per sequence

    def __call__(self, input_ids: Any, scores: Any) -> Any:
        self._follow(input_ids, scores)
        if self.sampler is None:
            self.sampler = Sampler(self.library, self.vocab_size, len(self.states), device=self.device)
        result = self.sampler.sample_from_logits(scores, self.states, processor=self.processor)
        tokens = result.token_ids.astype(np.int64)
        for r in np.flatnonzero(tokens < 0).tolist():
            if not self._done[r]:
                reason = result.finish_reason(r)
                raise ValueError(f"row {r} of the scores has nothing to sample ({reason}): "
                                 + ("the model's scores hold NaN or +inf" if reason == "non_finite_logits"
                                    else "every token is masked"))
            tokens[r] = min(self.eos_token_ids)  # a finished row: HF replaces its token with padding
        scores.fill_(-math.inf)
        scores[torch.arange(len(tokens), device=scores.device), torch.from_numpy(tokens).to(scores.device)] = 0.0
        return scores
