"""Where a running stream's gaps between tokens go while other requests arrive: the engine stepped in process (no
server, no HTTP), one line per step with what it fed, the seconds of each of its phases and what arrived.

    python scripts/step_trace.py [--model default] [--prompt-tokens 1000] [--steps-before 20] [--steps-after 10]
    python scripts/step_trace.py --mixed [--schemas 6]

One greedy stream (EOS banned) decodes alone for ``--steps-before`` steps; then a prompt of ``--prompt-tokens``
tokens arrives, and the steps go on until its first token and ``--steps-after`` more. ``--mixed`` replays instead
``bench_serve.py --mixed``'s arrivals as its server's loop does (``Engine.submit`` between steps, grammars compiled
on the engine's grammar thread): after 30 stream tokens a 1k-token prompt; once it has its first token and 10 more
stream tokens, a 4k-token prompt; 10 stream tokens later, ``--schemas`` requests with the largest JSON schemas of
``--schema-dir`` (8 tokens each, as the bench asks); the grammar backend is made first, as the server makes it
while loading (``Engine.prepare_constraints``).

Every step gives the stream one token, so a step's wall time plus the time between steps (the arrivals' ``submit``
calls, run between steps as the server's loop runs them) is the stream's gap. Per step: prefill tokens, the
model's prefill / decode seconds, logit processing + sampling (which waits for the grammar masks), the mask
workers' seconds (filled during the forward), the rest (scheduling, the Batch, commit, detokenizing: the engine's
own Python), the requests still compiling, and what happened (a request submitted, its grammar compiled and it
joined the queue, its first token). The summary: the median and largest gap against the decode-only median, and the
largest steps with their parts. With ``--engine-args``, the Engine's keyword arguments (a Python dict literal),
e.g. ``"{'max_prefill_tokens_with_decode': 8}"``.
"""

from __future__ import annotations

import argparse
import ast
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import machine_line  # noqa: E402

STORY = "Write a long story about a lighthouse keeper who finds a message in a bottle."


@dataclass
class StepRow:
    """One step of the trace (seconds)."""

    phase: str
    wall: float
    between: float  # since the previous step ended: the submit calls run between steps
    prefill_tokens: int
    prefill: float
    decode: float
    processing: float
    masks: float
    compiling: int
    events: list[str] = field(default_factory=list)

    @property
    def gap(self) -> float:
        """The running stream's gap that ends with this step's token."""
        return self.wall + self.between

    @property
    def rest(self) -> float:
        return self.wall - self.prefill - self.decode - self.processing


