"""Two compiled builds of one model side by side: prefill and decode step times at batch 1 / 8 / 16, interleaved.

    python scripts/compare_builds.py OLD_DIR NEW_DIR [--rounds 3] [--prompt-tokens 79] [--batches 1,8,16]

The directories are compiled models (``~/.cache/logitproc/models/<name>-<key>``), e.g. the build before and after a
change of ``compile/`` (each compile leaves its own). Prints the best of the interleaved rounds for each; figures
from the same run only (these machines are shared and noisy). The first sequence's prompt has ``--prompt-tokens``
tokens (so its decode steps read that much context; the others get 20). Used for the cost of batch invariance and
the decode attention / float16 KV cache figures in docs/model.md. ``--cpu-time``: the process's CPU time instead of
wall time (with ``TVM_NUM_THREADS=1``: one thread's work, less sensitive to other processes on a busy machine).
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np
from logitproc.serve.compiled_model import CompiledModel


def measure(model: CompiledModel, batch: int, prompt: list[int], steps: int,
            clock=time.perf_counter) -> tuple[float, float]:
    """(seconds of one prefill of ``prompt``, seconds of one decode step at ``batch``) by ``clock``."""
    ids = list(range(batch))
    for s in ids:
        model.add_sequence(s)
    try:
        start = clock()
        model.prefill(ids[:1], [prompt])
        prefill = clock() - start
        for s in ids[1:]:
            model.prefill([s], [prompt[:20]])
        model.decode(ids, [5] * batch)
        start = clock()
        for _ in range(steps):
            model.decode(ids, [5] * batch)
        return prefill, (clock() - start) / steps
    finally:
        for s in ids:
            model.remove_sequence(s)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("old")
    parser.add_argument("new")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--prompt-tokens", type=int, default=79)
    parser.add_argument("--batches", default="1,8,16")
    parser.add_argument("--cpu-time", action="store_true", help="CPU time of the process instead of wall time")
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    models = {"old": CompiledModel(args.old), "new": CompiledModel(args.new)}
    prompt = [int(t) for t in np.random.default_rng(0).integers(3, models["old"].vocab_size, args.prompt_tokens)]
    best: dict[tuple[str, int], list[float]] = {}
    for _ in range(args.rounds):
        for name, model in models.items():
            for batch in batches:
                times = measure(model, batch, prompt, args.steps,
                                time.process_time if args.cpu_time else time.perf_counter)
                kept = best.setdefault((name, batch), list(times))
                best[(name, batch)] = [min(a, b) for a, b in zip(kept, times, strict=True)]
    print(f"load average {os.getloadavg()[0]:.1f}; best of {args.rounds} interleaved rounds; "
          f"{'CPU' if args.cpu_time else 'wall'} time, TVM_NUM_THREADS={os.environ.get('TVM_NUM_THREADS', 'unset')}")
    for batch in batches:
        for name in models:
            prefill, step = best[(name, batch)]
            print(f"{name} batch {batch:2d}: prefill {len(prompt)} tokens {prefill * 1e3:7.1f} ms, decode step "
                  f"{step * 1e3:6.2f} ms ({batch / step:5.0f} tok/s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
