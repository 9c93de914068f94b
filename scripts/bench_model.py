"""Model throughput on the CPU: CompiledModel (TVM) against NumpyLlama (plain numpy), and the share of each decode
step that the engine spends in logit processing + sampling.

    python scripts/bench_model.py [--model default] [--prompt-tokens 128] [--decode-tokens 64] [--rounds 3]
                                  [--no-engine] [--markdown]
    python scripts/bench_model.py --llama-cpp [--contexts 64,1024,4096] [--threads 2] [--batch 8]
    python scripts/bench_model.py --profile [--prompt-tokens 128] [--profile-prefill 1024,4096] [--profile-verify 6]
                                  [--profile-batch 8]
    (every mode: [--kv-dtype float16|float32], the compiled model's KV cache; float16 by default, as llama.cpp's;
    [--activation-bits 16|8], the activation codes of its integer-dot matmuls on AVX2 CPUs)

1. prefill tokens/s (one prompt of ``--prompt-tokens``) and greedy decode tokens/s (batch 1) of both models, in
   ``--rounds`` interleaved rounds (numpy, compiled, numpy, ...; the machine may be shared, so each round's figures
   are printed and the best is kept); numpy's BLAS threads follow ``OPENBLAS_NUM_THREADS``, TVM's ``TVM_NUM_THREADS``;
2. ``Engine`` decode steps (batch 1, and batch 4 with the same config per request): the model forward, the logit
   processing + sampling part (bias, penalties, masks, softmax, top-p, sampling), and their share of the step,
   with a typical config (temperature 0.7, top_p 0.9, repetition penalty 1.1) and with a JSON schema added.

``--llama-cpp`` instead compares CompiledModel with llama.cpp (llama-cpp-python, the ``bench`` extra) on the same
GGUF file, same prompt tokens and same thread count, at each of ``--contexts``: prefill and decode tok/s, their
ratios, decode as a fraction of the memory floor, and ``--batch`` sequences decoded together (``side_by_side.py``).
``--profile`` instead times each packed function of one decode step (``decode_profile.py``), with
``--profile-prefill`` of a prefill of each of the given lengths, and with ``--profile-verify`` of a verify forward
of each of the given token counts (speculative decoding's check of 1 + K tokens), with ``--profile-batch`` of a
decode step of that many sequences.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import machine_line  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                   "tags": {"type": "array", "items": {"type": "string"}}},
    "required": ["name", "age", "tags"],
}
TEXT = ("The quick brown fox jumps over the lazy dog while the rain in Spain stays mainly in the plain; "
        "meanwhile a careful engineer measures how fast a small language model reads and writes text. ")


def prompt_ids(tokenizer, n: int) -> list[int]:
    ids: list[int] = []
    while len(ids) < n:
        ids += tokenizer.encode(TEXT, add_special_tokens=False).ids
    return ids[:n]


def bench_numpy(gguf, prompt: list[int], decode: int) -> tuple[float, float]:
    from logitproc.serve.numpy_llama import NumpyLlama

    llama = NumpyLlama(gguf, kv_dtype="float32")  # plain float32 numpy (the baseline of the table)
    llama.prefill(prompt[:8])  # warm-up
    t0 = time.perf_counter()
    logits = llama.prefill(prompt)
    prefill_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(decode):
        logits = llama.decode(int(np.argmax(logits)))
    return len(prompt) / prefill_s, decode / (time.perf_counter() - t0)


def bench_compiled(model, prompt: list[int], decode: int) -> tuple[float, float]:
    model.add_sequence(0)
    model.prefill([0], [prompt[:8]])  # warm-up
    model.remove_sequence(0)
    model.add_sequence(0)
    t0 = time.perf_counter()
    logits = model.prefill([0], [prompt])
    prefill_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(decode):
        logits = model.decode([0], [int(np.argmax(logits[0]))])
    decode_s = time.perf_counter() - t0
    model.remove_sequence(0)
    return len(prompt) / prefill_s, decode / decode_s


def bench_engine(model, prompt: list[int], decode: int, batch: int, config) -> dict[str, float]:
    """Decode steps only (the prefill step is left out): ms per step, ms in processing, and the share."""
    from logitproc.serve.engine import Engine
    from logitproc.serve.outputs import EngineStats

    engine = Engine(model, max_batch=batch)
    engine.generate(prompt[:16], config)  # warm-up (grammar compile, buffers)
    for i in range(batch):
        engine.add_request(prompt, config, request_id=f"r{i}")
    engine.step()  # prefill
    start = EngineStats(**engine.stats.__dict__)
    while engine.has_unfinished():
        engine.step()
    st = engine.stats
    steps = st.steps - start.steps
    step_s = st.step_seconds - start.step_seconds
    proc_s = st.processing_seconds - start.processing_seconds
    return {"steps": steps, "step_ms": 1e3 * step_s / steps, "proc_ms": 1e3 * proc_s / steps,
            "share": proc_s / step_s, "tok_s": batch * steps / step_s}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-engine", action="store_true", help="only the prefill/decode comparison")
    parser.add_argument("--markdown", action="store_true")
    parser.add_argument("--llama-cpp", action="store_true", help="side by side with llama.cpp on the same GGUF")
    parser.add_argument("--contexts", default="64,1024,4096", help="prompt lengths of the side-by-side mode")
    parser.add_argument("--threads", type=int, default=2, help="threads of both models in the side-by-side mode")
    parser.add_argument("--batch", type=int, default=8, help="sequences decoded together in the side-by-side mode")
    parser.add_argument("--profile", action="store_true", help="only where one decode step goes (decode_profile.py)")
    parser.add_argument("--kv-dtype", default="float16", choices=("float16", "float32"),
                        help="the compiled model's KV cache (llama.cpp's is float16)")
    parser.add_argument("--activation-bits", type=int, default=16, choices=(16, 8),
                        help="activation codes of the integer-dot matmuls (8: as llama.cpp's)")
    parser.add_argument("--profile-prefill", default="", help="with --profile: prompt lengths to profile prefills of")
    parser.add_argument("--profile-verify", default="", help="with --profile: token counts to profile verifies of")
    parser.add_argument("--profile-batch", default="", help="with --profile: batch sizes to profile decode steps of")
    args = parser.parse_args()
    if args.llama_cpp:
        os.environ["TVM_NUM_THREADS"] = str(args.threads)  # read when TVM's thread pool starts (first kernel)

    from logitproc.compile.gguf_model import load_default_model, load_gguf
    from logitproc.compile.model_compile import compile_model
    from logitproc.compile.model_fetch import fetch_default_model
    from logitproc.runtime import GenerationConfig
    from logitproc.serve.compiled_model import CompiledModel

    built = compile_model(args.model, progress=lambda m: print(m, file=sys.stderr), kv_dtype=args.kv_dtype,
                          activation_bits=args.activation_bits)
    model = CompiledModel.open(built)
    print(machine_line())
    print(f"load average before the run: {os.getloadavg()[0]:.2f} (other processes share these cores)")
    if args.llama_cpp:
        from side_by_side import side_by_side

        path = fetch_default_model() if args.model == "default" else Path(args.model)
        side_by_side(model, path, lambda n: prompt_ids(model.tokenizer, n),
                     [int(c) for c in args.contexts.split(",")], args.decode_tokens, args.rounds, args.threads,
                     args.batch)
        return 0
    if args.profile:
        from decode_profile import print_prefill_profile, print_profile

        print_profile(model, prompt_ids(model.tokenizer, args.prompt_tokens))
        for n in [int(n) for n in args.profile_prefill.split(",") if n]:
            print_prefill_profile(model, prompt_ids(model.tokenizer, n))
        for n in [int(n) for n in args.profile_verify.split(",") if n]:
            print_profile(model, prompt_ids(model.tokenizer, args.prompt_tokens), verify=n)
        for n in [int(n) for n in args.profile_batch.split(",") if n]:
            print_profile(model, prompt_ids(model.tokenizer, args.prompt_tokens), batch=n)
        return 0
    gguf = load_default_model() if args.model == "default" else load_gguf(args.model)
    prompt = prompt_ids(model.tokenizer, args.prompt_tokens)
    print(f"{model!r}, prompt {len(prompt)} tokens, "
          f"{args.decode_tokens} decode tokens")

    rounds = []
    for r in range(args.rounds):
        numpy_figures = bench_numpy(gguf, prompt, args.decode_tokens)
        rounds.append((*numpy_figures, *bench_compiled(model, prompt, args.decode_tokens)))
        print(f"round {r + 1}: numpy prefill {rounds[-1][0]:.0f} decode {rounds[-1][1]:.1f} | compiled prefill "
              f"{rounds[-1][2]:.0f} decode {rounds[-1][3]:.1f} tok/s (load {os.getloadavg()[0]:.2f})")
    np_prefill, np_decode, tvm_prefill, tvm_decode = (max(column) for column in zip(*rounds, strict=True))
    print(f"\nbest of {args.rounds} rounds; OPENBLAS_NUM_THREADS={os.environ.get('OPENBLAS_NUM_THREADS', '(unset)')}, "
          f"TVM_NUM_THREADS={os.environ.get('TVM_NUM_THREADS', '(unset)')}")
    print("\n| model | prefill tok/s | decode tok/s (batch 1) |\n|---|---|---|")
    print(f"| NumpyLlama (float32 numpy) | {np_prefill:.0f} | {np_decode:.1f} |")
    print(f"| CompiledModel (TVM) | {tvm_prefill:.0f} | {tvm_decode:.1f} |")
    print(f"| compiled / numpy | {tvm_prefill / np_prefill:.2f}x | {tvm_decode / np_decode:.2f}x |")
    if args.no_engine:
        return 0

    typical = GenerationConfig(temperature=0.7, top_p=0.9, repetition_penalty=1.1, seed=0,
                               max_tokens=args.decode_tokens, ignore_eos=True)
    schema = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
    configs = {"typical (T 0.7, top_p 0.9, rep 1.1)": typical,
               "typical + JSON schema": replace(typical, response_format=schema, ignore_eos=False)}
    print("\n| engine decode step | batch | steps | step ms | logit processing + sampling ms | share | tok/s |")
    print("|---|---|---|---|---|---|---|")
    for name, config in configs.items():
        for batch in (1, 4):
            r = bench_engine(model, prompt, args.decode_tokens, batch, config)
            print(f"| {name} | {batch} | {r['steps']} | {r['step_ms']:.1f} | {r['proc_ms']:.2f} | "
                  f"{100 * r['share']:.1f}% | {r['tok_s']:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
