"""A bad request never stalls or changes the others: failures inside a step end only their own request ("error"),
and the engine's API refuses hostile arguments clearly (tiny model; faults injected through a wrapping Runner)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest
from logitproc.runtime import GenerationConfig
from logitproc.serve.engine import Engine

GREEDY = GenerationConfig(temperature=0.0, max_tokens=12, ignore_eos=True)
POISON = 3 + ord("~")  # the tiny vocabulary's token for the byte "~"


@pytest.fixture(scope="module")
def model():
    from logitproc.serve.cli_options import tiny_model
    from logitproc.serve.compiled_model import CompiledModel

    return CompiledModel.open(tiny_model(), target="cpu")


class FaultyRunner:
    """The model, except that a sequence whose prompt holds the POISON token fails: in ``prefill`` (``at=0``) or in
    its ``at``-th ``decode`` call, after the real decode has grown every sequence's KV cache (so the engine must put
    the others back). Everything else is the wrapped runner's."""

    def __init__(self, model, at: int) -> None:
        self._model, self._at = model, at
        self._poisoned: dict[int, int] = {}  # seq_id -> decodes so far
        for name in ("name", "vocab_size", "context_length", "max_num_sequences", "max_total_tokens",
                     "eos_token_ids", "tokenizer", "kernel_library", "apply_chat_template", "chat_token_ids",
                     "sequence_length",
                     "add_sequence", "popn"):
            setattr(self, name, getattr(model, name))

    @property
    def sequence_ids(self) -> tuple[int, ...]:
        return self._model.sequence_ids

    def remove_sequence(self, seq_id: int) -> None:
        self._poisoned.pop(seq_id, None)
        self._model.remove_sequence(seq_id)

    def fork_sequence(self, parent_id: int, child_id: int, length: int | None = None) -> None:
        if parent_id in self._poisoned:
            self._poisoned[child_id] = 0
        self._model.fork_sequence(parent_id, child_id, length)

    def prefill(self, seq_ids: Sequence[int], token_ids: Sequence[Sequence[int]]) -> np.ndarray:
        for seq_id, tokens in zip(seq_ids, token_ids, strict=True):
            if POISON in tokens:
                if self._at == 0:
                    raise RuntimeError("injected prefill fault")
                self._poisoned[seq_id] = 0
        return self._model.prefill(seq_ids, token_ids)

    def decode(self, seq_ids: Sequence[int], token_ids: Sequence[int]) -> np.ndarray:
        out = self._model.decode(seq_ids, token_ids)
        for seq_id in seq_ids:
            if seq_id in self._poisoned:
                self._poisoned[seq_id] += 1
                if self._poisoned[seq_id] >= self._at:
                    raise RuntimeError("injected decode fault")
        return out


def run_all(engine: Engine, outputs: dict | None = None, steps: int = 500) -> dict[str, dict[int, object]]:
    """Step until idle (or ``steps`` steps); each request's outputs by sequence index."""
    outputs = {} if outputs is None else outputs
    for _ in range(steps):
        if not engine.has_unfinished():
            return outputs
        for delta in engine.step():
            if delta.output is not None:
                outputs.setdefault(delta.request_id, {})[delta.index] = delta.output
    if steps < 500:
        return outputs
    raise AssertionError("the engine never became idle")


@pytest.mark.parametrize("at", [0, 3])
def test_a_runner_fault_ends_only_its_request(model, at) -> None:
    """One request's sequences fail in the runner (at prefill, or at its 3rd decode after the KV cache grew): it
    ends with "error" and the message; the others (one n=2, one arriving later) equal their answers alone."""
    good = [("Hello there", GREEDY), ("The cat", GenerationConfig(temperature=0.0, max_tokens=10, n=2)),
            ("late", GREEDY)]
    expected = {p: Engine(model, max_batch=8).generate(p, c) for p, c in good}
    engine = Engine(FaultyRunner(model, at), max_batch=8)
    ids = {engine.add_request(p, c): p for p, c in good[:2]}
    bad = engine.add_request("bad ~ prompt", GenerationConfig(temperature=0.0, max_tokens=12, n=2))
    outputs = run_all(engine, steps=1)
    ids[engine.add_request(*good[2])] = good[2][0]
    run_all(engine, outputs)
    for index in (0, 1):
        failed = outputs[bad][index]
        assert failed.finish_reason == "error" and "injected" in failed.error
        assert len(failed.token_ids) == at  # the prefill token, then one per decode that worked
    for rid, prompt in ids.items():
        got = [outputs[rid][i] for i in sorted(outputs[rid])]
        assert [o.token_ids for o in got] == [o.token_ids for o in expected[prompt]]
    assert not engine.has_unfinished() and engine.num_running == 0 and engine.kv_tokens == 0


