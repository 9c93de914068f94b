"""Engine: continuous batching of generation requests over one model runner; ``step()`` runs one step of them.

The engine's state and its step are the ``EngineCore`` (``engine_core.py``: schedule -> run -> process -> commit),
single-threaded; this class is the way in from any thread. It checks and builds requests on the caller's thread
(tokenizing, the grammar compile of ``add_request``), and everything that touches the core goes through its
``CoreLoop`` (``core_loop.py``): a command queued there runs on the thread driving the core, between steps, and at
most one thread drives at a time. There is no engine thread: a caller that finds no thread driving drives itself
(``add_request`` then queues its request on its own thread; ``step()``, or a ``stream``/``generate`` waiting for its
deltas, runs the next step), so in-process use needs no thread of its own. The server's ``EngineLoop`` thread drives
for the engine's life instead (``driving()``), stepping and running every command queued from other threads
(``post``; ``run_commands``).

Requests join (``add_request``, or ``submit``: its grammar compiled on the engine's grammar thread while the steps
go on) and leave (finish or ``abort``) between steps; everything about a bad request is checked in ``add_request``
(a ValueError there; with ``submit``, a grammar that cannot compile fails the request's ``ready`` Future). Whatever
still fails inside a step ends only the requests it concerns, with finish reason "error" (``engine_core.py``).

Threads: every method may be called from any number of threads. One step runs at a time (``step`` waits for a step
running on another thread and returns its deltas); ``stream`` and ``generate`` have no stepping thread of their own:
whichever waiting caller finds no thread driving runs the next step, and each step's deltas go to the stream of their
request, so every caller sees exactly its own deltas. ``step()`` returns the deltas of the requests added with
``add_request``, including those of steps that a ``stream``/``generate`` caller ran in the meantime.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

from logitproc.runtime import GenerationConfig, LogitProcessor, RequestState, Sampler, TokenMaskSource
from logitproc.runtime.answer_check import load_checker
from logitproc.runtime.constraints import ConstraintFactory
from logitproc.runtime.field_error import FieldTypeError, FieldValueError
from logitproc.runtime.grammar import GrammarBackend
from logitproc.runtime.tree_decode import TreeDecodeConfig

from .core_loop import CoreLoop
from .engine_core import EngineCore
from .first_masks import make_first_masks
from .outputs import Delta, EngineStats, Output, RequestStats
from .prefix_cache import PrefixCache
from .prompt_tokens import prompt_token_ids
from .runner import Runner
from .scheduler import Scheduler, StepBudget
from .sequence import GeneratedSequence, Request
from .speculation import SpeculativeConfig

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
        #: The waiting queue, the running sequences and the KV cache: the core's, read it between steps only.
        self.scheduler = Scheduler(model, self.max_batch, self.max_total_tokens, self.stats, cache)
        # The state and the step, single-threaded: touched only by the thread driving it, through the loop.
        self._core = EngineCore(model, self.scheduler, self.processor, self.sampler, self.stats, self.budget,
                                self.speculative, self.jump_forward)
        self.step_runner = self._core.step_runner
        self._loop = CoreLoop()
        # made on first use (two threads asking at once may each make one: they are equivalent, one is kept)
        self._constraints: ConstraintFactory | None = None
        # request ids and arrival order (the latest-arrived request is preempted first); next() on a count is
        # atomic, so any thread takes the next one
        self._ids = itertools.count()
        self._arrivals = itertools.count()

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
        self._loop.call(lambda: self._join(request, watch))
        return request.request_id

    def _join(self, request: Request, watch: bool) -> None:
        """(Driving) the request joins the queue, and with ``watch`` its inbox opens in the same command: no step
        sees it before its inbox exists."""
        self._core.add(request)
        if watch:
            self._loop.watch(request.request_id)

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
            request = self._build(new)
            self._loop.call(lambda: self._join(request, watch=False))
            ready.set_result(new.request_id)
            return PendingRequest(new.request_id, ready)
        self._loop.call(lambda: self._core.start_compiling(new.request_id, lambda: self._compile(new, ready)))
        return PendingRequest(new.request_id, ready)

    def _compile(self, new: _NewRequest, ready: Future[str]) -> None:
        """On the grammar thread: build the request (compiling its grammar); the loop then queues it, or fails
        ``ready`` (``EngineCore.compiled``)."""
        request, error = None, None
        try:
            request = self._build(new)
        except BaseException as err:  # the request's ready Future holds it
            error = err
        self._loop.post(lambda: self._core.compiled(new.request_id, request, error, ready))

    @property
    def num_compiling(self) -> int:
        """Requests added with ``submit`` whose constraints are compiling."""
        return self._loop.call(lambda: self._core.num_compiling)

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
        factory = self._constraints
        if factory is None:
            factory = ConstraintFactory(self.model.tokenizer, self.vocab_size, self.eos_token_ids,
                                        backend=self.grammar_backend, tree_decode=self.tree_decode)
            self._constraints = factory
        return factory

    def abort(self, request_id: str) -> None:
        """Cancel a request (safe from another thread; not from a signal handler, which should set a flag that the
        stepping loop turns into ``abort``); it ends with "abort" at the next step (one compiling: at the first step
        after its compile). Returns at once: the abort is queued for the thread driving the engine."""
        self._loop.post(lambda: self._core.abort(request_id))

    def has_unfinished(self) -> bool:
        """Whether any request has not ended (compiling ones included)."""
        return self._loop.call(self._core.has_unfinished)

    def is_done(self, request_id: str) -> bool:
        """Whether the request has ended (or was never added): neither compiling, waiting nor running."""
        return self._loop.call(lambda: self._core.is_done(request_id))

    def prompt_progress(self, request_id: str) -> tuple[int, int] | None:
        """(prompt tokens prefilled, prompt tokens) while the request's prompt is going in (by chunks of the step's
        token budget); None once it decodes or ended (a compiling request: nothing in yet)."""
        return self._loop.call(lambda: self._core.prompt_progress(request_id))

    def has_runnable(self) -> bool:
        """Whether a step has something to do now: requests waiting, running or aborted (not compiling ones)."""
        return self._loop.call(self._core.has_runnable)

    @property
    def kv_tokens(self) -> int:
        """KV cache tokens held by running sequences (waits for a running step)."""
        return self._loop.call(lambda: self._core.kv_tokens)

    @property
    def prefix_cache_tokens(self) -> int:
        """KV cache tokens kept for prefix reuse (freed LRU when running sequences need the room)."""
        return self._loop.call(lambda: self.scheduler.cached_tokens)

    def clear_prefix_cache(self) -> None:
        """Free the KV cache kept for prefix reuse (waits for a running step)."""
        self._loop.call(self.scheduler.clear_prefix_cache)

    @property
    def num_running(self) -> int:
        return self._loop.call(lambda: len(self.scheduler.running))

    # ---------------------------------------------------------------------------------------------- stepping
    def step(self) -> list[Delta]:
        """Admit, prefill, decode, process and sample once; return the deltas of the requests added with
        ``add_request`` (this step's, after those of steps that ``stream``/``generate`` callers ran since the last
        ``step()``). While another thread runs a step, waits for it and returns its deltas instead of running one
        more (so a ``step()`` caller is never starved by busy streams). Inside ``driving()``, steps at once."""
        if self._loop.driving:
            self._turn_held()
        elif self._loop.drive_unless(self._loop.step_ran_since(self._loop.steps)):
            self._turn()
        return self._loop.take_unclaimed()

    def _turn(self) -> None:
        """(Driving) ``_turn_held``, then the drive given up (even on an exception)."""
        try:
            self._turn_held()
        finally:
            self._loop.release()

    def _turn_held(self) -> None:
        """(Driving) one turn of the loop: the queued commands; with nothing to step but grammars compiling, wait
        for one to join (or fail); one step, its deltas handed out."""
        self._loop.run_commands()
        while self._core.only_compiling():
            self._loop.wait_for_command()
            self._loop.run_commands()
        deltas = self._core.step()
        self._loop.deliver(deltas, self._core.is_done)

    @contextmanager
    def driving(self) -> Iterator[None]:
        """Drive the engine on this thread for the ``with`` block (once no other thread drives it): the commands
        other threads queue meanwhile (``submit``, ``abort``, ``post``, every question) run here, in ``step()`` and
        ``run_commands()``, and nowhere else; when the block ends, those left run and the drive is given up. The
        server's loop (``engine_loop.py``) drives so for the engine's life: then its thread is the only one that
        ever touches the engine's state."""
        self._loop.take_drive()
        try:
            yield
        finally:
            self._loop.release()

    def run_commands(self, wait: bool = False) -> None:
        """(Inside ``driving()``) run the commands queued for the engine; with ``wait``, first wait for one when
        none is queued (a request joining, a grammar compiled, ``post``)."""
        if not self._loop.driving:
            raise RuntimeError("run_commands is for the thread driving the engine (inside Engine.driving())")
        if wait:
            self._loop.wait_for_command()
        self._loop.run_commands()

    def post(self, command: Callable[[], None]) -> None:
        """Queue ``command`` (it must not raise) to run on the thread driving the engine, between steps, in the
        order queued; returns at once (with no thread driving, this one runs it now). Inside the command, every
        engine method answers at once."""
        self._loop.post(command)

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
        finished = 0
        try:
            while finished < config.n:
                for delta in self._wait_for(rid):
                    finished += delta.finish_reason is not None
                    yield delta
        finally:
            self._loop.close(rid)  # deltas still to come are dropped
            if finished < config.n:  # closed early or failed: abort, and free its slots now if nobody is stepping
                self.abort(rid)
                if self._loop.try_drive():
                    self._turn()
            self._loop.post(lambda: self._forget_if_done(rid))  # (not waiting for a step running elsewhere)

    def _forget_if_done(self, request_id: str) -> None:
        """(Driving) a closed stream's inbox goes once its request has ended (else with the step that ends it)."""
        if self._core.is_done(request_id):
            self._loop.forget(request_id)

    def _wait_for(self, rid: str) -> list[Delta]:
        """The request's next deltas: those in its inbox, else those of the next step (run here when no other
        thread is driving)."""
        while True:
            if not self._loop.drive_unless(lambda: self._loop.inbox_ready(rid)):
                return self._loop.take(rid)
            if self._core.is_done(rid):
                self._loop.release()
                raise RuntimeError(f"request {rid!r} ended without a final delta")  # never expected
            self._turn()

    def generate(self, prompt: Prompt, config: GenerationConfig | None = None, *,
                 chat: bool | None = None) -> list[Output]:
        """Run one request to the end; its outputs, one per sequence (``config.n``), in order."""
        outputs: dict[int, Output] = {}
        for delta in self.stream(prompt, config, chat=chat):
            if delta.output is not None:
                outputs[delta.index] = delta.output
        return [outputs[i] for i in sorted(outputs)]


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
