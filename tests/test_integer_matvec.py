"""The integer-dot decode matvecs (``compile/integer_matvec.py`` through ``linear_kernel(..., int8_dot=True)``), with
8- and 16-bit activations, against a numpy emulation of the same activation quantisation (exact integer sums, so
within float rounding), and against the float product within the quantisation's error; awkward shapes: rows not a
multiple of the 64 chunks, an odd number of blocks, 1 to 15 tokens, all-zero activation blocks, Q8_0 codes of -128."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from kernel_harness import built_for_cpu
from logitproc.compile.integer_matvec import has_int8_dot
from logitproc.compile.linear_kernels import integer_linear_kernel, linear_kernel
from logitproc.runtime.targets import build_features, resolve_target

TARGET = resolve_target("cpu").tvm_target()
pytestmark = pytest.mark.skipif(not has_int8_dot(build_features(TARGET)), reason="this CPU has no AVX2")

#: (out, in): SmolLM2's decode shapes and awkward ones (N below / not a multiple of 64 chunks, 3 and 1 blocks)
SHAPES = {"q4_1": [(960, 576), (576, 1536), (100, 96), (37, 32)], "q8_0": [(49152, 576), (100, 96), (5, 64)]}
TOKENS = (1, 2, 3, 5, 6, 8, 15)  # groups of 4, a pair, one: every combination


def quantise(x: np.ndarray, qmax: int) -> tuple[np.ndarray, np.ndarray]:
    """Blocks of 32 as the kernel makes them: int codes (as float64) and scales, float32 arithmetic."""
    blocks = x.reshape(x.shape[0], -1, 32)
    d = np.abs(blocks).max(axis=2) / np.float32(qmax)
    inv = np.where(d > 0, np.float32(1) / np.maximum(d, np.float32(1e-30)), np.float32(0)).astype(np.float32)
    q = np.rint(blocks * inv[:, :, None])
    return q.astype(np.float64), d.astype(np.float64)


def weights(fmt: str, n_out: int, n_in: int, rng: np.random.Generator):
    """(arrays in the kernel's layout, integer codes [N, blocks, 32], scales, mins or None)."""
    blocks = n_in // 32
    scales = (rng.uniform(0.001, 0.02, (n_out, blocks))).astype(np.float16)
    if fmt == "q8_0":
        codes = rng.integers(-128, 128, (n_out, n_in)).astype(np.int8)
        return [codes, scales], codes.reshape(n_out, blocks, 32).astype(np.float64), scales, None
    packed = rng.integers(0, 256, (n_out, n_in // 2)).astype(np.uint8).reshape(n_out, blocks, 16)
    mins = rng.uniform(-0.15, 0.0, (n_out, blocks)).astype(np.float16)
    q = np.concatenate([packed & 15, packed >> 4], axis=2).astype(np.float64)
    return [packed.reshape(n_out, -1), scales, mins], q, scales, mins


@pytest.mark.parametrize("xbits", [8, 16])
@pytest.mark.parametrize("fmt", ["q4_1", "q8_0"])
def test_integer_matvec_matches_the_emulated_quantisation(fmt: str, xbits: int) -> None:
    rng = np.random.default_rng(3)
    for n_out, n_in in SHAPES[fmt]:
        run = built_for_cpu(linear_kernel, n_out, n_in, fmt, True, xbits)
        arrays, q_w, scales, mins = weights(fmt, n_out, n_in, rng)
        offset = 0 if mins is None else mins[:, :, None].astype(np.float64)
        dense = (q_w * scales[:, :, None].astype(np.float64) + offset).reshape(n_out, n_in)
        device_arrays = [tvm.runtime.tensor(a) for a in arrays]
        for n in TOKENS:
            x = rng.standard_normal((n, n_in)).astype(np.float32)
            x[0, :32] = 0  # an all-zero block: scale 0, codes 0
            q_x, d_x = quantise(x, 2 ** (xbits - 1) - 1)
            dots = np.einsum("obj,tbj->tob", q_w, q_x)
            expected = (dots * scales[None].astype(np.float64) * d_x[:, None, :]).sum(axis=2)
            if mins is not None:
                expected += (mins[None].astype(np.float64) * (d_x * q_x.sum(axis=2))[:, None, :]).sum(axis=2)
            y = tvm.runtime.tensor(np.full((n, n_out), np.nan, np.float32))
            run(tvm.runtime.tensor(x), *device_arrays, y)
            scale = np.abs(expected).max()
            np.testing.assert_allclose(y.numpy(), expected, rtol=0, atol=2e-6 * scale,
                                       err_msg=f"{fmt} {n_out}x{n_in}, {n} tokens")
            exact = x.astype(np.float64) @ dense.T  # the activation quantisation's own error
            bound = 2e-2 if xbits == 8 else 1e-4
            assert np.abs(y.numpy() - exact).max() <= bound * np.abs(exact).max(), f"{fmt} {n_out}x{n_in}, {n}"


@pytest.mark.parametrize(("x_dtype", "y_dtype"), [("float32", "float16"), ("float16", "float32"),
                                                  ("float16", "float16")])
def test_float16_inputs_and_outputs_give_the_float32_kernels_sums_rounded_once(x_dtype: str, y_dtype: str) -> None:
    """``integer_linear_kernel`` (the qkv projection writing a float16 KV cache's q/k/v, the o projection reading its
    attention output): bitwise the float32 kernel's result on the same (float16) inputs, rounded once."""
    rng = np.random.default_rng(5)
    for fmt, (n_out, n_in) in (("q4_1", (100, 96)), ("q8_0", (37, 64))):
        kernels = {"f32": built_for_cpu(linear_kernel, n_out, n_in, fmt, True, 16, mode="decode"),
                   "mixed": built_for_cpu(integer_linear_kernel, n_out, n_in, fmt, x_dtype, y_dtype)}
        arrays = [tvm.runtime.tensor(a) for a in weights(fmt, n_out, n_in, rng)[0]]
        for n in (1, 6, 9):
            x = rng.standard_normal((n, n_in)).astype(x_dtype)
            want = tvm.runtime.tensor(np.zeros((n, n_out), np.float32))
            kernels["f32"](tvm.runtime.tensor(x.astype(np.float32)), *arrays, want)
            got = tvm.runtime.tensor(np.full((n, n_out), np.nan, y_dtype))
            kernels["mixed"](tvm.runtime.tensor(x), *arrays, got)
            np.testing.assert_array_equal(got.numpy(), want.numpy().astype(y_dtype), err_msg=f"{fmt}, {n} tokens")


def test_integer_linear_kernel_rejects_other_types() -> None:
    with pytest.raises(ValueError, match="y_dtype must be float32 or float16, got 'bfloat16'"):
        integer_linear_kernel(64, 64, "q8_0", "float32", "bfloat16")
    with pytest.raises(ValueError, match="the integer dot products take q4_1 or q8_0 weights, got 'float16'"):
        integer_linear_kernel(64, 64, "float16")
