"""Time to first token with and without the engine's prefix cache: a conversation's later turns, and requests that
share a long system prompt.

    python scripts/bench_prefix.py [--model default] [--system-tokens 1000] [--rounds 3]

Two scenarios, each run by an engine with the prefix cache and by one without, alternated in every round (best of
``--rounds`` kept; the machine is shared, so compare only within one run):

1. a three-turn chat (greedy, 48 tokens an answer): time to first token of turns two and three, whose prompts repeat
   the earlier turns;
2. four questions after the same system prompt of about ``--system-tokens`` tokens: time to first token of the
   second to fourth (the first fills the cache).

Printed: each TTFT with and without the cache, the ratio, the prompt tokens and how many came from the cache.
Answers are checked equal between the two engines.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import machine_line  # noqa: E402

TURNS = ["What is the capital of France?", "What is it famous for?", "Name one museum there."]
QUESTIONS = ["What is 12 times 7?", "Name three colours.", "Why is the sky blue?", "Write a haiku about rain."]


def first_token(engine, prompt, config) -> tuple[float, object]:
    """Seconds to the first generated token, and the request's output."""
    started, ttft, output = time.perf_counter(), None, None
    for delta in engine.stream(prompt, config):
        if ttft is None and delta.token_ids:
            ttft = time.perf_counter() - started
        if delta.output is not None:
            output = delta.output
    return ttft, output


def conversation(engine, config) -> list[tuple[float, object]]:
    history, results = [], []
    for turn in TURNS:
        history.append({"role": "user", "content": turn})
        ttft, out = first_token(engine, history, config)
        results.append((ttft, out))
        history.append({"role": "assistant", "content": out.text})
    return results


def shared_system(engine, config, system: str) -> list[tuple[float, object]]:
    return [first_token(engine, [{"role": "system", "content": system}, {"role": "user", "content": q}], config)
            for q in QUESTIONS]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default", help="'default' (SmolLM2-135M), 'tiny', a GGUF or HF folder")
    parser.add_argument("--system-tokens", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    from logitproc.runtime import GenerationConfig
    from logitproc.serve.cli_options import open_model
    from logitproc.serve.engine import Engine

    model = open_model(args.model, "cpu")
    config = GenerationConfig(temperature=0.0, max_tokens=48)
    sentence = "The museum keeps its records in order, and every visitor signs the book at the door. "
    per_sentence = len(model.tokenizer.encode(sentence, add_special_tokens=False).ids)
    system = "You are a helpful guide. " + sentence * max(1, args.system_tokens // per_sentence)
    print(machine_line())
    print(f"model {model.name}; system prompt {len(model.tokenizer.encode(system).ids)} tokens; "
          f"best of {args.rounds} rounds, the two engines alternated")
    best: dict[tuple[str, bool], list[float]] = {}
    answers: dict[bool, list[list[int]]] = {}
    prompts: dict[str, list[tuple[int, int]]] = {}
    for _ in range(args.rounds):
        for cached in (True, False):
            for name, run in (("chat", lambda e: conversation(e, config)),
                              ("system", lambda e: shared_system(e, config, system))):
                engine = Engine(model, prefix_cache=cached)
                results = run(engine)
                times = [t for t, _ in results]
                key = (name, cached)
                best[key] = times if key not in best else [min(a, b) for a, b in zip(best[key], times, strict=True)]
                answers.setdefault(cached, []).extend(o.token_ids for _, o in results)
                if cached:
                    prompts[name] = [(o.stats.prompt_tokens, o.stats.cached_tokens) for _, o in results]
    if answers[True] != answers[False]:
        print("ANSWERS DIFFER between the engines with and without the prefix cache")
        return 1
    print(f"{'scenario':<22} {'prompt':>7} {'cached':>7} {'TTFT cached':>12} {'TTFT plain':>11} {'speed-up':>9}")
    for name, label in (("chat", "chat turn"), ("system", "shared system, q")):
        for i, ((prompt, hit), t_cached, t_plain) in enumerate(
                zip(prompts[name], best[(name, True)], best[(name, False)], strict=True)):
            print(f"{label + ' ' + str(i + 1):<22} {prompt:>7} {hit:>7} {t_cached * 1e3:>10.1f}ms "
                  f"{t_plain * 1e3:>9.1f}ms {t_plain / t_cached:>8.2f}x")
    print("answers equal with and without the prefix cache")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
