# fmt: off
"""Pieces every kernel shares: the masked-logit value, a vectorisable exp for CPUs, and what a target allows.

Kernel factories write each element-wise formula once with these helpers and wrap it in a loop nest per target kind:
``is_cpu(target)`` picks the CPU nest (rows in parallel, branch-free vectorised words, a scalar tail), otherwise the
GPU nest (one block per row or a flat grid, ``max_threads(target)`` threads).
"""

from __future__ import annotations

import tvm
from tvm import tirx
from tvm.script import tirx as T

from ..runtime import kernel_abi

#: Bit pattern of float32 -inf. Masked logits are set to -inf so that their probability is exactly 0; it is written
#: as a bit cast rather than a literal so that every code generator (WGSL and OpenCL print 7-digit literals, WGSL has
#: no infinity literal) produces the same value.
NEG_INF_BITS = 0xFF800000
POS_INF_BITS = 0x7F800000

#: exp(x) underflows to 0 in float32 below this; fast_exp returns exactly 0 there (and for -inf).
EXP_UNDERFLOW = -87.33654

#: Vector width, in float32 lanes, of the CPU loop nests (one AVX-512 register; LLVM splits it for narrower CPUs).
CPU_LANES = 16

#: Declared alignment of the callers' [batch, vocab] float32 arrays (see ``runtime.kernel_abi``).
CALLER_ARRAY_ALIGN = kernel_abi.CALLER_ARRAY_ALIGN

#: Threads per block for WebGPU/Vulkan unless the device raises its limits.
WEBGPU_THREADS = 256

#: Threads per block on CUDA, ROCm and Metal.
GPU_THREADS = 1024

_GPU_KINDS = ("cuda", "rocm", "webgpu", "metal", "vulkan", "opencl")


def neg_inf() -> tirx.PrimExpr:
    """float32 -inf as an expression every backend prints exactly."""
    return T.reinterpret("float32", T.uint32(NEG_INF_BITS))


def pos_inf() -> tirx.PrimExpr:
    """float32 +inf as an expression every backend prints exactly."""
    return T.reinterpret("float32", T.uint32(POS_INF_BITS))


def is_cpu(target: tvm.target.Target) -> bool:
    """True for llvm (host CPU) targets, False for GPU kinds."""
    kind = target.kind.name
    if kind == "llvm":
        return True
    if kind in _GPU_KINDS:
        return False
    raise ValueError(f"target kind {kind!r} is not supported; expected llvm or one of {_GPU_KINDS}")


def max_threads(target: tvm.target.Target) -> int:
    """Threads per block the GPU loop nests use on ``target``."""
    return WEBGPU_THREADS if target.kind.name == "webgpu" else GPU_THREADS


# Taylor coefficients of 2**f = exp(f * ln 2) for f in [-0.5, 0.5]; degree 6 keeps the relative error near 1.2e-7.
_EXP2_COEFFS = (
    1.0,
    0.6931471805599453,
    0.2402265069591007,
    0.05550410866482158,
    0.009618129107628477,
    0.0013333558146428443,
    0.00015403530393381608,
)
_LOG2E = 1.4426950408889634


# Near-minimax coefficients of 2**f for f in [-0.5, 0.5] (relative error 7.5e-8 in exact arithmetic, 2.3e-7 evaluated
# in float32): one multiply-add fewer than the Taylor series above for the same accuracy.
_EXP2_MINIMAX = (
    1.0000000716548145,
    0.6931469670634909,
    0.24022119723146163,
    0.055507132751970084,
    0.009675541373425522,
    0.0013276471562143552,
)

#: log2(e): the CPU softmax exps are 2**((x - max) * (log2(e) / temperature)).
LOG2E = _LOG2E

#: 2**z is exactly 0 from here down in ``exp2_nonpositive`` (its exponent field would be 0).
EXP2_ZERO_BELOW = -127.0


def _pow2_times_poly(t: tirx.Var, n: tirx.Var, f: tirx.Var, coeffs) -> tirx.PrimExpr:
    """Given t (bound by the caller): n = floor(t + 0.5), f = t - n, then poly(f) * 2**n, poly's coefficients
    ``coeffs`` (lowest degree first, Horner's order) and 2**n built in the float's exponent field."""
    poly = tirx.const(coeffs[-1], "float32")
    for c in reversed(coeffs[:-1]):
        poly = poly * f + tirx.const(c, "float32")
    scale = T.reinterpret("float32", T.shift_left(T.Cast("int32", n) + 127, 23))
    return tirx.Let(n, T.floor(t + tirx.const(0.5, "float32")), tirx.Let(f, t - n, poly * scale))


def exp2_nonpositive(z: tirx.PrimExpr) -> tirx.PrimExpr:
    """2**z for float32 z <= 0 (the softmax numerators of the CPU kernels), in 12 vector operations.

    Equivalent to::

        t = max(z, -127); n = floor(t + 0.5); f = t - n
        poly(f) * 2**n                # 2**n built in the exponent field: 0.0 when n = -127

    Exactly 0 for -inf and for z < -126.5 (where the true value is below 1.2e-38), relative error about 2.3e-7
    elsewhere; no select, unlike ``fast_exp``. z > 0 is not supported (the callers subtract the row maximum).
    """
    t = tirx.Var("exp2_t", "float32")
    n = tirx.Var("exp2_n", "float32")
    f = tirx.Var("exp2_f", "float32")
    return tirx.Let(t, T.max(z, tirx.const(EXP2_ZERO_BELOW, "float32")), _pow2_times_poly(t, n, f, _EXP2_MINIMAX))


def fast_exp(x: tirx.PrimExpr) -> tirx.PrimExpr:
    """exp(x) for float32 without a libm call, so that LLVM keeps it in vector registers.

    Equivalent to::

        0.0 if x < EXP_UNDERFLOW else 2**n * poly(f)   # t = x*log2(e), n = round(t), f = t - n

    Exact 0 for -inf and for every x whose exp underflows; relative error about 2e-7 elsewhere (x <= 88).
    """
    t = tirx.Var("exp_t", "float32")
    n = tirx.Var("exp_n", "float32")
    f = tirx.Var("exp_f", "float32")
    value = tirx.Let(t, T.max(x, tirx.const(EXP_UNDERFLOW, "float32")) * tirx.const(_LOG2E, "float32"),
                     _pow2_times_poly(t, n, f, _EXP2_COEFFS))
    return T.Select(x < tirx.const(EXP_UNDERFLOW, "float32"), tirx.const(0.0, "float32"), value)


