"""Compilation: build the kernel library for a target kind, export it with a manifest, load it back; compile a
Llama-family model together with the kernels into one library (``compile_model``)."""

from .kernel_library import KernelLibrary, build_kernels, cache_root
from .model_compile import compile_model
from .targets import CUDA_ARCHS, ROCM_ARCHS, TARGET_KINDS, TargetSpec, resolve_target
from .tiny_model import make_tiny_model

__all__ = [
    "CUDA_ARCHS",
    "ROCM_ARCHS",
    "TARGET_KINDS",
    "KernelLibrary",
    "TargetSpec",
    "build_kernels",
    "cache_root",
    "compile_model",
    "make_tiny_model",
    "resolve_target",
]
