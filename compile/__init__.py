"""Compilation: build the kernel library for a target kind, export it with a manifest; compile a Llama-family model
together with the kernels into one library (``compile_model``).

Names are imported on first use, so that ``logitproc.compile.targets`` (which the runtime reads to open a library)
does not pull in the model compiler.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "CUDA_ARCHS": "targets",
    "ROCM_ARCHS": "targets",
    "TARGET_KINDS": "targets",
    "KernelLibrary": "kernel_library",
    "TargetSpec": "targets",
    "build_kernels": "kernel_library",
    "cache_root": "kernel_library",
    "compile_model": "model_compile",
    "make_tiny_model": "tiny_model",
    "resolve_target": "targets",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'logitproc.compile' has no attribute {name!r}")
    return getattr(importlib.import_module(f".{module}", __name__), name)
