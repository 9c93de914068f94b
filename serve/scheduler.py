"""Scheduling: which requests run, admitted in order while sequence slots and KV cache are free, preempted when not.

Requests wait in a FIFO queue. ``admit`` moves them to running while their sequences get model slots and their
prompts fit in the KV cache with a margin of one token per running sequence (with nothing running, the next request
always fits). ``make_room`` preempts the latest-arrived running request while the running sequences' next forward
would overflow the KV cache: its KV cache and slots are freed and it goes back to the front of the queue, to be
prefilled again (prompt + output so far, its state untouched) when there is room: recomputation, as vLLM does.
``retire`` frees the slots of finished sequences and forgets finished requests. Like the rest of the engine core it
is single-threaded: only the thread driving the engine calls it (``core_loop.py``), so it takes no lock.

``plan`` decides what the next forward feeds, within a token budget per step (``StepBudget``: vLLM's
``max_num_batched_tokens``, and a smaller bound on the prefill of a step that also decodes): every decoding
sequence's token first (with its drafts, while they fit), then prefill chunks of the prompts still going in, the
shortest rest first, as many tokens as the budget has left. A prompt longer than that goes in over several steps
(chunked prefill), so a long prompt never holds up the running streams for more than one step's budget.

With a ``PrefixCache``, a finished sequence keeps its KV cache and model slot as a cache entry, and ``place`` starts a
new sequence as a fork of the entry that shares the longest prefix with its tokens, so only the rest is prefilled
(a conversation's earlier turns, a shared system prompt). Entries count against the KV budget and the model's
sequence slots; when either runs short, entries are evicted least recently used before anything is preempted.

A step, seen from here, is two calls: ``schedule`` (aborts, retire, make room, admit, the drafts, ``plan``, and every
sequence that gets its first chunk placed in the model) returns the ``StepPlan``, which the model step carries out
without calling back; ``commit`` then applies the sampled rows to their sequences (``commit.py``).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .commit import commit_row, commit_verified
from .outputs import EngineStats, FinishReason
from .prefix_cache import PrefixCache
from .runner import Runner
from .sequence import Deltas, GeneratedSequence, Request, SequenceStatus, delta_of

if TYPE_CHECKING:
    from logitproc.runtime import SampleResult

    from .model_step import ModelStep

#: ``propose(decoding, room)``: the drafts each decoding sequence checks this step (speculative decoding), given the
#: decoding sequences and the KV cache tokens left once they are fed.
ProposeDrafts = Callable[[list[GeneratedSequence], int], dict[GeneratedSequence, list[int]]]


@dataclass
class StepPlan:
    """What one forward feeds: a chunk of each prefilling sequence's feed (its first ``take`` tokens), the decoding
    sequences' last tokens, and the verifying sequences' last tokens and drafts (speculative decoding)."""

    chunks: list[tuple[GeneratedSequence, int]] = field(default_factory=list)
    decode: list[GeneratedSequence] = field(default_factory=list)
    drafts: dict[GeneratedSequence, list[int]] = field(default_factory=dict)

    @property
    def tokens(self) -> int:
        """Tokens the forward feeds: each chunk, one per decoding sequence, one plus its drafts per verifying one."""
        return (sum(take for _, take in self.chunks) + len(self.decode)
                + sum(1 + len(d) for d in self.drafts.values()))

    def only(self, sequences: Iterable[GeneratedSequence]) -> StepPlan:
        """The part of the plan that concerns ``sequences`` (a request run alone after a failed step)."""
        keep = set(sequences)
        return StepPlan([(s, take) for s, take in self.chunks if s in keep], [s for s in self.decode if s in keep],
                        {s: d for s, d in self.drafts.items() if s in keep})

    def __bool__(self) -> bool:
        return bool(self.chunks or self.decode or self.drafts)


@dataclass(frozen=True)
class StepBudget:
    """The tokens one forward may feed: ``max_tokens`` in all (vLLM's ``max_num_batched_tokens``; None: no bound),
    and at most ``prefill_with_decode`` of them to prefill chunks when the forward also decodes (None: only
    ``max_tokens`` bounds them). Decoding streams wait for the step's prefill: the second bound keeps their gaps
    short, while a step with nothing to decode prefills as fast as ``max_tokens`` allows."""

    max_tokens: int | None = None
    prefill_with_decode: int | None = None

    def prefill_room(self, decode_tokens: int) -> int | None:
        """Prefill tokens left to a forward that decodes ``decode_tokens`` tokens (None: no bound)."""
        rooms = [] if self.max_tokens is None else [self.max_tokens - decode_tokens]
        if decode_tokens and self.prefill_with_decode is not None:
            rooms.append(self.prefill_with_decode)
        return min(rooms) if rooms else None


class Scheduler:
    """The waiting queue, the running sequences, their model slots and the KV cache budget."""

    def __init__(self, model: Runner, max_batch: int, max_total_tokens: int, stats: EngineStats,
                 prefix_cache: PrefixCache | None = None) -> None:
        self.model = model
        self.max_batch = max_batch
        self.max_total_tokens = max_total_tokens
        self.stats = stats
        self.prefix_cache = prefix_cache
        self.waiting: deque[Request] = deque()
        self.requests: dict[str, Request] = {}  # admitted, not yet finished
        self.running: list[GeneratedSequence] = []
        self._aborts: set[str] = set()
        for seq_id in model.sequence_ids:  # the engine owns the model's KV cache: what an earlier engine left goes
            model.remove_sequence(seq_id)
        # Model sequence slots: running sequences take at most max_batch of them, prefix cache entries the rest.
        slots = max(max_batch, int(model.max_num_sequences)) if prefix_cache is not None else max_batch
        self._free_ids = list(range(slots - 1, -1, -1))

    # ---- requests joining and leaving -------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        rid = request.request_id
        if self._known(rid):
            raise ValueError(f"request id {rid!r} is already in use")
        self._aborts.discard(rid)  # an abort left over from an earlier request of that id is not for this one
        self.waiting.append(request)

    def abort(self, request_id: str) -> None:
        """Abort the request (at the next step) if it is waiting or running; otherwise (finished, or not added
        yet) nothing happens."""
        if self._known(request_id):
            self._aborts.add(request_id)

    def _known(self, request_id: str) -> bool:
        return request_id in self.requests or any(r.request_id == request_id for r in self.waiting)

    def prompt_progress(self, request_id: str) -> tuple[int, int] | None:
        """(prompt tokens in the KV cache, prompt tokens) while the request's prompt is going in (waiting included:
        0 in); None once its first sequence decodes, or for a request it does not hold."""
        request = self.requests.get(request_id) or next(
            (r for r in self.waiting if r.request_id == request_id), None)
        if request is None:
            return None
        total = len(request.prompt_token_ids)
        first = request.sequences[0] if request.sequences else None
        if first is None:
            return 0, total
        if first.finish_reason is not None or not first.in_prefill:
            return None
        return min(first.kv_len, total), total

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self._aborts)

    def is_done(self, request_id: str) -> bool:
        return not self._known(request_id)

    # ---- the step ----------------------------------------------------------------------------------------------
    def live(self) -> list[GeneratedSequence]:
        """The running sequences that have not finished."""
        return [s for s in self.running if s.finish_reason is None]

    def handle_aborts(self, deltas: Deltas) -> None:
        """End every sequence of the aborted requests (waiting or running) with "abort"."""
        aborts, self._aborts = self._aborts, set()
        waiting = [r for r in self.waiting if r.request_id in aborts]
        for r in waiting:
            self.waiting.remove(r)
        for request in waiting + [self.requests[a] for a in aborts if a in self.requests]:
            for seq in request.sequences:
                if seq.finish_reason is None:
                    seq.finish(FinishReason.ABORT, delta_of(deltas, seq))
            request.stats.finish_time = time.perf_counter()

    def schedule(self, budget: StepBudget, deltas: Deltas, propose: ProposeDrafts | None = None) -> StepPlan:
        """The next step's plan: aborted requests end (``deltas``), finished sequences leave, room is made (prefix
        cache entries evicted, then the latest requests preempted), waiting requests admitted; ``propose`` gives the
        decoding sequences' drafts; then ``plan`` within ``budget``, and every sequence whose first chunk is planned
        is placed in the model (``place``: a prefix cache fork shortens its chunk to what the cache does not hold).
        A sequence that cannot be placed (the runner refuses) ends its request with "error". The model step then
        only carries the plan out."""
        self.handle_aborts(deltas)
        self.retire()  # aborted sequences leave the KV cache before room is counted
        self.make_room()
        self.admit()
        drafts: dict[GeneratedSequence, list[int]] = {}
        if propose is not None:
            decoding = [s for s in self.live() if s.status is SequenceStatus.DECODING]
            if decoding:
                drafts = propose(decoding, self.max_total_tokens - self.kv_needed() - self.cached_tokens)
        plan = self.plan(budget, drafts)
        chunks = []
        for seq, take in plan.chunks:
            if seq.finish_reason is not None:  # its request failed to place an earlier sequence
                continue
            if not seq.in_model:
                try:
                    self.place(seq)
                except Exception as err:  # the runner refused: this request ends, the others go on
                    for s in seq.request.sequences:
                        s.fail(delta_of(deltas, s), f"{type(err).__name__}: {err}")
                    continue
            chunks.append((seq, min(take, len(seq.feed))))
        plan.chunks = chunks
        return plan

    def commit(self, step: ModelStep, result: SampleResult, deltas: Deltas) -> None:
        """Commit each sampled row of ``step`` to its sequence (``commit.py``): one token, or a verifying
        sequence's rows while they agree with its drafts (the rejected drafts leave the KV cache). A sequence whose
        commit fails (e.g. its detokenizer) ends with "error"; the other rows are committed."""
        assert step.batch is not None
        errors = result.mask_errors
        for seq in step.sequences:
            row = step.batch.first_row[seq.state]
            delta = delta_of(deltas, seq)
            try:
                drafts = step.drafts.get(seq)
                if drafts is None:
                    commit_row(seq, result, row, delta, errors.get(row))
                    continue
                committed, accepted = commit_verified(self.model, seq, result, row, drafts, delta, errors)
                step.verify_committed += committed
                for stats in (seq.request.stats, self.stats):
                    stats.drafts += 1
                    stats.draft_tokens += len(drafts)
                    stats.accepted_draft_tokens += accepted
            except Exception as err:  # e.g. the detokenizer: this sequence ends, the other rows are committed
                seq.fail(delta, f"{type(err).__name__}: {err}")

    def plan(self, budget: StepBudget, drafts: dict[GeneratedSequence, list[int]]) -> StepPlan:
        """The next forward's work within ``budget``: each decoding sequence's token, with its ``drafts`` while they
        fit (the last planned lose theirs first), then prefill chunks with the tokens left, the shortest rest of a
        feed first (a short prompt arriving during a long one is not held up by it; ties in admission order). A
        sequence not in the model yet counts its feed without the prefix a prefix cache entry will give it."""
        live = self.live()
        decoding = [s for s in live if s.status is SequenceStatus.DECODING]
        verify = {s: drafts[s] for s in decoding if drafts.get(s)}
        # (a prefix cache lookup each: once)
        rest = {s: self._feed_to_prefill(s) for s in live if s.status is SequenceStatus.PREFILLING}
        prefilling = sorted(rest, key=rest.__getitem__)
        while verify and budget.max_tokens is not None and (  # drafts give way to a prefill token at least
                len(decoding) + sum(len(d) for d in verify.values()) + bool(prefilling) > budget.max_tokens):
            verify.pop(next(reversed(verify)))
        plan = StepPlan(decode=[s for s in decoding if s not in verify], drafts=verify)
        left = budget.prefill_room(plan.tokens)
        for seq in prefilling:
            if left is not None and left < 1:
                break
            take = rest[seq] if left is None else min(rest[seq], left)
            plan.chunks.append((seq, take))
            if left is not None:
                left -= take
        return plan

    def _feed_to_prefill(self, seq: GeneratedSequence) -> int:
        """The tokens of ``seq``'s feed still to prefill: those that ``place`` will not take from a prefix cache
        entry."""
        if seq.in_model or self.prefix_cache is None or len(seq.feed) < 2:
            return len(seq.feed)
        match = self.prefix_cache.match(seq.feed, limit=len(seq.feed) - 1, touch=False)
        return len(seq.feed) - (0 if match is None else match.length)

    def kv_needed(self) -> int:
        """KV cache tokens the running sequences hold once the next forward has fed them."""
        return sum(s.kv_need for s in self.live())

    @property
    def cached_tokens(self) -> int:
        """KV cache tokens held by prefix cache entries."""
        return self.prefix_cache.num_tokens if self.prefix_cache is not None else 0

    def make_room(self) -> None:
        """Evict prefix cache entries, then preempt the latest-arrived running requests, until the next forward fits
        in the KV cache."""
        while self.cached_tokens and self.kv_needed() + self.cached_tokens > self.max_total_tokens:
            self._evict()
        while self.kv_needed() > self.max_total_tokens:
            live = {s.request.request_id: s.request for s in self.live()}
            if len(live) < 2:  # cannot happen: a request alone always fits (its sequences stop at `limit`)
                raise RuntimeError(f"one request needs {self.kv_needed()} KV tokens of {self.max_total_tokens}")
            self._preempt(max(live.values(), key=lambda r: r.arrival_order))

    def _preempt(self, request: Request) -> None:
        """Free the request's KV cache and slots; it waits at the front of the queue to be prefilled again."""
        for seq in request.sequences:
            if seq.finish_reason is not None or seq.seq_id is None:
                continue  # finished (aborted this step) sequences are freed by retire
            self._free(seq)
            seq.recompute()
        self.running = [s for s in self.running if s.request is not request or s.finish_reason is not None]
        request.stats.preemptions += 1
        self.stats.preemptions += 1
        del self.requests[request.request_id]
        self.waiting.appendleft(request)

    def admit(self) -> None:
        """Admit waiting requests in order while their sequences get slots and their prompts fit in the KV cache
        with a margin of one token per running sequence (with nothing running, the next request always fits)."""
        used = self.kv_needed()
        running = len(self.live())
        while self.waiting:
            request = self.waiting[0]
            live = [s for s in request.sequences if s.finish_reason is None]
            need = sum(s.kv_need for s in live)
            if running + len(live) > self.max_batch:
                break
            while self.cached_tokens and (len(live) > len(self._free_ids) or (
                    used + self.cached_tokens + need + running + len(live) > self.max_total_tokens)):
                self._evict()  # cache entries make way for requests
            if len(live) > len(self._free_ids) or (
                    running and used + need + running + len(live) > self.max_total_tokens):
                break
            self.waiting.popleft()
            used, running = used + need, running + len(live)
            self.requests[request.request_id] = request
            for seq in live:
                seq.take_slot(self._free_ids.pop())
                self.running.append(seq)

    def place(self, seq: GeneratedSequence) -> None:
        """Start ``seq`` in the model: as a fork of the prefix cache entry sharing the longest prefix with its feed
        (at least one token is left to prefill, for the logits), or empty."""
        match = None
        if self.prefix_cache is not None and len(seq.feed) > 1:
            match = self.prefix_cache.match(seq.feed, limit=len(seq.feed) - 1)
        seq.enter_model(self.model, None if match is None else (match.seq_id, match.length))
        if match is not None:
            seq.request.stats.cached_tokens = max(seq.request.stats.cached_tokens,
                                                  min(match.length, len(seq.request.prompt_token_ids)))
            self.stats.cached_tokens += match.length

    def retire(self) -> None:
        """Free the model slots of finished sequences (or keep them in the prefix cache); forget finished
        requests."""
        keep = []
        for seq in self.running:
            if seq.finish_reason is None:
                keep.append(seq)
            elif not self._cache(seq):
                self._free(seq)
        self.running = keep
        for rid in [rid for rid, r in self.requests.items() if r.finished]:
            request = self.requests.pop(rid)
            if request.stats.finish_time is None:  # its Outputs (built once, as each sequence ended) share the stats
                request.stats.finish_time = time.perf_counter()

    def _free(self, seq: GeneratedSequence) -> None:
        seq.leave_model(self.model)
        self._free_ids.append(seq.give_slot_back())

    def _cache(self, seq: GeneratedSequence) -> bool:
        """Hand a finished sequence's model slot to the prefix cache; False when it has nothing to keep."""
        if self.prefix_cache is None or not seq.in_model or not seq.kv_len:
            return False
        tokens = seq.state.prompt_token_ids + seq.state.output_token_ids
        if len(tokens) < seq.kv_len:  # the cache would not hold what the tokens say: never share it
            return False
        for seq_id in self.prefix_cache.insert(seq.seq_id, tokens[: seq.kv_len]):
            self._release(seq_id)
        seq.hand_over_cache()
        return True

    def _evict(self) -> None:
        """Free the least recently used prefix cache entry."""
        self._release(self.prefix_cache.evict())

    def _release(self, seq_id: int) -> None:
        self.model.remove_sequence(seq_id)
        self._free_ids.append(seq_id)

    def clear_prefix_cache(self) -> None:
        """Free every prefix cache entry."""
        if self.prefix_cache is not None:
            for seq_id in self.prefix_cache.clear():
                self._release(seq_id)
