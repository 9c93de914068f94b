"""The server's EngineLoop over the tiny model: it drives the engine for its life through the engine's one command
queue (no queue of its own), so the model is entered by its thread only, whatever other threads submit, ask or
abort; answers equal the requests run alone; before the engine loaded and after it stopped, calls are answered at
once with EngineUnavailable; the waiting-queue limit refuses what does not fit."""

from __future__ import annotations

import queue
import threading

import pytest
from logitproc.runtime import GenerationConfig
from logitproc.serve.engine import Engine
from logitproc.serve.engine_loop import EngineLoop, EngineUnavailable, QueueFull
from logitproc.serve.server_metrics import ServerMetrics
from test_engine_threads import OneThreadAtATime, jobs, summary


@pytest.fixture(scope="module")
def model():
    from logitproc.serve.cli_options import tiny_model
    from logitproc.serve.compiled_model import CompiledModel

    return CompiledModel.open(tiny_model(), target="cpu")


def collect(loop: EngineLoop, prompt: str, config: GenerationConfig) -> list[tuple]:
    """Submit one request through the loop (as the app does, from this thread) and gather its outputs."""
    items: queue.SimpleQueue = queue.SimpleQueue()
    [rid] = loop.submit([prompt], config, False, items.put).result(timeout=120)
    outputs = {}
    while len(outputs) < config.n:
        delta = items.get(timeout=120)
        assert delta.request_id == rid
        if delta.output is not None:
            outputs[delta.index] = delta.output
    return summary([outputs[i] for i in sorted(outputs)])


def test_only_the_loop_thread_enters_the_model_whatever_other_threads_do(model) -> None:
    requests = jobs()[:6]
    expected = [summary(Engine(model, max_batch=8).generate(p, c)) for p, c in requests]
    counted = OneThreadAtATime(model)
    loop = EngineLoop(lambda: Engine(counted, max_batch=4), ServerMetrics())
    loop.start()
    try:
        assert loop.wait_loaded(timeout=120) == EngineLoop.READY
        loop_thread = loop.call(lambda engine: threading.get_ident()).result(timeout=60)
        assert loop_thread != threading.get_ident()
        results: dict[int, list] = {}
        errors: list[BaseException] = []
        done = threading.Event()

        def client(i: int) -> None:
            try:
                results[i] = collect(loop, *requests[i])
            except BaseException as err:  # reported below
                errors.append(err)

        def asker() -> None:  # the engine's questions, straight from another thread: queued for the loop thread
            while not done.is_set():
                loop.engine.has_unfinished(), loop.engine.num_running, loop.engine.kv_tokens
                loop.engine.abort("never-added")
                loop.abort(["never-added"])

        threads = [threading.Thread(target=client, args=(i,)) for i in range(len(requests))]
        ask = threading.Thread(target=asker)
        ask.start()
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
        done.set()
        ask.join(timeout=60)
        assert not errors, errors
        assert [results[i] for i in range(len(requests))] == expected
        assert counted.threads == {loop_thread} and counted.most == 1
    finally:
        loop.stop()
    assert loop.state == EngineLoop.STOPPED
    with pytest.raises(EngineUnavailable, match="stopped"):
        loop.call(lambda engine: None).result(timeout=10)
    with pytest.raises(EngineUnavailable, match="stopped"):
        loop.submit(["Hello"], GenerationConfig(max_tokens=2), False, lambda item: None).result(timeout=10)


def test_calls_while_loading_are_answered_at_once_and_stop_waits_for_the_load(model) -> None:
    loaded = threading.Event()

    def load() -> Engine:
        loaded.wait(60)
        return Engine(model, max_batch=2)

    loop = EngineLoop(load, ServerMetrics())
    loop.start()
    with pytest.raises(EngineUnavailable, match="loading"):
        loop.call(lambda engine: None).result(timeout=1)
    stopper = threading.Thread(target=loop.stop)
    stopper.start()
    loaded.set()
    stopper.join(timeout=60)
    assert loop.state == EngineLoop.STOPPED


def test_a_submit_past_the_queue_limit_is_refused(model) -> None:
    loop = EngineLoop(lambda: Engine(model, max_batch=1), ServerMetrics(), max_queue=2)
    loop.start()
    try:
        assert loop.wait_loaded(timeout=120) == EngineLoop.READY
        config = GenerationConfig(temperature=0.0, max_tokens=1)
        # both submitted between the same two steps (from a command, on the loop thread): nothing has started
        first, second = loop.call(lambda engine: (loop.submit(["a", "b"], config, False, lambda item: None),
                                                  loop.submit(["c"], config, False, lambda item: None))
                                  ).result(timeout=60)
        with pytest.raises(QueueFull, match="2 of 2"):
            second.result(timeout=60)
        assert len(first.result(timeout=60)) == 2
    finally:
        loop.stop()
