"""Soak: random requests through one Engine on the tiny model, checking every finish reason and invariant.

Random configs (sampling, penalties, seeds, n, logprobs), JSON schemas, regexes, stop strings, aborts, requests
whose runner calls fail (a poison token in the prompt), and ``stream`` callers on other threads, all on a short KV
cache so that requests are preempted. Bounded by ``--requests`` and ``--seconds``; exits 1 when an invariant broke.

    python scripts/soak.py --requests 1000 --seconds 600 --seed 1
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

SCHEMAS: list[dict[str, Any]] = [
    {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string", "maxLength": 4}},
     "required": ["a"], "additionalProperties": False},
    {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
    {"enum": ["red", "green", "blue"]},
]
REGEXES = ["[a-c]{2,5}", "(yes|no)", "[0-9]+"]
WORDS = "the cat sat on a mat while seven zebras ate green apples under blue skies".split()
POISON = 3 + ord("~")  # the tiny vocabulary's token for "~": a prompt holding it makes the runner fail


class PoisonRunner:
    """The wrapped runner, except that a sequence holding POISON fails at its ``at``-th decode (after
    the real decode grew the KV cache of every sequence in the call, so the engine must put the others back)."""

    def __init__(self, model: Any, at: int = 3) -> None:
        self._model, self._at = model, at
        self._poison_at: dict[int, int] = {}  # seq_id -> position of POISON in the sequence
        self._decodes: dict[int, int] = {}
        for name in ("name", "vocab_size", "context_length", "max_num_sequences", "max_total_tokens",
                     "eos_token_ids", "tokenizer", "kernel_library", "apply_chat_template", "chat_token_ids",
                     "sequence_length",
                     "add_sequence", "popn"):
            setattr(self, name, getattr(model, name))

    @property
    def sequence_ids(self) -> tuple[int, ...]:
        return self._model.sequence_ids

    def remove_sequence(self, seq_id: int) -> None:
        self._poison_at.pop(seq_id, None)
        self._decodes.pop(seq_id, None)
        self._model.remove_sequence(seq_id)

    def fork_sequence(self, parent_id: int, child_id: int, length: int | None = None) -> None:
        position = self._poison_at.get(parent_id)
        if position is not None and (length is None or position < length):  # the child holds the poison too
            self._poison_at[child_id], self._decodes[child_id] = position, 0
        self._model.fork_sequence(parent_id, child_id, length)

    def prefill(self, seq_ids: Sequence[int], token_ids: Sequence[Sequence[int]]) -> np.ndarray:
        for seq_id, tokens in zip(seq_ids, token_ids, strict=True):
            if POISON in tokens and seq_id not in self._poison_at:
                self._poison_at[seq_id] = self._model.sequence_length(seq_id) + list(tokens).index(POISON)
                self._decodes[seq_id] = 0
        return self._model.prefill(seq_ids, token_ids)

    def decode(self, seq_ids: Sequence[int], token_ids: Sequence[int]) -> np.ndarray:
        out = self._model.decode(seq_ids, token_ids)
        for seq_id in seq_ids:
            if seq_id in self._decodes:
                self._decodes[seq_id] += 1
                if self._decodes[seq_id] >= self._at:
                    raise RuntimeError("soak: injected decode fault")
        return out


@dataclass
class Job:
    """One soak request: what was asked, and everything that came back."""

    prompt: Any
    config: Any
    poisoned: bool = False
    response_format: dict[str, Any] | None = None  # as given (the config holds it parsed)
    aborted: bool = False
    rid: str | None = None
    refused: str | None = None
    deltas: list[Any] = field(default_factory=list)


def random_prompt(rng: random.Random, poisoned: bool) -> Any:
    text = " ".join(rng.choice(WORDS) for _ in range(rng.choice([1, 3, 8, 20])))
    if poisoned:
        text += " ~"
    kind = rng.random()
    if kind < 0.15 and not poisoned:
        return [3 + b for b in text.encode()]  # token ids (one per byte in the tiny vocabulary)
    if kind < 0.3:
        return [{"role": "user", "content": text}]
    return text


def random_config(rng: random.Random) -> tuple[Any, dict[str, Any] | None]:
    """A random GenerationConfig, and its response_format as given."""
    from logitproc.runtime import GenerationConfig

    values: dict[str, Any] = {"max_tokens": rng.randint(1, 40), "n": rng.choice([1, 1, 1, 2, 3])}
    values["temperature"] = rng.choice([0.0, 0.0, 0.7, 1.0, 1.3])
    if rng.random() < 0.7:
        values["seed"] = rng.randrange(2**32)
    if rng.random() < 0.3:
        values["top_p"] = rng.choice([0.5, 0.9])
    if rng.random() < 0.3:
        values["top_k"] = rng.choice([1, 5, 40])
    if rng.random() < 0.2:
        values["min_p"] = 0.1
    if rng.random() < 0.3:
        values["frequency_penalty"] = rng.uniform(-1, 2)
        values["presence_penalty"] = rng.uniform(-1, 2)
    if rng.random() < 0.2:
        values["repetition_penalty"] = rng.choice([0.8, 1.3])
    if rng.random() < 0.3:
        values["stop"] = tuple(rng.sample(["e", "at", "  ", "}", "z"], rng.randint(1, 2)))
    if rng.random() < 0.3:
        values["ignore_eos"] = True
    if rng.random() < 0.2:
        values["min_tokens"] = rng.randint(0, values["max_tokens"])
    if rng.random() < 0.2:
        values["logprobs"], values["top_logprobs"] = True, rng.choice([0, 3])
    if rng.random() < 0.1:
        values["logit_bias"] = {rng.randrange(3, 250): rng.uniform(-5, 5) for _ in range(3)}
    grammar = rng.random()
    if grammar < 0.1:
        values["response_format"] = {"type": "json_object"}
    elif grammar < 0.25:
        schema = rng.choice(SCHEMAS)
        values["response_format"] = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
    elif grammar < 0.35:
        values["response_format"] = {"type": "regex", "regex": rng.choice(REGEXES)}
    return GenerationConfig(**values), values.get("response_format")


def check(job: Job, context: int, jump_forward: bool) -> list[str]:
    """Every invariant of one finished job; the broken ones, described."""
    from logitproc.serve.outputs import FinishReason

    if job.refused is not None:
        return [] if job.refused else [f"{job.rid}: refused with an empty message"]
    problems: list[str] = []
    config = job.config
    # the runner fails any sequence holding POISON: in the prompt, or in an output re-fed after a preemption
    poisoned = job.poisoned or any(POISON in d.token_ids for d in job.deltas)
    for index in range(config.n):
        mine = [d for d in job.deltas if d.index == index]
        finals = [d for d in mine if d.finish_reason is not None]
        where = f"{job.rid}[{index}]"
        if len(finals) != 1 or mine[-1] is not finals[0] or finals[0].output is None:
            problems.append(f"{where}: {len(finals)} final deltas (exactly one, the last, expected)")
            continue
        out = finals[0].output
        reason = out.finish_reason
        tokens: list[int] = []
        for d in mine:
            del tokens[len(tokens) - d.rollback:]
            tokens.extend(d.token_ids)
        if not isinstance(reason, FinishReason):
            problems.append(f"{where}: unknown finish reason {reason!r}")
        if tokens != out.token_ids:
            problems.append(f"{where}: streamed tokens {tokens} differ from the output's {out.token_ids}")
        if "".join(d.text for d in mine) != out.text:
            problems.append(f"{where}: streamed text differs from the output's")
        if reason is FinishReason.ERROR and not (poisoned and out.error):
            problems.append(f"{where}: error without an injected fault: {out.error}")
        if reason is FinishReason.ABORT and not job.aborted:
            problems.append(f"{where}: aborted but never asked to")
        if config.max_tokens is not None and len(out.token_ids) > config.max_tokens:
            problems.append(f"{where}: {len(out.token_ids)} tokens > max_tokens={config.max_tokens}")
        if reason is FinishReason.LENGTH and len(out.token_ids) != config.max_tokens and \
                len(out.prompt_token_ids) + len(out.token_ids) < context // config.n - 1:
            problems.append(f"{where}: 'length' after {len(out.token_ids)} tokens, below max_tokens and the context")
        if reason is FinishReason.STOP and len(out.token_ids) < config.min_tokens:
            problems.append(f"{where}: stopped after {len(out.token_ids)} < min_tokens={config.min_tokens}")
        for stop in config.stop if config.min_tokens == 0 else ():  # (not looked for before min_tokens)
            if stop in out.text:
                problems.append(f"{where}: stop string {stop!r} in the text {out.text!r}")
        if config.logprobs and not jump_forward and reason not in (FinishReason.ABORT, FinishReason.ERROR) and (
                out.logprobs is None or len(out.logprobs) != len(out.token_ids)
                or not all(np.isfinite(x) and x <= 1e-6 for x in out.logprobs)):
            problems.append(f"{where}: logprobs {out.logprobs} do not match the {len(out.token_ids)} tokens")
        if not isinstance(out.stop_reason, str):  # (a stop string cuts the answer short of its format)
            problems += check_format(where, job.response_format, reason, out.text)
    return problems


def check_format(where: str, response_format: Any, reason: Any, text: str) -> list[str]:
    """A constrained answer that ended by itself (``FinishReason.STOP``) is valid in its format."""
    from logitproc.serve.outputs import FinishReason

    if response_format is None or reason is not FinishReason.STOP:
        return []
    kind = response_format["type"]
    if kind == "regex":
        ok = re.fullmatch(response_format["regex"], text) is not None
    else:
        try:
            value = json.loads(text)
        except ValueError:
            return [f"{where}: {kind} answer is not JSON: {text!r}"]
        if kind == "json_object":
            ok = isinstance(value, dict)
        else:
            import jsonschema

            ok = jsonschema.Draft202012Validator(response_format["json_schema"]["schema"]).is_valid(value)
    return [] if ok else [f"{where}: answer {text!r} does not match {response_format}"]


@dataclass
class Report:
    jobs: int = 0
    finish: dict[str, int] = field(default_factory=dict)
    refused: int = 0
    preemptions: int = 0
    steps: int = 0
    seconds: float = 0.0
    compared_alone: int = 0
    problems: list[str] = field(default_factory=list)

    def summary(self) -> str:
        return (f"{self.jobs} requests in {self.seconds:.1f}s ({self.steps} steps, {self.preemptions} preemptions, "
                f"{self.refused} refused at add_request); finish reasons {dict(sorted(self.finish.items()))}; "
                f"{self.compared_alone} answers compared with the request alone; {len(self.problems)} problems")


def soak(model: Any, requests: int = 200, seconds: float = 60.0, seed: int = 0, threads: int = 2,
         concurrency: int = 6, abort_rate: float = 0.004, poison_rate: float = 0.05, jump_forward: bool = False,
         compare_alone: int = 10) -> Report:
    """Run ``requests`` random requests (or as many as ``seconds`` allow) through one Engine over ``model`` (open it
    with a short KV cache for preemptions): ``concurrency`` at a time added and stepped here, plus ``threads``
    threads streaming their own; then check every invariant and compare some answers with the request alone."""
    from logitproc.serve.engine import Engine

    rng = random.Random(seed)
    engine = Engine(PoisonRunner(model), max_batch=8, jump_forward=jump_forward)
    context = min(engine.context_length, engine.max_total_tokens)
    deadline = time.perf_counter() + seconds
    started = time.perf_counter()
    jobs: list[Job] = []
    budget = threading.Semaphore(requests)
    lock = threading.Lock()

    def new_job(r: random.Random) -> Job | None:
        if time.perf_counter() > deadline or not budget.acquire(blocking=False):
            return None
        poisoned = r.random() < poison_rate
        config, response_format = random_config(r)
        job = Job(random_prompt(r, poisoned), config, poisoned, response_format)
        with lock:
            jobs.append(job)
        return job

    def streamer(t: int) -> None:
        r = random.Random(seed * 1000 + t)
        while (job := new_job(r)) is not None:
            try:
                for delta in engine.stream(job.prompt, job.config):
                    job.rid = delta.request_id
                    job.deltas.append(delta)
            except (ValueError, TypeError) as err:
                job.refused = str(err)

    pool = [threading.Thread(target=streamer, args=(t,), daemon=True) for t in range(threads)]
    for thread in pool:
        thread.start()
    live: dict[str, Job] = {}
    added = steps = 0
    report = Report()
    while True:
        while len(live) < concurrency and (job := new_job(rng)) is not None:
            try:
                job.rid = engine.add_request(job.prompt, job.config)
                live[job.rid] = job
            except (ValueError, TypeError) as err:
                job.refused = str(err)
                continue
            added += 1
            if added % 10 == 5:  # every tenth request aborted at once, while it waits
                job.aborted = True
                engine.abort(job.rid)
        if not live and not engine.has_unfinished() and not any(t.is_alive() for t in pool):
            break
        for delta in engine.step():
            job = live[delta.request_id]
            job.deltas.append(delta)
            if sum(d.finish_reason is not None for d in job.deltas) == job.config.n:
                del live[delta.request_id]
        steps, last_steps = engine.stats.steps, steps
        if live and steps > last_steps and rng.random() < abort_rate * len(live):  # (once per step run)
            victim = rng.choice(list(live.values()))
            victim.aborted = True
            engine.abort(victim.rid)
        if time.perf_counter() > deadline + 4 * seconds + 60:
            report.problems.append("the engine did not drain in time")
            break
    for thread in pool:
        thread.join(timeout=60)
    report.seconds = time.perf_counter() - started
    report.jobs, report.steps, report.preemptions = len(jobs), engine.stats.steps, engine.stats.preemptions
    if engine.has_unfinished() or engine.num_running or engine.kv_tokens:
        report.problems.append(f"not idle at the end: {engine.num_running} running, {engine.kv_tokens} KV tokens")
    for job in jobs:
        if job.refused is not None:
            report.refused += 1
        for d in job.deltas:
            if d.finish_reason is not None:
                report.finish[d.finish_reason.value] = report.finish.get(d.finish_reason.value, 0) + 1
        report.problems += check(job, context, jump_forward)
    report.compared_alone, problems = compare_with_alone(model, jobs, compare_alone, jump_forward)
    report.problems += problems
    return report


def compare_with_alone(model: Any, jobs: list[Job], count: int, jump_forward: bool) -> tuple[int, list[str]]:
    """Greedy or seeded answers that ended by themselves equal the same request run alone on a fresh engine."""
    from logitproc.serve.engine import Engine
    from logitproc.serve.outputs import FinishReason

    chosen = [j for j in jobs if j.refused is None and not j.aborted and not j.poisoned and j.deltas
              and all(d.finish_reason is not FinishReason.ERROR for d in j.deltas)
              and (j.config.temperature == 0 or j.config.seed is not None)][:count]
    problems = []
    for job in chosen:
        alone = Engine(model, max_batch=8, jump_forward=jump_forward).generate(job.prompt, job.config)
        got = {d.index: d.output for d in job.deltas if d.output is not None}
        for out in alone:
            if got[out.index].token_ids != out.token_ids:
                problems.append(f"{job.rid}[{out.index}]: {got[out.index].token_ids} under load, "
                                f"{out.token_ids} alone ({job.config})")
    return len(chosen), problems


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=300, help="at most this many requests (default: %(default)s)")
    parser.add_argument("--seconds", type=float, default=120.0,
                        help="stop adding requests after this long (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="(default: %(default)s)")
    parser.add_argument("--threads", type=int, default=2, help="threads streaming requests (default: %(default)s)")
    parser.add_argument("--kv-tokens", type=int, default=384,
                        help="KV cache size: small, for preemptions (default: %(default)s)")
    parser.add_argument("--jump-forward", action="store_true", help="engine with jump-forward (default: off)")
    args = parser.parse_args(argv)
    from logitproc.serve.cli_options import tiny_model
    from logitproc.serve.compiled_model import CompiledModel

    model = CompiledModel.open(tiny_model(), target="cpu", max_total_tokens=args.kv_tokens, max_num_sequences=16)
    report = soak(model, args.requests, args.seconds, args.seed, args.threads, jump_forward=args.jump_forward)
    for problem in report.problems[:50]:
        print("PROBLEM", problem)
    print(report.summary())
    return 1 if report.problems else 0


if __name__ == "__main__":
    sys.exit(main())
