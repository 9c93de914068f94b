"""A compiled model's logits over a prompt and greedy decode steps: the rows the model tests compare with a
reference (transformers, ``NumpyLlama``, llama.cpp) fed the same tokens."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def greedy_rows(compiled, prompt: Sequence[int], steps: int) -> tuple[np.ndarray, list[int]]:
    """``(rows, tokens)``: the logits after the prompt and after each of ``steps`` greedy tokens (``[steps + 1, V]``),
    and the prompt followed by those tokens (the last row's argmax not appended). Uses sequence 0 of ``compiled``."""
    compiled.add_sequence(0)
    rows = [compiled.prefill([0], [list(prompt)])[0]]
    tokens = list(prompt)
    for _ in range(steps):
        tokens.append(int(rows[-1].argmax()))
        rows.append(compiled.decode([0], [tokens[-1]])[0])
    return np.stack(rows), tokens
