"""What a verify's extra tokens cost in the matmuls: the packed Q4_1 kernels (``quant_matvec``, SmolLM2's layer
shapes) and the Q8_0 output head at 1 to n tokens, with 16-bit and 8-bit activation codes, CPU time of one thread.

    TVM_NUM_THREADS=1 python scripts/bench_packed_matvec.py [--tokens 1,2,3,4,6,64] [--rounds 7] [--verify 6]
    python scripts/bench_packed_matvec.py --forward [--tokens 1,2,3,6] [--rounds 7]
    TVM_NUM_THREADS=1 python scripts/bench_packed_matvec.py --types [--shape 576x1536] [--tokens 1,8,64] \
        [--wide-tokens 0,8]

Prints per kernel and token count the best CPU milliseconds of interleaved rounds, and the cost of each token past
the first up to ``--verify`` tokens (a verify of 1 + K tokens), as milliseconds and as GMAC/s. One thread and CPU
time, so that the other processes of a shared machine count less; the model runs these kernels on every core
(``docs/benchmarks.md``, speculative decoding).

``--forward``: the matmuls of one whole forward instead, on every TVM thread, wall time: SmolLM2's 30 layers of
distinct packed matrices and its output head (98 MB, so that the weights stream from memory as in the model),
called in the model's order at each token count, against the same calls on one layer's matrices (in cache). Per
token count: milliseconds streaming and in cache, and the weights' read rate; then the cost of a token past the
first. Whether memory and compute overlap shows here: where they do, the streaming time is about the larger of the
in-cache time and the time the bytes take at one token's rate.

``--types``: every GGUF type's packed kernel at one shape (``--shape``, default SmolLM2's ffn_down), VNNI tile where
the CPU has it, one thread, CPU time: milliseconds per token count and GMAC/s at the largest (packed Q8_0 beside
``quant_matvec``'s Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, IQ4; random blocks), these (``--only``: some) once per
``--wide-tokens`` size of their wide tile where they have one (``quant_matvec.wide_tile``; 0: without it).
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np
import tvm
from logitproc.compile.build_options import pass_context
from logitproc.compile.linear_kernels import linear_kernel
from logitproc.compile.packed_matvec import has_vnni, pack_q8_0, packed_q8_0_kernel
from logitproc.compile.quant_formats import LAYOUTS, Q4_1, pack, unpack_gguf
from logitproc.compile.quant_matvec import WIDE_TILE, quant_matmul_kernel, wide_tile
from logitproc.runtime.targets import build_features, resolve_target

#: SmolLM2-135M's packed matrices (out, in) per layer, and its output head
LAYER_SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
HEAD_SHAPE = (49152, 576)
LAYERS = 30


def vnni_here() -> bool:
    """Whether this machine's CPU target has AVX512-VNNI (the packed kernels' VNNI tile)."""
    return has_vnni(build_features(resolve_target("cpu").tvm_target()))


def build(func):
    target = resolve_target("cpu").tvm_target()
    with pass_context(target):
        return tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), target=target).mod["main"]


def cases(rng: np.random.Generator) -> dict[str, tuple[object, list, int, int]]:
    """name -> (kernel, weight arrays, out, in) for every kernel measured."""
    out = {}
    for kind, (n_out, n_in) in LAYER_SHAPES.items():
        arrays = q4_1_arrays(n_out, n_in, rng)
        for bits in (16, 8):
            for vnni in (False, True) if vnni_here() else (False,):
                out[f"{kind} {n_out}x{n_in} q4_1 {bits}-bit{' VNNI' if vnni else ''}"] = (
                    build(quant_matmul_kernel(Q4_1, n_out, n_in, xbits=bits, vnni=vnni)), arrays, n_out, n_in)
    n_out, n_in = HEAD_SHAPE
    arrays = [tvm.runtime.tensor(rng.integers(-127, 128, (n_out, n_in)).astype(np.int8)),
              tvm.runtime.tensor(rng.uniform(0.001, 0.02, (n_out, n_in // 32)).astype(np.float16))]
    out[f"head {n_out}x{n_in} q8_0 16-bit"] = (build(linear_kernel(n_out, n_in, "q8_0", True, mode="decode")),
                                              arrays, n_out, n_in)
    return out


def forward(tokens: list[int], rounds: int) -> None:
    """``--forward`` (module doc): a forward's matmuls streaming from memory against the same calls in cache."""
    rng = np.random.default_rng(0)
    kinds = {kind: build(quant_matmul_kernel(Q4_1, n_out, n_in, vnni=vnni_here())) for kind, (n_out, n_in) in
             LAYER_SHAPES.items()}
    head = build(linear_kernel(*HEAD_SHAPE, "q8_0", True, mode="decode"))
    layers = []
    for _ in range(LAYERS):
        layer = {}
        for kind, (n_out, n_in) in LAYER_SHAPES.items():
            layer[kind] = q4_1_arrays(n_out, n_in, rng)
        layers.append(layer)
    n_out, n_in = HEAD_SHAPE
    head_arrays = [tvm.runtime.tensor(rng.integers(-127, 128, (n_out, n_in)).astype(np.int8)),
                   tvm.runtime.tensor(rng.uniform(0.001, 0.02, (n_out, n_in // 32)).astype(np.float16))]
    megabytes = (sum(a.numpy().nbytes for layer in layers for arrays in layer.values() for a in arrays)
                 + sum(a.numpy().nbytes for a in head_arrays)) / 1e6
    best: dict[tuple[str, int], float] = {}
    for n in tokens:
        xs = {kind: tvm.runtime.tensor(rng.standard_normal((n, n_in)).astype(np.float32))
              for kind, (_, n_in) in {**LAYER_SHAPES, "head": HEAD_SHAPE}.items()}
        ys = {kind: tvm.runtime.tensor(np.zeros((n, n_out), np.float32))
              for kind, (n_out, _) in {**LAYER_SHAPES, "head": HEAD_SHAPE}.items()}
        for _ in range(rounds):  # interleaved: streaming, then in cache (layer 0 again and again)
            for mode in ("streaming", "in cache"):
                start = time.perf_counter()
                for i in range(LAYERS):
                    layer = layers[i if mode == "streaming" else 0]
                    for kind, run in kinds.items():
                        run(xs[kind], *layer[kind], ys[kind])
                if mode == "streaming":
                    head(xs["head"], *head_arrays, ys["head"])
                seconds = time.perf_counter() - start
                best[(mode, n)] = min(best.get((mode, n), float("inf")), seconds)
        # the head streams in both modes' totals: its in-cache time is not taken (it does not fit in cache)
    print(f"# a forward's matmuls ({megabytes:.0f} MB of weights{', VNNI' if vnni_here() else ''}), "
          f"{os.environ.get('TVM_NUM_THREADS', '?')} TVM threads, wall time, best of {rounds} interleaved rounds, "
          f"load {os.getloadavg()[0]:.1f}")
    print("| tokens | layers + head streaming ms | read rate GB/s | layers in cache ms | streaming ms per token past "
          "the first |")
    print("|---|---|---|---|---|")
    for n in tokens:
        per_token = (best[("streaming", n)] - best[("streaming", tokens[0])]) / (n - tokens[0]) if n > tokens[0] else 0
        print(f"| {n} | {1e3 * best[('streaming', n)]:.2f} | {megabytes / 1e3 / best[('streaming', n)]:.1f} | "
              f"{1e3 * best[('in cache', n)]:.2f} | {1e3 * per_token:.3f} |")


def _random_blocks(ggml: str, rows: int, in_features: int, rng: np.random.Generator) -> np.ndarray:
    """GGUF blocks of random bytes with small finite float16 scales (every float16 field at its offset)."""
    layout = {**LAYOUTS, "Q4_1": Q4_1}[ggml]
    raw = rng.integers(0, 256, (rows, in_features // layout.block_weights, layout.block_bytes)).astype(np.uint8)
    halves = {"Q4_1": (0, 2), "Q5_1": (0, 2), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}.get(ggml, (0,))
    for at in halves:
        raw[..., at: at + 2] = rng.uniform(0.001, 0.01, (*raw.shape[:2], 1)).astype(np.float16).view(np.uint8)
    return raw.reshape(rows, -1)


def q4_1_arrays(n_out: int, n_in: int, rng: np.random.Generator) -> list:
    """A random Q4_1 ``[n_out, n_in]`` weight packed for ``quant_matvec`` (device arrays)."""
    return [tvm.runtime.tensor(a) for a in pack(Q4_1, unpack_gguf(Q4_1, _random_blocks("Q4_1", n_out, n_in, rng)))
            .values()]


def types(shape: tuple[int, int], tokens: list[int], rounds: int, wide: list[int], only: set[str]) -> None:
    """``--types`` (module doc)."""
    if os.environ.get("TVM_NUM_THREADS") != "1":
        raise SystemExit("run with TVM_NUM_THREADS=1 (one thread, CPU time)")
    rng = np.random.default_rng(0)
    n_out, n_in = shape
    vnni = vnni_here()
    sizes = wide if wide_tile(vnni) else [0]  # one row per wide tile's size (0: none)
    kernels = {}
    if vnni:
        kernels["Q8_0"] = (build(packed_q8_0_kernel(n_out, n_in)), [tvm.runtime.tensor(a) for a in pack_q8_0(
            rng.integers(-127, 128, (n_out, n_in)).astype(np.int8),
            rng.uniform(0.001, 0.02, (n_out, n_in // 32)).astype(np.float16)).values()])
    for ggml, layout in {"Q4_1": Q4_1, **LAYOUTS}.items():
        if n_in % layout.block_weights == 0 and (vnni or not layout.codebook) and ggml in only:
            arrays = [tvm.runtime.tensor(a) for a in pack(layout, unpack_gguf(
                layout, _random_blocks(ggml, n_out, n_in, rng))).values()]
            for size in sizes:
                kernels[f"{ggml} wide {size}" if len(sizes) > 1 else ggml] = (build(quant_matmul_kernel(
                    layout, n_out, n_in, vnni=vnni, wide_tokens=size)), arrays)
    best: dict[tuple[str, int], float] = {}
    for n in tokens:
        x = tvm.runtime.tensor(rng.standard_normal((n, n_in)).astype(np.float32))
        y = tvm.runtime.tensor(np.zeros((n, n_out), np.float32))
        calls = max(3, int(2e8 // (n_out * n_in * n)))
        for _ in range(rounds):
            for name, (run, arrays) in kernels.items():
                run(x, *arrays, y)
                start = time.process_time()
                for _ in range(calls):
                    run(x, *arrays, y)
                best[(name, n)] = min(best.get((name, n), float("inf")), (time.process_time() - start) / calls)
    print(f"# {n_out}x{n_in}, one thread, CPU time{', VNNI tile' if vnni else ', AVX2 tile'}, best of {rounds} "
          f"interleaved rounds, load {os.getloadavg()[0]:.1f}")
    print("| type | " + " | ".join(f"{n} tok ms" for n in tokens) + f" | GMAC/s at {tokens[-1]} |")
    print("|---|" + "---|" * (len(tokens) + 1))
    for name in kernels:
        cells = [f"{1e3 * best[(name, n)]:.3f}" for n in tokens]
        rate = n_out * n_in * tokens[-1] / best[(name, tokens[-1])] / 1e9
        print(f"| {name} | " + " | ".join(cells) + f" | {rate:.0f} |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="1,2,3,4,6,64")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--verify", type=int, default=6, help="the token count the cost per token is taken at")
    parser.add_argument("--forward", action="store_true", help="a whole forward's matmuls, streaming (module doc)")
    parser.add_argument("--types", action="store_true", help="every GGUF type's packed kernel (module doc)")
    parser.add_argument("--shape", default="576x1536", help="with --types: out x in")
    parser.add_argument("--wide-tokens", default=f"0,{WIDE_TILE}",
                        help="with --types: the wide tile's sizes to time (0: without it)")
    parser.add_argument("--only", default="", help="with --types: these quant_matvec types (Q4_0,Q4_K), not all")
    args = parser.parse_args()
    if args.types:
        n_out, n_in = (int(v) for v in args.shape.split("x"))
        types((n_out, n_in), sorted({int(t) for t in args.tokens.split(",")}), args.rounds,
              [int(v) for v in args.wide_tokens.split(",")],
              set(args.only.split(",")) if args.only else {"Q4_1", *LAYOUTS})
        return 0
    if args.forward:
        forward(sorted({int(t) for t in args.tokens.split(",")}), args.rounds)
        return 0
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
