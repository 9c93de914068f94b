"""Check and time logitproc's CUDA kernels through the CUDA driver: the kernel table, the runtime, a benchmark.

Runs on a GPU machine from an exported library (``logitproc compile-kernels --target cuda --arch sm_90 --out DIR``),
numpy and NVIDIA's cuda-bindings; TVM is not needed: the kernels load and launch through
``runtime/cuda_launch.py`` (which imports no TVM), and where TVM is missing the ``logitproc`` folders are imported
without running their package ``__init__`` (``import_logitproc_without_tvm``), whatever this checkout's folder is
named. Then

1. every case of ``tests/kernel_cases.py`` (10 kernels x 7 awkward sizes) against the numpy references;
2. where TVM is installed (the runtime imports it): ``LogitProcessor`` and ``Sampler`` on the GPU against the same
   pipeline in numpy (bias, penalties, temperature, top-k/top-p/min-p, greedy rows, the staged and fused sampling
   paths, a torch CUDA tensor in place), and draft chains with masks from a mask source (each draft row against its
   prefix alone); skipped with the reason otherwise;
3. with ``--bench``: each kernel at B x V = 1 x 128256, 64 x 128256, 256 x 151936 against a device-to-device copy
   of the same logits and torch's equivalents on the same card, each timed as a CUDA graph of repeated launches
   (launch overhead excluded; CUDA events), then one line per aim of issue 38 (measured, bound, met or not), and
   each kernel's share of the multi-kernel functions (softmax, renormalize, the fused sampler with top-p 0.9, top_n)
   at 1 x 128256 and 64 x 128256 (the time of the first k kernels, less that of the first k - 1).

Usage: python scripts/cuda_check.py DIR [--bench] [--json OUT]   (``scripts/bench_kernels.py --device cuda`` runs
``--bench`` alone). For a lent GPU session (docs/kernels.md, "Measuring on a GPU"): export the library here into the
ignored folder ``.dev`` (``python -m logitproc compile-kernels --target cuda --arch sm_90 --out .dev/cuda-sm_90``),
carry ``.dev``, and run ``python3 scripts/cuda_check.py .dev/cuda-sm_90 --bench --json $OUT/cuda.json`` there.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
import types
from pathlib import Path
from typing import Any

import numpy as np

#: The checkout's root: the ``logitproc`` package itself.
REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))


def tvm_installed() -> bool:
    """Whether TVM imports here (the runtime's checks need it; the kernels and the benchmark do not)."""
    try:
        import tvm  # noqa: F401
    except ImportError:
        return False
    return True


def import_logitproc_without_tvm() -> None:
    """Make ``logitproc.runtime.cuda_launch`` and ``logitproc.tir_kernels.reference`` importable where TVM is not:
    ``logitproc`` and ``logitproc.runtime`` become plain namespaces over this checkout's folders (their ``__init__``
    files, which import TVM, do not run). Modules imported later through them must not import TVM themselves."""
    for name, folder in (("logitproc", REPO), ("logitproc.runtime", REPO / "runtime")):
        if name in sys.modules:
            continue
        package = types.ModuleType(name)
        package.__path__ = [str(folder)]
        sys.modules[name] = package

BENCH_SHAPES = ((1, 128256), (64, 128256), (256, 151936))
#: Launches captured in one graph (the time per launch is the graph's time over this).
LAUNCHES_PER_GRAPH = 20


def check_cases(device: Any, kernels: dict) -> dict:
    from kernel_cases import all_cases

    passed, failures = 0, []
    for case in all_cases():
        try:
            args = [device.upload(np.ascontiguousarray(a)) for a in case.args]
            kernels[case.kernel](*args)
            case.check([device.download(a) for a in args])
            passed += 1
        except Exception as exc:  # noqa: BLE001 - every failure is reported, the run goes on
            failures.append(f"{case.id}: {type(exc).__name__}: {str(exc)[:300]}")
    return {"passed": passed, "failed": len(failures), "failures": failures}


def check_runtime(library: Any, device: Any) -> dict:
    """The processor and the sampler on the GPU against ``tests/pipeline_reference.py`` (numpy): processed logits
    and probabilities of a mixed batch (bias, penalties, masks, temperature, top-k/top-p/min-p), greedy tokens, and
    sampled tokens that the processed distribution allows (staged and fused paths)."""
    from logitproc import GenerationConfig, RequestState
    from logitproc.runtime import LogitProcessor, Sampler
    from pipeline_reference import process_row

    vocab = 32003
    configs = [
        GenerationConfig(), GenerationConfig(temperature=0.0),
        GenerationConfig(temperature=0.7, top_p=0.9, top_k=50, min_p=0.05, presence_penalty=0.5,
                         frequency_penalty=0.3, repetition_penalty=1.1, logit_bias={42: 5.0, 7: -100.0}),
        GenerationConfig(repetition_penalty=1.3), GenerationConfig(temperature=1.5, top_k=3),
        GenerationConfig(frequency_penalty=-1.0, presence_penalty=2.0, top_p=0.5),
        GenerationConfig(logit_bias={0: 100.0, 1002: -50.0}, min_p=0.2, temperature=0.0),
    ]
    proc = LogitProcessor(library, vocab_size=vocab, max_num_token=16, device=device)
    sampler = Sampler(library, vocab_size=vocab, max_num_token=16, device=device)
    logits = (np.random.default_rng(0).standard_normal((len(configs), vocab)) * 3).astype(np.float32)
    states, expected_logits, expected_probs = [], [], []
    for cfg in configs:
        state = RequestState((5, 6, 7, 5), cfg)
        for t in (9, 9, 11):
            state.append_token(t)
        states.append(state)
        x, p = process_row(logits[len(states) - 1], cfg, state.prompt_token_ids, state.output_token_ids, None)
        expected_logits.append(x)
        expected_probs.append(p)
    work = logits.copy()
    proc.inplace_update_logits(work, states)
    probs = sampler.renormalize(proc.compute_probs_from_logits(work, states), states)
    exp_x, exp_p = np.stack(expected_logits), np.stack(expected_probs)
    finite = np.isfinite(exp_x)
    result: dict = {
        "logits_max_abs_error": float(np.max(np.abs(np.where(finite, work - exp_x, 0)))),
        "logits_inf_agree": bool(np.array_equal(np.isfinite(work), finite)),
        "probs_max_abs_error": float(np.max(np.abs(probs - exp_p))),
    }
    for fused in (False, True):
        out = sampler.sample_from_logits(work.copy(), states) if fused else sampler.sample(probs, states)
        tokens = [int(t) for t in out.token_ids]
        allowed = all(exp_p[r, t] > 0 for r, t in enumerate(tokens))
        greedy = all(tokens[r] == int(np.argmax(exp_x[r])) for r, c in enumerate(configs) if c.temperature == 0)
        result["fused" if fused else "staged"] = {"tokens": tokens, "allowed": allowed, "greedy_equal": greedy}
    try:  # a torch CUDA tensor is processed in place, without a host round trip
        import torch

        if torch.cuda.is_available():
            tensor = torch.from_numpy(logits.copy()).cuda()
            torch.cuda.synchronize()
            proc.inplace_update_logits(tensor, states)
            device.synchronize()
            result["torch_cuda_max_abs_error"] = float(np.max(np.abs(np.where(finite, tensor.cpu().numpy() - exp_x,
                                                                              0))))
    except ImportError:
        pass
    result["ok"] = (result["logits_max_abs_error"] < 1e-4 and result.get("torch_cuda_max_abs_error", 0) < 1e-4
                    and result["logits_inf_agree"]
                    and result["probs_max_abs_error"] < 1e-5
                    and all(result[k]["allowed"] and result[k]["greedy_equal"] for k in ("staged", "fused")))
    return result


class _AllowedEvery:
    """A mask source allowing every ``step``-th token, plus token t + 1 after each draft token t (as the tests')."""

    def __init__(self, vocab: int, step: int) -> None:
        self.allowed = np.zeros(vocab, bool)
        self.allowed[::step] = True

    def allowed_after(self, path) -> np.ndarray:
        allowed = self.allowed.copy()
        for t in path:
            allowed[(t + 1) % allowed.size] = True
        return allowed

    def fill_bitmask(self, row: np.ndarray, draft_path) -> bool:
        bits = np.packbits(self.allowed_after(draft_path), bitorder="little")
        words = np.zeros(row.size * 4, np.uint8)
        words[: bits.size] = bits
        row[:] = words.view(np.int32)[: row.size]
        return True

    def accept_token(self, token_id: int) -> None:
        pass

    def rollback(self, num_tokens: int) -> None:
        pass

    def jump_forward(self, output_token_ids) -> None:
        return None


def check_drafts_and_masks(library: Any, device: Any) -> dict:
    """Draft chains and grammar-style masks through the processor on the device: each draft row equals the numpy
    pipeline of its prefix alone (its mask after that prefix, its penalties counting the drafted tokens)."""
    from logitproc import GenerationConfig, RequestState
    from logitproc.runtime import LogitProcessor
    from pipeline_reference import process_row

    vocab = 32003
    proc = LogitProcessor(library, vocab_size=vocab, max_num_token=16, device=device)
    configs = [GenerationConfig(temperature=0.7, top_p=0.9, repetition_penalty=1.2, presence_penalty=0.5),
               GenerationConfig(frequency_penalty=1.0, logit_bias={3: 4.0})]
    states = []
    for i, cfg in enumerate(configs):
        state = RequestState((5, 6, 7, 5), cfg, mask_sources=[_AllowedEvery(vocab, 2 + i)])
        for t in (9, 9, 11):
            state.append_token(t)
        state.draft_token_ids = [50, 51, 50]
        states.append(state)
    rows = sum(1 + len(s.draft_token_ids) for s in states)
    logits = (np.random.default_rng(3).standard_normal((rows, vocab)) * 3).astype(np.float32)
    work = logits.copy()
    batch = proc.inplace_update_logits(work, states)
    worst = 0.0
    for r in range(rows):
        state, path = batch.row_states[r], tuple(batch.paths[r])
        mask = state.mask_sources[0].allowed_after(path)
        x, _ = process_row(logits[r], state.config, state.prompt_token_ids, list(state.output_token_ids) + list(path),
                           mask)
        finite = np.isfinite(x)
        if not np.array_equal(finite, np.isfinite(work[r])):
            return {"ok": False, "row": r, "why": "masked tokens differ"}
        with np.errstate(invalid="ignore"):
            worst = max(worst, float(np.max(np.abs(np.where(finite, work[r] - x, 0)))))
    return {"rows": rows, "max_abs_error": worst, "ok": worst < 1e-4}


def bench(device: Any, kernels: dict) -> list[dict]:
    from kernel_cases import CASE_BUILDERS

    rows = []
    for batch, vocab in BENCH_SHAPES:
        rng = np.random.default_rng(batch + vocab)
        src = device.upload((rng.standard_normal((batch, vocab)) * 3).astype(np.float32))
        dst = device.empty((batch, vocab), "float32")
        row = {"shape": f"{batch} x {vocab}",
               "copy_us": device.time_launches(lambda s=src, d=dst: device.copy(d, s), LAUNCHES_PER_GRAPH) * 1e6}
        for builder in CASE_BUILDERS:
            case = builder(rng, batch, vocab)
            args = [device.upload(np.ascontiguousarray(a)) for a in case.args]
            fn = kernels[case.kernel]
            try:
                row[f"{case.kernel}_us"] = device.time_launches(lambda f=fn, a=args: f(*a), LAUNCHES_PER_GRAPH) * 1e6
            except Exception as exc:  # noqa: BLE001
                row[f"{case.kernel}_us"] = f"{type(exc).__name__}: {exc}"
        row.update(variant_times(device, kernels, rng, batch, vocab))
        row.update(torch_times(batch, vocab))
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def variant_times(device: Any, kernels: dict, rng: np.random.Generator, batch: int, vocab: int) -> dict:
    """The sampling kernels with one filter at a time (what each costs): no filter, top-p 0.9 alone, top-k 50 alone."""
    from kernel_cases import renormalize_case, sample_from_logits_case

    out = {}
    settings = {"plain": (0, 1.0, 0.0), "top_p": (0, 0.9, 0.0), "top_k": (50, 1.0, 0.0), "min_p": (0, 1.0, 0.05)}
    for name, (k, p, m) in settings.items():
        case = sample_from_logits_case(rng, batch, vocab)
        args = [np.ascontiguousarray(a) for a in case.args]
        args[2][:], args[3][:], args[4][:] = k, p, m  # top_k, top_p, min_p
        args[5][:] = 0 if name == "plain" else 1  # renorm
        args[7][:] = -1  # no mask
        args[11][:] = 0  # no top-n
        on = [device.upload(a) for a in args]
        out[f"sample_{name}_us"] = device.time_launches(lambda a=on: kernels["sample_from_logits"](*a),
                                                        LAUNCHES_PER_GRAPH) * 1e6
        if name != "plain":
            case = renormalize_case(rng, batch, vocab)
            args = [np.ascontiguousarray(a) for a in case.args]
            args[1][:], args[2][:], args[3][:] = k, p, m  # top_k, top_p, min_p
            on = [device.upload(a) for a in args]
            out[f"renormalize_{name}_us"] = device.time_launches(lambda a=on: kernels["renormalize_probs"](*a),
                                                                 LAUNCHES_PER_GRAPH) * 1e6
    # top_n at the width of OpenAI's top_logprobs (20) on logits without ties (the table's case rounds them)
    on = [device.upload((rng.standard_normal((batch, vocab)) * 3).astype(np.float32)),
          device.empty((batch, 20), "float32"), device.empty((batch, 20), "int32")]
    out["top_n20_us"] = device.time_launches(lambda a=on: kernels["top_n"](*a), LAUNCHES_PER_GRAPH) * 1e6
    return out


def torch_times(batch: int, vocab: int) -> dict:
    try:
        import torch
    except ImportError:
        return {}
    if not torch.cuda.is_available():
        return {"torch": "no CUDA in this torch"}
    x = torch.randn(batch, vocab, device="cuda") * 3
    y = torch.empty_like(x)
    t = torch.full((batch, 1), 0.8, device="cuda")

    def top_p_sample() -> torch.Tensor:  # sort-based top-p, then an exponential-race sample (graph capturable)
        probs = torch.softmax(x / t, dim=-1)
        sorted_p, idx = probs.sort(dim=-1, descending=True)
        keep = sorted_p.cumsum(dim=-1) - sorted_p < 0.9
        sorted_p = sorted_p * keep
        q = torch.empty_like(sorted_p).exponential_()
        return idx.gather(1, (sorted_p / q).argmax(dim=-1, keepdim=True))

    ops = {"torch_copy_us": lambda: y.copy_(x), "torch_softmax_us": lambda: torch.softmax(x / t, dim=-1),
           "torch_topk8_us": lambda: torch.topk(x, 8, dim=-1), "torch_top_p_sample_us": top_p_sample}
    out = {}
    for name, op in ops.items():
        try:
            stream = torch.cuda.Stream()
            with torch.cuda.stream(stream):
                for _ in range(3):
                    op()
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for _ in range(LAUNCHES_PER_GRAPH):
                    op()
            graph.replay()
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(10):
                graph.replay()
            end.record()
            torch.cuda.synchronize()
            out[name] = start.elapsed_time(end) * 1e3 / (10 * LAUNCHES_PER_GRAPH)
        except Exception as exc:  # noqa: BLE001
            out[name] = f"{type(exc).__name__}: {str(exc)[:200]}"
    return out


#: The columns of the markdown table: (title, key).
TABLE = (("copy", "copy_us"), ("softmax", "softmax_with_temperature_us"), ("renormalize", "renormalize_probs_us"),
         ("fused sampling", "sample_from_logits_us"), ("top_n", "top_n_us"), ("top_n (20)", "top_n20_us"),
         ("argmax", "argmax_us"),
         ("torch softmax", "torch_softmax_us"), ("torch top-p sample", "torch_top_p_sample_us"),
         ("torch topk(8)", "torch_topk8_us"))


def markdown(rows: list[dict]) -> str:
    """The benchmark as a markdown table: microseconds, and each kernel's ratio to the copy."""
    lines = ["| B x V | " + " | ".join(title for title, _ in TABLE) + " |",
             "| --- | " + " | ".join("---" for _ in TABLE) + " |"]
    for row in rows:
        copy = row["copy_us"]
        cells = []
        for _, key in TABLE:
            value = row.get(key)
            if not isinstance(value, float):
                cells.append("-")
            elif key == "copy_us":
                cells.append(f"{value:.1f} us")
            else:
                cells.append(f"{value:.0f} us ({value / copy:.1f}x)")
        lines.append(f"| {row['shape']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


#: Issue 38's aims: (shape, kernel column, what it is compared with, the bound). "copy": at most bound x the copy of
#: the same logits; "us": at most bound microseconds; a torch column: faster than torch's equivalent.
AIMS = (
    ("64 x 128256", "sample_from_logits_us", "copy", 3.0),
    ("64 x 128256", "softmax_with_temperature_us", "copy", 2.0),
    ("64 x 128256", "renormalize_probs_us", "copy", 4.0),
    ("64 x 128256", "top_n_us", "copy", 3.0),
    ("64 x 128256", "top_n20_us", "copy", 3.0),
    ("64 x 128256", "sample_from_logits_us", "torch_top_p_sample_us", 1.0),
    ("64 x 128256", "softmax_with_temperature_us", "torch_softmax_us", 1.0),
    ("64 x 128256", "top_n_us", "torch_topk8_us", 1.0),
    ("1 x 128256", "sample_from_logits_us", "us", 40.0),
)


def aims(rows: list[dict]) -> list[str]:
    """One line per aim: the measured figure, the bound, met or not (or why it cannot be judged)."""
    by_shape = {row["shape"]: row for row in rows}
    lines = []
    for shape, key, against, bound in AIMS:
        row = by_shape.get(shape, {})
        value, base = row.get(key), row.get("copy_us" if against == "copy" else against)
        name = f"{key.removesuffix('_us')} at {shape}"
        if not isinstance(value, float) or (against != "us" and not isinstance(base, float)):
            lines.append(f"aim {name} vs {against}: not measured ({value!r}, {base!r})")
        elif against == "us":
            lines.append(f"aim {name} <= {bound:g} us: {value:.1f} us, {'met' if value <= bound else 'NOT met'}")
        else:
            ratio = value / base
            lines.append(f"aim {name} <= {bound:g}x {against.removesuffix('_us')}: {ratio:.2f}x "
                         f"({value:.1f} / {base:.1f} us), {'met' if ratio <= bound else 'NOT met'}")
    return lines


#: The shapes of the per-kernel breakdown.
BREAKDOWN_SHAPES = ((1, 128256), (64, 128256))


def breakdown(device: Any, kernels: dict) -> list[str]:
    """One line per kernel of each multi-kernel function: its entry name and its share of the function's time
    (the first k kernels timed, less the first k - 1), at BREAKDOWN_SHAPES; the fused sampler and renormalize with
    top-p 0.9 on every row, no mask, no top-n; top_n of width 20."""
    from kernel_cases import renormalize_case, sample_from_logits_case, softmax_case
    from logitproc.runtime.cuda_launch import CudaFunction

    lines = []
    for batch, vocab in BREAKDOWN_SHAPES:
        rng = np.random.default_rng(batch * 7 + vocab)
        fused = [np.ascontiguousarray(a) for a in sample_from_logits_case(rng, batch, vocab).args]
        fused[2][:], fused[3][:], fused[4][:], fused[5][:], fused[7][:], fused[11][:] = 0, 0.9, 0, 1, -1, 0
        renorm = [np.ascontiguousarray(a) for a in renormalize_case(rng, batch, vocab).args]
        renorm[1][:], renorm[2][:], renorm[3][:] = 0, 0.9, 0
        soft = [np.ascontiguousarray(a) for a in softmax_case(rng, batch, vocab).args]
        top = [(rng.standard_normal((batch, vocab)) * 3).astype(np.float32), np.zeros((batch, 20), np.float32),
               np.zeros((batch, 20), np.int32)]
        for name, host in (("sample_from_logits", fused), ("renormalize_probs", renorm),
                           ("softmax_with_temperature", soft), ("top_n", top)):
            fn = kernels[name]
            if not isinstance(fn, CudaFunction):
                lines.append(f"breakdown of {name}: not available on {device!r} (not the CUDA driver path)")
                continue
            args = [device.upload(a) for a in host]
            before = 0.0
            for count, kernel in enumerate(fn.launches.kernels, start=1):
                total = device.time_launches(lambda f=fn, c=count, a=args: f.launch_first(c, *a),
                                             LAUNCHES_PER_GRAPH) * 1e6
                lines.append(f"breakdown {name} {batch} x {vocab}: kernel {count} {kernel.entry}: "
                             f"{total - before:.1f} us (first {count}: {total:.1f} us)")
                before = total
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("library", help="an exported CUDA kernel library (with the PTX and launches)")
    parser.add_argument("--bench", action="store_true")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    with_runtime = tvm_installed()
    if not with_runtime:
        import_logitproc_without_tvm()
    from logitproc.runtime.cuda_launch import CudaRunner, read_exported

    launches, ptx = read_exported(args.library)
    gpu = CudaRunner(0)
    report: dict = {"device": repr(gpu), "tvm": with_runtime}
    print(report, flush=True)
    started = time.perf_counter()
    kernels = gpu.functions(launches, ptx, sorted(launches))
    report["load_s"] = time.perf_counter() - started
    report["cases"] = check_cases(gpu, kernels)
    print("cases:", json.dumps(report["cases"])[:3000], flush=True)
    if with_runtime:
        from logitproc.runtime import Device
        from logitproc.runtime.kernel_library import KernelLibrary

        library, device = KernelLibrary.load(args.library), Device("cuda")
        for key, check in (("runtime", check_runtime), ("drafts_and_masks", check_drafts_and_masks)):
            try:
                report[key] = check(library, device)
            except Exception:  # noqa: BLE001
                report[key] = traceback.format_exc()
            print(f"{key}:", report[key], flush=True)
    else:
        report["runtime"] = "skipped: TVM is not installed here (the runtime imports it)"
        print("runtime:", report["runtime"], flush=True)
    if args.bench:
        report["bench"] = bench(gpu, kernels)
        print(markdown(report["bench"]))
        report["aims"] = aims(report["bench"])
        print("\n".join(report["aims"]))
        report["breakdown"] = breakdown(gpu, kernels)
        print("\n".join(report["breakdown"]))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0 if report["cases"]["failed"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
