"""Long-context decode by KV cache type: logitproc's float16 and q8_0 caches against llama.cpp with
``-ctk q8_0 -ctv q8_0`` (llama-cpp-python, ``type_k = type_v = 8``, flash attention: llama.cpp's quantised V cache
needs it), same GGUF, same prompt tokens, same threads, interleaved rounds (best kept).

    python scripts/bench_kv_cache.py [--model default] [--context 4096] [--decode-tokens 32] [--rounds 3]
                                     [--threads 2] [--markdown]

The memory floor of a decode step at that context: a copy (``--threads`` threads) of the weights plus the KV cache
a step reads (every layer's keys and values of every token, in the cache's own bytes: logitproc's rows of
``kv_layout.KVLayout``, llama.cpp's 34-byte blocks of 32); ``decode tok/s * floor seconds`` is the fraction of it
reached.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import machine_line  # noqa: E402
from side_by_side import CompiledRunner, memcpy_seconds, run  # noqa: E402

TEXT = ("The river rises in the hills above the town, runs through the old market and the mill, and reaches the "
        "sea twelve miles to the south, where the harbour has sheltered fishing boats for four hundred years. ")


class LlamaCppQ8:
    """llama.cpp with a q8_0 KV cache (``type_k = type_v = GGML_TYPE_Q8_0``, flash attention)."""

    name = "llama.cpp q8_0"

    def __init__(self, gguf: Path, n_ctx: int, threads: int) -> None:
        import llama_cpp

        self._llama_cpp = llama_cpp
        self.llm = llama_cpp.Llama(model_path=str(gguf), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                                   type_k=llama_cpp.GGML_TYPE_Q8_0, type_v=llama_cpp.GGML_TYPE_Q8_0,
                                   flash_attn=True, verbose=False)
        self._vocab = self.llm.n_vocab()

    def _logits(self) -> np.ndarray:
        pointer = self._llama_cpp.llama_get_logits_ith(self.llm.ctx, -1)
        return np.ctypeslib.as_array(pointer, shape=(self._vocab,)).copy()

    def prefill(self, tokens):
        self.llm.reset()
        self.llm.eval(list(tokens))
        return self._logits()

    def decode(self, token: int):
        self.llm.eval([token])
        return self._logits()

    def release(self) -> None:
        self.llm.reset()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args()
    os.environ.setdefault("TVM_NUM_THREADS", str(args.threads))

    from logitproc.compile.kv_layout import KVLayout
    from logitproc.compile.model_compile import PARAMS_FILE
    from logitproc.compile.model_fetch import fetch_default_model
    from logitproc.serve.compiled_model import CompiledModel

    gguf = fetch_default_model() if args.model == "default" else Path(args.model)
    n_ctx = args.context + args.decode_tokens + 64
    models = {kv: CompiledModel.open(gguf, kv_dtype=kv, max_num_sequences=1, max_total_tokens=n_ctx)
              for kv in ("float16", "q8_0")}
    cfg = models["q8_0"].config
    words = models["q8_0"].tokenizer.encode(TEXT * (args.context // 20 + 1), add_special_tokens=False).ids
    prompt = [int(t) for t in words[: args.context]]
    runners = {f"logitproc {kv}": CompiledRunner(model) for kv, model in models.items()}
    runners["llama.cpp q8_0"] = LlamaCppQ8(gguf, n_ctx, args.threads)

    with np.load(models["q8_0"].directory / PARAMS_FILE) as stored:
        weight_bytes = sum(stored[name].nbytes for name in stored.files)
    kv_bytes = {f"logitproc {kv}": cfg.n_layers * args.context * KVLayout(kv, cfg.n_kv_heads, cfg.head_dim)
                .bytes_per_token() for kv in models}
    kv_bytes["llama.cpp q8_0"] = cfg.n_layers * args.context * 2 * cfg.n_kv_heads * cfg.head_dim // 32 * 34
    floors = {name: memcpy_seconds(weight_bytes + kv_bytes[name], args.threads) for name in runners}

    best: dict[str, float] = {}
    for round_ in range(args.rounds):
        order = list(runners) if round_ % 2 == 0 else list(reversed(runners))
        for name in order:
            _, decode = run(runners[name], prompt, args.decode_tokens)
            best[name] = max(best.get(name, 0.0), decode)
            print(f"round {round_ + 1}: {name}: decode {decode:.1f} tok/s at context {len(prompt)}",
                  file=sys.stderr)

    print(f"# bench_kv_cache: {models['q8_0'].name}, context {len(prompt)}, {args.decode_tokens} greedy decode "
          f"steps, {args.threads} threads, best of {args.rounds} interleaved rounds, load {os.getloadavg()[0]:.1f}")
    print(f"# {machine_line()}")
    print(f"# weights {weight_bytes / 2**20:.1f} MiB (logitproc's stored bytes)")
    header = ["runner", "KV MiB", "decode tok/s", "vs llama.cpp q8_0", "floor ms (weights + KV)", "decode / floor"]
    sep = " | " if args.markdown else "  "
    print(("| " if args.markdown else "") + sep.join(header) + (" |" if args.markdown else ""))
    if args.markdown:
        print("|" + "---|" * len(header))
    for name in runners:
        cells = [name, f"{kv_bytes[name] / 2**20:.1f}", f"{best[name]:.1f}",
                 f"{best[name] / best['llama.cpp q8_0']:.2f}x", f"{floors[name] * 1e3:.2f}",
                 f"{best[name] * floors[name]:.2f}"]
        print(("| " if args.markdown else "") + sep.join(cells) + (" |" if args.markdown else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
