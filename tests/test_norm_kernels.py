"""The RMS norm kernel of the hidden states (``compile/norm_kernels.py``): against numpy in float64, batch
invariant, the add's output exact, bad sizes refused."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from kernel_harness import built_for_cpu
from logitproc.compile.norm_kernels import PARALLEL_FROM, rms_norm_kernel

#: widths below, at and past a vector, not multiples of 16 (the tail), and Llama 3.2 1B's
WIDTHS = (1, 8, 21, 64, 576, 2048)
TOKENS = (1, PARALLEL_FROM - 1, PARALLEL_FROM, 33)


def _reference(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    x64 = x.astype(np.float64)
    return x64 / np.sqrt((x64 * x64).mean(axis=-1, keepdims=True) + eps) * w.astype(np.float64)


def _tensor(a: np.ndarray) -> tvm.runtime.Tensor:
    return tvm.runtime.tensor(a, tvm.cpu())


@pytest.mark.parametrize("hidden", WIDTHS)
def test_add_and_norm_match_numpy_and_each_token_is_batch_invariant(hidden: int) -> None:
    rng = np.random.default_rng(hidden)
    eps = 1e-5
    w = rng.standard_normal(hidden).astype(np.float32)
    add, plain = built_for_cpu(rms_norm_kernel, hidden, eps, True), built_for_cpu(rms_norm_kernel, hidden, eps, False)
    x = (rng.standard_normal((max(TOKENS), hidden)) * 3).astype(np.float32)
    r = rng.standard_normal((max(TOKENS), hidden)).astype(np.float32)
    x[2] = 0.0  # a zero row after the add: eps alone
    r[2] = 0.0
    outs = {}
    for n in TOKENS:
        total = _tensor(np.full((n, hidden), np.nan, np.float32))
        out = _tensor(np.full((n, hidden), np.nan, np.float32))
        add(_tensor(x[:n]), _tensor(r[:n]), _tensor(w), total, out)
        np.testing.assert_array_equal(total.numpy(), x[:n] + r[:n])
        np.testing.assert_allclose(out.numpy(), _reference(x[:n] + r[:n], w, eps), rtol=2e-6, atol=1e-6,
                                   err_msg=f"width {hidden}, {n} tokens")
        normed = _tensor(np.full((n, hidden), np.nan, np.float32))
        plain(_tensor(x[:n] + r[:n]), _tensor(w), normed)
        np.testing.assert_array_equal(normed.numpy(), out.numpy())  # the same operations without the add
        outs[n] = out.numpy()
    for n, out in outs.items():  # a token's row whatever the other tokens (serial and parallel loops alike)
        np.testing.assert_array_equal(out, outs[max(TOKENS)][:n], err_msg=f"width {hidden}, {n} tokens")


def test_bad_sizes_are_refused() -> None:
    with pytest.raises(ValueError, match="width must be at least 1, got 0"):
        rms_norm_kernel(0, 1e-5, True)
    with pytest.raises(ValueError, match="epsilon must be a finite number >= 0, got -1"):
        rms_norm_kernel(8, -1.0, False)
    with pytest.raises(ValueError, match="epsilon must be a finite number >= 0, got nan"):
        rms_norm_kernel(8, float("nan"), False)
