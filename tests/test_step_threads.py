"""The stepping thread's TVM pool (``serve/step_threads.py``): one thread fewer while a grammar compiles beside the
steps, the whole pool otherwise, and the same logits and answers either way."""

from __future__ import annotations

import threading
from collections.abc import Callable

import numpy as np
import pytest
import tvm
from logitproc.runtime import GenerationConfig
from logitproc.serve.engine import Engine
from logitproc.serve.step_threads import StepThreads
from test_grammar_off_step import constrained, large_schema

RUNNING = GenerationConfig(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def model():
    from logitproc.serve.cli_options import tiny_model
    from logitproc.serve.compiled_model import CompiledModel

    return CompiledModel.open(tiny_model(), target="cpu")


def on_a_new_thread(work: Callable[[], object]) -> object:
    """``work()`` on a thread of its own (TVM keeps one pool per thread), its result or its exception."""
    result: list[object] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            result.append(work())
        except BaseException as err:  # noqa: BLE001 - handed to the caller
            errors.append(err)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    if errors:
        raise errors[0]
    return result[0]


def test_one_thread_fewer_beside_other_work_then_the_whole_pool() -> None:
    def sizes() -> tuple[int, int, int, int]:
        num_threads = tvm.get_global_func("runtime.NumThreads")
        whole = int(num_threads())
        threads = StepThreads()
        fewer = threads.use(beside_other_work=True)
        seen_fewer = int(num_threads())
        back = threads.use(beside_other_work=False)
        return whole, fewer, seen_fewer, back if back == int(num_threads()) else -1

    whole, fewer, seen_fewer, back = on_a_new_thread(sizes)
    assert fewer == seen_fewer == max(1, whole - 1)
    assert back == whole


def test_the_model_gives_the_same_logits_on_fewer_threads(model) -> None:
    prompt = [(7 * i) % 200 + 3 for i in range(70)]

    def logits(beside_other_work: bool) -> list[np.ndarray]:
        StepThreads().use(beside_other_work)
        model.add_sequence(0)
        try:
            rows = [model.prefill([0], [prompt])[0].copy()]
            for _ in range(4):
                rows.append(model.decode([0], [int(np.argmax(rows[-1]))])[0].copy())
        finally:
            model.remove_sequence(0)
        return rows

    whole = on_a_new_thread(lambda: logits(False))
    fewer = on_a_new_thread(lambda: logits(True))
    for a, b in zip(whole, fewer, strict=True):
        assert np.array_equal(a, b)


def test_a_stream_beside_a_compile_answers_as_alone(model) -> None:
    """The running stream's steps beside the compile run on fewer threads: its answer is the one it gives alone (the
    schema grows until at least one step ran while it compiled)."""
    [alone] = Engine(model).generate("Hello there", RUNNING)
    for fields in (1600, 6400):
        engine = Engine(model)
        running = engine.add_request("Hello there", RUNNING)
        engine.step()
        pending = engine.submit("Some JSON:", constrained(large_schema(f"beside the stream {fields}", fields)))
        outputs, compiling_steps = {}, 0
        while engine.has_unfinished():
            compiling = engine.num_compiling
            outputs.update({d.request_id: d.output for d in engine.step() if d.output is not None})
            compiling_steps += compiling and engine.num_compiling
        assert pending.ready.result() == pending.request_id
        assert outputs[running].token_ids == alone.token_ids
        if compiling_steps:
            break
    assert compiling_steps, "even the largest schema compiled within one step"