def test_a_request_failing_in_processing_ends_alone(model) -> None:
    """top_k beyond int32: refused at add_request, or (where the config allows it) ended with "error" at its first
    step while the other request's answer is unchanged."""
    [want] = Engine(model, max_batch=8).generate("Hello", GREEDY)
    engine = Engine(model, max_batch=4)
    rid = engine.add_request("Hello", GREEDY)
    try:
        bad = engine.add_request("bad", GenerationConfig(temperature=1.0, top_k=2**31, max_tokens=8))
    except ValueError:
        bad = None
    outputs = run_all(engine)
    assert outputs[rid][0].token_ids == want.token_ids
    if bad is not None:
        assert outputs[bad][0].finish_reason == "error" and outputs[bad][0].error


def test_generate_with_a_failing_request_returns_error_not_raises(model) -> None:
    [out] = Engine(FaultyRunner(model, 2), max_batch=2).generate("~", GREEDY)
    assert out.finish_reason == "error" and "injected decode fault" in out.error


def test_abort_before_add_request_does_not_abort_it(model) -> None:
    engine = Engine(model, max_batch=4)
    engine.abort("mine")  # nothing of that id yet: ignored
    assert not engine.has_unfinished()
    rid = engine.add_request("Hello", GREEDY, request_id="mine")
    assert run_all(engine)[rid][0].finish_reason == "length"
    engine.abort("mine")  # finished: ignored, and a new request of the same id runs whole
    engine.add_request("Hello", GREEDY, request_id="mine")
    assert run_all(engine)["mine"][0].finish_reason == "length"


@pytest.mark.parametrize("prompt", [None, 7, b"hello", bytearray(b"hi"), {"role": "user", "content": "hi"}, 2.5])
def test_prompt_of_a_wrong_type_is_a_type_error_naming_it(model, prompt) -> None:
    engine = Engine(model, max_batch=2)
    with pytest.raises(TypeError, match="prompt must be text"):
        engine.add_request(prompt)
    with pytest.raises(TypeError, match="prompt must be text"):
        engine.generate(prompt)
    assert not engine.has_unfinished()


def test_request_id_of_a_wrong_type(model) -> None:
    with pytest.raises(TypeError, match="request_id must be a str"):
        Engine(model, max_batch=2).add_request("hi", request_id=5)


def test_an_answer_too_deep_to_check_still_ends_with_one_final_delta(model) -> None:
    """A recursive schema and an answer nested 300 deep: the final check cannot follow it (jsonschema recurses) and
    says so; the sequence still ends with exactly one final delta (before, ``generate`` raised "ended without a
    final delta" and a server request hung)."""
    schema = {"anyOf": [{"type": "array", "items": {"$ref": "#"}}, {"type": "integer"}]}
    fmt = {"type": "json_schema", "json_schema": {"name": "deep", "schema": schema}}
    config = GenerationConfig(temperature=0.0, max_tokens=600, logit_bias={3 + ord("["): 100.0}, response_format=fmt)
    deltas = list(Engine(model, max_batch=2).stream("x", config))
    [final] = [d for d in deltas if d.finish_reason is not None]
    assert final is deltas[-1] and final.output.text.startswith("[" * 200)
    assert final.output.schema_valid is None and "deeper than the checker can follow" in final.output.schema_error


class FinalDeltaDropper(Engine):
    """The engine, except that its step() loses every final delta (a fault the engine never has): the request ends
    inside the engine while its caller never hears of it."""

    def step(self):
        return [d for d in super().step() if d.finish_reason is None]


def test_the_server_loop_ends_a_request_whose_final_delta_was_lost(model) -> None:
    import queue

    from logitproc.serve.engine_loop import EngineLoop, RequestFailed
    from logitproc.serve.server_metrics import ServerMetrics

    loop = EngineLoop(lambda: FinalDeltaDropper(model, max_batch=2), ServerMetrics())
    loop.start()
    try:
        assert loop.wait_loaded(timeout=120) == EngineLoop.READY  # (a submit while loading is refused at once)
        items: queue.SimpleQueue = queue.SimpleQueue()
        [rid] = loop.submit(["Hello"], GREEDY, False, items.put).result(timeout=60)
        while not isinstance(item := items.get(timeout=60), RequestFailed):
            assert item.finish_reason is None
        assert item.request_id == rid and "without its final answer" in item.message
    finally:
        loop.stop()


def test_tokenizing_a_long_prompt_lets_other_threads_run(tiny_compiled) -> None:
    """The stepping thread goes on while another thread tokenizes a huge prompt (the tokenizer releases the GIL)."""
    import threading
    import time

    from logitproc.serve.engine import Engine

    engine = Engine(tiny_compiled)
    ticks, done = [0], threading.Event()

    def tick() -> None:
        while not done.is_set():
            time.sleep(0.001)
            ticks[0] += 1

    ticker = threading.Thread(target=tick)
    ticker.start()
    started = time.perf_counter()
    ids = engine.tokenize("hello world, a long paste " * 40000)
    took = time.perf_counter() - started
    done.set()
    ticker.join()
    assert len(ids) > 500_000
    assert ticks[0] > 0.1 * took / 0.001 and ticks[0] > 20  # encode holding the GIL gave a handful
