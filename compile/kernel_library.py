"""Building the kernel library: every TIR kernel compiled for one target, exported as files plus a manifest, cached.

An exported library is a directory::

    manifest.json          target, TVM and logitproc versions, source hash, kernels with their parameters, files
    kernels.tir.py         the TVMScript of exactly what was compiled (reloadable with tvm.script.from_source)
    kernels.so             cpu, cuda, rocm: TVM module (host code plus embedded device code)
    kernels.o              cpu: the same code as an object file, which every compiled model for the target links into
                           its model.so (so a model build compiles no logit-processing kernel of its own)
    kernels.cu             cuda: the CUDA C source (JIT-compiled by TVM's runtime at load, NVRTC by default)
    kernels.<arch>.ptx     cuda: PTX from nvcc or NVRTC, when either is installed; with the manifest's
                           ``launches`` (each function's kernels, arguments, grid and block as expressions of its
                           shapes) it runs through the CUDA driver alone (``runtime/cuda_device.py``)
    kernels.<arch>.hsaco   rocm: the AMDGPU code object
    kernels.wgsl           vulkan: WGSL shaders (run through wgpu), plus kernels.func_info.json
    kernels.metal          metal: Metal shading language source

``build_kernels(kind)`` builds into the cache (``$LOGITPROC_CACHE`` or ``~/.cache/logitproc``) under a key made of
every input (kernel and compiler sources, target, TVM version) and reuses it when the key matches. Opening a built
library is the runtime's job (``logitproc.runtime.kernel_library.KernelLibrary``, re-exported here).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import tvm
from logitproc import __version__
from logitproc.runtime.kernel_library import MANIFEST, MANIFEST_FORMAT, KernelLibrary

from ..runtime.launch_geometry import FunctionLaunches, describe_functions, lower_split
from ..runtime.targets import TargetSpec, resolve_target
from .build_options import pass_context
from .cache_lock import cache_entry_lock
from .device_code import capture_rocm_code_objects, compile_cuda, cuda_compiler_available, prepare_rocm_env
from .macro_lookup import fast_macro_lookup

__all__ = ["KERNEL_OBJECT", "MANIFEST", "MANIFEST_FORMAT", "KernelLibrary", "build_in_cache", "build_kernels",
           "cache_key", "cache_root", "kernel_entries", "source_hash", "write_manifest"]

#: cpu: the kernels' object code, linked into each compiled model (``compile_model``).
KERNEL_OBJECT = "kernels.o"
_PACKAGE_ROOT = Path(__file__).resolve().parent.parent
#: What a kernel build depends on: every kernel source, and the compiler modules that turn them into artifacts.
_HASHED_SOURCES = ("tir_kernels/*.py", "compile/kernel_library.py", "compile/build_options.py", "runtime/targets.py",
                   "compile/device_code.py", "runtime/launch_geometry.py", "runtime/kernel_abi.py")


def source_hash() -> str:
    """sha256 over the kernel and compiler sources: a change in any of them invalidates cached builds."""
    digest = hashlib.sha256()
    for pattern in _HASHED_SOURCES:
        for path in sorted(_PACKAGE_ROOT.glob(pattern)):
            digest.update(path.name.encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


def cache_root() -> Path:
    """Where builds are cached: ``$LOGITPROC_CACHE`` or ``~/.cache/logitproc``."""
    return Path(os.environ.get("LOGITPROC_CACHE", Path.home() / ".cache" / "logitproc"))


def build_in_cache(final: Path, build: Callable[[Path], object]) -> None:
    """Run ``build(staging)`` in a fresh directory beside ``final`` and rename it to ``final`` (atomic), so that a
    reader never sees half a build. One process builds an entry at a time: another one asking for it meanwhile waits
    for that build and keeps its result instead of building it again."""
    final.parent.mkdir(parents=True, exist_ok=True)
    with cache_entry_lock(final):
        if (final / MANIFEST).is_file():
            return
        staging = Path(tempfile.mkdtemp(prefix=".building-", dir=final.parent))
        try:
            build(staging)
            staging.rename(final)
        finally:
            shutil.rmtree(staging, ignore_errors=True)


def cache_key(spec: TargetSpec, *material: object) -> str:
    """The cache key of a build (kernels or a model): the manifest format, the logitproc and TVM versions, the target
    (kind, arch, features turned off) and ``material`` (source hashes, model hash, options), hashed."""
    text = json.dumps([MANIFEST_FORMAT, __version__, tvm.__version__, spec.kind, spec.arch, *spec.mattr, *material])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def write_manifest(out: Path, spec: TargetSpec, target: tvm.target.Target, src_hash: str,
                   kernels: list[dict[str, Any]], files: list[str], **extra: Any) -> dict[str, Any]:
    """Write ``out/manifest.json``: the fields every exported library has (format, versions, target, source hash,
    the logit-processing kernels with their parameters (``kernel_entries``), the files), plus ``extra`` (a compiled
    model's own)."""
    manifest = {
        "format": MANIFEST_FORMAT,
        "logitproc_version": __version__,
        "tvm_version": tvm.__version__,
        "target": {"kind": spec.kind, "arch": spec.arch, "tvm": str(target)},
        "source_hash": src_hash,
        "kernels": kernels,
        "files": files,
        **extra,
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2))
    return manifest


