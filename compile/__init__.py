"""Compilation: build the kernel library for a target kind, export it with a manifest, load it back."""

from .targets import CUDA_ARCHS, ROCM_ARCHS, TARGET_KINDS, TargetSpec, resolve_target

__all__ = ["CUDA_ARCHS", "ROCM_ARCHS", "TARGET_KINDS", "TargetSpec", "resolve_target"]