class Tracer:
    """Steps an engine and records each step's parts, with the events noted since the previous step."""

    def __init__(self, engine: Any, stream: str) -> None:
        self.engine = engine
        self.stream = stream
        self.rows: list[StepRow] = []
        self.first_token: dict[str, float] = {}  # request id -> when its first token came
        self._pending_events: list[str] = []
        self._last_end = time.perf_counter()

    def note(self, event: str) -> None:
        self._pending_events.append(f"{time.perf_counter() - self._last_end:+.3f}s {event}")

    def step(self, phase: str) -> list[Any]:
        engine, s = self.engine, self.engine.stats
        before = (s.prefill_tokens, s.prefill_seconds, s.decode_seconds, s.processing_seconds, s.mask_seconds)
        compiling = engine.num_compiling
        t0 = time.perf_counter()
        deltas = engine.step()
        end = time.perf_counter()
        events, self._pending_events = self._pending_events, []
        for d in deltas:
            if d.request_id != self.stream and d.token_ids and d.request_id not in self.first_token:
                self.first_token[d.request_id] = end
                events.append(f"first token of {d.request_id}")
        self.rows.append(StepRow(phase, end - t0, t0 - self._last_end, s.prefill_tokens - before[0],
                                 s.prefill_seconds - before[1], s.decode_seconds - before[2],
                                 s.processing_seconds - before[3], s.mask_seconds - before[4], compiling, events))
        self._last_end = end
        return deltas

    def print_table(self) -> None:
        print("| step | phase | gap ms | wall ms | between ms | prefill tokens | prefill ms | decode ms | "
              "processing ms | masks ms | rest ms | compiling | events |")
        print("| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
        for i, r in enumerate(self.rows):
            print(f"| {i} | {r.phase} | {r.gap * 1e3:.0f} | {r.wall * 1e3:.0f} | {r.between * 1e3:.1f} | "
                  f"{r.prefill_tokens} | {r.prefill * 1e3:.0f} | {r.decode * 1e3:.0f} | {r.processing * 1e3:.1f} | "
                  f"{r.masks * 1e3:.1f} | {r.rest * 1e3:.1f} | {r.compiling} | {'; '.join(r.events)} |")


def describe(row: StepRow) -> str:
    return (f"{row.prefill_tokens} prefill tokens, prefill {row.prefill * 1e3:.0f} ms, decode {row.decode * 1e3:.0f} "
            f"ms, processing {row.processing * 1e3:.1f} ms (masks {row.masks * 1e3:.1f} ms on the workers), rest "
            f"{row.rest * 1e3:.1f} ms, between steps {row.between * 1e3:.1f} ms, {row.compiling} compiling"
            + (f"; {'; '.join(row.events)}" if row.events else ""))


def long_prompt_trace(args: argparse.Namespace, model: Any, engine: Any) -> Tracer:
    """A stream decodes alone, then one long prompt of digits arrives (``add_request``)."""
    from logitproc.runtime import GenerationConfig

    eos = {t: -100.0 for t in model.eos_token_ids}
    stream = engine.add_request([{"role": "user", "content": STORY}],
                                GenerationConfig(temperature=0.0, max_tokens=4000, logit_bias=eos))
    tracer = Tracer(engine, stream)
    while engine.prompt_progress(stream) is not None or len(tracer.rows) < args.steps_before:
        tracer.step("alone")
    text = "".join(str(i % 10) for i in range(1, 50_000))  # digits tokenize about one token each
    ids = engine.tokenize(text)[: args.prompt_tokens]
    rid = engine.add_request(ids, GenerationConfig(temperature=0.0, max_tokens=args.steps_after + 1))
    tracer.note(f"{rid}: {len(ids)}-token prompt")
    while rid not in tracer.first_token:
        tracer.step("arriving")
    for _ in range(args.steps_after):
        tracer.step("after")
    return tracer


def filler_messages(engine: Any, tokens: int) -> list[dict[str, str]]:
    """bench_serve.py's long user message of about ``tokens`` tokens (its filler sentences), counted here."""
    from bench_serve import FILLER

    def text(sentences: int) -> str:
        return "".join(FILLER.format(n=i) for i in range(sentences)) + "Summarise the log in one sentence."

    def count(sentences: int) -> int:
        return len(engine.tokenize([{"role": "user", "content": text(sentences)}]))

    sentences = tokens // 40  # (a sentence is about 35 tokens)
    while sentences > 0 and count(sentences) > tokens:
        sentences -= 1
    while count(sentences + 1) <= tokens:
        sentences += 1
    return [{"role": "user", "content": text(sentences)}]


def mixed_trace(args: argparse.Namespace, model: Any, engine: Any) -> Tracer:
    """``bench_serve.py --mixed``'s arrivals, submitted between steps as its server's loop does."""
    from bench_serve import EOS_BIAS, largest_schemas
    from bench_serve import STORY as SERVE_STORY
    from logitproc.runtime import GenerationConfig
    from logitproc.runtime.response_format import parse_response_format

    schemas = largest_schemas(args.schema_dir, args.schemas)
    prompts = {n: filler_messages(engine, n) for n in (1000, 4000)}
    eos = {int(t): float(b) for t, b in EOS_BIAS.items()}
    stream = engine.add_request([{"role": "user", "content": SERVE_STORY}],
                                GenerationConfig(temperature=0.0, max_tokens=2000, logit_bias=eos))
    tracer = Tracer(engine, stream)
    arrivals: dict[str, float] = {}  # request id -> submitted at

    def submit(name: str, messages: list[dict[str, str]], **config: Any) -> str:
        t0 = time.perf_counter()
        pending = engine.submit(messages, GenerationConfig(temperature=0.0, max_tokens=8, **config))
        arrivals[pending.request_id] = t0
        tracer.note(f"{pending.request_id} ({name}) submitted in {(time.perf_counter() - t0) * 1e3:.1f} ms")
        pending.ready.add_done_callback(lambda f, rid=pending.request_id: tracer.note(
            f"{rid} compiled {time.perf_counter() - arrivals[rid]:.2f} s after submit"
            + (f" (failed: {f.exception()})" if f.exception() else "")))
        return pending.request_id

    def steps(phase: str, until: Callable[[], bool]) -> None:
        while not until():
            tracer.step(phase)

    for _ in range(30):  # the stream's prefill and 29 decode steps
        tracer.step("alone")
    first = submit("1k-token prompt", prompts[1000])
    steps("1k", lambda: first in tracer.first_token)
    for _ in range(10):
        tracer.step("1k")
    long = submit("4k-token prompt", prompts[4000])
    for _ in range(10):
        tracer.step("4k")
    ids = [submit(name, [{"role": "user", "content": "Write a JSON document for this schema."}],
                  response_format=parse_response_format(
                      {"type": "json_schema", "json_schema": {"name": "doc", "schema": schema}}))
           for name, schema in schemas]
    steps("schemas", lambda: all(rid in tracer.first_token or engine.is_done(rid) and not
                                 engine.num_compiling for rid in [*ids, long]))
    for _ in range(10):
        tracer.step("after")
    print("\nTTFT: " + ", ".join(f"{rid} {tracer.first_token[rid] - t:.2f} s" if rid in tracer.first_token
                                 else f"{rid} none" for rid, t in arrivals.items()), file=sys.stderr)
    return tracer


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default", help="'default' (SmolLM2-135M), 'tiny', a GGUF or HF folder")
    parser.add_argument("--prompt-tokens", type=int, default=1000)
    parser.add_argument("--steps-before", type=int, default=20)
    parser.add_argument("--steps-after", type=int, default=10)
    parser.add_argument("--mixed", action="store_true", help="bench_serve.py --mixed's arrivals (see the module doc)")
    parser.add_argument("--schemas", type=int, default=6, help="--mixed: schema requests (default: %(default)s)")
    parser.add_argument("--schema-dir", default="/work/shared/data/maskbench-dev",
                        help="--mixed: a folder of maskbench JSON files ({'schema': ...}) (default: %(default)s)")
    parser.add_argument("--max-batch", type=int, default=8)
    parser.add_argument("--engine-args", default="{}", help="Engine keyword arguments, a Python dict literal")
    args = parser.parse_args()

    from logitproc.serve.cli_options import open_model
    from logitproc.serve.engine import Engine

    model = open_model(args.model, "cpu")
    engine = Engine(model, max_batch=args.max_batch, **ast.literal_eval(args.engine_args))
    if args.mixed:
        engine.prepare_constraints()  # as `logitproc serve` does while loading
    tracer = mixed_trace(args, model, engine) if args.mixed else long_prompt_trace(args, model, engine)

    print(f"{machine_line()}; load average {os.getloadavg()[0]:.1f}; {model.name}; "
          + ("bench_serve --mixed arrivals" if args.mixed else f"prompt {args.prompt_tokens} tokens")
          + f"; engine args {args.engine_args}\n")
    tracer.print_table()
    rows = tracer.rows
    alone = [r.gap for r in rows if r.phase == "alone"][1:]  # (the first step prefilled the stream's own prompt)
    busy = [r for r in rows[1:] if r.phase != "alone"]
    gaps = [r.gap for r in rows[1:]]
    median, worst = statistics.median(gaps), max(rows[1:], key=lambda r: r.gap)
    print(f"\ndecode-only median {statistics.median(alone) * 1e3:.0f} ms; while requests arrive: median "
          f"{statistics.median(r.gap for r in busy) * 1e3:.0f} ms; all gaps: median {median * 1e3:.0f} ms, largest "
          f"{worst.gap * 1e3:.0f} ms ({worst.gap / median:.1f}x the median, "
          f"{worst.gap / statistics.median(alone):.1f}x decode-only)")
    print("largest gaps:")
    for row in sorted(rows[1:], key=lambda r: r.gap, reverse=True)[:5]:
        print(f"- step {rows.index(row)} ({row.phase}) {row.gap * 1e3:.0f} ms: {describe(row)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
