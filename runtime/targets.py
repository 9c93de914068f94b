"""Target kinds logitproc builds for, and the TVM targets they map to.

The public names are ``cpu``, ``cuda``, ``rocm``, ``vulkan`` and ``metal``. Targets are always TVM dicts (TVM 0.27
rejects flag strings). The CPU target names the host CPU explicitly, since ``mcpu="native"`` falls back to generic
SSE code, and turns off the instruction sets the host lacks although its CPU model has them (``mattr``): a virtual
machine may hide AVX-512 from a CPU that LLVM knows as ``znver4``, and code built for the model's full set then
stops on an illegal instruction. ``build_features`` names what a build may use; ``check_runs_here`` refuses a
build whose features this CPU lacks.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tvm

TARGET_KINDS = ("cpu", "cuda", "rocm", "vulkan", "metal")
CUDA_ARCHS = ("sm_80", "sm_90")
ROCM_ARCHS = ("gfx90a", "gfx942", "gfx1100")


@dataclass(frozen=True)
class TargetSpec:
    """One build target: the public kind, its architecture (CPU name, sm_XX, gfxXXXX, or '' where none applies)."""

    kind: str
    arch: str
    #: cpu: LLVM features turned off because the host lacks them (``-avx512f``, ...), sorted
    mattr: tuple[str, ...] = ()

    def tvm_target(self) -> tvm.target.Target:
        """The TVM target (with an llvm host for GPU kinds)."""
        host = {"kind": "llvm"}
        if self.kind == "cpu":
            options: dict[str, Any] = {"kind": "llvm", "mcpu": self.arch, "num-cores": os.cpu_count() or 1}
            if self.mattr:
                options["mattr"] = list(self.mattr)
            return tvm.target.Target(options)
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


#: x86 LLVM features and the Linux /proc/cpuinfo flag that says the CPU has them
_X86_FLAGS = {
    "sse4.1": "sse4_1", "sse4.2": "sse4_2", "ssse3": "ssse3", "popcnt": "popcnt", "avx": "avx", "avx2": "avx2",
    "fma": "fma", "f16c": "f16c", "bmi": "bmi1", "bmi2": "bmi2", "lzcnt": "abm", "movbe": "movbe", "adx": "adx",
    "aes": "aes", "pclmul": "pclmulqdq", "sha": "sha_ni", "gfni": "gfni", "vaes": "vaes",
    "vpclmulqdq": "vpclmulqdq", "avxvnni": "avx_vnni", "avx512f": "avx512f", "avx512bw": "avx512bw",
    "avx512cd": "avx512cd", "avx512dq": "avx512dq", "avx512vl": "avx512vl", "avx512ifma": "avx512ifma",
    "avx512vbmi": "avx512vbmi", "avx512vbmi2": "avx512_vbmi2", "avx512vnni": "avx512_vnni",
    "avx512bitalg": "avx512_bitalg", "avx512vpopcntdq": "avx512_vpopcntdq", "avx512bf16": "avx512_bf16",
    "avx512fp16": "avx512_fp16", "amx-tile": "amx_tile", "amx-int8": "amx_int8", "amx-bf16": "amx_bf16",
}


def _cpuinfo_flags() -> set[str] | None:
    """The CPU flags Linux reports for this machine, or None where /proc/cpuinfo is not readable."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return None


def host_missing_features(cpu: str) -> tuple[str, ...]:
    """``-feature`` for each x86 feature LLVM's CPU model ``cpu`` has that this machine does not report (sorted;
    empty off Linux/x86, where LLVM's model of the CPU is trusted)."""
    flags = _cpuinfo_flags()
    if flags is None or not str(tvm.target.codegen.llvm_get_system_triple()).startswith(("x86_64", "i686", "i386")):
        return ()
    model = tvm.target.codegen.llvm_get_cpu_features(tvm.target.Target({"kind": "llvm", "mcpu": cpu}))
    return tuple(sorted(f"-{feature}" for feature, flag in _X86_FLAGS.items()
                        if feature in model and flag not in flags))


def build_features(target: tvm.target.Target) -> frozenset[str]:
    """The LLVM features code built for ``target`` may use."""
    return frozenset(str(f) for f in tvm.target.codegen.llvm_get_cpu_features(target))


def host_target() -> TargetSpec:
    """The cpu target of this machine: its CPU name and the features it lacks turned off."""
    cpu = host_cpu_name()
    return TargetSpec("cpu", cpu, host_missing_features(cpu))


def check_runs_here(target: dict[str, Any], where: str) -> None:
    """Raise ValueError if a cpu build uses features this CPU lacks (``target``: a manifest's ``kind``, ``arch``
    and ``tvm``, the TVM target as JSON)."""
    if target.get("kind") != "cpu":
        return
    built = tvm.target.Target(json.loads(target["tvm"]))
    missing = sorted(build_features(built) - build_features(host_target().tvm_target()))
    if missing:
        raise ValueError(f"{where} was built for CPU {target.get('arch')!r} with features this CPU lacks "
                         f"({', '.join(missing)}); rebuild it here")


def resolve_target(kind: str, arch: str | None = None) -> TargetSpec:
    """Validate a public target kind and architecture; fill in the default architecture."""
    if kind not in TARGET_KINDS:
        raise ValueError(f"target kind {kind!r} is not supported; expected one of {TARGET_KINDS}")
    if kind == "cpu":
        return host_target() if arch is None or arch == host_cpu_name() else TargetSpec(kind, arch)
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
