"""The TVM pass context every build of this package runs under, per target.

One place decides which of TVM's TIR passes a build runs and with which options, so that the model compile, the
kernel library, the tests' standalone kernels and the benchmarks all compile the same code.

CPU builds skip ``s_tir.CompactBufferAllocation``. That pass only shrinks a buffer a block allocates to the region
the block's statements touch; every buffer of these kernels is already declared at the size it needs (a few at a
power of two the kernel only partly uses), so what it saves is a few bytes of stack, while its region analysis took
80-85% of every CPU build's TIR time (measured on this machine: the CPU kernel library's ``tvm.compile`` 14.9 s ->
2.5 s, the tiny model's 58 s compile -> 38 s; the decode attention kernel alone 5.6 s -> 1.1 s, with the same lowered
code). The kernels compute the same values either way (the tests compare a kernel built both ways bit for bit).
GPU builds keep it: there the compacted sizes are the shared memory a block reserves, which sets how many blocks
share a multiprocessor, and ``runtime/launch_geometry.py`` / ``runtime/wgsl.py`` lower the kernels as
``tvm.compile`` does for those targets.

CPU builds also skip four passes that change nothing in these kernels' lowered code (``NO_OP_PASSES``): with or
without them, every TIR function of the tiny model and its float16-KV and q8_0-KV variants, of two model families
(Gemma 2's window and soft-caps, Phi-3's partial rotary), of SmolLM2 in Q4_K_M, Q4_0, Q8_0 and Q4_1, the kernel
library and the attention and quantised linear kernels the tests build alone lowers to the same TIR, text for text
(so to the same object code), and they were a third of the TIR passes' time (the tiny model's 6.4 s of passes:
``HoistIfThenElse`` 1.1 s, ``RemoveNoOp`` 1.4 s; the two GPU-only passes 0.3 s). ``InjectPermutedLayout`` and
``InjectVirtualThread`` rewrite GPU shared-memory layouts and virtual threads, which no CPU kernel has;
``HoistIfThenElse`` finds no invariant condition to hoist out of a loop (the kernels branch outside their loops
already); ``RemoveNoOp`` finds no statement without an effect. Leaving a pass out can only cost speed, never change a
result (a hoisted condition or a removed no-op computes the same values); ``tests/test_build_passes.py`` keeps
the claim checked.
"""

from __future__ import annotations

import tvm

#: the TIR pass CPU builds leave out (above)
COMPACT_BUFFER_ALLOCATION = "s_tir.CompactBufferAllocation"
#: TIR passes that change nothing in a CPU build of these kernels (above), left out of CPU builds
NO_OP_PASSES = ("s_tir.InjectPermutedLayout", "s_tir.InjectVirtualThread", "s_tir.HoistIfThenElse", "tirx.RemoveNoOp")


def pass_context(target: tvm.target.Target) -> tvm.transform.PassContext:
    """The pass context a build for ``target`` runs under: ``opt_level=3``; CPU builds (LLVM's host kinds) without
    CompactBufferAllocation and the ``NO_OP_PASSES``; GPU builds without TIR common-subexpression elimination (it
    adds hidden kernel parameters that launchers of raw WGSL / CUDA would have to know about)."""
    if target.kind.name in ("llvm", "c"):
        return tvm.transform.PassContext(opt_level=3, disabled_pass=[COMPACT_BUFFER_ALLOCATION, *NO_OP_PASSES])
    return tvm.transform.PassContext(opt_level=3, config={"tirx.disable_cse_tir": True})