def kernel_entries(kernels: dict[str, tvm.tirx.PrimFunc]) -> list[dict[str, Any]]:
    """The manifest's ``kernels``: each kernel's name and parameters."""
    return [{"name": name, "params": _param_list(func)} for name, func in kernels.items()]


def _param_list(func: tvm.tirx.PrimFunc) -> list[dict[str, Any]]:
    """Name, dtype and symbolic shape of each parameter (in TVM 0.27 buffer parameters are the buffers themselves)."""
    params = []
    for param in func.params:
        shape = getattr(param, "shape", None)
        dims = None if shape is None else [str(d) for d in shape]
        params.append({"name": str(param.name), "dtype": str(param.dtype), "shape": dims})
    return params


def _write_device_artifacts(spec: TargetSpec, executable: Any, code_objects: list[bytes], out: Path) -> list[str]:
    files: list[str] = []
    if spec.kind == "cpu":
        # The host module's object file, kept (one code generation serves the library and every model's link).
        with tempfile.TemporaryDirectory(prefix="logitproc-export-") as workspace:
            executable.export_library(str(out / "kernels.so"), workspace_dir=workspace)
            objects = list(Path(workspace).glob("*.o"))
            if len(objects) != 1:
                raise RuntimeError(f"expected one object file from the CPU library's export, got {objects}")
            shutil.move(objects[0], out / KERNEL_OBJECT)
        return ["kernels.so", KERNEL_OBJECT]
    if spec.kind in ("cuda", "rocm"):
        executable.export_library(str(out / "kernels.so"))
        files.append("kernels.so")
    device_module = executable.mod.imports[0]
    if spec.kind == "cuda":
        source = device_module.inspect_source("")
        (out / "kernels.cu").write_text(source)
        files.append("kernels.cu")
        if cuda_compiler_available():
            (out / f"kernels.{spec.arch}.ptx").write_bytes(compile_cuda(source, spec.arch, "ptx"))
            files.append(f"kernels.{spec.arch}.ptx")
    elif spec.kind == "rocm":
        if len(code_objects) != 1:
            raise RuntimeError(f"expected one AMDGPU code object from the ROCm build, got {len(code_objects)}")
        (out / f"kernels.{spec.arch}.hsaco").write_bytes(code_objects[0])
        (out / f"kernels.{spec.arch}.s").write_text(device_module.inspect_source("asm"))
        files += [f"kernels.{spec.arch}.hsaco", f"kernels.{spec.arch}.s"]
    elif spec.kind == "vulkan":
        (out / "kernels.wgsl").write_text(device_module.inspect_source("wgsl"))
        (out / "kernels.func_info.json").write_text(device_module.inspect_source("func_info"))
        files += ["kernels.wgsl", "kernels.func_info.json"]
    elif spec.kind == "metal":
        (out / "kernels.metal").write_text(device_module.inspect_source("metal"))
        files.append("kernels.metal")
    return files


def _lowered_cuda_executable(prim_funcs: dict[str, tvm.tirx.PrimFunc], target: tvm.target.Target
                             ) -> tuple[Any, tvm.IRModule, tvm.IRModule]:
    """The CUDA library built from one lowering: ``lower_split``'s host and device IR (kept for the launch
    description) turned into the executable as ``tvm.compile`` does (``tvm.tirx.build``'s last steps: the host's
    finalisation, then code generation), rather than lowered a second time by ``tvm.compile`` (a third of the CUDA
    library's build time). Returns (executable, host IR before finalisation, device IR)."""
    from tvm.runtime import Executable
    from tvm.tirx.build import tir_to_runtime

    context = pass_context(target)
    if list(context.disabled_pass) or not context.config.get("tirx.disable_cse_tir"):
        raise RuntimeError("the CUDA build's pass context differs from lower_split's: lower it with tvm.compile")
    host_mod, device_mod, device_target = lower_split(prim_funcs, target)
    with context:
        _, finalize_host, _ = tvm.tirx.get_default_tir_pipeline(target)
        runtime_module = tir_to_runtime(finalize_host()(host_mod), {device_target: device_mod}, target.host)
    return Executable(runtime_module), host_mod, device_mod


