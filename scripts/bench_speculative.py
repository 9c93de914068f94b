"""Speculative decoding (prompt lookup) against plain decoding, on input-grounded prompts and an open-ended one.

    python scripts/bench_speculative.py [--model default] [--max-tokens 128] [--rounds 3] [--k 5] [--markdown]
                                        [--only "rename a variable"] [--bounds]

Each prompt is answered greedily (batch 1) by one engine without speculation, one with ``{"method": "ngram",
"num_speculative_tokens": K}`` (adaptive, the default) and one with every proposal checked (``adaptive=False``), in
interleaved rounds; the best round of each is kept. Printed per prompt: generated tokens per second of wall time
(prefill included) and of the decode phase (from the first token to the last), the ratios to plain decoding, the
acceptance rate and the draft tokens accepted per verify, and whether the answers are the same tokens (they must be:
the exit status is 1 when a greedy answer differs with drafts). Also
printed: the forward's cost by token count (decode of 1 token, verify of 1 + K), which bounds what drafts can give
on this machine.

``--bounds``: also, per prompt, the plain answer's tokens replayed through the prompt lookup without timing noise
(``draft_bound``): the decode speed-up of the best plan with perfect foresight, of checking every proposal at full
length and of the engine's adaptive plan, at this run's verify cost, and the verify cost each needs for 2x (as
``slope``: a verify of 1 + k tokens costs ``1 + slope * k`` decodes; the forward above gives this machine's). The
replays leave out what a step costs besides the forward (sampling, the processor, Python).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import machine_line  # noqa: E402

FUNCTION = '''def total_price(items, tax_rate):
    subtotal = 0
    for item in items:
        subtotal += item.price * item.quantity
    tax = subtotal * tax_rate
    total = subtotal + tax
    return round(total, 2)'''

#: The record as JSON is usually shown (and as SmolLM2 writes it): given on one line, the model re-laid it out over
#: several lines, so its answer was no copy of the prompt (docs/benchmarks.md, "Speculative decoding").
RECORD = json.dumps({"id": 4812, "name": "Ada Lovelace", "email": "ada@example.org", "role": "engineer",
                     "team": "compilers", "active": True, "languages": ["python", "c", "rust"], "manager_id": 17},
                    indent=2)

PARAGRAPH = ("The river rises in the hills above the town, runs through the old market and the mill, and reaches "
             "the sea twelve miles to the south, where the harbour has sheltered fishing boats for four hundred "
             "years.")

PROMPTS = {
    "rename a variable": f"Rename the variable `subtotal` to `net` in this function. Reply with the whole "
                         f"function only.\n\n{FUNCTION}",
    "copy a JSON record": f"Copy this JSON record exactly, changing only the value of \"role\" to \"manager\". "
                          f"Reply with the JSON only.\n\n```json\n{RECORD}\n```",
    "repeat a paragraph": f"Repeat this paragraph word for word.\n\n{PARAGRAPH}",
    "open-ended": "Write a short story about a lighthouse keeper.",
}


def answer(engine, prompt: str, max_tokens: int):
    from logitproc.runtime import GenerationConfig

    engine.stats.reset()
    started = time.perf_counter()
    [out] = engine.generate([{"role": "user", "content": prompt}],
                            GenerationConfig(temperature=0, max_tokens=max_tokens))
    seconds = time.perf_counter() - started
    return seconds, out, engine.stats.acceptance_rate, engine.stats.mean_accepted_tokens, out.stats.decode_tokens_per_s


class FixedCosts:
    """Forward costs in decodes: a forward of n tokens costs ``1 + slope * (n - 1)`` (``ForwardCosts``' line, fixed:
    the replays below take no timings)."""

    def __init__(self, slope: float) -> None:
        self.slope = slope

    def record(self, tokens: int, seconds: float) -> None:
        pass

    def seconds(self, tokens: int) -> float:
        return 1 + self.slope * (tokens - 1) if tokens > 0 else 0.0


def _accepted(draft: list[int], answer: list[int], i: int) -> int:
    """How many of ``draft``'s tokens equal the answer's from position ``i`` on."""
    m = 0
    while m < len(draft) and i + m < len(answer) and draft[m] == answer[i + m]:
        m += 1
    return m


def draft_bound(context: list[int], answer: list[int], k: int, slope: float, plan: str = "perfect",
                min_n: int = 1, max_n: int = 4) -> float:
    """Decode speed-up (tokens after the first per decode-time, as the bench's "decode tok/s") of prompt-lookup
    drafts on a known greedy ``answer`` after ``context``, forwards costing as ``FixedCosts(slope)``. A step decodes
    one token or verifies ``j <= k`` drafts (the accepted prefix plus the target's token). ``plan``: "perfect" (the
    best plan with foresight: dynamic programming over the positions), "every" (each proposal checked at its full
    length, the ``adaptive=False`` engine) or "adaptive" (the engine's ``SpeculationPlanner`` and ``Drafter``,
    replayed)."""
    from logitproc.runtime import RequestState
    from logitproc.serve.ngram_index import NgramIndex
    from logitproc.serve.speculation import Candidate, Drafter, SpeculationPlanner, SpeculativeConfig

    n, costs = len(answer), FixedCosts(slope)
    if plan == "adaptive":
        config = SpeculativeConfig(num_speculative_tokens=k, prompt_lookup_min=min_n, prompt_lookup_max=max_n)
        planner, state = SpeculationPlanner(config), RequestState(context)
        planner.costs = costs
        state.append_token(answer[0])  # the prefill's token
        drafter, i, seconds = Drafter(config, state), 1, 0.0
        while i < n:
            drafter.sync(state)
            limit = min(k, n - i - 1)
            proposal = drafter.propose(limit) if limit > 0 else []
            drafts = planner.plan([Candidate(0, drafter, proposal, limit)], 1, 1 << 30).get(0, [])
            accepted = _accepted(drafts, answer, i)
            seconds += costs.seconds(len(drafts) + 1)
            for token in answer[i:i + accepted + 1]:
                state.append_token(token)
            i += accepted + 1
        return (n - 1) / seconds
    index = NgramIndex(context + answer[:1], min_n=min_n, max_n=max_n)
    proposals = [[]]
    for token in answer[1:]:
        proposals.append(index.propose(k))
        index.append(token)
    cost = [0.0] * (n + 1)
    for i in range(n - 1, 0, -1):
        draft = proposals[i][:max(0, n - i - 1)]
        accepted = _accepted(draft, answer, i)
        lengths = [len(draft)] if plan == "every" else range(len(draft) + 1)  # 0: a decode
        cost[i] = min(costs.seconds(j + 1) + cost[i + 1 + min(j, accepted)] for j in lengths)
    return (n - 1) / cost[1]


def slope_for(context: list[int], answer: list[int], k: int, aim: float, plan: str) -> float:
    """The largest verify cost slope (``draft_bound``) at which ``plan`` still reaches ``aim`` (0 if never)."""
    if draft_bound(context, answer, k, 0.0, plan) < aim:
        return 0.0
    low, high = 0.0, 1.0
    for _ in range(20):
        mid = (low + high) / 2
        low, high = (mid, high) if draft_bound(context, answer, k, mid, plan) >= aim else (low, mid)
    return low


def forward_costs(model, k: int, repeat: int = 5) -> tuple[float, float]:
    """Best-of seconds of a decode of 1 token and a verify of 1 + k tokens, on a 100-token context."""
    seq = max(model.sequence_ids, default=-1) + 1
    model.add_sequence(seq)
    model.prefill([seq], [list(range(100, 200))])
    best = [float("inf"), float("inf")]
    for _ in range(repeat):
        t0 = time.perf_counter()
        model.decode([seq], [5])
        best[0] = min(best[0], time.perf_counter() - t0)
        model.popn(seq, 1)
        t0 = time.perf_counter()
        model.verify([seq], [[5] * (k + 1)])
        best[1] = min(best[1], time.perf_counter() - t0)
        model.popn(seq, k + 1)
    model.remove_sequence(seq)
    return best[0], best[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--k", type=int, default=5)
    parser.add_argument("--markdown", action="store_true")
    parser.add_argument("--show", action="store_true", help="print the answers")
    parser.add_argument("--bounds", action="store_true", help="replay the plain answers (draft_bound)")
    parser.add_argument("--only", action="append", choices=list(PROMPTS), help="run this prompt only (repeatable)")
    args = parser.parse_args()
    prompts = {name: PROMPTS[name] for name in args.only} if args.only else PROMPTS

    from logitproc.serve.cli_options import open_model
    from logitproc.serve.engine import Engine

    model = open_model(args.model, "cpu")
    modes = {"plain": None, "ngram": {"method": "ngram", "num_speculative_tokens": args.k},
             "ngram, every draft": {"method": "ngram", "num_speculative_tokens": args.k, "adaptive": False}}
    engines = {name: Engine(model, max_batch=1, speculative=spec, prefix_cache=False) for name, spec in modes.items()}
    best: dict[tuple[str, str], tuple] = {}
    for _ in range(args.rounds):
        for prompt_name, prompt in prompts.items():
            for mode, engine in engines.items():  # interleaved: each round runs every mode once
                result = answer(engine, prompt, args.max_tokens)
                key = (prompt_name, mode)
                if key not in best or result[0] < best[key][0]:
                    best[key] = result
    decode_s, verify_s = forward_costs(model, args.k)

    print(f"# bench_speculative: {model.name}, greedy, batch 1, max_tokens {args.max_tokens}, K {args.k}, "
          f"best of {args.rounds} interleaved rounds, load {os.getloadavg()[0]:.1f}")
    print(f"# {machine_line()}")
    print(f"# forward: decode of 1 token {1e3 * decode_s:.1f} ms, verify of {args.k + 1} tokens "
          f"{1e3 * verify_s:.1f} ms ({verify_s / decode_s:.2f}x): drafts give at most "
          f"{(args.k + 1) * decode_s / verify_s:.2f}x when all {args.k} are accepted")
    sep = "|" if args.markdown else " "
    header = ["prompt", "mode", "tokens", "tok/s", "vs plain", "decode tok/s", "vs plain", "accepted", "per verify",
              "same answer"]
    print(sep.join(header) if not args.markdown else "| " + " | ".join(header) + " |")
    if args.markdown:
        print("|" + "---|" * len(header))
    texts, differ = {}, []
    for prompt_name in prompts:
        seconds0, plain, _, _, decode0 = best[(prompt_name, "plain")]
        rate0 = len(plain.token_ids) / seconds0
        for mode in modes:
            seconds, out, acceptance, per_verify, decode = best[(prompt_name, mode)]
            rate = len(out.token_ids) / seconds
            cells = [prompt_name, mode, str(len(out.token_ids)), f"{rate:.1f}", f"{rate / rate0:.2f}x",
                     f"{decode:.1f}", f"{decode / decode0:.2f}x",
                     "-" if mode == "plain" else f"{100 * acceptance:.0f}%",
                     "-" if mode == "plain" else f"{per_verify:.2f}", str(out.token_ids == plain.token_ids)]
            print("| " + " | ".join(cells) + " |" if args.markdown else "  ".join(f"{c:>12}" for c in cells))
            if out.token_ids != plain.token_ids:
                differ.append(f"{prompt_name} ({mode})")
        texts[prompt_name] = plain.text
    # The verify's logits are decode's bit for bit (docs/serving.md): a greedy answer never changes with drafts.
    print("greedy answers with drafts equal plain decoding's on every prompt" if not differ else
          f"GREEDY ANSWERS DIFFER with drafts: {', '.join(differ)}")
    if args.bounds:
        slope = (verify_s / decode_s - 1) / args.k
        print(f"\nreplays of the plain answers (draft_bound: decode speed-up at this run's slope {slope:.3f}, and the "
              f"slope that gives 2x; a verify of 1 + {args.k} tokens costs 1 + {args.k} x slope decodes):")
        for prompt_name, prompt in prompts.items():
            answer_ids = list(best[(prompt_name, "plain")][1].token_ids)
            text = model.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
            context = list(model.tokenizer.encode(text, add_special_tokens=False).ids)
            cells = []
            for plan in ("perfect", "every", "adaptive"):
                need = slope_for(context, answer_ids, args.k, 2.0, plan)
                cells.append(f"{plan} {draft_bound(context, answer_ids, args.k, slope, plan):.2f}x "
                             f"(2x at slope <= {need:.3f})")
            print(f"  {prompt_name}: " + ", ".join(cells))
    if args.show:
        for name, text in texts.items():
            print(f"\n## {name}\n{text}")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
