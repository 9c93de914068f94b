"""Benchmark one processing step of the runtime, staged and fused, against numpy, torch (if installed) and a memcpy.

    python scripts/bench_runtime.py [--batch 1 8 64] [--vocab 32000 128256] [--repeat 9] [--markdown] [--top-logprobs N]
    python scripts/bench_runtime.py --host-overhead [--output-tokens 1000 32000]
    python scripts/bench_runtime.py --public-api [--parts steps hf] [--hf-batch 1 8] [--hf-repeat 3]

One step: logit bias (16 tokens per row), penalties (512 appeared tokens per row), a grammar bitmask on half the
rows, temperature softmax, top-p 0.9, sampling. ``staged`` samples through ``compute_probs_from_logits`` ->
``renormalize`` -> ``sample`` (each writing a [B, V] array), ``fused`` through ``Sampler.sample_from_logits`` (one
kernel, what the engine runs); ``sampling`` columns time the sampling
alone, from processed logits. All figures of a row come from one run of interleaved rounds (each round calls every
contender once, in turn). ``memcpy`` copies the float32 [B, V] logits once (the floor of any full pass). Each step
starts from fresh logits copied in before the clock starts (in the engine the model writes them; the copy costs one
memcpy more); ``fused`` defers the masks to the sampling kernel as the engine does, ``staged`` applies them first.
``--top-logprobs N`` adds, in the same rounds, the sampling of the same batch in which every row also asks for its N
most probable tokens' processed logprobs (staged: the top_n kernel on its probabilities; fused: the same kernel
selects them from the row it sampled from).
``--host-overhead`` measures, with 1k and 32k output tokens per row, the Python/numpy work per step (everything but
the kernels), to show that it does not grow with length, and each stage's kernel time.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import time
from collections.abc import Callable, Sequence

import numpy as np
from bench_common import machine_line, median_us
from logitproc import GenerationConfig, LogitProcessor, RequestState, Sampler
from logitproc.compile import build_kernels
from logitproc.runtime import ProcessedBatch, empty_aligned
from logitproc.runtime.batch import Batch
from logitproc.runtime.mask_source import NeverForces
from logitproc.tir_kernels import reference

try:
    import torch
except ImportError:  # optional
    torch = None

BIAS_PER_ROW = 16
APPEARED_PER_ROW = 512


class FixedMask(NeverForces):
    """A precomputed bitmask row (stands in for a grammar whose mask is ready)."""

    def __init__(self, allowed_words: np.ndarray) -> None:
        self.words = allowed_words

    def fill_bitmask(self, row: np.ndarray, draft_path: Sequence[int]) -> bool:
        np.copyto(row, self.words)
        return True

    def accept_token(self, token_id: int) -> None:
        pass

    def rollback(self, num_tokens: int) -> None:
        pass


def replace_config(state: RequestState, top_logprobs: int) -> RequestState:
    """The same request (prompt, output, masks, seed) also asking for processed top-n logprobs."""
    cfg = dataclasses.replace(state.config, logprobs=True, top_logprobs=top_logprobs)
    twin = RequestState(list(state.prompt_token_ids), cfg, mask_sources=list(state.mask_sources))
    for t in state.output_token_ids:
        twin.append_token(int(t))
    return twin


def make_batch(batch: int, vocab: int, output_tokens: int, rng: np.random.Generator) -> list[RequestState]:
    states = []
    for r in range(batch):
        bias = {int(t): 2.0 for t in rng.choice(vocab, BIAS_PER_ROW, replace=False)}
        cfg = GenerationConfig(temperature=0.7, top_p=0.9, presence_penalty=0.5, frequency_penalty=0.3,
                               repetition_penalty=1.1, logit_bias=bias, seed=r)
        mask = [FixedMask(reference.pack_bitmask(rng.random((1, vocab)) < 0.5)[0])] if r % 2 == 0 else []
        appeared = rng.choice(vocab, APPEARED_PER_ROW, replace=False)
        state = RequestState(appeared[: APPEARED_PER_ROW // 2].tolist(), cfg, mask_sources=mask)
        pool = appeared[APPEARED_PER_ROW // 2 :] if output_tokens <= APPEARED_PER_ROW else np.arange(vocab)
        for t in rng.choice(pool, output_tokens):
            state.append_token(int(t))
        states.append(state)
    return states


def numpy_step(logits: np.ndarray, states: list[RequestState], uniform: np.ndarray) -> np.ndarray:
    """The same step in plain (vectorised) numpy, from the same incremental sparse state."""
    x = logits.copy()
    for r, s in enumerate(states):
        cfg = s.config
        toks = np.fromiter(cfg.logit_bias, np.int64)
        x[r, toks] += np.fromiter(cfg.logit_bias.values(), np.float32)
        tok, cnt = s.appeared_token_ids, s.output_counts
        v = x[r, tok]
        v = np.where(v > 0, v / cfg.repetition_penalty, v * cfg.repetition_penalty)
        x[r, tok] = v - (cfg.frequency_penalty * cnt + cfg.presence_penalty * (cnt > 0))
        if s.mask_sources:
            allowed = reference.unpack_bitmask(s.mask_sources[0].words[None, :], x.shape[1])[0]
            x[r] = np.where(allowed, x[r], -np.inf)
    z = x / 0.7
    e = np.exp(z - z.max(axis=1, keepdims=True))
    p = e / e.sum(axis=1, keepdims=True)
    order = np.argsort(-p, axis=1)
    sp = np.take_along_axis(p, order, axis=1)
    csum = np.cumsum(sp, axis=1)
    sp[(csum - sp) >= 0.9] = 0
    target = uniform[:, None] * sp.sum(axis=1, keepdims=True)
    idx = (np.cumsum(sp, axis=1) <= target).sum(axis=1)
    return order[np.arange(len(states)), np.minimum(idx, p.shape[1] - 1)]


def torch_step(logits: np.ndarray, states: list[RequestState], uniform: np.ndarray) -> object:
    x = torch.from_numpy(logits.copy())
    for r, s in enumerate(states):
        cfg = s.config
        x[r, torch.tensor(list(cfg.logit_bias))] += 2.0
        tok = torch.from_numpy(s.appeared_token_ids.astype(np.int64))
        cnt = torch.from_numpy(s.output_counts.astype(np.float32))
        v = x[r, tok]
        v = torch.where(v > 0, v / cfg.repetition_penalty, v * cfg.repetition_penalty)
        x[r, tok] = v - (cfg.frequency_penalty * cnt + cfg.presence_penalty * (cnt > 0))
        if s.mask_sources:
            allowed = torch.from_numpy(reference.unpack_bitmask(s.mask_sources[0].words[None, :], x.shape[1])[0])
            x[r] = torch.where(allowed, x[r], float("-inf"))
    p = torch.softmax(x / 0.7, dim=1)
    sp, order = torch.sort(p, dim=1, descending=True)
    csum = torch.cumsum(sp, dim=1)
    sp[(csum - sp) >= 0.9] = 0
    return order.gather(1, torch.multinomial(sp, 1))


def staged_sampling(proc: LogitProcessor, sampler: Sampler, logits: np.ndarray,
                    batch: Batch | ProcessedBatch) -> np.ndarray:
    probs = sampler.renormalize(proc.compute_probs_from_logits(logits, batch), batch)
    return sampler.sample(probs, batch).token_ids


def fused_sampling(proc: LogitProcessor, sampler: Sampler, logits: np.ndarray,
                   batch: Batch | ProcessedBatch) -> np.ndarray:
    return sampler.sample_from_logits(logits, batch).token_ids


def step(proc: LogitProcessor, sampler: Sampler, logits: np.ndarray, states: list[RequestState],
         sampling: Callable[..., np.ndarray] = fused_sampling) -> np.ndarray:
    batch = proc.batch(states)  # the step's rows, worked out once and handed to every stage (as the engine does)
    # as the engine does: the fused kernel reads the masks itself (they come back in the ProcessedBatch); the staged
    # path applies them to the logits
    processed = proc.inplace_update_logits(logits, batch, defer_masks=sampling is fused_sampling)
    return sampling(proc, sampler, logits, processed)


Contender = Callable[[], object] | tuple[Callable[[], object], Callable[[], object]]


def interleaved_us(contenders: dict[str, Contender], rounds: int) -> dict[str, float]:
    """Median wall time of each contender in microseconds over ``rounds`` rounds; each round calls every contender
    once, starting one further along each time (so that load changes and cache effects fall on all alike). A
    contender given as ``(setup, run)`` has ``setup`` called before the clock starts."""
    names = list(contenders)
    samples: dict[str, list[float]] = {name: [] for name in names}
    pairs = {name: c if isinstance(c, tuple) else (lambda: None, c) for name, c in contenders.items()}
    for name in names:  # warm-up
        pairs[name][0]()
        pairs[name][1]()
    for i in range(rounds):
        for name in names[i % len(names):] + names[: i % len(names)]:
            setup, run = pairs[name]
            setup()
            start = time.perf_counter()
            run()
            samples[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) * 1e6 for name, values in samples.items()}


def bench_steps(args: argparse.Namespace, lib) -> None:
    rng = np.random.default_rng(0)
    header = ["B", "V", "staged us", "fused us", "numpy us", "torch us", "memcpy us", "staged/memcpy", "fused/memcpy",
              "numpy/fused", "sampling staged us", "sampling fused us", "sampling fused/memcpy"]
    if args.top_logprobs:
        header += [f"top-{args.top_logprobs} staged us", f"top-{args.top_logprobs} fused us"]
    print("| " + " | ".join(header) + " |" if args.markdown else "".join(f"{h:>14}" for h in header))
    if args.markdown:
        print("|" + "---|" * len(header))
    for vocab in args.vocab:
        proc = LogitProcessor(lib, vocab, max(args.batch))
        sampler = Sampler(lib, vocab, max_num_token=max(args.batch))
        for batch in args.batch:
            states = make_batch(batch, vocab, 128, rng)
            base = (rng.standard_normal((batch, vocab)) * 3).astype(np.float32)
            work = empty_aligned((batch, vocab))
            copy_dst = np.empty_like(base)
            uniform = rng.random(batch)
            processed = empty_aligned((batch, vocab))
            np.copyto(processed, base)
            processed_batch = proc.batch(states)
            proc.inplace_update_logits(processed, processed_batch)

            def full_step(sampling: Callable[..., np.ndarray], work=work, base=base, states=states, proc=proc,
                          sampler=sampler) -> Contender:
                # fresh logits before each step (the model's output; the copy is the memcpy column), then the step
                return (lambda: np.copyto(work, base)), (lambda: step(proc, sampler, work, states, sampling))

            def sampling_only(sampling: Callable[..., np.ndarray], logits=processed, batch_=processed_batch,
                              proc=proc, sampler=sampler) -> Callable[[], object]:
                return lambda: sampling(proc, sampler, logits, batch_)

            contenders = {
                "memcpy": lambda base=base, dst=copy_dst: np.copyto(dst, base),
                "staged": full_step(staged_sampling), "fused": full_step(fused_sampling),
                "sampling staged": sampling_only(staged_sampling), "sampling fused": sampling_only(fused_sampling),
            }
            if args.top_logprobs:
                with_top = proc.batch([replace_config(s, args.top_logprobs) for s in states])
                contenders["top staged"] = sampling_only(staged_sampling, batch_=with_top)
                contenders["top fused"] = sampling_only(fused_sampling, batch_=with_top)
            us = interleaved_us(contenders, args.repeat)
            if torch is not None:  # apart: its own thread pool would slow the contenders of its rounds
                us["torch"] = median_us(lambda base=base, states=states, u=uniform: torch_step(base, states, u),
                                        max(3, args.repeat // 3))
            numpy_us = median_us(lambda base=base, states=states, u=uniform: numpy_step(base, states, u),
                                 max(3, args.repeat // 3))
            memcpy = us["memcpy"]
            cells = [batch, vocab, f"{us['staged']:.0f}", f"{us['fused']:.0f}", f"{numpy_us:.0f}",
                     f"{us['torch']:.0f}" if "torch" in us else "-", f"{memcpy:.0f}", f"{us['staged'] / memcpy:.2f}",
                     f"{us['fused'] / memcpy:.2f}", f"{numpy_us / us['fused']:.1f}x", f"{us['sampling staged']:.0f}",
                     f"{us['sampling fused']:.0f}", f"{us['sampling fused'] / memcpy:.2f}"]
            if args.top_logprobs:
                cells += [f"{us['top staged']:.0f}", f"{us['top fused']:.0f}"]
            print("| " + " | ".join(map(str, cells)) + " |" if args.markdown else "".join(f"{c:>14}" for c in cells))


def bench_host_overhead(args: argparse.Namespace, lib) -> None:
    """Per-step time outside the kernels, with long outputs: it must stay flat as sequences grow."""
    rng = np.random.default_rng(1)
    batch, vocab = max(args.batch), max(args.vocab)
    proc = LogitProcessor(lib, vocab, batch)
    sampler = Sampler(lib, vocab, max_num_token=batch)
    kernel_time = [0.0]
    per_kernel: dict[str, list[float]] = {}

    def timed(name: str, fn: Callable[..., None]) -> Callable[..., None]:
        def call(*a: object) -> None:
            start = time.perf_counter()
            fn(*a)
            took = time.perf_counter() - start
            kernel_time[0] += took
            per_kernel.setdefault(name, []).append(took)
        return call

    proc.kernels = {k: timed(k, f) for k, f in proc.kernels.items()}
    sampler.kernels = {k: timed(k, f) for k, f in sampler.kernels.items()}
    print(f"host overhead per step, B={batch}, V={vocab} (everything but kernel execution):")
    for output_tokens in args.output_tokens:
        states = make_batch(batch, vocab, output_tokens, rng)
        entries = sum(s.appeared_token_ids.size for s in states)
        logits = empty_aligned((batch, vocab))
        logits[...] = rng.standard_normal((batch, vocab))
        totals, kernels = [], []
        per_kernel.clear()
        for _ in range(args.repeat):
            kernel_time[0] = 0.0
            start = time.perf_counter()
            step(proc, sampler, logits, states)
            totals.append(time.perf_counter() - start)
            kernels.append(kernel_time[0])
        host = statistics.median(t - k for t, k in zip(totals, kernels, strict=True)) * 1e6
        stages = ", ".join(f"{name} {statistics.median(t) * 1e6:.0f}" for name, t in per_kernel.items())
        print(f"  {output_tokens:>6} output tokens/row ({entries} penalty entries): host {host:.0f} us, "
              f"kernels {statistics.median(kernels) * 1e6:.0f} us ({stages} us)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--vocab", type=int, nargs="+", default=[32000, 128256])
    parser.add_argument("--repeat", type=int, default=9)
    parser.add_argument("--markdown", action="store_true")
    parser.add_argument("--host-overhead", action="store_true")
    parser.add_argument("--top-logprobs", type=int, default=0, help="processed top-n logprobs on every row")
    parser.add_argument("--output-tokens", type=int, nargs="+", default=[1000, 32000])
    parser.add_argument("--public-api", action="store_true",
                        help="the public API on numpy and torch logits, and HF generate() (bench_public_api.py)")
    parser.add_argument("--parts", nargs="+", choices=["steps", "hf"], default=["steps", "hf"],
                        help="--public-api: the steps on numpy / torch, HF generate(), or both")
    parser.add_argument("--hf-batch", type=int, nargs="+", default=[1, 8], help="--public-api: generate() batches")
    parser.add_argument("--hf-repeat", type=int, default=3, help="--public-api: generate() rounds")
    args = parser.parse_args()
    lib = build_kernels("cpu")
    print(f"# machine: {machine_line()}; load average {os.getloadavg()[0]:.1f} at the start")
    if args.public_api:
        from bench_public_api import bench_hf_generate, bench_public_api

        if "steps" in args.parts:
            bench_public_api(args, lib)
        if "hf" in args.parts:
            bench_hf_generate(args, lib)
    elif args.host_overhead:
        bench_host_overhead(args, lib)
    else:
        bench_steps(args, lib)


if __name__ == "__main__":
    main()