def _cuda_launches(spec: TargetSpec, prim_funcs: dict[str, tvm.tirx.PrimFunc], host_mod: tvm.IRModule,
                   device_mod: tvm.IRModule, out: Path) -> dict[str, Any]:
    """For the CUDA driver path (``runtime/cuda_device.py``): how each function launches its kernels (read from the
    host and device IR ``kernels.cu`` was generated from), and the PTX they come from. Returns the manifest's extra
    keys."""
    launches = describe_functions(prim_funcs, host_mod, device_mod)
    extra: dict[str, Any] = {"launches": {name: f.to_json() for name, f in launches.items()}}
    ptx = f"kernels.{spec.arch}.ptx"
    if (out / ptx).is_file():
        check_ptx_entries(launches, (out / ptx).read_text())
        extra["device_code"] = ptx
    return extra


def check_ptx_entries(launches: dict[str, FunctionLaunches], ptx: str) -> None:
    """Every kernel entry of the launch description is in the PTX with as many parameters as it passes
    (a mismatch would make the driver read the wrong arguments)."""
    for function in launches.values():
        for kernel in function.kernels:
            header = re.search(rf"\.entry {re.escape(kernel.entry)}\(([^)]*)\)", ptx)
            if header is None:
                raise RuntimeError(f"the PTX has no entry {kernel.entry}")
            count = len(re.findall(r"\.param\s", header.group(1)))
            if count != len(kernel.args):
                raise RuntimeError(f"{kernel.entry}: the PTX declares {count} parameters, the launch passes "
                                   f"{len(kernel.args)}")


def _build_into(spec: TargetSpec, src_hash: str, out: Path) -> dict[str, Any]:
    from logitproc.tir_kernels import KERNEL_FACTORIES

    target = spec.tvm_target()
    with fast_macro_lookup():
        module = tvm.IRModule({name: factory(target) for name, factory in KERNEL_FACTORIES.items()})
    prim_funcs = {name: module[name] for name in KERNEL_FACTORIES}
    if spec.kind == "rocm":
        prepare_rocm_env()
    if spec.kind == "cuda":
        code_objects: list[bytes] = []
        executable, host_mod, device_mod = _lowered_cuda_executable(prim_funcs, target)
    else:
        with pass_context(target), capture_rocm_code_objects() as code_objects:
            executable = tvm.compile(module, target=target)
    (out / "kernels.tir.py").write_text(module.script())
    files = ["kernels.tir.py", *_write_device_artifacts(spec, executable, code_objects, out)]
    kernels = kernel_entries(prim_funcs)
    extra: dict[str, Any] = {}
    if spec.kind == "cuda":
        extra = _cuda_launches(spec, prim_funcs, host_mod, device_mod, out)
    return write_manifest(out, spec, target, src_hash, kernels, files, **extra)


def build_kernels(
    target: str | TargetSpec = "cpu", arch: str | None = None, *, cache: bool = True
) -> KernelLibrary:
    """Compile every kernel for ``target`` (cpu, cuda, rocm, vulkan, metal), reusing a cached build when one exists.

    ``arch`` picks the CPU name, ``sm_NN`` or ``gfxNNNN`` (defaults: this CPU, sm_80, gfx942). ``cache=False``
    builds into a fresh temporary directory and leaves the cache alone.
    """
    spec = target if isinstance(target, TargetSpec) else resolve_target(target, arch)
    src_hash = source_hash()
    if not cache:
        out = Path(tempfile.mkdtemp(prefix=f"logitproc-{spec.kind}-"))
        return KernelLibrary(out, _build_into(spec, src_hash, out))
    final = cache_root() / "kernels" / f"{spec.kind}-{spec.arch or 'any'}-{cache_key(spec, src_hash)}"
    if not (final / MANIFEST).is_file():
        build_in_cache(final, lambda staging: _build_into(spec, src_hash, staging))
    return KernelLibrary.load(final)
