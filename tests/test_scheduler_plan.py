"""The scheduler's plan of a step on data: which tokens one forward feeds within its budget (decode rows first, their
drafts while they fit, then prefill chunks, the shortest rest of a prompt first), over a runner that keeps only the
KV bookkeeping (lengths), so that no model runs: the plan is data, checked as vLLM checks its scheduler. Then the
whole step's parts (``Scheduler.schedule`` -> ``StepRunner.run`` -> ``process`` -> ``Scheduler.commit``) over a
scripted runner whose logits say in advance which token each position gets."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
from logitproc.compile.gguf_model import LlamaConfig
from logitproc.runtime import GenerationConfig, RequestState
from logitproc.serve.chat_template import ChatTemplate
from logitproc.serve.model_step import StepRunner
from logitproc.serve.outputs import Delta, EngineStats, FinishReason, RequestStats
from logitproc.serve.prefix_cache import PrefixCache
from logitproc.serve.processing import process
from logitproc.serve.runner import ModelRunner
from logitproc.serve.scheduler import Scheduler, StepBudget, StepPlan
from logitproc.serve.sequence import GeneratedSequence, Request, SequenceStatus


class ByteDecoder:
    """Text of byte tokens (id = 3 + byte), as the tiny vocabulary's: what a finished sequence's detokenizer reads."""

    def decode(self, ids, skip_special_tokens=True):
        return bytes(i - 3 for i in ids if 3 <= i < 259).decode("utf-8", errors="replace")

    def get_added_tokens_decoder(self):
        return {}  # no control tokens


class LengthsOnly(ModelRunner):
    """The runner interface's bookkeeping (sequences and their lengths, every check) with no KV cache behind it."""

    def __init__(self, max_num_sequences: int = 8, max_total_tokens: int = 4096) -> None:
        config = LlamaConfig(architecture="llama", n_layers=1, hidden=8, n_heads=1, n_kv_heads=1, ffn=8, vocab=300,
                             context=4096, rope_theta=1e4, rms_eps=1e-5, tied_embeddings=True, bos_id=1, eos_id=0,
                             head_dim=8, rope_dim=8, chat_template=None)
        super().__init__(config=config, tokenizer=ByteDecoder(), eos_token_ids=[0], name="lengths-only",
                         max_num_sequences=max_num_sequences, context_length=4096,
                         max_total_tokens=max_total_tokens, chat_template=ChatTemplate())

    def _add(self, seq_id: int) -> None: ...

    def _remove(self, seq_id: int) -> None: ...

    def _fork(self, parent: int, child: int, length: int) -> None: ...

    def _popn(self, seq_id: int, n: int) -> None: ...

    def _prefill(self, seq_ids: list[int], token_ids: list[np.ndarray]) -> np.ndarray:
        return np.zeros((len(seq_ids), self.vocab_size), np.float32)  # no model: the plan is what is checked


_arrivals = iter(range(10**6))


def request(rid: str, prompt_len: int) -> GeneratedSequence:
    ids = [3 + i % 200 for i in range(prompt_len)]
    req = Request(rid, ids, RequestStats(prompt_tokens=prompt_len), next(_arrivals))
    seq = GeneratedSequence(req, 0, RequestState(ids, GenerationConfig()), ByteDecoder(), [0], 4096)
    req.sequences.append(seq)
    return seq


def feed(scheduler: Scheduler, plan) -> None:
    """Put the plan's chunks into the (bookkeeping) KV cache as the model step does, without logits."""
    for seq, _ in plan.chunks:
        if not seq.in_model:
            scheduler.place(seq)
    for seq, take in plan.chunks:
        take = min(take, len(seq.feed))
        scheduler.model.prefill([seq.seq_id], [seq.feed[:take]])
        seq.kv_len += take
        seq.feed = seq.feed[take:]
        if not seq.feed:
            seq.in_prefill = False
            seq.feed = [7]  # as if its first token was sampled: it decodes from the next step on


@pytest.fixture()
def scheduler() -> Scheduler:
    return Scheduler(LengthsOnly(), max_batch=4, max_total_tokens=4096, stats=EngineStats(),
                     prefix_cache=PrefixCache(4096, 8))


def admit(scheduler: Scheduler, *seqs: GeneratedSequence) -> None:
    for seq in seqs:
        scheduler.add(seq.request)
    scheduler.admit()


