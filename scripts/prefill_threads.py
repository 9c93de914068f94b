"""How well a prefill uses two cores: one thread's CPU time against the two-thread wall time, and where TVM's threads
run (its worker is pinned to one core, the calling thread may run on either).

    python scripts/prefill_threads.py MODEL_DIR [--tokens 64] [--rounds 5]

``MODEL_DIR``: a compiled model (``~/.cache/logitproc/models/<name>-<key>``). Runs three child processes, interleaved
per round: ``TVM_NUM_THREADS=1`` (the prefill's CPU time), ``TVM_NUM_THREADS=2`` as TVM sets it up (its worker
thread pinned to the last core, the calling thread free), and ``TVM_NUM_THREADS=2`` with ``TVM_BIND_THREADS=0``
(no pinning); in the two-thread processes also the calling thread pinned to core 0 (the other core than the worker)
and to the worker's core. Prints the best wall time of each, and the two-thread efficiency ``cpu1 / (2 x wall)``.
Needs a quiet machine (``uptime`` about 0): with another process on a core, two threads measure that process.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

CHILD = "--child"


def child(path: str, tokens: int, repeats: int) -> dict[str, float]:
    """In a child process: best wall and CPU seconds of a prefill of ``tokens`` tokens, per calling thread's
    affinity (free; core 0; the last core) where TVM has two threads."""
    from logitproc.serve.compiled_model import CompiledModel

    model = CompiledModel(path)
    prompt = [int(t) for t in np.random.default_rng(0).integers(3, model.vocab_size, tokens)]

    def once() -> tuple[float, float]:
        model.add_sequence(0)
        try:
            wall, cpu = time.perf_counter(), time.process_time()
            model.prefill([0], [prompt])
            return time.perf_counter() - wall, time.process_time() - cpu
        finally:
            model.remove_sequence(0)

    once()
    every = set(os.sched_getaffinity(0))
    out: dict[str, float] = {}
    masks = {"free": every}
    if len(every) >= 2 and os.environ.get("TVM_NUM_THREADS") == "2":
        masks |= {"core 0": {min(every)}, "last core": {max(every)}}
    for name, mask in masks.items():
        os.sched_setaffinity(0, mask)
        runs = [once() for _ in range(repeats)]
        out[f"{name} wall"] = min(w for w, _ in runs)
        out[f"{name} cpu"] = min(c for _, c in runs)
    os.sched_setaffinity(0, every)
    return out


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == CHILD:
        print(json.dumps(child(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3, help="prefills per child and affinity")
    args = parser.parse_args()
    setups = {"1 thread": {"TVM_NUM_THREADS": "1"}, "2 threads": {"TVM_NUM_THREADS": "2"},
              "2 threads, unbound": {"TVM_NUM_THREADS": "2", "TVM_BIND_THREADS": "0"}}
    best: dict[tuple[str, str], float] = {}
    for r in range(args.rounds):
        for name, env in setups.items():
            done = subprocess.run([sys.executable, __file__, CHILD, args.model, str(args.tokens), str(args.repeats)],
                                  env={**os.environ, **env}, capture_output=True, text=True, check=True)
            for key, value in json.loads(done.stdout.strip().splitlines()[-1]).items():
                best[(name, key)] = min(best.get((name, key), float("inf")), value)
        print(f"round {r + 1}: load {os.getloadavg()[0]:.2f}", flush=True)
    cpu1 = best[("1 thread", "free cpu")]
    print(f"\nprefill of {args.tokens} tokens, best of {args.rounds} rounds x {args.repeats}; one thread's CPU "
          f"{cpu1 * 1e3:.1f} ms\n\n| setup | calling thread | wall ms | CPU ms | cpu1 / (2 x wall) |\n"
          "|---|---|---|---|---|")
    for (name, key), value in best.items():
        if key.endswith(" wall"):
            where = key[: -len(" wall")]
            print(f"| {name} | {where} | {value * 1e3:.1f} | {best[(name, where + ' cpu')] * 1e3:.1f} | "
                  f"{cpu1 / (2 * value):.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
