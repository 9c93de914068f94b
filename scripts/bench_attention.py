"""Attention kernels of the KV cache alone, at SmolLM2's shapes (9 query heads, 3 KV heads of 64): ours against
TVM's CPU kernels they replace, and against a copy of the K/V bytes they read (the floor of a kernel that streams
them once).

    python scripts/bench_attention.py [--contexts 64,1024,4096] [--batch 1] [--prefill 512] [--repeat 20]

1. decode (one query token per sequence) over ``--batch`` sequences of each context length, in scattered pages;
2. prefill of ``--prefill`` new tokens of one sequence: against themselves (causal, ragged) and against the cached
   context in the pages (the two parts the cache merges).
"""

from __future__ import annotations

import argparse
import math
import sys
from functools import partial
from pathlib import Path

import numpy as np
import tvm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import machine_line, median_us  # noqa: E402

H_Q, H_KV, D, PAGE = 9, 3, 64, 16


def compiled(func):
    from logitproc.compile.build_options import pass_context
    from logitproc.runtime.targets import resolve_target

    target = resolve_target("cpu").tvm_target()
    with pass_context(target):
        lib = tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), target=target)
    return lib.mod["main"]


def tvm_kernels() -> dict[str, object]:
    """TVM's own CPU kernels for the same shapes (what the cache would use without ours)."""
    from tvm.relax.frontend.nn.llm import kv_cache

    return {"decode": kv_cache._attention_decode_cpu(H_KV, H_Q, D, "float32", False, {}),
            "paged": kv_cache._attention_prefill_cpu(H_KV, H_Q, D, "float32", False, {}),
            "ragged": kv_cache._attention_prefill_ragged_cpu(H_KV, H_Q, D, D, "float32", {})}


def cache_arrays(lengths: list[int], rng: np.random.Generator) -> list[np.ndarray]:
    counts = [(n + PAGE - 1) // PAGE for n in lengths]
    pages = rng.standard_normal((sum(counts) + 1, 2, H_KV, PAGE, D)).astype(np.float32)
    indptr = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    values = rng.permutation(sum(counts)).astype(np.int32)
    last = np.array([n - (c - 1) * PAGE for n, c in zip(lengths, counts, strict=True)], np.int32)
    return [pages, indptr, values, last]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", default="64,1024,4096")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prefill", type=int, default=512)
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args()

    from logitproc.compile.attention_kernels import paged_prefill_kernel, ragged_prefill_kernel
    from logitproc.compile.decode_attention import decode_attention_kernel
    from logitproc.compile.kv_layout import KVLayout

    theirs = {name: compiled(f) for name, f in tvm_kernels().items()}
    ours = {"decode": compiled(decode_attention_kernel(H_KV, H_Q, D)),
            "paged": compiled(paged_prefill_kernel(H_KV, H_Q, D)),
            "ragged": compiled(ragged_prefill_kernel(H_KV, H_Q, D))}
    dev, rng, scale = tvm.cpu(), np.random.default_rng(0), 1 / math.sqrt(D)
    both = (("ours", ours), ("tvm", theirs))
    print(machine_line())

    def t(a: np.ndarray) -> tvm.runtime.Tensor:
        return tvm.runtime.tensor(a, dev)

    heads = {"ours": KVLayout("float32", H_KV, D).query_heads(H_Q), "tvm": H_Q}  # ours carry the tokens' k and v

    def rows(n: int, name: str) -> list[tvm.runtime.Tensor]:
        return [t(rng.standard_normal((n, heads[name], D)).astype(np.float32))]

    def outs(n: int, name: str) -> list[tvm.runtime.Tensor]:
        return [t(np.zeros((n, heads[name], D), np.float32)), t(np.zeros((n, heads[name]), np.float32))]

    print("\n| kernel | context | ours us | TVM's us | TVM's / ours | K/V MiB | K/V memcpy us | ours / memcpy |")
    print("|---|---|---|---|---|---|---|---|")
    for ctx in [int(c) for c in args.contexts.split(",")]:
        b = args.batch
        pages, indptr, values, last = cache_arrays([ctx] * b, rng)
        kv_bytes = b * ctx * 2 * H_KV * D * 4
        src, dst = np.ones(kv_bytes, np.uint8), np.zeros(kv_bytes, np.uint8)
        copy_us = median_us(lambda s=src, d=dst: np.copyto(d, s), args.repeat)
        zeros = t(np.zeros(b, np.int32))
        cache = [t(a) for a in (pages, indptr, values, last)]
        calls = {name: [*rows(b, name), *cache, zeros, zeros, *outs(b, name), 0, 1.0, 1e4, scale] for name, _ in both}
        times = {name: median_us(partial(kernels["decode"], *calls[name]), args.repeat if name == "ours" else 3)
                 for name, kernels in both}
        print(f"| decode, batch {b} | {ctx} | {times['ours']:.0f} | {times['tvm']:.0f} | "
              f"{times['tvm'] / times['ours']:.1f}x | {kv_bytes / 2**20:.1f} | {copy_us:.0f} | "
              f"{times['ours'] / copy_us:.2f} |")

    n = args.prefill
    for ctx in [int(c) for c in args.contexts.split(",")]:
        pages, indptr, values, last = cache_arrays([ctx], rng)
        q_indptr, zeros_b, zeros_n = t(np.array([0, n], np.int32)), t(np.zeros(1, np.int32)), t(
            np.zeros(n, np.int32))
        cache = [t(a) for a in (pages, indptr, values, last)]
        calls = {name: [*rows(n, name), q_indptr, *cache, zeros_b, zeros_n, *outs(n, name), 0, 0, 1.0, 1e4, scale]
                 for name, _ in both}
        times = {name: median_us(partial(kernels["paged"], *calls[name]), 2) for name, kernels in both}
        print(f"| prefill {n} new against the pages | {ctx} | {times['ours']:.0f} | {times['tvm']:.0f} | "
              f"{times['tvm'] / times['ours']:.1f}x | | | |")
    k, v = (t(rng.standard_normal((n, H_KV, D)).astype(np.float32)) for _ in range(2))
    calls = {name: [*rows(n, name), q_indptr, k, v, q_indptr, zeros_n, zeros_b, *outs(n, name), 1, 0, 1.0, 1e4,
                    scale] for name, _ in both}
    times = {name: median_us(partial(kernels["ragged"], *calls[name]), 2) for name, kernels in both}
    print(f"| prefill {n} new against themselves (causal) | {n} | {times['ours']:.0f} | {times['tvm']:.0f} | "
          f"{times['tvm'] / times['ours']:.1f}x | | | |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