def test_chunks_go_in_shortest_rest_first_within_the_budget(scheduler) -> None:
    long, short = request("long", 300), request("short", 40)
    admit(scheduler, long, short)
    budget = StepBudget(max_tokens=64, prefill_with_decode=16)
    plan = scheduler.plan(budget, {})
    assert [(s.request_id, take) for s, take in plan.chunks] == [("short", 40), ("long", 24)] and not plan.decode
    feed(scheduler, plan)
    # "short" now decodes: one token first, then at most 16 prefill tokens beside it
    plan = scheduler.plan(budget, {})
    assert plan.decode == [short] and [(s.request_id, take) for s, take in plan.chunks] == [("long", 16)]
    assert plan.tokens == 17
    chunks = []
    while long.in_prefill:
        plan = scheduler.plan(budget, {})
        chunks.append(plan.chunks[0][1])
        feed(scheduler, plan)
    assert sum(chunks) == 300 - 24 and set(chunks[:-1]) == {16} and 0 < chunks[-1] <= 16


def test_drafts_fit_in_the_budget_and_give_way_to_one_prefill_token(scheduler) -> None:
    a, b, waiting = request("a", 5), request("b", 5), request("waiting", 50)
    admit(scheduler, a, b)
    feed(scheduler, scheduler.plan(StepBudget(), {}))
    drafts = {a: [1, 2, 3, 4], b: [5, 6, 7, 8]}
    plan = scheduler.plan(StepBudget(max_tokens=10), drafts)
    assert plan.drafts == drafts and plan.tokens == 10 and not plan.chunks  # nothing to prefill: all drafts fit
    admit(scheduler, waiting)
    plan = scheduler.plan(StepBudget(max_tokens=10), drafts)
    assert plan.drafts == {a: [1, 2, 3, 4]} and plan.decode == [b]  # the last planned lost its drafts
    assert [(s.request_id, take) for s, take in plan.chunks] == [("waiting", 4)] and plan.tokens == 10


def test_no_budget_prefills_every_prompt_whole(scheduler) -> None:
    seqs = [request(f"r{i}", n) for i, n in enumerate([700, 3, 90])]
    admit(scheduler, *seqs)
    plan = scheduler.plan(StepBudget(), {})
    assert sorted(take for _, take in plan.chunks) == [3, 90, 700]


def test_a_prefix_cache_hit_is_counted_out_of_the_budget(scheduler) -> None:
    """A prompt sharing 250 tokens with a cache entry plans chunks of the other 50: the budget is not spent on what
    the cache gives."""
    first = request("first", 300)
    admit(scheduler, first)
    feed(scheduler, scheduler.plan(StepBudget(), {}))
    first.finish("length", Delta("first", 0))
    scheduler.retire()
    assert scheduler.cached_tokens == 300
    second = request("second", 300)
    second.feed = second.feed[:250] + [299] * 50
    second.state = RequestState(second.feed, GenerationConfig())
    admit(scheduler, second)
    plan = scheduler.plan(StepBudget(max_tokens=32), {})
    assert [(s.request_id, take) for s, take in plan.chunks] == [("second", 32)]
    feed(scheduler, plan)
    assert second.kv_len == 250 + 32 and second.request.stats.cached_tokens == 250
    plan = scheduler.plan(StepBudget(max_tokens=32), {})
    assert [take for _, take in plan.chunks] == [18]


def test_a_sequence_preempted_mid_prefill_starts_its_prompt_again(scheduler) -> None:
    small = Scheduler(LengthsOnly(max_total_tokens=200), max_batch=4, max_total_tokens=200, stats=EngineStats())
    running, late = request("running", 20), request("late", 150)
    admit(small, running)
    feed(small, small.plan(StepBudget(), {}))
    admit(small, late)
    feed(small, small.plan(StepBudget(max_tokens=64, prefill_with_decode=8), {}))
    assert late.kv_len == 8 and late.in_prefill
    running.kv_len += 40  # the running answer grew: the late prompt no longer fits beside it
    small.model.prefill([running.seq_id], [[5] * 40])
    small.make_room()
    assert small.stats.preemptions == 1 and late.kv_len == 0 and len(late.feed) == 150 and late.in_prefill
    assert late.seq_id is None and list(small.waiting) == [late.request]


