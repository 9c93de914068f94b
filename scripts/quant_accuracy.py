"""How far each quantised file's logits are from a float reference on the same weights: logitproc (16- and 8-bit
activation codes) and llama.cpp, per GGUF file.

    python scripts/quant_accuracy.py FILE.gguf [FILE.gguf ...] [--steps 8] [--markdown]

For each file the float reference is ``NumpyLlama`` on the file's dequantised weights (float32 activations, float32
KV cache): what the file's weights compute without any activation rounding. The prompt is the model's chat template
around "What is the capital of France?"; the reference decodes ``--steps`` greedy tokens after it, and every runner
is fed the same tokens (teacher forcing), so the rows compare like with like. Per runner: the largest and the mean
absolute logit difference over the prompt's last row and the decode rows, and the share of rows whose argmax is the
reference's. The logits' standard deviation is printed beside them for scale. Needs llama-cpp-python (the ``oracle``
extra) for the llama.cpp column.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def open_compiled(path: Path, activation_bits: int):
    """The file compiled with ``activation_bits`` codes and a float32 KV cache (one sequence)."""
    from logitproc.serve.compiled_model import CompiledModel

    return CompiledModel.open(path, activation_bits=activation_bits, kv_dtype="float32", max_num_sequences=1)


def compiled_rows(model, tokens: Sequence[int], prompt_len: int) -> np.ndarray:
    """logitproc's logits for the rows after ``tokens[:prompt_len]`` and each later token."""
    model.add_sequence(0)
    rows = [model.prefill([0], [list(tokens[:prompt_len])])[0]]
    rows += [model.decode([0], [int(t)])[0] for t in tokens[prompt_len:-1]]
    return np.stack(rows)


def llama_cpp_rows(path: Path, tokens: Sequence[int], prompt_len: int) -> np.ndarray:
    """llama.cpp's logits for the same rows (its own activation rounding, float16 KV cache: its default)."""
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(path), logits_all=True, n_ctx=len(tokens) + 8, n_threads=2, verbose=False)
    llm.eval(list(tokens[:-1]))
    return np.asarray(llm.scores[prompt_len - 1: len(tokens) - 1], np.float32)


def measure(path: Path, steps: int, log: Callable[[str], None]) -> list[tuple[str, float, float, float]]:
    """(runner, largest difference, mean difference, argmax agreement) per runner for one file."""
    from logitproc.compile.gguf_model import load_gguf
    from logitproc.serve.numpy_llama import NumpyLlama

    opened = open_compiled(path, 16)
    prompt = opened.tokenizer.encode(opened.apply_chat_template(QUESTION)).ids
    reference = NumpyLlama(load_gguf(path))
    rows = [reference.prefill(prompt)]
    tokens = list(prompt)
    for _ in range(steps):
        tokens.append(int(rows[-1].argmax()))
        rows.append(reference.decode(tokens[-1]))
    tokens.append(int(rows[-1].argmax()))
    expected = np.stack(rows)
    log(f"{path.name}: prompt {len(prompt)} tokens, {steps} decode rows, logits std {expected.std():.2f}")
    runners = {"logitproc, 16-bit codes": lambda: compiled_rows(opened, tokens, len(prompt)),
               "logitproc, 8-bit codes": lambda: compiled_rows(open_compiled(path, 8), tokens, len(prompt)),
               "llama.cpp": lambda: llama_cpp_rows(path, tokens, len(prompt))}
    results = []
    for name, run in runners.items():
        got = run()
        diff = np.abs(got - expected)
        agree = float((got.argmax(axis=1) == expected.argmax(axis=1)).mean())
        results.append((name, float(diff.max()), float(diff.mean()), agree))
        log(f"  {name}: max {diff.max():.3f}, mean {diff.mean():.4f}, argmax {agree:.0%}")
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="+", type=Path)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args()
    table = [(path.name, measure(path, args.steps, print)) for path in args.files]
    if args.markdown:
        print("\n| file | logitproc 16-bit codes: max / mean / argmax | 8-bit codes | llama.cpp |")
        print("|---|---|---|---|")
        for name, results in table:
            cells = [f"{m:.3f} / {a:.4f} / {g:.0%}" for _, m, a, g in results]
            print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
