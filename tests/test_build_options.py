"""The build options every CPU build runs under (``compile/build_options.py``): leaving TVM's
CompactBufferAllocation out changes no kernel's results. The logit-processing kernels whose lowered code the pass
does change (buffers declared larger than the kernel touches) are built again the way TVM builds by default, with
the pass, and both builds run the kernel case table (awkward sizes, ties, masked rows): the same bits out."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from kernel_cases import all_cases
from kernel_harness import cpu_kernel
from logitproc.compile.build_options import COMPACT_BUFFER_ALLOCATION, pass_context
from logitproc.runtime.targets import resolve_target
from logitproc.tir_kernels import KERNEL_FACTORIES

#: the kernels whose lowered CPU code differs with and without the pass (the others lower to the same code)
CHANGED = ["softmax_with_temperature", "renormalize_probs", "top_n"]
TARGET = resolve_target("cpu").tvm_target()


def test_cpu_builds_leave_out_compact_buffer_allocation_and_gpu_builds_keep_it() -> None:
    assert COMPACT_BUFFER_ALLOCATION in pass_context(TARGET).disabled_pass
    assert not pass_context(resolve_target("cuda").tvm_target()).disabled_pass


@pytest.mark.parametrize("name", CHANGED)
def test_kernel_built_with_the_pass_gives_the_same_bits(name: str) -> None:
    with tvm.transform.PassContext(opt_level=3):  # TVM's default pipeline, CompactBufferAllocation included
        compacted = tvm.compile(tvm.IRModule({name: KERNEL_FACTORIES[name](TARGET)}), target=TARGET).mod[name]
    cases = [case for case in all_cases() if case.kernel == name]
    assert cases
    for case in cases:
        results = []
        for kernel in (cpu_kernel(name), compacted):
            tensors = [tvm.runtime.tensor(np.ascontiguousarray(a), tvm.cpu()) for a in case.args]
            kernel(*tensors)
            results.append([t.numpy() for t in tensors])
        for ours, theirs in zip(*results, strict=True):
            assert ours.tobytes() == theirs.tobytes(), case.id
        case.check(results[0])
