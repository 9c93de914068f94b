"""Target kinds logitproc builds for, and the TVM targets they map to.

The public names are ``cpu``, ``cuda``, ``rocm``, ``vulkan`` and ``metal``. Targets are always TVM dicts (TVM 0.27
rejects flag strings). The CPU target names the host CPU explicitly, since ``mcpu="native"`` falls back to generic
SSE code.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import tvm

TARGET_KINDS = ("cpu", "cuda", "rocm", "vulkan", "metal")
CUDA_ARCHS = ("sm_80", "sm_90")
ROCM_ARCHS = ("gfx90a", "gfx942", "gfx1100")


@dataclass(frozen=True)
class TargetSpec:
    """One build target: the public kind, its architecture (CPU name, sm_XX, gfxXXXX, or '' where none applies)."""

    kind: str
    arch: str

    def tvm_target(self) -> tvm.target.Target:
        """The TVM target (with an llvm host for GPU kinds)."""
        host = {"kind": "llvm"}
        if self.kind == "cpu":
            return tvm.target.Target({"kind": "llvm", "mcpu": self.arch, "num-cores": os.cpu_count() or 1})
        if self.kind == "cuda":
            return tvm.target.Target({"kind": "cuda", "arch": self.arch}, host=host)
        if self.kind == "rocm":
            return tvm.target.Target({"kind": "rocm", "mcpu": self.arch}, host=host)
        if self.kind == "vulkan":
            # TVM 0.27 has no SPIR-V code generator; its webgpu target emits WGSL, which wgpu runs on Vulkan.
            return tvm.target.Target({"kind": "webgpu"}, host=host)
        return tvm.target.Target({"kind": "metal"}, host=host)


def host_cpu_name() -> str:
    """LLVM's name for this machine's CPU, or 'generic' where LLVM does not know it."""
    codegen = tvm.target.codegen
    name = str(codegen.llvm_get_system_cpu())
    return name if name and codegen.llvm_is_valid_cpu(name, str(codegen.llvm_get_system_triple())) else "generic"


def resolve_target(kind: str, arch: str | None = None) -> TargetSpec:
    """Validate a public target kind and architecture; fill in the default architecture."""
    if kind not in TARGET_KINDS:
        raise ValueError(f"target kind {kind!r} is not supported; expected one of {TARGET_KINDS}")
    if kind == "cpu":
        return TargetSpec(kind, arch or host_cpu_name())
    if kind == "cuda":
        arch = arch or CUDA_ARCHS[0]
        if not (arch.startswith("sm_") and arch[3:].isdigit() and int(arch[3:]) >= 70):
            raise ValueError(f"cuda arch {arch!r} is not supported; expected sm_NN with NN >= 70, e.g. {CUDA_ARCHS}")
        return TargetSpec(kind, arch)
    if kind == "rocm":
        arch = arch or ROCM_ARCHS[1]
        if not arch.startswith("gfx"):
            raise ValueError(f"rocm arch {arch!r} is not supported; expected gfxNNNN, e.g. {ROCM_ARCHS}")
        return TargetSpec(kind, arch)
    if arch:
        raise ValueError(f"target kind {kind!r} takes no arch, got {arch!r}")
    return TargetSpec(kind, "")
