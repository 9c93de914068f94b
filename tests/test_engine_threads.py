"""One Engine used from many threads at once, and several streams interleaved on one thread (tiny model)."""

from __future__ import annotations

import random
import threading

import pytest
from logitproc.runtime import GenerationConfig
from logitproc.serve.engine import Engine

WORDS = ["Hello", "the cat", "What is", "x", "a tree", "JSON", "1 2 3", "zebra", "Once upon", "ok"]


def jobs(seeded: bool = False) -> list[tuple[str, GenerationConfig]]:
    """20 distinct requests: greedy (or sampled with seeds), with stop strings, n=2, penalties, max_tokens from 1
    to 12."""
    out = []
    for i in range(20):
        sampling = {"temperature": 0.9, "seed": 100 + i, "top_p": 0.95} if seeded else {"temperature": 0.0}
        config = GenerationConfig(**sampling, max_tokens=1 + i % 12, ignore_eos=i % 3 == 0,
                                  n=2 if i % 7 == 0 else 1, stop=("e",) if i % 5 == 0 else (),
                                  frequency_penalty=0.5 if i % 4 == 1 else 0.0)
        out.append((f"{WORDS[i % len(WORDS)]} {i}", config))
    return out


def summary(outputs) -> list[tuple]:
    return [(o.token_ids, o.text, o.finish_reason) for o in outputs]


@pytest.fixture(scope="module")
def model():
    from logitproc.serve.cli_options import tiny_model
    from logitproc.serve.compiled_model import CompiledModel

    return CompiledModel.open(tiny_model(), target="cpu")


def run_threads(engine: Engine, requests: list, threads: int, rounds: int = 1) -> list[dict]:
    """Each thread runs every request (in its own shuffled order) through ``engine.generate``."""
    results: list[dict] = [{} for _ in range(threads)]
    errors: list[BaseException] = []
    start = threading.Barrier(threads)

    def work(t: int) -> None:
        order = list(range(len(requests))) * rounds
        random.Random(t).shuffle(order)
        start.wait()
        try:
            for i in order:
                prompt, config = requests[i]
                results[t][i] = summary(engine.generate(prompt, config))
        except BaseException as err:  # reported by the main thread
            errors.append(err)

    pool = [threading.Thread(target=work, args=(t,)) for t in range(threads)]
    for thread in pool:
        thread.start()
    for thread in pool:
        thread.join(timeout=300)
    assert not any(thread.is_alive() for thread in pool), "a thread hung"
    assert not errors, errors
    return results


@pytest.mark.parametrize("seeded", [False, True], ids=["greedy", "seeded"])
def test_eight_threads_twenty_requests_each_equal_alone(model, seeded) -> None:
    """8 threads x 20 requests through one Engine: all finish, each answer equals the request run alone."""
    requests = jobs(seeded)
    expected = [summary(Engine(model, max_batch=8).generate(p, c)) for p, c in requests]
    engine = Engine(model, max_batch=8)
    results = run_threads(engine, requests, threads=8)
    for t, answers in enumerate(results):
        assert answers == dict(enumerate(expected)), f"thread {t}"
    assert not engine.has_unfinished() and engine.num_running == 0


def test_threads_mixed_with_step_and_abort(model) -> None:
    """While threads call generate, the main thread adds requests, steps them and aborts one: every request gets
    its own deltas only, the aborted one ends with "abort", the rest equal their answers alone."""
    requests = jobs()[:6]
    expected = [summary(Engine(model, max_batch=8).generate(p, c)) for p, c in requests]
    config = GenerationConfig(temperature=0.0, max_tokens=40, ignore_eos=True)
    [mine_alone] = Engine(model, max_batch=8).generate("mine", config)
    engine = Engine(model, max_batch=4)
    results: list[dict] = []
    worker = threading.Thread(target=lambda: results.extend(run_threads(engine, requests, threads=3)))
    worker.start()
    mine = engine.add_request("mine", config)
    doomed = engine.add_request("doomed", config)
    seen: dict[str, list] = {}
    steps = 0
    while engine.has_unfinished() or worker.is_alive():
        for delta in engine.step():
            seen.setdefault(delta.request_id, []).append(delta)
        steps += 1
        if steps == 3:
            engine.abort(doomed)
    worker.join()
    assert set(seen) <= {mine, doomed}
    [out] = [d.output for d in seen[mine] if d.output is not None]
    assert out.token_ids == mine_alone.token_ids
    assert "".join(d.text for d in seen[mine]) == out.text
    [aborted] = [d.output for d in seen[doomed] if d.output is not None]
    assert aborted.finish_reason == "abort"
    for answers in results:
        assert answers == dict(enumerate(expected))


