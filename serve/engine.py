"""Engine: continuous batching of generation requests over one model runner; ``step()`` runs one step of them.

One ``step()`` (``_step`` and ``_forward``)::

    plan = scheduler.schedule(budget, deltas, propose_drafts)   # what the forward feeds, sequences placed
    step = step_runner.run(plan)                                # the model runs it: rows, Batch, logits
    tokens = process(processor, sampler, step.batch, step.logits)
    scheduler.commit(step, tokens, deltas)                      # each row's token to its sequence
    scheduler.retire()                                          # (after jump-forward) finished sequences leave

module by module::

    scheduler.py   ``schedule``: aborts end their sequences; the latest-arrived requests are preempted while the
                   next forward would overflow the KV cache; waiting requests are admitted while slots and KV cache
                   are free;
    speculation.py (``speculative``) decoding sequences propose prompt-lookup drafts; those expected to pay are
                   checked this step;
    scheduler.py   the step's plan within its budget (``StepBudget``): every decoding sequence's token (and drafts
                   while they fit), then prefill chunks of the prompts going in, the shortest rest first; a sequence
                   getting its first chunk is placed in the model (a fork of the prefix cache entry sharing the
                   longest prefix, if any)
    model_step.py  ``StepRunner.run``: the step's Batch is made (its masks start filling on worker threads), then
                   the model runs: prefill (the chunks: new prompts, the rest of long ones, feeds left by a
                   jump-forward; a completed prompt's n > 1 forks), then decode, then verify (each drafting
                   sequence's last token and drafts, logits after every one)
    processing.py  LogitProcessor -> Sampler on the Batch, once over every row
    scheduler.py   ``commit`` (commit.py): each row's token is committed (state, text deltas, finish rules); a
                   drafting sequence commits its rows while they agree with its drafts, and the rejected drafts
                   leave the KV cache
    commit.py      with ``jump_forward``, the tokens the constraints force are appended without a decode step each
    scheduler.py   finished sequences free their slots (or keep their KV cache as prefix cache entries)
    step_stats.py  the step's statistics

Requests join (``add_request``, or ``submit``: its grammar compiled on the engine's grammar thread while the steps
go on) and leave (finish or ``abort``) between steps; everything about a bad request is checked in ``add_request``
(a ValueError there; with ``submit``, a grammar that cannot compile fails the request's ``ready`` Future). Whatever
still fails inside a step (a constraint, the runner, the detokenizer) ends only the requests it concerns, with
finish reason "error": when the step's batch fails, its state is put back, each request is run alone, and those
that fail alone end (``Output.error`` says why).

Threads: every method may be called from any number of threads. One step runs at a time (``step`` waits for a step
running on another thread); ``stream`` and ``generate`` have no stepping thread of their own: whichever waiting
caller finds no step running runs the next one, and each step's deltas go to the stream of their request, so every
caller sees exactly its own deltas. ``step()`` returns the deltas of the requests added with ``add_request``,
including those of steps that a ``stream``/``generate`` caller ran in the meantime.
"""

from __future__ import annotations

import itertools
import os
import sys
import threading
import time
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

from logitproc.runtime import GenerationConfig, LogitProcessor, RequestState, Sampler, TokenMaskSource
from logitproc.runtime.answer_check import load_checker
from logitproc.runtime.constraints import ConstraintFactory
from logitproc.runtime.field_error import FieldTypeError, FieldValueError
from logitproc.runtime.grammar import GrammarBackend
from logitproc.runtime.tree_decode import TreeDecodeConfig

from .commit import jump_forward
from .first_masks import make_first_masks
from .model_step import ModelStep, StepRunner
from .outputs import Delta, EngineStats, Output, RequestStats
from .prefix_cache import PrefixCache
from .processing import process
from .prompt_tokens import prompt_token_ids
from .runner import Runner
from .scheduler import Scheduler, StepBudget, StepPlan
from .sequence import Deltas, GeneratedSequence, Request, delta_of
from .speculation import Candidate, Drafter, SpeculationPlanner, SpeculativeConfig
from .step_stats import account_step

Prompt = str | Sequence[int] | Sequence[Mapping[str, str]]

