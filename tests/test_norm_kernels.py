"""The RMS norm kernel of the hidden states (``compile/norm_kernels.py``): bit for bit Relax's own ``rms_norm`` as
it lowers today and numpy's float32 operations in that order, batch invariant, the add's output exact, bad sizes
refused."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from kernel_harness import built_for_cpu, compiled_for_cpu
from logitproc.compile.norm_kernels import PARALLEL_FROM, TILE, rms_norm_kernel
from tvm import relax
from tvm.relax.frontend import nn

#: widths of one element, below, at and past a vector, not multiples of 16, a power of two (where LLVM turns the
#: mean's division into an exact multiplication), SmolLM2's and Llama 3.2 1B's
WIDTHS = (1, 8, 21, 64, 129, 576, 2048)
#: one token, a tile and one more, just below and at the parallel threshold, and 140 (tiles and leftover tokens)
TOKENS = (1, TILE + 1, PARALLEL_FROM - 1, PARALLEL_FROM, 33, 140)
EPS = 1e-5


def _relax_rms_norm(hidden: int, eps: float) -> tvm.tir.PrimFunc:
    """Relax's ``rms_norm`` over the last axis of float32 ``[n, hidden]`` rows, legalised as a model build does
    (``LegalizeOps``: TOPI's blocks)."""

    class Norm(nn.Module):
        def __init__(self) -> None:
            self.weight = nn.Parameter((hidden,), "float32")

        def forward(self, x: nn.Tensor) -> nn.Tensor:
            return nn.op.rms_norm(x, self.weight, axes=[-1], epsilon=eps)

    mod, _ = Norm().export_tvm(spec={"forward": {"x": nn.spec.Tensor(["n", hidden], "float32")}})
    return relax.transform.LegalizeOps()(mod)["rms_norm"]


def _in_order(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """The norm as float32 operations in the order of the Relax lowering: each square rounded, each token's squares
    added one at a time in index order, ``1 / sqrt(sum / hidden + eps)``, ``(r * x) * w``."""
    sq = x * x
    total = np.zeros(x.shape[0], np.float32)
    for i in range(x.shape[1]):
        total = total + sq[:, i]
    r = np.float32(1) / np.sqrt(total / np.float32(x.shape[1]) + np.float32(eps))
    return r[:, None] * x * w


def _tensor(a: np.ndarray) -> tvm.runtime.Tensor:
    return tvm.runtime.tensor(a, tvm.cpu())


def _rows(rng: np.random.Generator, n: int, hidden: int) -> np.ndarray:
    """Gaussian rows at scales from 1e-3 to 1e3 (so the sums' roundings differ between orders)."""
    return (rng.standard_normal((n, hidden)) * 10.0 ** rng.uniform(-3, 3, (n, 1))).astype(np.float32)


@pytest.mark.parametrize("hidden", WIDTHS)
def test_norm_is_relax_rms_norm_bit_for_bit_and_batch_invariant(hidden: int) -> None:
    rng = np.random.default_rng(hidden)
    w = rng.standard_normal(hidden).astype(np.float32)
    relax_norm = compiled_for_cpu(_relax_rms_norm(hidden, EPS))
    add, plain = built_for_cpu(rms_norm_kernel, hidden, EPS, True), built_for_cpu(rms_norm_kernel, hidden, EPS, False)
    x, r = _rows(rng, max(TOKENS), hidden), _rows(rng, max(TOKENS), hidden)
    x[2], r[2] = 0.0, 0.0  # a zero row after the add: eps alone
    r[3] = -x[3]
    outs = {}
    for n in TOKENS:
        s = x[:n] + r[:n]
        want = _tensor(np.full((n, hidden), np.nan, np.float32))
        relax_norm(_tensor(s), _tensor(w), want)
        np.testing.assert_array_equal(want.numpy(), _in_order(s, w, EPS))  # the order the module doc states
        total = _tensor(np.full((n, hidden), np.nan, np.float32))
        out = _tensor(np.full((n, hidden), np.nan, np.float32))
        add(_tensor(x[:n]), _tensor(r[:n]), _tensor(w), total, out)
        np.testing.assert_array_equal(total.numpy(), s)
        np.testing.assert_array_equal(out.numpy(), want.numpy(), err_msg=f"width {hidden}, {n} tokens, with the add")
        normed = _tensor(np.full((n, hidden), np.nan, np.float32))
        plain(_tensor(s), _tensor(w), normed)
        np.testing.assert_array_equal(normed.numpy(), want.numpy(), err_msg=f"width {hidden}, {n} tokens")
        outs[n] = out.numpy()
    for n, out in outs.items():  # a token's row whatever the other tokens (serial, tiles and leftovers alike)
        np.testing.assert_array_equal(out, outs[max(TOKENS)][:n], err_msg=f"width {hidden}, {n} tokens")


def test_norm_agrees_with_float64_numpy() -> None:
    rng = np.random.default_rng(0)
    hidden, n = 576, 37
    x, w = _rows(rng, n, hidden), rng.standard_normal(hidden).astype(np.float32)
    out = _tensor(np.full((n, hidden), np.nan, np.float32))
    built_for_cpu(rms_norm_kernel, hidden, EPS, False)(_tensor(x), _tensor(w), out)
    x64 = x.astype(np.float64)
    want = x64 / np.sqrt((x64 * x64).mean(axis=-1, keepdims=True) + EPS) * w
    np.testing.assert_allclose(out.numpy(), want, rtol=5e-6, atol=1e-6)


def test_bad_sizes_are_refused() -> None:
    with pytest.raises(ValueError, match="width must be at least 1, got 0"):
        rms_norm_kernel(0, 1e-5, True)
    with pytest.raises(ValueError, match="epsilon must be a finite number >= 0, got -1"):
        rms_norm_kernel(8, -1.0, False)
    with pytest.raises(ValueError, match="epsilon must be a finite number >= 0, got nan"):
        rms_norm_kernel(8, float("nan"), False)
