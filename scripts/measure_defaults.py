"""Measure sampling settings on a small fixed question set, to choose a model's default settings.

Each setting answers every question (sampled settings with several seeds), all requests batched through the engine.
Per setting: the share of answers that contain the expected word (correct), that ran into the token cap (ran on),
that repeat themselves (an 8-token run seen three times), the mean answer length, and whether the README's JSON
schema example gave valid JSON with a non-empty colour. Prints a Markdown table (docs/serving.md holds the figures).

    python scripts/measure_defaults.py [--model default] [--seeds 3] [--max-tokens 256]
"""

from __future__ import annotations

import argparse
import json
import re
import time
from collections import Counter
from dataclasses import dataclass

# (question, regular expression an answer must contain, case-insensitive)
QUESTIONS: list[tuple[str, str]] = [
    ("What is the capital of France?", r"\bparis\b"),
    ("How many days are in a week?", r"\b(seven|7)\b"),
    ("What colour is the sky on a clear day?", r"\bblue\b"),
    ("What is 2 + 3?", r"\b(5|five)\b"),
    ("Who wrote Romeo and Juliet?", r"\bshakespeare\b"),
    ("What is the largest planet in our solar system?", r"\bjupiter\b"),
    ("What gas do plants take in from the air to make food?", r"(carbon dioxide|co2|co₂)"),
    ("At what temperature in degrees Celsius does water boil at sea level?", r"\b100\b"),
    ("What is the opposite of hot?", r"\bcold\b"),
    ("How many legs does a spider have?", r"\b(eight|8)\b"),
    ("What language is spoken in Spain?", r"\bspanish\b"),
    ("What is the freezing point of water in degrees Celsius?", r"\b(0|zero)\b"),
]
# The README's example: a JSON object with one string field.
SCHEMA = {"type": "object", "properties": {"colour": {"type": "string"}}, "required": ["colour"],
          "additionalProperties": False}
SCHEMA_PROMPT = "Name a colour."

# name -> GenerationConfig values (seeds are added for sampled settings)
SETTINGS: dict[str, dict[str, float]] = {
    "temperature 1 (GenerationConfig's default)": {"temperature": 1.0},
    "temperature 0.7, top_p 0.9": {"temperature": 0.7, "top_p": 0.9},
    "temperature 0.3, top_p 0.9": {"temperature": 0.3, "top_p": 0.9},
    "temperature 0.2, top_p 0.9 (model card)": {"temperature": 0.2, "top_p": 0.9},
    "temperature 0.2, top_p 0.9, repetition 1.1": {"temperature": 0.2, "top_p": 0.9, "repetition_penalty": 1.1},
    "greedy": {"temperature": 0.0},
    "greedy, repetition 1.05": {"temperature": 0.0, "repetition_penalty": 1.05},
    "greedy, repetition 1.1": {"temperature": 0.0, "repetition_penalty": 1.1},
    "greedy, repetition 1.2": {"temperature": 0.0, "repetition_penalty": 1.2},
}


@dataclass
class Score:
    answers: int = 0
    correct: int = 0
    ran_on: int = 0
    repetitive: int = 0
    tokens: int = 0
    json_ok: int = 0
    json_runs: int = 0


def repeats_itself(token_ids: list[int], n: int = 8, times: int = 3) -> bool:
    grams = Counter(tuple(token_ids[i : i + n]) for i in range(len(token_ids) - n + 1))
    return any(count >= times for count in grams.values())


def json_ok(text: str) -> bool:
    try:
        value = json.loads(text)
    except ValueError:
        return False
    return isinstance(value, dict) and isinstance(value.get("colour"), str) and bool(value["colour"].strip())


def run(model_spec: str, seeds: int, max_tokens: int, batch: int) -> dict[str, Score]:
    from logitproc import GenerationConfig
    from logitproc.serve.cli_options import open_model
    from logitproc.serve.engine import Engine
    from logitproc.serve.outputs import FinishReason

    engine = Engine(open_model(model_spec, "cpu"), max_batch=batch)
    scores = {name: Score() for name in SETTINGS}
    pending: dict[str, tuple[str, str | None]] = {}  # request id -> (setting, expected pattern or None for JSON)
    for name, values in SETTINGS.items():
        runs = [None] if values["temperature"] == 0 else list(range(seeds))
        for seed in runs:
            extra = {} if seed is None else {"seed": seed}
            config = GenerationConfig(**values, **extra, max_tokens=max_tokens)
            for question, pattern in QUESTIONS:
                rid = engine.add_request([{"role": "user", "content": question}], config)
                pending[rid] = (name, pattern)
            schema_config = GenerationConfig(**values, **extra, max_tokens=max_tokens, response_format={
                "type": "json_schema", "json_schema": {"name": "colour", "schema": SCHEMA}})
            rid = engine.add_request([{"role": "user", "content": SCHEMA_PROMPT}], schema_config)
            pending[rid] = (name, None)
    while engine.has_unfinished():
        for delta in engine.step():
            if delta.output is None:
                continue
            name, pattern = pending[delta.request_id]
            out, score = delta.output, scores[name]
            if pattern is None:
                score.json_runs += 1
                score.json_ok += json_ok(out.text)
                continue
            score.answers += 1
            score.correct += bool(re.search(pattern, out.text, re.IGNORECASE))
            score.ran_on += out.finish_reason is FinishReason.LENGTH
            score.repetitive += repeats_itself(list(out.token_ids))
            score.tokens += len(out.token_ids)
    return scores


def table(scores: dict[str, Score]) -> str:
    lines = ["| setting | correct | ran on (cap) | repeats itself | mean tokens | README JSON example valid |",
             "| --- | --- | --- | --- | --- | --- |"]
    for name, s in scores.items():
        lines.append(f"| {name} | {s.correct}/{s.answers} | {s.ran_on}/{s.answers} | {s.repetitive}/{s.answers} | "
                     f"{s.tokens / max(s.answers, 1):.0f} | {s.json_ok}/{s.json_runs} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--seeds", type=int, default=3, help="seeds per sampled setting")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--only", help="measure only the settings whose name contains this text")
    args = parser.parse_args()
    if args.only:
        for name in [name for name in SETTINGS if args.only not in name]:
            del SETTINGS[name]
    started = time.perf_counter()
    scores = run(args.model, args.seeds, args.max_tokens, args.batch)
    print(table(scores))
    print(f"\n{len(QUESTIONS)} questions + the JSON example per run; sampled settings x {args.seeds} seeds; "
          f"max_tokens {args.max_tokens}; {time.perf_counter() - started:.0f}s")


if __name__ == "__main__":
    main()