def test_kv_bookkeeping_agrees_with_the_model_after_every_operation() -> None:
    """The sequence's KV bookkeeping (its one owner: ``GeneratedSequence``'s methods) checked against the runner's
    lengths after each operation a step performs, as a shadow model: chunked prefill, a sampled token, a verify whose
    drafts are partly rejected, a failed step put back, a jump-forward re-tokenization, preemption."""
    model = LengthsOnly()
    seq = request("kv", 10)
    seq.seq_id = 0
    state = seq.state

    def agrees(cached: int, feed: list[int]) -> None:
        assert (model.sequence_length(0), seq.kv_len, seq.feed) == (cached, cached, feed)

    seq.enter_model(model)
    agrees(0, state.prompt_token_ids)
    model.prefill([0], [seq.feed[:6]])  # a chunk
    seq.fed(6)
    agrees(6, state.prompt_token_ids[6:])
    assert seq.in_prefill and seq.prefilling
    model.prefill([0], [seq.feed])  # the rest of the prompt
    seq.fed(4)
    assert not seq.in_prefill
    state.append_token(50)
    seq.feed_sampled(50)
    agrees(10, [50])
    assert seq.decoding
    model.prefill([0], [[50, 51, 52, 53]])  # a verify: the token and three drafts go in
    seq.fed(4)
    for token in (51, 60):  # draft 51 accepted, then 60 sampled in place of draft 52
        state.append_token(token)
    seq.feed_sampled(60)
    seq.keep_in_cache(model, min(seq.kv_len, state.num_tokens - len(seq.feed)))  # the rejected drafts leave
    agrees(12, [60])
    before = seq.kv_snapshot()
    model.prefill([0], [[60]])  # a step that fails after its forward
    seq.fed(1)
    seq.restore_kv(model, before)
    agrees(12, [60])
    state.rollback(2)  # a jump-forward re-tokenizes the last two tokens as three forced ones
    for token in (70, 71, 72):
        state.append_token(token)
    seq.rewind_cache(model, state.num_tokens - 3)
    agrees(11, [70, 71, 72])
    state.rollback(3)  # rolled back to a point already in the cache: its last token goes in again, for the logits
    seq.rewind_cache(model, state.num_tokens)
    agrees(10, [50])
    seq.leave_model(model)  # preempted: out of the model, everything goes in again as a prompt
    seq.recompute()
    assert 0 not in model.sequence_ids and not seq.in_model and seq.in_prefill
    assert seq.feed == state.prompt_token_ids + [50] and seq.kv_len == 0


# ---- the step's parts on data: schedule -> StepRunner.run -> process -> commit, over a scripted runner --------------
V = 300  # the vocabulary of LengthsOnly, for the ``proc`` and ``sampler`` fixtures


def next_token(position: int) -> int:
    """The scripted model's greedy answer after ``position`` tokens: a byte token, never EOS (0)."""
    return 3 + (7 * position) % 50


class Scripted(LengthsOnly):
    """LengthsOnly whose logits after ``p`` tokens of a sequence are one-hot at ``next_token(p)``, whatever the tokens:
    every answer is known in advance, so the step's parts can be checked on data."""

    def __init__(self, max_total_tokens: int = 4096, refuse: frozenset[int] = frozenset()) -> None:
        super().__init__(max_total_tokens=max_total_tokens)
        self.refuse = refuse  # sequence slots whose add/fork the runner refuses (a failing placement)

    def _rows(self, positions: list[int]) -> np.ndarray:
        logits = np.zeros((len(positions), self.vocab_size), np.float32)
        logits[np.arange(len(positions)), [next_token(p) for p in positions]] = 10.0
        return logits

    def _add(self, seq_id: int) -> None:
        if seq_id in self.refuse:
            raise RuntimeError(f"no room for sequence {seq_id}")

    def _fork(self, parent: int, child: int, length: int) -> None:
        self._add(child)

    def _prefill(self, seq_ids, token_ids) -> np.ndarray:
        return self._rows([self._lengths[s] + t.size for s, t in zip(seq_ids, token_ids, strict=True)])

    def _decode(self, seq_ids, token_ids) -> np.ndarray:
        return self._rows([self._lengths[s] + 1 for s in seq_ids])

    def _verify(self, seq_ids, token_ids) -> list[np.ndarray]:
        return [self._rows([self._lengths[s] + j + 1 for j in range(t.size)])
                for s, t in zip(seq_ids, token_ids, strict=True)]


