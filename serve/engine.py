"""Engine: continuous batching over a model runner, with the compiled logit processor and sampler.

One ``step()``::

    preempt: when the running sequences' next forward would overflow the KV cache, the latest-arrived request is
             preempted: its KV cache is freed and it goes back to the front of the queue, to be prefilled again
             (prompt + output so far, its state untouched) when there is room: recomputation, as vLLM does
    admit waiting requests while sequence slots and KV cache are free (FIFO; a request needs its prompt's tokens
             for each of its n sequences, plus a margin of one token per running sequence)
    prefill: new requests' prompts, and sequences that a jump-forward left with several tokens to feed
    fork:    a request with n > 1 prefills once, then forks its other sequences from the first
    decode:  every other running sequence feeds its last sampled token, all in one batch
    process: LogitProcessor.inplace_update_logits -> compute_probs_from_logits -> Sampler.renormalize -> sample,
             once over every row (each row with its own request's config; temperature 0 is greedy)
    commit:  append each token to its state; text deltas (UTF-8 safe, stop strings held back); finish rules
    jump:    (jump_forward=True) tokens the constraints force are appended without a decode step each

Requests join (``add_request``) and leave (finish or ``abort``) between steps; everything about a bad request is
checked in ``add_request`` (a ValueError there), so it never disturbs the others.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
from logitproc.runtime import GenerationConfig, LogitProcessor, RequestState, Sampler, empty_aligned

from .outputs import Delta, EngineStats, Output, RequestStats
from .sequence import GeneratedSequence, Request

Prompt = str | Sequence[int] | Sequence[Mapping[str, str]]


@dataclass
class _StepInfo:
    """What one step's forward pass did: the rows to sample (in order), their logits, and the model timings."""

    rows: list[GeneratedSequence] = field(default_factory=list)
    logits: Any = None
    started: set[str] = field(default_factory=set)  # requests prefilled for the first time
    prefill_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_tokens: int = 0
    decode_seconds: float = 0.0


