"""Compilation: build the kernel library for a target kind, export it with a manifest; compile a Llama-family model
together with the kernels into one library (``compile_model``).

Names are imported on first use, so that importing one of them does not pull in the whole compiler. The target
descriptions live in ``logitproc.runtime.targets`` (the runtime reads them to open a library and never imports the
compiler); they are re-exported here for callers that build.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "CUDA_ARCHS": "runtime.targets",
    "ROCM_ARCHS": "runtime.targets",
    "TARGET_KINDS": "runtime.targets",
    "KernelLibrary": "compile.kernel_library",
    "TargetSpec": "runtime.targets",
    "build_kernels": "compile.kernel_library",
    "cache_root": "compile.kernel_library",
    "compile_model": "compile.model_compile",
    "make_tiny_model": "compile.tiny_model",
    "resolve_target": "runtime.targets",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'logitproc.compile' has no attribute {name!r}")
    return getattr(importlib.import_module(f"..{module}", __name__), name)
