"""Where a running stream's gaps between tokens go while a long prompt arrives: the engine stepped in process (no
server, no HTTP), one line per step with what it fed and the seconds of each of its phases.

    python scripts/step_trace.py [--model default] [--prompt-tokens 1000] [--steps-before 20] [--steps-after 10]

One greedy stream (EOS banned) decodes alone for ``--steps-before`` steps; then a prompt of ``--prompt-tokens``
tokens arrives, and the steps go on until its first token and ``--steps-after`` more. Every step gives the stream one
token, so a step's wall time is the stream's gap. Per step: prefill tokens, the model's prefill / decode seconds,
logit processing + sampling, and the rest (scheduling, the Batch, commit, detokenizing: the engine's own Python).
The summary: the median and largest gap while the prompt goes in, against the decode-only median, and what the
largest step spent its time on. With ``--engine-args``, the Engine's keyword arguments (a Python dict literal), e.g.
``"{'max_prefill_tokens_with_decode': 8}"``.
"""

from __future__ import annotations

import argparse
import ast
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import machine_line  # noqa: E402

STORY = "Write a long story about a lighthouse keeper who finds a message in a bottle."


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default", help="'default' (SmolLM2-135M), 'tiny', a GGUF or HF folder")
    parser.add_argument("--prompt-tokens", type=int, default=1000)
    parser.add_argument("--steps-before", type=int, default=20)
    parser.add_argument("--steps-after", type=int, default=10)
    parser.add_argument("--engine-args", default="{}", help="Engine keyword arguments, a Python dict literal")
    args = parser.parse_args()

    from logitproc.runtime import GenerationConfig
    from logitproc.serve.cli_options import open_model
    from logitproc.serve.engine import Engine

    model = open_model(args.model, "cpu")
    engine = Engine(model, max_batch=4, **ast.literal_eval(args.engine_args))
    eos = {t: -100.0 for t in model.eos_token_ids}
    stream = engine.add_request([{"role": "user", "content": STORY}],
                                GenerationConfig(temperature=0.0, max_tokens=4000, logit_bias=eos))
    rows: list[tuple[str, float, int, float, float, float]] = []  # (phase, wall, prefill tokens, prefill, decode, proc)

    def step(phase: str) -> bool:
        """One step; False once the long prompt has its first token."""
        s = engine.stats
        before = (s.prefill_tokens, s.prefill_seconds, s.decode_seconds, s.processing_seconds)
        t0 = time.perf_counter()
        deltas = engine.step()
        wall = time.perf_counter() - t0
        rows.append((phase, wall, s.prefill_tokens - before[0], s.prefill_seconds - before[1],
                     s.decode_seconds - before[2], s.processing_seconds - before[3]))
        return not any(d.request_id != stream and d.token_ids for d in deltas)

    while engine.scheduler.prompt_progress(stream) is not None or len(rows) < args.steps_before:
        step("alone")
    text = "".join(str(i % 10) for i in range(1, 50_000))  # digits tokenize about one token each
    ids = engine.tokenize(text)[: args.prompt_tokens]
    engine.add_request(ids, GenerationConfig(temperature=0.0, max_tokens=args.steps_after + 1))
    while step("arriving"):
        pass
    for _ in range(args.steps_after):
        step("after")

    print(f"{machine_line()}; load average {os.getloadavg()[0]:.1f}; {model.name}; prompt {args.prompt_tokens} "
          f"tokens; engine args {args.engine_args}\n")
    print("| step | phase | wall ms | prefill tokens | prefill ms | decode ms | processing ms | rest ms |")
    print("| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for i, (phase, wall, tokens, prefill, decode, proc) in enumerate(rows):
        rest = wall - prefill - decode - proc
        print(f"| {i} | {phase} | {wall * 1e3:.0f} | {tokens} | {prefill * 1e3:.0f} | {decode * 1e3:.0f} | "
              f"{proc * 1e3:.1f} | {rest * 1e3:.1f} |")
    alone = [r[1] for r in rows if r[0] == "alone"][1:]  # (the first step prefilled the stream's own prompt)
    busy = [r for r in rows if r[0] == "arriving"]
    worst = max(busy, key=lambda r: r[1])
    median = statistics.median(r[1] for r in busy)
    print(f"\ndecode-only median {statistics.median(alone) * 1e3:.0f} ms; while the prompt goes in: median "
          f"{median * 1e3:.0f} ms, largest {worst[1] * 1e3:.0f} ms ({worst[1] / median:.1f}x the median, "
          f"{worst[1] / statistics.median(alone):.1f}x decode-only): {worst[2]} prefill tokens, prefill "
          f"{worst[3] * 1e3:.0f} ms, decode {worst[4] * 1e3:.0f} ms, processing {worst[5] * 1e3:.1f} ms, rest "
          f"{(worst[1] - worst[3] - worst[4] - worst[5]) * 1e3:.1f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
