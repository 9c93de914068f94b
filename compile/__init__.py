"""Compilation: build the kernel library for a target kind, export it with a manifest, load it back."""

from .kernel_library import KernelLibrary, build_kernels, cache_root
from .targets import CUDA_ARCHS, ROCM_ARCHS, TARGET_KINDS, TargetSpec, resolve_target

__all__ = [
    "CUDA_ARCHS",
    "ROCM_ARCHS",
    "TARGET_KINDS",
    "KernelLibrary",
    "TargetSpec",
    "build_kernels",
    "cache_root",
    "resolve_target",
]
