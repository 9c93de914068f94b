"""Benchmark every kernel on this CPU against plain numpy, torch (when installed) and a memcpy of the same logits.

    python scripts/bench_kernels.py [--batch 1 8 64] [--vocab 32000 128256] [--repeat 15] [--markdown]

All figures of one row come from the same run, interleaved, median of ``--repeat`` calls. ``memcpy`` copies the
float32 [B, V] logits once: no full pass over the logits can beat it. The ratios printed are ``numpy / ours``,
``torch / ours`` (speed-ups) and ``ours / memcpy`` (distance from the floor).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import numpy as np
import tvm
from bench_common import machine_line, median_us
from logitproc.compile import build_kernels
from logitproc.tir_kernels import reference

try:
    import torch
except ImportError:  # torch is optional
    torch = None

BIAS_PER_ROW = 16
PENALTY_PER_ROW = 512
TOP_N = 5


def make_case(batch: int, vocab: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    logits = (rng.standard_normal((batch, vocab)) * 3).astype(np.float32)
    bias_rows = np.repeat(np.arange(batch, dtype=np.int32), BIAS_PER_ROW)
    bias_toks = np.concatenate([rng.choice(vocab, BIAS_PER_ROW, replace=False) for _ in range(batch)])
    pen_rows = np.repeat(np.arange(batch, dtype=np.int32), PENALTY_PER_ROW)
    pen_toks = np.concatenate([rng.choice(vocab, PENALTY_PER_ROW, replace=False) for _ in range(batch)])
    mask_rows = np.arange(0, batch, 2, dtype=np.int32)  # half the rows carry a grammar mask
    probs = reference.softmax_with_temperature(logits, np.ones(batch, np.float32))
    return {
        "logits": logits,
        "probs": probs,
        "bias_rows": bias_rows,
        "bias_toks": bias_toks.astype(np.int32),
        "bias": rng.uniform(-5, 5, bias_rows.size).astype(np.float32),
        "pen_rows": pen_rows,
        "pen_toks": pen_toks.astype(np.int32),
        "pen_cnt": rng.integers(0, 4, pen_rows.size).astype(np.int32),
        "penalties": np.tile(np.array([[0.5, 0.3, 1.1]], np.float32), (batch, 1)),
        "mask_rows": mask_rows,
        "bitmask": reference.pack_bitmask(rng.random((mask_rows.size, vocab)) < 0.5),
        "temperature": np.full(batch, 0.7, np.float32),
        "top_k": np.full(batch, 50, np.int32),
        "top_p": np.full(batch, 0.9, np.float32),
        "min_p": np.full(batch, 0.05, np.float32),
        "uniform": rng.random(batch).astype(np.float32),
        "targets": rng.integers(0, vocab, batch).astype(np.int32),
    }


# ---- plain numpy versions (vectorised numpy, what a Python engine without kernels would run) ----

def np_bias(c: dict[str, np.ndarray], x: np.ndarray) -> None:
    x[c["bias_rows"], c["bias_toks"]] += c["bias"]


def np_penalty(c: dict[str, np.ndarray], x: np.ndarray) -> None:
    r, t, cnt = c["pen_rows"], c["pen_toks"], c["pen_cnt"]
    p = c["penalties"][r]
    v = x[r, t]
    v = np.where(v > 0, v / p[:, 2], v * p[:, 2]) - (p[:, 1] * cnt + p[:, 0] * (cnt > 0))
    x[r, t] = v


def np_bitmask(c: dict[str, np.ndarray], x: np.ndarray) -> None:
    rows = c["mask_rows"]
    allowed = reference.unpack_bitmask(c["bitmask"], x.shape[1])
    x[rows] = np.where(allowed, x[rows], -np.inf)


def np_softmax(c: dict[str, np.ndarray], x: np.ndarray) -> np.ndarray:
    z = x / c["temperature"][:, None]
    e = np.exp(z - z.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def np_renormalize(c: dict[str, np.ndarray], p: np.ndarray) -> np.ndarray:
    order = np.argsort(-p, axis=1)
    sorted_p = np.take_along_axis(p, order, axis=1)
    keep = sorted_p >= c["min_p"][:, None] * sorted_p[:, :1]
    keep[:, c["top_k"][0]:] = False
    kept = np.where(keep, sorted_p, 0)
    csum = np.cumsum(kept, axis=1)
    keep &= (csum - kept) < c["top_p"][:, None] * csum[:, -1:]
    out = np.zeros_like(p)
    np.put_along_axis(out, order, np.where(keep, sorted_p, 0), axis=1)
    return out / out.sum(axis=1, keepdims=True)


def np_multinomial(c: dict[str, np.ndarray], p: np.ndarray) -> np.ndarray:
    csum = np.cumsum(p, axis=1)
    return (csum <= c["uniform"][:, None] * csum[:, -1:]).sum(axis=1)


def np_top_n(c: dict[str, np.ndarray], x: np.ndarray) -> np.ndarray:
    part = np.argpartition(-x, TOP_N, axis=1)[:, :TOP_N]
    vals = np.take_along_axis(x, part, axis=1)
    return np.take_along_axis(part, np.argsort(-vals, axis=1), axis=1)


def np_log_softmax_gather(c: dict[str, np.ndarray], x: np.ndarray) -> np.ndarray:
    m = x.max(axis=1, keepdims=True)
    lse = np.log(np.exp(x - m).sum(axis=1)) + m[:, 0]
    return x[np.arange(x.shape[0]), c["targets"]] - lse


# ---- torch versions (CPU), when torch is installed ----

def torch_versions(c: dict[str, np.ndarray]) -> dict[str, Callable[[], object]]:
    if torch is None:
        return {}
    x, p = torch.from_numpy(c["logits"].copy()), torch.from_numpy(c["probs"])
    temp = torch.from_numpy(c["temperature"])[:, None]
    rows = torch.from_numpy(c["mask_rows"]).long()
    allowed = torch.from_numpy(reference.unpack_bitmask(c["bitmask"], x.shape[1]))
    return {
        "apply_bitmask_inplace": lambda: x.index_put_((rows,), torch.where(allowed, x[rows], float("-inf"))),
        "softmax_with_temperature": lambda: torch.softmax(x / temp, dim=1),
        "argmax": lambda: torch.argmax(x, dim=1),
        "top_n": lambda: torch.topk(x, TOP_N, dim=1),
        "multinomial_from_uniform": lambda: torch.multinomial(p, 1),
        "log_softmax_gather": lambda: torch.log_softmax(x, dim=1)[torch.arange(x.shape[0]), c["targets"]],
    }


def bench_case(lib, batch: int, vocab: int, repeat: int, rng: np.random.Generator) -> list[dict[str, object]]:
    c = make_case(batch, vocab, rng)
    dev = tvm.cpu()
    t = {k: tvm.runtime.tensor(v, dev) for k, v in c.items()}
    out_probs = tvm.runtime.tensor(np.empty_like(c["probs"]), dev)
    # Outputs allocated once, as the runtime does (paired buffers at capacity).
    tokens = tvm.runtime.tensor(np.zeros(batch, np.int32), dev)
    values = tvm.runtime.tensor(np.zeros(batch, np.float32), dev)
    lse = tvm.runtime.tensor(np.zeros(batch, np.float32), dev)
    top_values = tvm.runtime.tensor(np.zeros((batch, TOP_N), np.float32), dev)
    top_ids = tvm.runtime.tensor(np.zeros((batch, TOP_N), np.int32), dev)
    work = c["logits"].copy()
    copy_dst = np.empty_like(c["logits"])
    ours: dict[str, Callable[[], object]] = {
        "apply_logit_bias_inplace": lambda: lib["apply_logit_bias_inplace"](
            t["logits"], t["bias_rows"], t["bias_toks"], t["bias"]),
        "apply_penalty_inplace": lambda: lib["apply_penalty_inplace"](
            t["logits"], t["pen_rows"], t["pen_toks"], t["pen_cnt"], t["penalties"]),
        "apply_bitmask_inplace": lambda: lib["apply_bitmask_inplace"](t["logits"], t["mask_rows"], t["bitmask"]),
        "softmax_with_temperature": lambda: lib["softmax_with_temperature"](t["logits"], t["temperature"], out_probs),
        "renormalize_probs": lambda: lib["renormalize_probs"](
            t["probs"], t["top_k"], t["top_p"], t["min_p"], out_probs),
        "multinomial_from_uniform": lambda: lib["multinomial_from_uniform"](t["probs"], t["uniform"], tokens, values),
        "argmax": lambda: lib["argmax"](t["logits"], tokens, values),
        "top_n": lambda: lib["top_n"](t["logits"], top_values, top_ids),
        "log_softmax_gather": lambda: lib["log_softmax_gather"](t["logits"], t["targets"], values, lse),
    }
    plain: dict[str, Callable[[], object]] = {
        "apply_logit_bias_inplace": lambda: np_bias(c, work),
        "apply_penalty_inplace": lambda: np_penalty(c, work),
        "apply_bitmask_inplace": lambda: np_bitmask(c, work),
        "softmax_with_temperature": lambda: np_softmax(c, c["logits"]),
        "renormalize_probs": lambda: np_renormalize(c, c["probs"]),
        "multinomial_from_uniform": lambda: np_multinomial(c, c["probs"]),
        "argmax": lambda: np.argmax(c["logits"], axis=1),
        "top_n": lambda: np_top_n(c, c["logits"]),
        "log_softmax_gather": lambda: np_log_softmax_gather(c, c["logits"]),
    }
    with_torch = torch_versions(c)
    rows = []
    for name, fn in ours.items():
        memcpy = median_us(lambda: np.copyto(copy_dst, c["logits"]), repeat)
        ours_us = median_us(fn, repeat)
        numpy_us = median_us(plain[name], max(3, repeat // 3))
        torch_us = median_us(with_torch[name], repeat) if name in with_torch else None
        rows.append({"kernel": name, "B": batch, "V": vocab, "ours": ours_us, "numpy": numpy_us, "torch": torch_us,
                     "memcpy": memcpy})
    return rows


def bench_cuda(library_dir: str | None) -> None:
    """The GPU table: every kernel at 1 x 128256, 64 x 128256 and 256 x 151936 against a device-to-device copy and
    torch's equivalents on the same card, then issue 38's aims, met or not (``scripts/cuda_check.py``)."""
    from cuda_check import aims, bench, markdown
    from logitproc.runtime import Device
    from logitproc.runtime.kernel_library import KernelLibrary

    library = KernelLibrary.load(library_dir) if library_dir else build_kernels("cuda", "sm_90")
    device = Device("cuda")
    print(f"# machine: {machine_line()}; GPU: {[str(d) for d in Device.available() if d.kind == 'cuda']}")
    rows = bench(device, device.load(library))
    print(markdown(rows))
    print("\n".join(aims(rows)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--vocab", type=int, nargs="+", default=[32000, 128256])
    parser.add_argument("--repeat", type=int, default=15)
    parser.add_argument("--markdown", action="store_true", help="print a markdown table for docs/benchmarks.md")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cuda: the GPU through the CUDA driver (scripts/cuda_check.py's benchmark: each kernel "
                             "against a device copy and torch's equivalents, timed as CUDA graphs)")
    parser.add_argument("--library", help="with --device cuda: an exported CUDA kernel library (else built here)")
    args = parser.parse_args()
    if args.device == "cuda":
        bench_cuda(args.library)
        return
    lib = build_kernels("cpu")
    rng = np.random.default_rng(0)
    print(f"# machine: {machine_line()}")
    header = ["kernel", "B", "V", "ours us", "numpy us", "torch us", "memcpy us", "numpy/ours", "torch/ours",
              "ours/memcpy"]
    if args.markdown:
        print("| " + " | ".join(header) + " |")
        print("|" + "---|" * len(header))
    else:
        print("{:<26}{:>4}{:>8}{:>11}{:>11}{:>11}{:>11}{:>12}{:>12}{:>13}".format(*header))
    for vocab in args.vocab:
        for batch in args.batch:
            for r in bench_case(lib, batch, vocab, args.repeat, rng):
                torch_us = "-" if r["torch"] is None else f"{r['torch']:.0f}"
                torch_ratio = "-" if r["torch"] is None else f"{r['torch'] / r['ours']:.1f}x"
                cells = [r["kernel"], r["B"], r["V"], f"{r['ours']:.0f}", f"{r['numpy']:.0f}", torch_us,
                         f"{r['memcpy']:.0f}", f"{r['numpy'] / r['ours']:.1f}x", torch_ratio,
                         f"{r['ours'] / r['memcpy']:.2f}"]
                if args.markdown:
                    print("| " + " | ".join(str(x) for x in cells) + " |")
                else:
                    print("{:<26}{:>4}{:>8}{:>11}{:>11}{:>11}{:>11}{:>12}{:>12}{:>13}".format(*cells))


if __name__ == "__main__":
    main()