GREEDY = GenerationConfig(temperature=0.0, max_tokens=6)


def greedy_request(rid: str, prompt_len: int, config: GenerationConfig = GREEDY) -> GeneratedSequence:
    ids = [3 + i % 200 for i in range(prompt_len)]
    req = Request(rid, ids, RequestStats(prompt_tokens=prompt_len), next(_arrivals))
    for index in range(config.n):
        seq = GeneratedSequence(req, index, RequestState(ids, config), ByteDecoder(), [0], 4096,
                                forked_from=req.sequences[0] if index else None)
        req.sequences.append(seq)
    return req.sequences[0]


def one_step(scheduler: Scheduler, runner: StepRunner, sampler, budget: StepBudget, drafts=None) -> StepPlan:
    """The engine's step without the engine: the four calls, each on the data the one before returns."""
    deltas: dict = {}
    plan = scheduler.schedule(budget, deltas, drafts)
    step = runner.run(plan)
    if step.batch is not None:
        scheduler.commit(step, process(runner.processor, sampler, step.batch, step.logits), deltas)
    scheduler.retire()
    return plan


def agrees_with_the_model(scheduler: Scheduler) -> None:
    for seq in scheduler.running:
        assert scheduler.model.sequence_length(seq.seq_id) == seq.kv_len


@pytest.fixture()
def parts(proc, sampler):
    model = Scripted()
    scheduler = Scheduler(model, max_batch=4, max_total_tokens=4096, stats=EngineStats(),
                          prefix_cache=PrefixCache(4096, 8))
    return scheduler, StepRunner(model, proc), sampler


def test_a_step_is_schedule_run_sample_commit_on_data(parts) -> None:
    """A 40-token prompt beside a running answer, budget 16 with decode: the chunks are 16, 16, 8 (the answer
    decodes beside each), its first token comes with its last chunk; both answers are the script's."""
    scheduler, runner, sampler = parts
    running, late = greedy_request("running", 5), greedy_request("late", 40)
    scheduler.add(running.request)
    budget = StepBudget(max_tokens=64, prefill_with_decode=16)
    one_step(scheduler, runner, sampler, budget)
    scheduler.add(late.request)
    assert (running.status, late.status) == (SequenceStatus.DECODING, SequenceStatus.WAITING)
    chunks = []
    while late.in_prefill:
        plan = one_step(scheduler, runner, sampler, budget)
        chunks.append([take for _, take in plan.chunks])
        assert plan.decode == [running] or running.finish_reason is not None
        agrees_with_the_model(scheduler)
        assert late.token_ids == ([] if late.in_prefill else [next_token(40)])
        assert late.status is (SequenceStatus.PREFILLING if late.in_prefill else SequenceStatus.DECODING)
    assert chunks == [[16], [16], [8]]
    while not late.request.finished:
        one_step(scheduler, runner, sampler, budget)
    assert running.token_ids == [next_token(5 + i) for i in range(6)] and running.finish_reason == "length"
    assert late.token_ids == [next_token(40 + i) for i in range(6)] and late.finish_reason is FinishReason.LENGTH
    assert late.status is SequenceStatus.FINISHED
    assert json.dumps({"finish_reason": late.output().finish_reason}) == '{"finish_reason": "length"}'


def test_schedule_places_a_prefix_cache_hit_so_the_chunks_start_where_it_ends(parts) -> None:
    """Placement is the scheduler's: after ``schedule`` a prompt sharing 250 tokens with a cache entry is in the model
    with those 250, and the chunk planned is the budget's share of the other 50."""
    scheduler, runner, sampler = parts
    first = greedy_request("first", 300, replace(GREEDY, max_tokens=1))
    scheduler.add(first.request)
    while not first.request.finished:
        one_step(scheduler, runner, sampler, StepBudget())
    assert scheduler.cached_tokens >= 300
    second = greedy_request("second", 300)
    second.feed = second.feed[:250] + [299] * 50
    second.state = RequestState(second.feed, GREEDY)
    scheduler.add(second.request)
    plan = scheduler.schedule(StepBudget(max_tokens=32), {})
    assert second.in_model and second.kv_len == 250 and plan.chunks == [(second, 32)]
    assert scheduler.model.sequence_length(second.seq_id) == 250 and second.request.stats.cached_tokens == 250