#: The default token budgets of one step (``Engine(max_num_batched_tokens=..., max_prefill_tokens_with_decode=...)``),
#: measured on the 2-core CPU this was developed on: see docs/serving.md, "Chunked prefill".
DEFAULT_MAX_NUM_BATCHED_TOKENS = 256
DEFAULT_MAX_PREFILL_TOKENS_WITH_DECODE = 16


class Engine:
    """Serves generation requests on one model runner (``CompiledModel`` or ``NumpyRunner``; see ``Runner``).

    ``max_batch`` bounds the sequences running at once (and the rows of one processing call);
    ``jump_forward`` appends the tokens that grammar constraints force without a decode step each;
    ``grammar_backend`` names the constraint backend used for ``response_format`` and thinking budgets (or is one
    made for the model's tokenizer, ``ConstraintFactory``'s ``backend``);
    ``tree_decode`` constrains every sequence to a Tree Decode map; ``prefix_cache`` keeps finished sequences' KV
    cache so that a prompt sharing a prefix with one (a conversation's earlier turns, a system prompt) prefills only
    the rest (``RequestStats.cached_tokens``; entries are evicted LRU when the KV cache or the model's sequence slots
    run short). ``max_num_batched_tokens`` bounds the tokens one step feeds the model (vLLM's name): the decoding
    sequences' tokens first, then chunks of the prompts going in, so a long prompt is prefilled over several steps
    (None: no bound; it must exceed ``max_batch``, so that a prefill chunk always fits beside the decode rows);
    ``max_prefill_tokens_with_decode`` bounds the prefill chunks of a step that also decodes, so that a long prompt
    never holds the running streams up for more than that (None: only ``max_num_batched_tokens`` does). Both None:
    every prompt is prefilled whole in one step. ``speculative`` turns on speculative decoding
    (``SpeculativeConfig``, or a dict of its fields in vLLM's names, e.g. ``{"method": "ngram",
    "num_speculative_tokens": 5}``; None: off): prompt-lookup drafts checked in one verify forward, kept only where
    they pay (``docs/serving.md``). An engine owns its model's KV cache: making one frees the sequences an earlier
    engine left there.
    Logit processing runs on the CPU, with the kernels of the model's own library.
    """

    def __init__(self, model: Runner, max_batch: int = 8, jump_forward: bool = False,
                 grammar_backend: str | GrammarBackend = "llguidance", tree_decode: TreeDecodeConfig | None = None,
                 prefix_cache: bool = True, speculative: SpeculativeConfig | Mapping[str, Any] | str | None = None,
                 max_num_batched_tokens: int | None = DEFAULT_MAX_NUM_BATCHED_TOKENS,
                 max_prefill_tokens_with_decode: int | None = DEFAULT_MAX_PREFILL_TOKENS_WITH_DECODE) -> None:
        if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
            raise ValueError(f"max_batch must be an int >= 1, got {max_batch!r}")
        self.model = model
        self.max_batch = min(max_batch, int(model.max_num_sequences))
        if max_num_batched_tokens is not None and (
                isinstance(max_num_batched_tokens, bool) or not isinstance(max_num_batched_tokens, int)
                or max_num_batched_tokens <= self.max_batch):
            raise ValueError(f"max_num_batched_tokens must be None or an int above max_batch={self.max_batch} (the "
                             f"decode rows and at least one prefill token), got {max_num_batched_tokens!r}")
        if max_prefill_tokens_with_decode is not None and (
                isinstance(max_prefill_tokens_with_decode, bool) or not isinstance(max_prefill_tokens_with_decode, int)
                or max_prefill_tokens_with_decode < 1):
            raise ValueError(f"max_prefill_tokens_with_decode must be None or an int >= 1, got "
                             f"{max_prefill_tokens_with_decode!r}")
        #: Tokens one step feeds the model at most, and prefill tokens of a step that also decodes (None: no bound).
        self.budget = StepBudget(max_num_batched_tokens, max_prefill_tokens_with_decode)
        #: Speculative decoding's settings, or None (off).
        self.speculative = SpeculativeConfig.of(speculative)
        self._planner = SpeculationPlanner(self.speculative) if self.speculative is not None else None
        self.jump_forward = bool(jump_forward)
        self.grammar_backend = grammar_backend
        #: A TreeDecodeConfig constraining every sequence (``--tree-decode-config``), or None.
        self.tree_decode = tree_decode
        self.vocab_size = int(model.vocab_size)
        self.context_length = int(model.context_length)
        self.eos_token_ids = tuple(int(t) for t in model.eos_token_ids)
        self.max_total_tokens = int(model.max_total_tokens)
        # Rows of one processing call: a row per sequence, and one per draft token checked.
        rows = self.max_batch * (1 + (self.speculative.num_speculative_tokens if self.speculative else 0))
        self.processor = LogitProcessor(model.kernel_library, self.vocab_size, rows)
        self.sampler = Sampler(model.kernel_library, self.vocab_size, rows)
        self.stats = EngineStats()
        cache = PrefixCache(self.max_total_tokens, int(model.max_num_sequences)) if prefix_cache else None
        self.scheduler = Scheduler(model, self.max_batch, self.max_total_tokens, self.stats, cache)
        self.step_runner = StepRunner(model, self.processor)
        self._constraints: ConstraintFactory | None = None
        self._ids = itertools.count()
        self._arrivals = itertools.count()  # arrival order: the latest-arrived request is preempted first
        self._add_lock = threading.Lock()  # add_request: ids, arrival order, the constraint factory, compiling
        # submit(): requests whose constraints compile on the grammar thread (id -> aborted meanwhile)
        self._compiling: dict[str, bool] = {}
        self._compiled = threading.Condition(self._add_lock)  # notified when one leaves the compiling state
        self._grammar_pool: ThreadPoolExecutor | None = None
        # Stepping, under self._turn: one step at a time; each step's deltas routed to the stream of their request
        # (None: a closed stream, its deltas dropped), the others kept for the next step() call.
        self._turn = threading.Condition()
        self._stepping = False
        self._steps = 0  # steps run so far
        self._inboxes: dict[str, deque[Delta] | None] = {}
        self._unclaimed: list[Delta] = []

    # ---------------------------------------------------------------------------------------------- requests
    def tokenize(self, prompt: Prompt, chat: bool | None = None) -> list[int]:
        """Token ids of a prompt: text, token ids, or chat messages (rendered with the model's chat template)."""
        return prompt_token_ids(self.model, prompt, chat)

    def add_request(self, prompt: Prompt, config: GenerationConfig | None = None, *, chat: bool | None = None,
                    request_id: str | None = None, jump_forward: bool | None = None) -> str:
        """Queue a request; it starts at the next ``step()``. Returns its id.

        ``prompt`` is text, token ids, or chat messages (``[{"role": ..., "content": ...}]``, rendered with the
        model's chat template; ``chat=True`` wraps a text prompt as one user message). Raises ValueError (or
        TypeError) for anything wrong with the request: empty prompt, token ids outside the vocabulary, a prompt
        that leaves no room in the context, more sequences than ``max_batch``, logit_bias ids outside the
        vocabulary, a schema/regex/grammar the constraint backend cannot compile. ``jump_forward`` turns the
        engine's jump-forward off for this request (False), or asks for it (True: an error if the engine was
        created without it); None follows the engine.
        """
        return self._add(prompt, config, chat, request_id, jump_forward, watch=False)

    def _add(self, prompt: Prompt, config: GenerationConfig | None, chat: bool | None, request_id: str | None,
             jump_forward: bool | None, watch: bool) -> str:
        """``add_request``; ``watch``: deltas go to the request's inbox (``stream``), not to ``step()``."""
        request = self._build(self._new_request(prompt, config, chat, request_id, jump_forward))
        self._enqueue(request, watch)
        return request.request_id

    def _new_request(self, prompt: Prompt, config: GenerationConfig | None, chat: bool | None,
                     request_id: str | None, jump_forward: bool | None) -> _NewRequest:
        """A request's checks (all but its grammar's), its token ids, id and arrival order."""
        config = GenerationConfig() if config is None else config
        if not isinstance(config, GenerationConfig):
            raise TypeError(f"config must be a GenerationConfig, got {type(config).__name__}")
        if jump_forward is not None and not isinstance(jump_forward, bool):
            raise FieldTypeError("jump_forward", f"jump_forward must be a boolean or None, got {jump_forward!r}")
        if jump_forward and not self.jump_forward:
            raise FieldValueError("jump_forward", "jump_forward=True needs an engine created with jump_forward=True "
                             "(logitproc serve --jump-forward)")
        ids = self.tokenize(prompt, chat)
        if not ids:
            raise FieldValueError("prompt", "the prompt is empty")
        if config.n > self.max_batch:
            raise FieldValueError("n", f"n={config.n} sequences do not fit in max_batch={self.max_batch}")
        config.check_vocab(self.vocab_size)
        if config.max_thinking_tokens is not None:  # generation starts inside the think block
            self._check_thinking_mode(config)
            ids = self._constraint_factory().open_think_block(ids, config)
        # Each sequence may grow to `limit` tokens: the context, or its share of the KV cache when n > 1.
        limit = min(self.context_length, self.max_total_tokens // config.n)
        if len(ids) >= limit:
            raise FieldValueError("prompt", f"the prompt has {len(ids)} tokens; the context holds {limit} per sequence "
                             "(prompt and output together)")
        room = limit - len(ids)
        if config.response_format is not None and (config.max_tokens is None or room < config.max_tokens):
            config = replace(config, max_tokens=room)  # the closing ends the document where the sequence must end
        if request_id is not None and not isinstance(request_id, str):
            raise TypeError(f"request_id must be a str, got {type(request_id).__name__}")
        with self._add_lock:
            rid = request_id if request_id is not None else f"req-{next(self._ids)}"
            arrival = next(self._arrivals)
        return _NewRequest(rid, ids, config, limit, self.jump_forward if jump_forward is None else jump_forward,
                           RequestStats(prompt_tokens=len(ids), arrival=time.perf_counter()), arrival)

    def _build(self, new: _NewRequest) -> Request:
        """The request and its sequences, each with fresh mask sources (this compiles its grammar, if not cached)
        and its first masks made (``first_masks.py``)."""
        config = new.config
        request = Request(new.request_id, new.prompt_token_ids, new.stats, new.arrival)
        request.jump_forward = new.jump_forward
        for index in range(config.n):
            cfg = config
            if config.n > 1 and config.seed is not None:  # each sequence its own stream, reproducibly
                cfg = replace(config, seed=(config.seed + index) % 2**64)
            state = RequestState(new.prompt_token_ids, cfg, mask_sources=self._mask_sources(cfg))
            # n > 1: prefilled once, then forked from the first sequence
            seq = GeneratedSequence(request, index, state, self.model.tokenizer, self.eos_token_ids, new.limit,
                                    forked_from=request.sequences[0] if index > 0 else None)
            request.sequences.append(seq)
        make_first_masks((s.state for s in request.sequences), self.vocab_size)  # not left for a step to make
        return request

    def _enqueue(self, request: Request, watch: bool) -> None:
        """The request joins the scheduler's queue (its id must be free; ``watch``: its deltas go to its inbox)."""
        rid = request.request_id
        with self._add_lock:
            if rid in self._compiling:
                raise ValueError(f"request id {rid!r} is already in use")
            if watch:
                with self._turn:
                    self.scheduler.add(request)  # under the turn lock: no step sees it before its inbox exists
                    self._inboxes[rid] = deque()
            else:
                self.scheduler.add(request)

    def submit(self, prompt: Prompt, config: GenerationConfig | None = None, *, chat: bool | None = None,
               request_id: str | None = None, jump_forward: bool | None = None) -> PendingRequest:
        """``add_request`` without waiting for the request's grammar: its constraints compile on the engine's
        grammar thread while the steps go on, the request waiting meanwhile in the compiling state
        (``num_compiling``); then it joins the queue. Everything ``add_request`` checks but the grammar raises here;
        a grammar that cannot compile is the exception of ``PendingRequest.ready`` (the request then never ran and
        gives no delta). Its deltas come from ``step()``. The grammar cache is shared and single-flight: a schema
        is compiled once, however many requests ask for it at once. A request without a response format joins the
        queue at once (its ``ready`` is done), never behind a compile."""
        new = self._new_request(prompt, config, chat, request_id, jump_forward)
        ready: Future[str] = Future()
        if new.config.response_format is None:  # nothing to compile: it joins the queue now
            self._enqueue(self._build(new), watch=False)
            ready.set_result(new.request_id)
            return PendingRequest(new.request_id, ready)
        with self._add_lock:
            if new.request_id in self._compiling or not self.scheduler.is_done(new.request_id):
                raise ValueError(f"request id {new.request_id!r} is already in use")
            self._compiling[new.request_id] = False  # not aborted
            if self._grammar_pool is None:
                self._grammar_pool = ThreadPoolExecutor(1, thread_name_prefix="logitproc-grammar",
                                                        initializer=_lower_thread_priority)
        self._grammar_pool.submit(self._compile, new, ready)
        return PendingRequest(new.request_id, ready)

    def _compile(self, new: _NewRequest, ready: Future[str]) -> None:
        """On the grammar thread: build the request (compiling its grammar), then queue it; or fail ``ready``."""
        rid = new.request_id
        try:
            request = self._build(new)
        except BaseException as err:
            with self._compiled:
                del self._compiling[rid]
                self._compiled.notify_all()
            ready.set_exception(err)
            return
        with self._compiled:
            aborted = self._compiling.pop(rid)
            self.scheduler.add(request)
            if aborted:  # aborted while compiling: it ends with "abort" at the next step
                self.scheduler.abort(rid)
            self._compiled.notify_all()
        ready.set_result(rid)

    @property
    def num_compiling(self) -> int:
        """Requests added with ``submit`` whose constraints are compiling."""
        with self._add_lock:
            return len(self._compiling)

    def _wait_for_compiles(self) -> None:
        """With nothing to step but requests compiling, wait until one of them joins the queue (or fails)."""
        with self._compiled:
            while self._compiling and not self.scheduler.has_unfinished():
                self._compiled.wait(0.1)

    def _check_thinking_mode(self, config: GenerationConfig) -> None:
        """A thinking budget needs a model with a thinking mode: its vocabulary has the think markers as tokens."""
        for field_name in ("think_begin", "think_end"):
            marker = getattr(config, field_name)
            if self.model.tokenizer.token_to_id(marker) is None:
                raise FieldValueError(
                    "max_thinking_tokens",
                    f"max_thinking_tokens={config.max_thinking_tokens}: {self.model.name} has no thinking mode "
                    f"({field_name}={marker!r} is not a token of its vocabulary); leave max_thinking_tokens unset, "
                    "or set think_begin/think_end to the markers the model has")

    def _mask_sources(self, config: GenerationConfig) -> list[TokenMaskSource]:
        """Constraint sources for one sequence (a grammar, a think budget), made fresh per sequence."""
        if not config.needs_mask_sources and self.tree_decode is None:
            return []
        return list(self._constraint_factory().sources_for(config))

    def prepare_constraints(self) -> None:
        """Make the constraint backend for the model's tokenizer now (``ConstraintFactory.prepare``) instead of at
        the first request with a response format, whose compile would then hold up the steps for about a second
        (llguidance reads the vocabulary holding Python's GIL; docs/serving.md). ``logitproc serve`` calls it while
        loading; it also imports the checker of finished JSON answers (``answer_check.load_checker``), which the
        first such answer would import inside a step. ValueError (as such a request would get) when the tokenizer
        cannot carry grammars."""
        load_checker()
        self._constraint_factory().prepare()

    def _constraint_factory(self) -> ConstraintFactory:
        """The ConstraintFactory for this model, made on first use (the grammar backend reads the tokenizer)."""
        with self._add_lock:
            if self._constraints is None:
                self._constraints = ConstraintFactory(self.model.tokenizer, self.vocab_size, self.eos_token_ids,
                                                      backend=self.grammar_backend, tree_decode=self.tree_decode)
            return self._constraints

    def abort(self, request_id: str) -> None:
        """Cancel a request (safe from another thread; not from a signal handler, which should set a flag that the
        stepping loop turns into ``abort``); it ends with "abort" at the next step (one compiling: at the first step
        after its compile)."""
        with self._add_lock:
            if request_id in self._compiling:
                self._compiling[request_id] = True
                return
        self.scheduler.abort(request_id)

    def has_unfinished(self) -> bool:
        """Whether any request has not ended (compiling ones included)."""
        with self._add_lock:
            return bool(self._compiling) or self.scheduler.has_unfinished()

    def prompt_progress(self, request_id: str) -> tuple[int, int] | None:
        """(prompt tokens prefilled, prompt tokens) while the request's prompt is going in (by chunks of the step's
        token budget); None once it decodes or ended (a compiling request: nothing in yet)."""
        with self._add_lock:
            if request_id in self._compiling:
                return None
        return self.scheduler.prompt_progress(request_id)

    def has_runnable(self) -> bool:
        """Whether a step has something to do now: requests waiting, running or aborted (not compiling ones)."""
        return self.scheduler.has_unfinished()

    @property
    def kv_tokens(self) -> int:
        """KV cache tokens held by running sequences (waits for a running step)."""
        with self._between_steps():
            return sum(self.model.sequence_length(s.seq_id) for s in self.scheduler.running if s.in_model)

    @property
    def prefix_cache_tokens(self) -> int:
        """KV cache tokens kept for prefix reuse (freed LRU when running sequences need the room)."""
        return self.scheduler.cached_tokens

    def clear_prefix_cache(self) -> None:
        """Free the KV cache kept for prefix reuse (waits for a running step)."""
        with self._between_steps():
            self.scheduler.clear_prefix_cache()

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    # ---------------------------------------------------------------------------------------------- stepping
    def step(self) -> list[Delta]:
        """Admit, prefill, decode, process and sample once; return the deltas of the requests added with
        ``add_request`` (this step's, after those of steps that ``stream``/``generate`` callers ran since the last
        ``step()``). While another thread runs a step, waits for it and returns its deltas instead of running one
        more (so a ``step()`` caller is never starved by busy streams)."""
        with self._turn:
            seen = self._steps
            while self._stepping and self._steps == seen:
                self._turn.wait()
            run = self._steps == seen
            if run:
                self._stepping = True
        if run:
            self._run_step()
        with self._turn:
            deltas, self._unclaimed = self._unclaimed, []
        return deltas

    def _take_turn(self) -> None:
        """Wait until no step runs, then hold the turn (the caller runs ``_run_step`` or ``_give_turn``)."""
        with self._turn:
            while self._stepping:
                self._turn.wait()
            self._stepping = True

    def _give_turn(self) -> None:
        with self._turn:
            self._stepping = False
            self._turn.notify_all()

    @contextmanager
    def _between_steps(self) -> Iterator[None]:
        self._take_turn()
        try:
            yield
        finally:
            self._give_turn()

    def _run_step(self) -> None:
        """Run one step (the caller holds the turn), route its deltas and hand the turn on (even on an exception)."""
        try:
            deltas = self._step()
        except BaseException:
            self._give_turn()
            raise
        with self._turn:  # routed before the turn is free: a waiting stream sees its deltas or a step running
            for delta in deltas:
                inbox = self._inboxes.get(delta.request_id, self._unclaimed)
                if inbox is not None:
                    inbox.append(delta)
            for rid in [rid for rid, inbox in self._inboxes.items() if inbox is None]:
                if self.scheduler.is_done(rid):  # a closed stream's request has ended: forget it
                    del self._inboxes[rid]
            self._steps += 1
            self._stepping = False
            self._turn.notify_all()

    def _step(self) -> list[Delta]:
        """One step: ``schedule`` -> ``run`` -> ``sample`` -> ``commit`` (in ``_forward``), then jump-forward and the
        finished sequences' retirement."""
        self._wait_for_compiles()
        started = time.perf_counter()
        deltas: Deltas = {}
        plan = self.scheduler.schedule(self.budget, deltas, self._propose_drafts if self._planner else None)
        step, processing_s = self._forward_isolated(plan, deltas)
        if self.jump_forward:
            jump_forward(self.model, self.processor, self.scheduler.running, deltas, self.stats)
        self.scheduler.retire()
        step_s = time.perf_counter() - started
        account_step(self.stats, step, processing_s, step_s)
        if self._planner is not None:  # a token costs its forward and its row's share of the rest of the step
            rest = step_s - step.prefill_seconds - step.decode_seconds - step.verify_seconds
            per_row = max(rest, 0.0) / step.rows if step.rows else 0.0
            self._planner.costs.record(step.decode_tokens, step.decode_seconds + per_row * step.decode_tokens)
            self._planner.costs.record(step.verify_tokens, step.verify_seconds + per_row * step.verify_tokens)
        return [d for d in deltas.values() if d.text or d.token_ids or d.rollback or d.finish_reason]

    def _forward(self, plan: StepPlan, deltas: Deltas, step: ModelStep) -> tuple[ModelStep, float]:
        """The plan carried out: the model runs it, its rows are sampled and committed to their sequences. An
        exception leaves the sequences' tokens uncommitted (``step`` shows how far the model got)."""
        self.step_runner.run(plan, step)
        if step.batch is None or step.logits is None:
            return step, 0.0
        t0 = time.perf_counter()
        tokens = process(self.processor, self.sampler, step.batch, step.logits)
        processing_s = time.perf_counter() - t0
        self.scheduler.commit(step, tokens, deltas)
        return step, processing_s

    def _propose_drafts(self, decoding: list[GeneratedSequence], room: int) -> dict[GeneratedSequence, list[int]]:
        """The drafts the ``decoding`` sequences check this step, with ``room`` KV cache tokens left
        (``SpeculationPlanner.plan``)."""
        assert self._planner is not None and self.speculative is not None
        candidates = []
        for seq in decoding:
            if seq.drafter is None:
                seq.drafter = Drafter(self.speculative, seq.state)
            seq.drafter.sync(seq.state)
            # k drafts commit up to k + 1 tokens, and the verify puts k + 1 tokens in the KV cache
            limit = min(self.speculative.num_speculative_tokens, seq.tokens_left - 1,
                        self.context_length - seq.kv_need)
            proposal = seq.drafter.propose(limit) if limit > 0 else []
            candidates.append(Candidate(seq, seq.drafter, proposal, limit))
        return self._planner.plan(candidates, len(decoding), room)

    def _forward_isolated(self, plan: StepPlan, deltas: Deltas) -> tuple[ModelStep, float]:
        """``_forward`` of the plan; when that fails, the live sequences are put back as they were and each request
        runs its part of the plan alone: those that fail alone end with "error", the others go on."""
        kept = [_Placement(seq) for seq in self.scheduler.live()]
        step = ModelStep()
        try:
            return self._forward(plan, deltas, step)
        except Exception as err:
            first = f"{type(err).__name__}: {err}"
            kept = [p for p in kept if not self._undo(step, [p], first, deltas)]
        total, processing_s = ModelStep(), 0.0
        requests: dict[int, list[_Placement]] = {}
        for placement in kept:
            requests.setdefault(id(placement.seq.request), []).append(placement)
        for group in requests.values():
            group = [p for p in group if p.seq.finish_reason is None]
            step = ModelStep()
            try:
                alone, seconds = self._forward(plan.only(p.seq for p in group), deltas, step)
            except Exception as err:
                message = f"{type(err).__name__}: {err}"
                self._undo(step, group, message, deltas)
                for p in group:
                    p.seq.fail(delta_of(deltas, p.seq), message)
                continue
            total.add(alone)
            processing_s += seconds
        return total, processing_s

    def _undo(self, step: ModelStep, kept: list[_Placement], why: str, deltas: Deltas) -> bool:
        """Put the sequences back as they were before a failed ``_forward`` (its masks finished first); a sequence
        that cannot be put back (the runner fails that too) ends with "error". True when any could not."""
        if step.masks is not None:
            step.masks.wait()
        failed = False
        for placement in kept:
            try:
                placement.restore(self.model)
            except Exception as err:
                failed = True
                placement.seq.fail(delta_of(deltas, placement.seq),
                                   f"{why} (and undoing the step failed: {type(err).__name__}: {err})")
        return failed

    # ---------------------------------------------------------------------------------------------- convenience
    def stream(self, prompt: Prompt, config: GenerationConfig | None = None, *,
               chat: bool | None = None) -> Iterator[Delta]:
        """Add one request and yield its deltas as they come, stepping the engine while no other caller does.

        Any number of streams may run at once, on one thread (interleaved) or many: each sees all of its own
        deltas and only those. Closing the iterator early (``break``, an exception, Ctrl-C in the consumer) aborts
        the request.
        """
        config = GenerationConfig() if config is None else config
        rid = self._add(prompt, config, chat, None, None, watch=True)
        inbox = self._inboxes[rid]
        assert inbox is not None
        finished = 0
        try:
            while finished < config.n:
                for delta in self._wait_for(rid, inbox):
                    finished += delta.finish_reason is not None
                    yield delta
        finally:
            with self._turn:
                self._inboxes[rid] = None  # deltas still to come are dropped
            if finished < config.n:  # closed early or failed: abort, and free its slots now if nobody is stepping
                self.abort(rid)
                with self._turn:
                    idle = not self._stepping
                    if idle:
                        self._stepping = True
                if idle:
                    self._run_step()
            with self._turn:
                if self.scheduler.is_done(rid):
                    self._inboxes.pop(rid, None)

    def _wait_for(self, rid: str, inbox: deque[Delta]) -> list[Delta]:
        """The request's next deltas: those in its inbox, else those of the next step (run here when no other
        thread is running one)."""
        while True:
            with self._turn:
                while not inbox and self._stepping:
                    self._turn.wait()
                if inbox:
                    items = list(inbox)
                    inbox.clear()
                    return items
                if self.scheduler.is_done(rid):
                    raise RuntimeError(f"request {rid!r} ended without a final delta")  # never expected
                self._stepping = True
            self._run_step()

    def generate(self, prompt: Prompt, config: GenerationConfig | None = None, *,
                 chat: bool | None = None) -> list[Output]:
        """Run one request to the end; its outputs, one per sequence (``config.n``), in order."""
        outputs: dict[int, Output] = {}
        for delta in self.stream(prompt, config, chat=chat):
            if delta.output is not None:
                outputs[delta.index] = delta.output
        return [outputs[i] for i in sorted(outputs)]


#: How much lower the grammar thread's CPU priority is than the engine's (Linux nice levels).
GRAMMAR_THREAD_NICENESS = 5


def _lower_thread_priority() -> None:
    """On Linux, lower the calling thread's CPU priority (its own nice level: Linux threads are tasks) by
    ``GRAMMAR_THREAD_NICENESS``, so that on a machine with few cores the model's threads are preferred while a
    grammar compiles (on 2 cores a compile beside a step slows the step down: the model's thread pool then shares
    the cores with it; docs/serving.md). Elsewhere (or when the system refuses), the thread keeps its priority."""
    if sys.platform != "linux":
        return
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + GRAMMAR_THREAD_NICENESS)
    except OSError:
        pass


@dataclass(frozen=True)
class PendingRequest:
    """A request added with ``Engine.submit``: its id, and ``ready``, a Future holding the id once its constraints
    are compiled and it has joined the queue, or the ValueError of a grammar that cannot compile."""

    request_id: str
    ready: Future[str]


@dataclass(frozen=True)
class _NewRequest:
    """A checked request, before its sequences and constraints are made."""

    request_id: str
    prompt_token_ids: list[int]
    config: GenerationConfig
    limit: int  # tokens each sequence may grow to (prompt and output)
    jump_forward: bool
    stats: RequestStats
    arrival: int


class _Placement:
    """A sequence's place in the model before a step (its KV bookkeeping), to put it back if the step fails."""

    def __init__(self, seq: GeneratedSequence) -> None:
        self.seq = seq
        self.kv = seq.kv_snapshot()

    def restore(self, model: Runner) -> None:
        self.seq.restore_kv(model, self.kv)