def test_interleaved_streams_on_one_thread_get_all_their_deltas(model) -> None:
    """Two (then three) stream() generators advanced in turn on one thread: each gets all its own deltas."""
    config = GenerationConfig(temperature=0.0, max_tokens=20, ignore_eos=True)
    prompts = ["first prompt", "second one", "third"]
    expected = [Engine(model, max_batch=8).generate(p, config)[0] for p in prompts]
    engine = Engine(model, max_batch=8)
    streams = [engine.stream(p, config) for p in prompts]
    got: list[list] = [[] for _ in prompts]
    live = set(range(len(prompts)))
    turn = 0
    while live:
        i = turn % len(prompts)
        turn += 1
        if i not in live or (i == 2 and turn < 6):  # the third joins late
            continue
        try:
            got[i].append(next(streams[i]))
        except StopIteration:
            live.discard(i)
    for deltas, want in zip(got, expected, strict=True):
        assert [t for d in deltas for t in d.token_ids] == want.token_ids
        assert "".join(d.text for d in deltas) == want.text
        assert deltas[-1].output.token_ids == want.token_ids
    assert not engine.has_unfinished()


def test_closing_one_stream_leaves_the_other_whole(model) -> None:
    config = GenerationConfig(temperature=0.0, max_tokens=16, ignore_eos=True)
    [want] = Engine(model, max_batch=8).generate("kept", config)
    engine = Engine(model, max_batch=8)
    kept, closed = engine.stream("kept", config), engine.stream("closed", config)
    deltas = [next(kept)]
    next(closed)
    deltas.append(next(kept))
    closed.close()  # aborts its request; its later deltas go nowhere
    deltas.extend(kept)
    assert [t for d in deltas for t in d.token_ids] == want.token_ids
    assert not engine.has_unfinished() and engine.step() == []


class OneThreadAtATime:
    """The tiny model, recording how many threads are inside its KV cache and forward calls at once (the engine's
    state has one owner thread at a time: never more than one)."""

    CALLS = ("sequence_length", "add_sequence", "remove_sequence", "fork_sequence", "popn", "prefill", "decode",
             "verify")

    def __init__(self, model) -> None:
        self._model = model
        self._lock = threading.Lock()
        self.inside = 0
        self.most = 0
        self.threads: set[int] = set()

    def __getattr__(self, name: str):
        attr = getattr(self._model, name)
        if name not in self.CALLS:
            return attr

        def counted(*args, **kwargs):
            with self._lock:
                self.inside += 1
                self.most = max(self.most, self.inside)
                self.threads.add(threading.get_ident())
            try:
                return attr(*args, **kwargs)
            finally:
                with self._lock:
                    self.inside -= 1

        return counted


def test_questions_from_other_threads_never_meet_a_step(model) -> None:
    """Three threads generate while a fourth asks the engine everything it can be asked and aborts requests that
    never were: the model is entered by one thread at a time (several take turns), nothing breaks, and every answer
    equals the request alone."""
    requests = jobs()[:6]
    expected = [summary(Engine(model, max_batch=8).generate(p, c)) for p, c in requests]
    counted = OneThreadAtATime(model)
    engine = Engine(counted, max_batch=4)
    done = threading.Event()
    asked = [0]

    def ask() -> None:
        while not done.is_set():
            engine.has_unfinished(), engine.has_runnable(), engine.num_running, engine.kv_tokens
            engine.prefix_cache_tokens, engine.num_compiling, engine.prompt_progress("req-0"), engine.is_done("x")
            engine.abort("never-added")
            asked[0] += 1

    asker = threading.Thread(target=ask)
    asker.start()
    try:
        results = run_threads(engine, requests, threads=3)
    finally:
        done.set()
        asker.join(timeout=60)
    for answers in results:
        assert answers == dict(enumerate(expected))
    assert counted.most == 1 and len(counted.threads) > 1 and asked[0] > 0
    assert not engine.has_unfinished() and engine.kv_tokens == 0
