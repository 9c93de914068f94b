"""Compile single kernels for the CPU and run them on numpy arrays (shared by the kernel tests)."""

from __future__ import annotations

import functools

import numpy as np
import tvm
from logitproc.compile import resolve_target
from logitproc.tir_kernels import KERNEL_FACTORIES


@functools.cache
def cpu_kernel(name: str) -> tvm.runtime.Module:
    """The kernel ``name`` compiled for this machine's CPU (cached per process)."""
    target = resolve_target("cpu").tvm_target()
    return tvm.compile(tvm.IRModule({name: KERNEL_FACTORIES[name](target)}), target=target)[name]


def run_cpu(name: str, *arrays: np.ndarray) -> list[np.ndarray]:
    """Call kernel ``name`` on copies of ``arrays``; return every argument's contents afterwards (in place and out)."""
    dev = tvm.cpu()
    tensors = [tvm.runtime.tensor(np.ascontiguousarray(a), dev) for a in arrays]
    cpu_kernel(name)(*tensors)
    return [t.numpy() for t in tensors]
