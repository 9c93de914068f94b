"""EngineCore: the engine's state and its step, single-threaded: only the thread driving the engine calls it.

It owns the scheduler (the waiting queue, the running sequences, their model slots, the prefix cache), the model
step, the processor and sampler, the requests whose grammar compiles, and the statistics; it takes no lock, since
one thread at a time drives it (``core_loop.py``: other threads queue commands that the driving thread runs between
steps). One ``step()``::

    plan = scheduler.schedule(budget, deltas, propose_drafts)   # what the forward feeds, sequences placed
    step = step_runner.run(plan)                                # the model runs it: rows, Batch, logits
    tokens = process(processor, sampler, step.batch, step.logits)
    scheduler.commit(step, tokens, deltas)                      # each row's token to its sequence
    scheduler.retire()                                          # (after jump-forward) finished sequences leave

Whatever fails inside a step (a constraint, the runner, the detokenizer) ends only the requests it concerns, with
finish reason "error": when the step's batch fails, its state is put back, each request is run alone, and those
that fail alone end (``Output.error`` says why).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from logitproc.runtime import LogitProcessor, Sampler

from .commit import jump_forward
from .model_step import ModelStep, StepRunner
from .outputs import Delta, EngineStats
from .processing import process
from .runner import Runner
from .scheduler import Scheduler, StepBudget, StepPlan
from .sequence import Deltas, GeneratedSequence, Request, delta_of
from .speculation import Candidate, Drafter, SpeculationPlanner, SpeculativeConfig
from .step_stats import account_step
from .step_threads import StepThreads

#: How much lower the grammar thread's CPU priority is than the engine's (Linux nice levels).
GRAMMAR_THREAD_NICENESS = 5


class EngineCore:
    """The engine's state and step (not thread-safe: the driving thread's only; ``Engine`` is the way in)."""

    def __init__(self, model: Runner, scheduler: Scheduler, processor: LogitProcessor, sampler: Sampler,
                 stats: EngineStats, budget: StepBudget, speculative: SpeculativeConfig | None,
                 jump_forward: bool) -> None:
        self.model = model
        self.scheduler = scheduler
        self.processor = processor
        self.sampler = sampler
        self.stats = stats
        self.budget = budget
        self.speculative = speculative
        self.jump_forward = jump_forward
        self.context_length = int(model.context_length)
        self.step_runner = StepRunner(model, processor)
        self._planner = SpeculationPlanner(speculative) if speculative is not None else None
        self._compiling: dict[str, bool] = {}  # requests whose grammar compiles (id -> aborted meanwhile)
        self._grammar_pool: ThreadPoolExecutor | None = None
        self._step_threads = StepThreads()

    # ---------------------------------------------------------------------------------------------- requests
    def add(self, request: Request) -> None:
        """The request joins the queue (its id must be free)."""
        if request.request_id in self._compiling:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.scheduler.add(request)

    def start_compiling(self, request_id: str, build: Callable[[], None]) -> None:
        """The request waits in the compiling state while ``build`` (which ends by queueing ``compiled``) runs on
        the grammar thread; its id must be free."""
        if request_id in self._compiling or not self.scheduler.is_done(request_id):
            raise ValueError(f"request id {request_id!r} is already in use")
        self._compiling[request_id] = False  # not aborted
        if self._grammar_pool is None:
            self._grammar_pool = ThreadPoolExecutor(1, thread_name_prefix="logitproc-grammar",
                                                    initializer=_lower_thread_priority)
        self._grammar_pool.submit(build)

    def compiled(self, request_id: str, request: Request | None, error: BaseException | None,
                 ready: Future[str]) -> None:
        """A compile ended: the request joins the queue (ending with "abort" at the next step if it was aborted
        meanwhile) and ``ready`` holds its id, or ``ready`` holds the compile's ``error`` and it never runs (nor
        does one whose ``ready`` was cancelled)."""
        aborted = self._compiling.pop(request_id)
        if ready.cancelled():  # nobody waits for it any more: it never runs
            return
        if request is None:
            ready.set_exception(error if error is not None else RuntimeError("the grammar compile gave nothing"))
            return
        self.scheduler.add(request)
        if aborted:
            self.scheduler.abort(request_id)
        ready.set_result(request_id)

    def abort(self, request_id: str) -> None:
        """The request ends with "abort" at the next step (a compiling one: at the first step after its compile)."""
        if request_id in self._compiling:
            self._compiling[request_id] = True
            return
        self.scheduler.abort(request_id)

    # ---------------------------------------------------------------------------------------------- questions
    @property
    def num_compiling(self) -> int:
        return len(self._compiling)

    def has_unfinished(self) -> bool:
        return bool(self._compiling) or self.scheduler.has_unfinished()

    def has_runnable(self) -> bool:
        return self.scheduler.has_unfinished()

    def only_compiling(self) -> bool:
        """Nothing to step but requests whose grammar compiles."""
        return bool(self._compiling) and not self.scheduler.has_unfinished()

    def is_done(self, request_id: str) -> bool:
        """Whether the request has ended (or was never added): neither compiling, waiting nor running."""
        return request_id not in self._compiling and self.scheduler.is_done(request_id)

    def prompt_progress(self, request_id: str) -> tuple[int, int] | None:
        if request_id in self._compiling:
            return None
        return self.scheduler.prompt_progress(request_id)

    @property
    def kv_tokens(self) -> int:
        return sum(self.model.sequence_length(s.seq_id) for s in self.scheduler.running if s.in_model)

    # ---------------------------------------------------------------------------------------------- the step
    def step(self) -> list[Delta]:
        """One step: ``schedule`` -> ``run`` -> ``sample`` -> ``commit`` (in ``_forward``), then jump-forward and the
        finished sequences' retirement; the deltas of every request it touched."""
        started = time.perf_counter()
        deltas: Deltas = {}
        # while a grammar compiles on its thread, it has a core: the kernels use the others (step_threads.py)
        self._step_threads.use(beside_other_work=bool(self._compiling))
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


class _Placement:
    """A sequence's place in the model before a step (its KV bookkeeping), to put it back if the step fails."""

    def __init__(self, seq: GeneratedSequence) -> None:
        self.seq = seq
        self.kv = seq.kv_snapshot()

    def restore(self, model: Runner) -> None:
        self.seq.restore_kv(model, self.kv)
