"""The side-by-side model benchmark: CompiledModel against llama.cpp (llama-cpp-python) on the same GGUF file.

Used by ``bench_model.py --llama-cpp``. Both models get the same prompt tokens and the same number of threads; at
each context length (a prompt of that many tokens) they prefill the prompt and then decode greedily, in interleaved
rounds (the order alternating from round to round), and the best round of each figure is kept. The memory floor is
a read of as many bytes as the compiled model's weights (``read_seconds``: 64-bit words OR-reduced by numpy on the
run's threads; the fastest read of those tried on the AMD EPYC VM, 2026-11-28: 42 GB/s on two threads, quiet, where a
TVM loop of 512-bit loads read 34 GB/s), measured before the first round and after every round (the VM's memory rate
moves with its host's load), best of all: no decode step, which reads every weight once, can take less, so ``decode
tok/s * read seconds`` is the fraction of that floor reached (at most 1.0). A copy of the bytes (``memcpy_seconds``, a
read and a write per byte; the floor of docs/benchmarks.md's side-by-side figures before this note) is printed too.
Each run starts after a pause of ``SETTLE_SECONDS``: llama.cpp's OpenMP workers spin on the cores for a while after
its run (and TVM's pool after ours), which slowed whichever engine ran next (2026-11-28: logitproc's Q4_0 prefill at
context 64 1,912-2,038 tok/s right after llama.cpp, 2,460-2,577 right after its own decode).
"""

from __future__ import annotations

import functools
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np

#: the pause before each measured run, so that the other engine's spinning threads have gone to sleep
SETTLE_SECONDS = 1.0

class Runner(Protocol):
    """One model under test: a single sequence, prefilled and then decoded greedily."""

    name: str

    def prefill(self, tokens: Sequence[int]) -> np.ndarray:
        """Start a new sequence with ``tokens``; the logits after the last one."""
        ...

    def decode(self, token: int) -> np.ndarray:
        """Append ``token``; the logits after it."""
        ...

    def release(self) -> None:
        """Drop the sequence."""
        ...


class CompiledRunner:
    """``CompiledModel`` as a ``Runner`` (sequence id 0)."""

    name = "logitproc"

    def __init__(self, model) -> None:
        self.model = model

    def prefill(self, tokens: Sequence[int]) -> np.ndarray:
        if 0 in self.model.sequence_ids:
            self.model.remove_sequence(0)
        self.model.add_sequence(0)
        return self.model.prefill([0], [list(tokens)])[0]

    def decode(self, token: int) -> np.ndarray:
        return self.model.decode([0], [token])[0]

    def release(self) -> None:
        self.model.remove_sequence(0)


class LlamaCppRunner:
    """llama.cpp through llama-cpp-python, as a new user would create it: defaults except the context size and the
    thread counts (prompt and generation); logits read from its context after each ``llama_decode``."""

    name = "llama.cpp"

    def __init__(self, gguf: Path, n_ctx: int, threads: int) -> None:
        try:
            import llama_cpp
        except ImportError as error:  # pragma: no cover - the optional `bench` extra
            raise SystemExit("the side-by-side mode needs llama-cpp-python: pip install -e '.[bench]'") from error
        self._llama_cpp = llama_cpp
        self.version = llama_cpp.__version__
        self.system_info = llama_cpp.llama_print_system_info().decode()
        self.llm = llama_cpp.Llama(model_path=str(gguf), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                                   verbose=False)
        self._vocab = self.llm.n_vocab()

    def _logits(self) -> np.ndarray:
        """The last evaluated token's logits (llama.cpp's C API; ``Llama.eval`` keeps them only with logits_all)."""
        pointer = self._llama_cpp.llama_get_logits_ith(self.llm.ctx, -1)
        return np.ctypeslib.as_array(pointer, shape=(self._vocab,)).copy()

    def prefill(self, tokens: Sequence[int]) -> np.ndarray:
        self.llm.reset()
        self.llm.eval(list(tokens))
        return self._logits()

    def decode(self, token: int) -> np.ndarray:
        self.llm.eval([token])
        return self._logits()

    def release(self) -> None:
        self.llm.reset()


def run(runner: Runner, prompt: Sequence[int], decode_tokens: int) -> tuple[float, float]:
    """(prefill tok/s, greedy decode tok/s) of one prompt."""
    t0 = time.perf_counter()
    logits = runner.prefill(prompt)
    prefill_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(decode_tokens):
        logits = runner.decode(int(np.argmax(logits)))
    decode_s = time.perf_counter() - t0
    runner.release()
    return len(prompt) / prefill_s, decode_tokens / decode_s


def batch_decode(model, prompt: Sequence[int], batch: int, steps: int) -> float:
    """Aggregate greedy decode tok/s of ``batch`` sequences of ``CompiledModel`` decoded together."""
    ids = list(range(batch))
    for seq in ids:
        model.add_sequence(seq)
    logits = model.prefill(ids, [list(prompt)] * batch)
    t0 = time.perf_counter()
    for _ in range(steps):
        logits = model.decode(ids, [int(t) for t in np.argmax(logits, axis=1)])
    seconds = time.perf_counter() - t0
    for seq in ids:
        model.remove_sequence(seq)
    return batch * steps / seconds