def test_schedule_preempts_mid_prefill_and_the_prompt_goes_in_again(proc, sampler) -> None:
    """A prompt partly in when the KV cache runs short (the running answer grows) is preempted, its chunks freed, and
    prefilled again from its first token once there is room; both answers are the script's all the same."""
    model = Scripted(max_total_tokens=120)
    scheduler = Scheduler(model, max_batch=4, max_total_tokens=120, stats=EngineStats())
    runner = StepRunner(model, proc)
    running = greedy_request("running", 20, replace(GREEDY, max_tokens=60))
    late = greedy_request("late", 90, replace(GREEDY, max_tokens=3))
    scheduler.add(running.request)
    budget = StepBudget(max_tokens=64, prefill_with_decode=8)
    one_step(scheduler, runner, sampler, budget)
    scheduler.add(late.request)
    while scheduler.stats.preemptions == 0:
        was_in = late.kv_len
        one_step(scheduler, runner, sampler, budget)
        agrees_with_the_model(scheduler)
    assert 0 < was_in < 90  # preempted mid-prefill
    assert late.request.stats.preemptions == 1 and late.kv_len == 0 and len(late.feed) == 90
    while not (late.request.finished and running.request.finished):
        one_step(scheduler, runner, sampler, budget)
        agrees_with_the_model(scheduler)
    assert late.token_ids == [next_token(90 + i) for i in range(3)]
    assert running.token_ids == [next_token(20 + i) for i in range(60)]


def test_a_sequence_the_runner_cannot_place_ends_its_request_alone(proc, sampler) -> None:
    model = Scripted(refuse=frozenset({1}))
    scheduler = Scheduler(model, max_batch=4, max_total_tokens=4096, stats=EngineStats())
    runner = StepRunner(model, proc)
    ok, refused = greedy_request("ok", 10), greedy_request("refused", 10, replace(GREEDY, n=2))
    for seq in (ok, refused):
        scheduler.add(seq.request)
    deltas: dict = {}
    plan = scheduler.schedule(StepBudget(), deltas)
    assert [s.request_id for s, _ in plan.chunks] == ["ok"]
    assert [s.finish_reason for s in refused.request.sequences] == ["error", "error"]
    assert "no room for sequence 1" in refused.error and deltas[refused].finish_reason == "error"
    step = runner.run(plan)
    scheduler.commit(step, process(proc, sampler, step.batch, step.logits), deltas)
    assert ok.token_ids == [next_token(10)]


def test_the_step_runner_refuses_a_plan_with_a_sequence_not_placed(parts) -> None:
    scheduler, runner, _ = parts
    seq = greedy_request("unplaced", 10)
    with pytest.raises(ValueError, match="not in the model: Scheduler.schedule places"):
        runner.run(StepPlan(chunks=[(seq, 10)]))


def test_n_forks_after_the_last_chunk_and_drafts_commit_while_they_agree(parts) -> None:
    """n=2: the prompt goes in by chunks once, both sequences get their first token from its last chunk; then a
    verify with two right drafts and a wrong one commits three tokens and leaves the wrong one out of the KV cache."""
    scheduler, runner, sampler = parts
    first = greedy_request("n2", 30, replace(GREEDY, n=2, max_tokens=8))
    second = first.request.sequences[1]
    scheduler.add(first.request)
    budget = StepBudget(max_tokens=16)
    while first.in_prefill:
        one_step(scheduler, runner, sampler, budget)
        assert second.status is SequenceStatus.FORKING or not first.in_prefill
    assert first.token_ids == second.token_ids == [next_token(30)]

    def propose(decoding, room):
        assert decoding == [first, second] and room > 0
        return {first: [next_token(31), next_token(32), 7]}

    plan = one_step(scheduler, runner, sampler, StepBudget(max_tokens=16), propose)
    assert plan.drafts == {first: [next_token(31), next_token(32), 7]} and plan.decode == [second]
    assert first.token_ids == [next_token(30 + i) for i in range(4)] and second.token_ids == [next_token(30),
                                                                                              next_token(31)]
    assert scheduler.stats.accepted_draft_tokens == 2 and scheduler.stats.draft_tokens == 3
    agrees_with_the_model(scheduler)
    assert first.kv_len == 33 and first.feed == [next_token(33)]
