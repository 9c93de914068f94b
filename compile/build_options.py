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
"""

from __future__ import annotations

import tvm

#: the TIR pass CPU builds leave out (above)
COMPACT_BUFFER_ALLOCATION = "s_tir.CompactBufferAllocation"


def pass_context(target: tvm.target.Target) -> tvm.transform.PassContext:
    """The pass context a build for ``target`` runs under: ``opt_level=3``; CPU builds (LLVM's host kinds) without
    CompactBufferAllocation; GPU builds without TIR common-subexpression elimination (it adds hidden kernel
    parameters that launchers of raw WGSL / CUDA would have to know about)."""
    if target.kind.name in ("llvm", "c"):
        return tvm.transform.PassContext(opt_level=3, disabled_pass=[COMPACT_BUFFER_ALLOCATION])
    return tvm.transform.PassContext(opt_level=3, config={"tirx.disable_cse_tir": True})