def read_seconds(n_bytes: int, threads: int, repeat: int = 7) -> float:
    """Best time of a read of ``n_bytes`` (a fresh buffer larger than any cache, OR-reduced as 64-bit words) split
    over ``threads`` threads: what one decode step, which reads every weight once, cannot beat."""
    words = np.full(max(n_bytes // 8, threads), 0x5A5A, np.uint64)
    return _best_threaded([functools.partial(np.bitwise_or.reduce, part) for part in np.array_split(words, threads)],
                          repeat)


def memcpy_seconds(n_bytes: int, threads: int, repeat: int = 7) -> float:
    """Best time of a copy of ``n_bytes`` (fresh buffers larger than any cache) split over ``threads`` threads."""
    src = np.ones(n_bytes, np.uint8)
    dst = np.zeros(n_bytes, np.uint8)
    bounds = np.linspace(0, n_bytes, threads + 1).astype(int)

    return _best_threaded([functools.partial(np.copyto, dst[bounds[i]: bounds[i + 1]], src[bounds[i]: bounds[i + 1]])
                           for i in range(threads)], repeat)


def _best_threaded(parts: list[Callable[[], object]], repeat: int) -> float:
    """Best wall time of ``repeat`` runs of ``parts``, each on a thread of its own, all started together."""
    best = float("inf")
    for _ in range(repeat):
        workers = [threading.Thread(target=part) for part in parts]
        t0 = time.perf_counter()
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        best = min(best, time.perf_counter() - t0)
    return best


@dataclass
class Best:
    """The best figure of each (runner, context, measure) over the rounds."""

    figures: dict[tuple[str, int, str], float] = field(default_factory=dict)

    def add(self, runner: str, context: int, measure: str, value: float) -> None:
        key = (runner, context, measure)
        self.figures[key] = max(self.figures.get(key, 0.0), value)

    def __getitem__(self, key: tuple[str, int, str]) -> float:
        return self.figures[key]


def side_by_side(model, gguf: Path, prompt_for: Callable[[int], list[int]], contexts: Sequence[int],
                 decode_tokens: int, rounds: int, threads: int, batch: int, log: Callable[[str], None] = print,
                 ) -> None:
    """Run the comparison and print its table (markdown); see the module doc."""
    from logitproc.compile.model_compile import PARAMS_FILE

    ours = CompiledRunner(model)
    llama = LlamaCppRunner(gguf, n_ctx=max(contexts) + decode_tokens + 16, threads=threads)
    log(f"llama-cpp-python {llama.version}: {llama.system_info.strip()}")
    log(f"KV caches: logitproc {getattr(model, 'kv_dtype', 'float32')}, llama.cpp float16 (its default type_k/type_v)")
    with np.load(model.directory / PARAMS_FILE) as stored:
        weight_bytes = sum(stored[name].nbytes for name in stored.files)
    copy_s = memcpy_seconds(weight_bytes, threads)
    floor_s = read_seconds(weight_bytes, threads)
    log(f"weights {weight_bytes / 2**20:.1f} MiB; a read of them ({threads} threads): {floor_s * 1e3:.2f} ms "
        f"-> floor {1 / floor_s:.1f} decode steps/s (a copy of them: {copy_s * 1e3:.2f} ms)")

    prompts = {ctx: prompt_for(ctx) for ctx in contexts}
    for runner in (ours, llama):  # warm-up: first-call costs, buffers
        run(runner, prompts[min(contexts)][:8], 4)
    best = Best()
    for r in range(rounds):
        order = (ours, llama) if r % 2 == 0 else (llama, ours)
        for ctx in contexts:
            line = [f"round {r + 1} context {ctx}:"]
            for runner in order:
                time.sleep(SETTLE_SECONDS)
                prefill, decode = run(runner, prompts[ctx], decode_tokens)
                best.add(runner.name, ctx, "prefill", prefill)
                best.add(runner.name, ctx, "decode", decode)
                line.append(f"{runner.name} prefill {prefill:.0f} decode {decode:.1f} tok/s;")
            log(" ".join(line) + f" load {os.getloadavg()[0]:.2f}")
        if batch > 1:
            aggregate = batch_decode(model, prompts[min(contexts)], batch, decode_tokens)
            best.add(ours.name, min(contexts), f"batch{batch}", aggregate)
            log(f"round {r + 1}: logitproc batch {batch} aggregate decode {aggregate:.1f} tok/s")
        floor_s = min(floor_s, read_seconds(weight_bytes, threads, repeat=3))

    log(f"\nbest of {rounds} interleaved rounds, {threads} threads each, {decode_tokens} decode tokens after the "
        f"prompt, greedy; memory floor = a read of the {weight_bytes / 2**20:.1f} MiB of weights in "
        f"{floor_s * 1e3:.2f} ms (best of the reads between the rounds)")
    log("\n| context | prefill tok/s llama.cpp | logitproc | ratio | decode tok/s llama.cpp | logitproc | ratio "
        "| decode / floor llama.cpp | logitproc |")
    log("|---|---|---|---|---|---|---|---|---|")
    for ctx in contexts:
        lp, op = best[llama.name, ctx, "prefill"], best[ours.name, ctx, "prefill"]
        ld, od = best[llama.name, ctx, "decode"], best[ours.name, ctx, "decode"]
        log(f"| {ctx} | {lp:.0f} | {op:.0f} | {op / lp:.2f}x | {ld:.1f} | {od:.1f} | {od / ld:.2f}x "
            f"| {ld * floor_s:.2f} | {od * floor_s:.2f} |")
    if batch > 1:
        ctx = min(contexts)
        aggregate = best[ours.name, ctx, f"batch{batch}"]
        log(f"\nlogitproc batch {batch} aggregate decode at context {ctx}: {aggregate:.1f} tok/s = "
            f"{aggregate / best[llama.name, ctx, 'decode']:.2f}x llama.cpp batch 1")