class Engine:
    """Serves generation requests on one model runner (``CompiledModel`` or ``NumpyRunner``).

    ``max_batch`` bounds the sequences running at once (and the rows of one processing call);
    ``jump_forward`` appends the tokens that grammar constraints force without a decode step each;
    ``grammar_backend`` names the constraint backend used for ``response_format`` and thinking budgets.
    """

    def __init__(self, model: Any, max_batch: int = 8, jump_forward: bool = False,
                 grammar_backend: str = "llguidance", device: str = "cpu", tree_decode: Any = None) -> None:
        if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
            raise ValueError(f"max_batch must be an int >= 1, got {max_batch!r}")
        self.model = model
        self.max_batch = min(max_batch, int(getattr(model, "max_num_sequences", max_batch)))
        self.jump_forward = bool(jump_forward)
        self.grammar_backend = grammar_backend
        #: A TreeDecodeConfig constraining every sequence (``--tree-decode-config``), or None.
        self.tree_decode = tree_decode
        self.vocab_size = int(model.vocab_size)
        self.context_length = int(model.context_length)
        self.eos_token_ids = tuple(int(t) for t in model.eos_token_ids)
        self.max_total_tokens = int(getattr(model, "max_total_tokens", self.max_batch * self.context_length))
        self.processor = LogitProcessor(model.kernel_library, self.vocab_size, self.max_batch, device=device)
        self.sampler = Sampler(model.kernel_library, self.vocab_size, device=device, max_num_token=self.max_batch)
        self.stats = EngineStats()
        self._constraints: Any = None
        self._lock = threading.Lock()
        self._waiting: deque[Request] = deque()
        self._aborts: set[str] = set()
        self._requests: dict[str, Request] = {}
        self._running: list[GeneratedSequence] = []
        self._free_ids = list(range(self.max_batch - 1, -1, -1))
        self._ids = itertools.count()
        self._arrivals = itertools.count()  # arrival order: the latest-arrived request is preempted first

    # ---------------------------------------------------------------------------------------------- requests
    def tokenize(self, prompt: Prompt, chat: bool | None = None) -> list[int]:
        """Token ids of a prompt: text, token ids, or chat messages (rendered with the model's chat template)."""
        if isinstance(prompt, str):
            if chat:
                prompt = [{"role": "user", "content": prompt}]
            else:
                return list(self.model.tokenizer.encode(prompt, add_special_tokens=False).ids)
        items = list(prompt)
        if items and all(isinstance(m, Mapping) for m in items):
            for m in items:
                if not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                    raise ValueError(f"chat messages need string 'role' and 'content', got {dict(m)!r}")
            text = self.model.apply_chat_template(items, add_generation_prompt=True)
            return list(self.model.tokenizer.encode(text, add_special_tokens=False).ids)
        ids = []
        for t in items:
            if isinstance(t, bool) or not isinstance(t, (int, np.integer)):
                raise ValueError(f"a prompt is text, token ids or chat messages; got an item {t!r}")
            if not 0 <= t < self.vocab_size:
                raise ValueError(f"prompt token id {t} is outside the vocabulary [0, {self.vocab_size})")
            ids.append(int(t))
        return ids

    def add_request(self, prompt: Prompt, config: GenerationConfig | None = None, *, chat: bool | None = None,
                    request_id: str | None = None) -> str:
        """Queue a request; it starts at the next ``step()``. Returns its id.

        ``prompt`` is text, token ids, or chat messages (``[{"role": ..., "content": ...}]``, rendered with the
        model's chat template; ``chat=True`` wraps a text prompt as one user message). Raises ValueError (or
        TypeError) for anything wrong with the request: empty prompt, token ids outside the vocabulary, a prompt
        that leaves no room in the context, more sequences than ``max_batch``, logit_bias ids outside the
        vocabulary, a schema/regex/grammar the constraint backend cannot compile.
        """
        config = GenerationConfig() if config is None else config
        if not isinstance(config, GenerationConfig):
            raise TypeError(f"config must be a GenerationConfig, got {type(config).__name__}")
        ids = self.tokenize(prompt, chat)
        if not ids:
            raise ValueError("the prompt is empty")
        if config.n > self.max_batch:
            raise ValueError(f"n={config.n} sequences do not fit in max_batch={self.max_batch}")
        config.check_vocab(self.vocab_size)
        if config.max_thinking_tokens is not None:  # generation starts inside the think block
            ids = self._constraint_factory().open_think_block(ids, config)
        # Each sequence may grow to `limit` tokens: the context, or its share of the KV cache when n > 1.
        limit = min(self.context_length, self.max_total_tokens // config.n)
        if len(ids) >= limit:
            raise ValueError(f"the prompt has {len(ids)} tokens; the context holds {limit} per sequence "
                             "(prompt and output together)")
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        request = Request(rid, ids, RequestStats(prompt_tokens=len(ids), arrival=time.perf_counter()),
                          next(self._arrivals))
        for index in range(config.n):
            cfg = config
            if config.n > 1 and config.seed is not None:  # each sequence its own stream, reproducibly
                cfg = replace(config, seed=(config.seed + index) % 2**64)
            state = RequestState(ids, cfg, mask_sources=self._mask_sources(cfg))
            seq = GeneratedSequence(request, index, state, self.model.tokenizer, self.eos_token_ids, limit)
            if index > 0:  # prefilled once, then forked from the first sequence
                seq.forked_from = request.sequences[0]
            request.sequences.append(seq)
        with self._lock:
            if rid in self._requests or any(r.request_id == rid for r in self._waiting):
                raise ValueError(f"request id {rid!r} is already in use")
            self._waiting.append(request)
        return rid

    def _mask_sources(self, config: GenerationConfig) -> list[Any]:
        """Constraint sources for one sequence (a grammar, a think budget), made fresh per sequence."""
        if not config.needs_mask_sources and self.tree_decode is None:
            return []
        return list(self._constraint_factory().sources_for(config))

    def _constraint_factory(self) -> Any:
        """The ConstraintFactory for this model, made on first use (the grammar backend reads the tokenizer)."""
        if self._constraints is None:
            from logitproc.runtime.constraints import ConstraintFactory

            self._constraints = ConstraintFactory(self.model.tokenizer, self.vocab_size, self.eos_token_ids,
                                                  backend=self.grammar_backend, tree_decode=self.tree_decode)
        return self._constraints

    def abort(self, request_id: str) -> None:
        """Cancel a request (safe from another thread; not from a signal handler, which should set a flag that the
        stepping loop turns into ``abort``); it ends with "abort" at the next step."""
        with self._lock:
            self._aborts.add(request_id)

    def has_unfinished(self) -> bool:
        with self._lock:
            return bool(self._waiting or self._running or self._aborts)

    @property
    def num_running(self) -> int:
        return len(self._running)

    # ---------------------------------------------------------------------------------------------- stepping
    def step(self) -> list[Delta]:
        """Admit, prefill, decode, process and sample once; return each sequence's delta for this step."""
        started = time.perf_counter()
        deltas: dict[GeneratedSequence, Delta] = {}
        self._handle_aborts(deltas)
        self._retire(deltas)  # aborted sequences leave the KV cache before room is counted
        self._make_room()
        self._admit()
        step = self._forward()
        processing_s = 0.0
        if step.rows:
            t0 = time.perf_counter()
            result = self._sample(step.logits, [s.state for s in step.rows])
            processing_s = time.perf_counter() - t0
            for r, seq in enumerate(step.rows):
                delta = deltas.setdefault(seq, Delta(seq.request_id, seq.index))
                self._commit(seq, result, r, delta)
        if self.jump_forward:
            self._jump_forward(deltas)
        self._retire(deltas)
        elapsed = time.perf_counter() - started
        self._account(step, processing_s, elapsed)
        return [d for d in deltas.values() if d.text or d.token_ids or d.rollback or d.finish_reason]

    def _handle_aborts(self, deltas: dict[GeneratedSequence, Delta]) -> None:
        with self._lock:
            aborts, self._aborts = self._aborts, set()
            waiting = [r for r in self._waiting if r.request_id in aborts]
            for r in waiting:
                self._waiting.remove(r)
        for request in waiting + [self._requests[a] for a in aborts if a in self._requests]:
            for seq in request.sequences:
                if seq.finish_reason is None:
                    seq.finish("abort", deltas.setdefault(seq, Delta(seq.request_id, seq.index)))
            request.stats.finish_time = time.perf_counter()

    def _kv_needed(self) -> int:
        """KV cache tokens the running sequences hold once the next forward has fed them."""
        return sum(s.kv_need for s in self._running if s.finish_reason is None)

    def _make_room(self) -> None:
        """Preempt the latest-arrived running requests until the next forward fits in the KV cache."""
        while self._kv_needed() > self.max_total_tokens:
            live = {s.request.request_id: s.request for s in self._running if s.finish_reason is None}
            if len(live) < 2:  # cannot happen: a request alone always fits (its sequences stop at `limit`)
                raise RuntimeError(f"one request needs {self._kv_needed()} KV tokens of {self.max_total_tokens}")
            self._preempt(max(live.values(), key=lambda r: r.arrival_order))

    def _preempt(self, request: Request) -> None:
        """Free the request's KV cache and slots; it waits at the front of the queue to be prefilled again."""
        for seq in request.sequences:
            if seq.finish_reason is not None or seq.seq_id is None:
                continue  # finished (aborted this step) sequences are freed by _retire
            if seq.in_model:
                self.model.remove_sequence(seq.seq_id)
                seq.in_model = False
            self._free_ids.append(seq.seq_id)
            seq.seq_id = None
            state = seq.state
            seq.feed, seq.kv_len, seq.forked_from = state.prompt_token_ids + state.output_token_ids, 0, None
        self._running = [s for s in self._running if s.request is not request or s.finish_reason is not None]
        request.stats.preemptions += 1
        self.stats.preemptions += 1
        with self._lock:  # never seen as finished from another thread: it moves to the queue in one go
            del self._requests[request.request_id]
            self._waiting.appendleft(request)

    def _admit(self) -> None:
        """Admit waiting requests in order while their sequences get slots and their prompts fit in the KV cache
        with a margin of one token per running sequence (with nothing running, the next request always fits)."""
        used = self._kv_needed()
        running = sum(1 for s in self._running if s.finish_reason is None)
        with self._lock:
            while self._waiting:
                request = self._waiting[0]
                live = [s for s in request.sequences if s.finish_reason is None]
                need = sum(s.kv_need for s in live)
                if len(live) > len(self._free_ids) or (
                        running and used + need + running + len(live) > self.max_total_tokens):
                    break
                self._waiting.popleft()
                used, running = used + need, running + len(live)
                self._requests[request.request_id] = request
                for seq in live:
                    seq.seq_id = self._free_ids.pop()
                    self._running.append(seq)

    def _forward(self) -> _StepInfo:
        """Run the model: prefill (with forks), then decode. Returns the rows in order and their logits."""
        model, step = self.model, _StepInfo()
        live = [s for s in self._running if s.finish_reason is None]
        prefill = [s for s in live if s.forked_from is None and (len(s.feed) > 1 or not s.in_model)]
        decode = [s for s in live if s.in_model and len(s.feed) == 1]
        order = [r for s in prefill for r in [s, *(c for c in s.request.sequences if c.forked_from is s)]] + decode
        if any(s.state.mask_sources for s in order):  # grammar masks fill on worker threads during the forward
            self.processor.start_masks([s.state for s in order])
        blocks: list[np.ndarray] = []
        if prefill:
            for seq in prefill:
                if not seq.in_model:
                    model.add_sequence(seq.seq_id)
                    seq.in_model = True
                    step.started.add(seq.request_id)
            t0 = time.perf_counter()
            out = np.asarray(model.prefill([s.seq_id for s in prefill], [s.feed for s in prefill]))
            step.prefill_seconds = time.perf_counter() - t0
            for i, seq in enumerate(prefill):
                step.prefill_tokens += len(seq.feed)
                seq.kv_len += len(seq.feed)
                seq.feed = []
                step.rows.append(seq)
                blocks.append(out[i : i + 1])
                for child in [c for c in seq.request.sequences if c.forked_from is seq]:
                    model.fork_sequence(seq.seq_id, child.seq_id)
                    child.in_model, child.kv_len, child.forked_from = True, seq.kv_len, None
                    step.rows.append(child)
                    blocks.append(out[i : i + 1])
        if decode:
            t0 = time.perf_counter()
            out = np.asarray(model.decode([s.seq_id for s in decode], [s.feed[0] for s in decode]))
            step.decode_seconds = time.perf_counter() - t0
            step.decode_tokens = len(decode)
            for seq in decode:
                seq.kv_len += 1
                seq.feed = []
            step.rows.extend(decode)
            blocks.append(out)
        if step.rows:
            step.logits = empty_aligned((len(step.rows), self.vocab_size))
            np.concatenate(blocks, axis=0, out=step.logits)
        return step

    def _sample(self, logits: np.ndarray, states: list[RequestState]) -> Any:
        raw = logits.copy() if any(s.config.logprobs and s.config.logprobs_mode == "raw" for s in states) else None
        self.processor.inplace_update_logits(logits, states)
        probs = self.processor.compute_probs_from_logits(logits, states)
        probs = self.sampler.renormalize(probs, states)
        return self.sampler.sample(probs, states, raw_logits=raw)

    def _commit(self, seq: GeneratedSequence, result: Any, row: int, delta: Delta) -> None:
        stats = seq.request.stats
        if stats.first_token_time is None:
            stats.first_token_time = time.perf_counter()
        if result.no_valid_token[row]:
            error = seq.state.constraint_error
            seq.finish("error" if error else "grammar_dead_end", delta, error=error)
            return
        token = int(result.token_ids[row])
        if token not in seq.stop_token_ids:  # a stop token ends the sequence: its state is not advanced
            try:
                seq.state.append_token(token)
            except Exception as err:  # a constraint refusing the token ends this sequence, not the step
                seq.finish("error", delta, error=f"{type(err).__name__}: {err}")
                return
            seq.feed = [token]
        stats.completion_tokens += 1
        if seq.logprobs is not None:
            seq.logprobs.append(float(result.logprobs[row]))
            delta.logprobs = (delta.logprobs or []) + [float(result.logprobs[row])]
        if seq.top_logprobs is not None:
            top = result.top_logprobs[row] or []
            seq.top_logprobs.append(top)
            delta.top_logprobs = (delta.top_logprobs or []) + [top]
        seq.commit(token, delta)

    def _jump_forward(self, deltas: dict[GeneratedSequence, Delta]) -> None:
        """Append the tokens the constraints force; make the KV cache agree with the re-tokenized state."""
        for seq in self._running:
            if seq.finish_reason is not None or not seq.state.mask_sources or len(seq.feed) != 1:
                continue
            try:
                forced = self.processor.jump_forward(seq.state)
            except Exception as err:  # this sequence's constraint failed: it ends, the others go on
                seq.finish("error", deltas.setdefault(seq, Delta(seq.request_id, seq.index)),
                           error=f"{type(err).__name__}: {err}")
                continue
            if forced is None or (not forced.rollback and not forced.token_ids):
                continue
            delta = deltas.setdefault(seq, Delta(seq.request_id, seq.index))
            state = seq.state
            unchanged = state.num_tokens - len(forced.token_ids)
            if seq.kv_len > unchanged:
                self.model.popn(seq.seq_id, seq.kv_len - unchanged)
                seq.kv_len = unchanged
            prompt_len = len(state.prompt_token_ids)
            seq.feed = list(state.output_token_ids[seq.kv_len - prompt_len :])
            if not seq.feed:  # rolled back to a point already in the cache: feed its last token again
                self.model.popn(seq.seq_id, 1)
                seq.kv_len -= 1
                seq.feed = [(state.prompt_token_ids + state.output_token_ids)[seq.kv_len]]
            before = len(seq.token_ids)
            seq.rollback(forced.rollback, delta)
            for token in forced.token_ids:
                seq.commit(int(token), delta)
                if seq.finish_reason is not None:
                    break
            seq.request.stats.completion_tokens += len(seq.token_ids) - before
            seq.request.stats.jump_forward_tokens += len(forced.token_ids)
            self.stats.jump_forward_tokens += len(forced.token_ids)
            self.stats.jump_forward_steps_saved += max(len(forced.token_ids) - forced.rollback, 0)

    def _retire(self, deltas: dict[GeneratedSequence, Delta]) -> None:
        """Free the model slots of finished sequences; forget finished requests."""
        keep = []
        for seq in self._running:
            if seq.finish_reason is None:
                keep.append(seq)
                continue
            if seq.in_model:
                self.model.remove_sequence(seq.seq_id)
                seq.in_model = False
            self._free_ids.append(seq.seq_id)
            seq.seq_id = None
        self._running = keep
        for rid in [rid for rid, r in self._requests.items() if r.finished]:
            request = self._requests.pop(rid)
            if request.stats.finish_time is None:
                request.stats.finish_time = time.perf_counter()
            for seq in request.sequences:  # a finished request's outputs carry its final statistics
                if seq in deltas and deltas[seq].output is not None:
                    deltas[seq].output = seq.output()

    def _account(self, step: _StepInfo, processing_s: float, elapsed: float) -> None:
        st = self.stats
        if not step.rows:
            return
        st.steps += 1
        st.prefill_tokens += step.prefill_tokens
        st.prefill_seconds += step.prefill_seconds
        st.decode_tokens += step.decode_tokens
        st.decode_seconds += step.decode_seconds
        st.processing_seconds += processing_s
        st.step_seconds += elapsed
        st.sampled_tokens += len(step.rows)
        for request in {id(s.request): s.request for s in step.rows}.values():
            if request.request_id in step.started:
                request.stats.prefill_seconds += step.prefill_seconds
            else:
                request.stats.decode_seconds += step.decode_seconds + step.prefill_seconds
            request.stats.processing_seconds += processing_s
            request.stats.step_seconds += elapsed

    # ---------------------------------------------------------------------------------------------- convenience
    def stream(self, prompt: Prompt, config: GenerationConfig | None = None, *,
               chat: bool | None = None) -> Iterator[Delta]:
        """Add one request and drive the engine until it finishes, yielding its deltas as they come.

        Closing the iterator early (``break``, an exception, Ctrl-C in the consumer) aborts the request. Other
        requests in the engine advance too, but their deltas are not seen here.
        """
        rid = self.add_request(prompt, config, chat=chat)
        done = False
        try:
            while not done:
                for delta in self.step():
                    if delta.request_id == rid:
                        yield delta
                        done = done or self._request_done(rid)
        except GeneratorExit:  # the consumer closed the stream: abort now and free the request's slots
            if not done:
                self.abort(rid)
                self.step()
                done = True
            raise
        finally:
            if not done:  # an exception (the request is aborted at the next step)
                self.abort(rid)

    def _request_done(self, rid: str) -> bool:
        with self._lock:
            return rid not in self._requests and all(r.request_id != rid for r in self._waiting)

    def generate(self, prompt: Prompt, config: GenerationConfig | None = None, *,
                 chat: bool | None = None) -> list[Output]:
        """Run one request to the end; its outputs, one per sequence (``config.n``), in order."""
        outputs: dict[int, Output] = {}
        for delta in self.stream(prompt, config, chat=chat):
            if delta.output is not None:
                outputs[delta.index] = delta.output
        return [outputs[i] for i in sorted(outputs)]
