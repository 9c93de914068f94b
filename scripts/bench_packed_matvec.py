"""What a verify's extra tokens cost in the matmuls: the packed Q4_1 kernels (SmolLM2's layer shapes) and the Q8_0
output head at 1 to n tokens, with 16-bit and 8-bit activation codes, CPU time of one thread.

    TVM_NUM_THREADS=1 python scripts/bench_packed_matvec.py [--tokens 1,2,3,4,6,64] [--rounds 7] [--verify 6]

Prints per kernel and token count the best CPU milliseconds of interleaved rounds, and the cost of each token past
the first up to ``--verify`` tokens (a verify of 1 + K tokens), as milliseconds and as GMAC/s. One thread and CPU
time, so that the other processes of a shared machine count less; the model runs these kernels on every core
(``docs/benchmarks.md``, speculative decoding).
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np
import tvm
from logitproc.compile.linear_kernels import linear_kernel
from logitproc.compile.packed_matvec import pack_q4_1, packed_q4_1_kernel
from logitproc.compile.targets import resolve_target

#: SmolLM2-135M's packed matrices (out, in) per layer, and its output head
LAYER_SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
HEAD_SHAPE = (49152, 576)


def build(func):
    target = resolve_target("cpu").tvm_target()
    with tvm.transform.PassContext(opt_level=3):
        return tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), target=target).mod["main"]


def cases(rng: np.random.Generator) -> dict[str, tuple[object, list, int, int]]:
    """name -> (kernel, weight arrays, out, in) for every kernel measured."""
    out = {}
    for kind, (n_out, n_in) in LAYER_SHAPES.items():
        weights = pack_q4_1(rng.integers(0, 256, (n_out, n_in // 2)).astype(np.uint8),
                            rng.uniform(0.001, 0.02, (n_out, n_in // 32)).astype(np.float16),
                            rng.uniform(-0.15, 0, (n_out, n_in // 32)).astype(np.float16))
        arrays = [tvm.runtime.tensor(a) for a in weights.values()]
        for bits in (16, 8):
            out[f"{kind} {n_out}x{n_in} q4_1 {bits}-bit"] = (
                build(packed_q4_1_kernel(n_out, n_in, xbits=bits)), arrays, n_out, n_in)
    n_out, n_in = HEAD_SHAPE
    arrays = [tvm.runtime.tensor(rng.integers(-127, 128, (n_out, n_in)).astype(np.int8)),
              tvm.runtime.tensor(rng.uniform(0.001, 0.02, (n_out, n_in // 32)).astype(np.float16))]
    out[f"head {n_out}x{n_in} q8_0 16-bit"] = (build(linear_kernel(n_out, n_in, "q8_0", True, mode="decode")),
                                              arrays, n_out, n_in)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="1,2,3,4,6,64")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--verify", type=int, default=6, help="the token count the cost per token is taken at")
    args = parser.parse_args()
    if os.environ.get("TVM_NUM_THREADS") != "1":
        raise SystemExit("run with TVM_NUM_THREADS=1 (one thread, CPU time)")
    tokens = sorted({int(t) for t in args.tokens.split(",")} | {1, args.verify})
    rng = np.random.default_rng(0)
    kernels = cases(rng)
    best: dict[tuple[str, int], float] = {}
    for n in tokens:
        inputs = {}
        for name, (_, _, n_out, n_in) in kernels.items():
            inputs[name] = (tvm.runtime.tensor(rng.standard_normal((n, n_in)).astype(np.float32)),
                            tvm.runtime.tensor(np.zeros((n, n_out), np.float32)))
        for _ in range(args.rounds):  # interleaved: each round runs every kernel
            for name, (run, arrays, n_out, n_in) in kernels.items():
                x, y = inputs[name]
                calls = max(3, int(2e8 // (n_out * n_in * n)))
                run(x, *arrays, y)
                start = time.process_time()
                for _ in range(calls):
                    run(x, *arrays, y)
                seconds = (time.process_time() - start) / calls
                best[(name, n)] = min(best.get((name, n), float("inf")), seconds)
    print(f"# one thread, CPU time, best of {args.rounds} interleaved rounds, load {os.getloadavg()[0]:.1f}")
    print("| kernel | " + " | ".join(f"{n} tok ms" for n in tokens)
          + f" | ms per token, 2 to {args.verify} | GMAC/s there |")
    print("|---|" + "---|" * (len(tokens) + 2))
    for name, (_, _, n_out, n_in) in kernels.items():
        extra = (best[(name, args.verify)] - best[(name, 1)]) / max(args.verify - 1, 1)
        rate = n_out * n_in / extra / 1e9 if extra > 0 else float("nan")
        cells = [f"{1e3 * best[(name, n)]:.3f}" for n in tokens]
        print(f"| {name} | " + " | ".join(cells) + f" | {1e3 * extra:.4f} | {rate:.0f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
