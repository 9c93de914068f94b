"""Engine throughput with concurrent requests: continuous batching against one request at a time, and what
preemption costs when the KV cache is short.

    python scripts/bench_engine.py [--model default] [--requests 8] [--max-tokens 64] [--short-kv 384] [--markdown]

Three runs of the same requests (chat prompts, temperature 0.7, one seed each, ``--max-tokens`` tokens each):

1. sequential: one request at a time (what a server without batching does);
2. batched: all requests added at once, up to ``--requests`` sequences per decode step;
3. batched with a KV cache of only ``--short-kv`` tokens: the engine preempts the latest requests and recomputes
   them later (their answers are the same; the preemptions and the extra prefill are the cost).

Printed: generated tokens per second of wall time for each, the ratios to sequential, preemptions, and the share of
step time in logit processing + sampling.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import machine_line  # noqa: E402

QUESTIONS = ["What is the capital of France?", "Name three colours.", "Why is the sky blue?",
             "Write a haiku about rain.", "What is 12 times 7?", "Tell me about cats.",
             "How do planes fly?", "Give me a tip for learning Python."]


def run(engine, jobs: list[tuple[list[dict[str, str]], object]], batched: bool) -> tuple[float, int, list[list[int]]]:
    """Wall seconds, generated tokens and each request's tokens."""
    started = time.perf_counter()
    outputs: dict[str, list[int]] = {}
    order: list[str] = []
    if batched:
        order = [engine.add_request(messages, config) for messages, config in jobs]
        while engine.has_unfinished():
            for delta in engine.step():
                if delta.output is not None:
                    outputs[delta.request_id] = delta.output.token_ids
    else:
        for k, (messages, config) in enumerate(jobs):
            [out] = engine.generate(messages, config)
            outputs[str(k)] = out.token_ids
            order.append(str(k))
    seconds = time.perf_counter() - started
    tokens = [outputs[rid] for rid in order]
    return seconds, sum(len(t) for t in tokens), tokens


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default", help="'default' (SmolLM2-135M), 'tiny', a GGUF or HF folder")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--short-kv", type=int, default=384, help="KV cache tokens of the third run")
    parser.add_argument("--markdown", action="store_true", help="print a table for docs/benchmarks.md")
    args = parser.parse_args()

    from logitproc.runtime import GenerationConfig
    from logitproc.serve.cli_options import TINY_MODEL, tiny_model
    from logitproc.serve.compiled_model import CompiledModel
    from logitproc.serve.engine import Engine

    spec = tiny_model() if args.model == TINY_MODEL else args.model
    jobs = [([{"role": "user", "content": QUESTIONS[k % len(QUESTIONS)]}],
             GenerationConfig(temperature=0.7, seed=k, max_tokens=args.max_tokens, ignore_eos=True))
            for k in range(args.requests)]
    model = CompiledModel.open(spec, max_num_sequences=args.requests)
    short = CompiledModel.open(spec, max_num_sequences=args.requests, max_total_tokens=args.short_kv)
    rows = []
    seq_s, seq_tokens, expected = run(Engine(model, max_batch=1), jobs, batched=False)
    rows.append(("sequential (1 at a time)", seq_s, seq_tokens, 0, None))
    engine = Engine(model, max_batch=args.requests)
    bat_s, bat_tokens, got = run(engine, jobs, batched=True)
    assert got == expected, "batched answers differ from sequential ones"
    rows.append((f"batched ({args.requests} at once)", bat_s, bat_tokens, 0, engine.stats.processing_share))
    engine = Engine(short, max_batch=args.requests)
    pre_s, pre_tokens, got = run(engine, jobs, batched=True)
    assert got == expected, "answers after preemption differ from sequential ones"
    rows.append((f"batched, KV cache {args.short_kv} tokens", pre_s, pre_tokens, engine.stats.preemptions,
                 engine.stats.processing_share))

    print(machine_line())
    print(f"{model.name}: {args.requests} requests x {args.max_tokens} tokens (chat prompts, temperature 0.7)")
    if args.markdown:
        print("| run | wall s | generated tok/s | vs sequential | preemptions | processing share |")
        print("|---|---|---|---|---|---|")
    for name, seconds, tokens, preemptions, share in rows:
        rate = tokens / seconds
        ratio = rate / (seq_tokens / seq_s)
        share_text = "-" if share is None else f"{100 * share:.1f}%"
        if args.markdown:
            print(f"| {name} | {seconds:.1f} | {rate:.1f} | {ratio:.2f}x | {preemptions} | {share_text} |")
        else:
            print(f"{name:34s} {seconds:7.1f} s {rate:8.1f} tok/s {ratio:6.2f}x  preemptions {preemptions:3d}  "
                  f"processing {share_text}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
