"""The kernel library: every TIR kernel compiled for one target, exported as files plus a manifest, cached on disk.

An exported library is a directory::

    manifest.json          target, TVM and logitproc versions, source hash, kernels with their parameters, files
    kernels.tir.py         the TVMScript of exactly what was compiled (reloadable with tvm.script.from_source)
    kernels.so             cpu, cuda, rocm: TVM module (host code plus embedded device code)
    kernels.cu             cuda: the CUDA C source (JIT-compiled by TVM's runtime at load, NVRTC by default)
    kernels.<arch>.ptx     cuda: PTX from nvcc or NVRTC, when either is installed
    kernels.<arch>.hsaco   rocm: the AMDGPU code object
    kernels.wgsl           vulkan: WGSL shaders (run through wgpu), plus kernels.func_info.json
    kernels.metal          metal: Metal shading language source

``build_kernels(kind)`` builds into the cache (``$LOGITPROC_CACHE`` or ``~/.cache/logitproc``) under a key made of
every input (kernel and compiler sources, target, TVM version) and reuses it when the key matches.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from functools import cached_property
from pathlib import Path
from typing import Any

import tvm
from logitproc import __version__

from .device_code import capture_rocm_code_objects, compile_cuda, cuda_compiler_available, prepare_rocm_env
from .targets import TargetSpec, check_runs_here, resolve_target

MANIFEST = "manifest.json"
MANIFEST_FORMAT = 1
_PACKAGE_ROOT = Path(__file__).resolve().parent.parent
#: What a kernel build depends on: every kernel source, and the compiler modules that turn them into artifacts.
_HASHED_SOURCES = ("tir_kernels/*.py", "compile/kernel_library.py", "compile/targets.py", "compile/device_code.py")


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
    reader never sees half a build; when a concurrent builder got there first, its result is kept."""
    final.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".building-", dir=final.parent))
    try:
        build(staging)
        try:
            staging.rename(final)
        except OSError:
            if not (final / MANIFEST).is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _cache_key(spec: TargetSpec, src_hash: str) -> str:
    material = json.dumps([MANIFEST_FORMAT, __version__, tvm.__version__, spec.kind, spec.arch, *spec.mattr, src_hash])
    return hashlib.sha256(material.encode()).hexdigest()[:16]


def _param_list(func: tvm.tirx.PrimFunc) -> list[dict[str, Any]]:
    """Name, dtype and symbolic shape of each parameter (in TVM 0.27 buffer parameters are the buffers themselves)."""
    params = []
    for param in func.params:
        shape = getattr(param, "shape", None)
        dims = None if shape is None else [str(d) for d in shape]
        params.append({"name": str(param.name), "dtype": str(param.dtype), "shape": dims})
    return params


class KernelLibrary:
    """An exported kernel library directory, and the ways to use it.

    ``lib[name]`` calls a kernel through TVM's runtime (cpu; cuda where TVM's CUDA runtime and a GPU exist).
    ``lib.prim_funcs()`` gives the compiled TIR back (the Vulkan route launches its WGSL with them).
    """

    def __init__(self, directory: Path, manifest: dict[str, Any]) -> None:
        self.directory = Path(directory)
        self.manifest = manifest

    @property
    def target(self) -> TargetSpec:
        target = self.manifest["target"]
        return TargetSpec(target["kind"], target["arch"], tuple(json.loads(target["tvm"]).get("mattr", ())))

    @property
    def module_file(self) -> str:
        """The loadable module (manifest key ``module_file``): ``kernels.so``, or ``model.so`` for a compiled model,
        whose one library holds the model and these kernels."""
        return self.manifest.get("module_file", "kernels.so")

    @property
    def kernel_names(self) -> tuple[str, ...]:
        return tuple(k["name"] for k in self.manifest["kernels"])

    def params(self, name: str) -> list[dict[str, Any]]:
        """Parameter list of kernel ``name``: name, dtype and symbolic shape of each."""
        for kernel in self.manifest["kernels"]:
            if kernel["name"] == name:
                return kernel["params"]
        raise KeyError(f"kernel {name!r} is not in this library; it has {self.kernel_names}")

    def artifact(self, filename: str) -> Path:
        """Path of one exported file (one of ``manifest['files']``)."""
        if filename not in self.manifest["files"]:
            raise KeyError(f"{filename!r} is not part of this library; files: {self.manifest['files']}")
        return self.directory / filename

    def prim_funcs(self) -> dict[str, tvm.tirx.PrimFunc]:
        """The TIR functions this library was compiled from, parsed back from kernels.tir.py."""
        module = tvm.script.from_source(self.artifact("kernels.tir.py").read_text())
        return {gv.name_hint: module[gv] for gv in module.get_global_vars()}

    @cached_property
    def runtime_module(self) -> tvm.runtime.Module:
        """The TVM runtime module (cpu, cuda). Other kinds are not loadable by this TVM build: a clear error."""
        kind = self.target.kind
        if kind not in ("cpu", "cuda"):
            reason = {
                "rocm": "this TVM wheel has no ROCm (HIP) runtime; the code object is kernels.*.hsaco",
                "vulkan": "TVM has no Vulkan runtime here; run kernels.wgsl through logitproc's wgpu route",
                "metal": "TVM's Metal runtime exists only on macOS builds; the source is kernels.metal",
            }[kind]
            raise RuntimeError(f"a {kind} kernel library cannot be loaded into TVM's runtime: {reason}")
        path = self.artifact(self.module_file)
        try:
            return tvm.runtime.load_module(str(path))
        except Exception as err:  # TVM raises its own error types; say what is missing
            raise RuntimeError(
                f"loading {path} failed: {kind} kernels need TVM's {kind} runtime and a device ({err})"
            ) from err

    def __getitem__(self, name: str) -> tvm.runtime.Function:
        if name not in self.kernel_names:
            raise KeyError(f"kernel {name!r} is not in this library; it has {self.kernel_names}")
        # query_imports: in a compiled model's library the kernels sit in the VM executable's imported host module.
        return self.runtime_module.get_function(name, query_imports=True)

    def export(self, directory: str | os.PathLike[str]) -> Path:
        """Copy the library (all files and the manifest) into ``directory``; return that path."""
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        for filename in [*self.manifest["files"], MANIFEST]:
            shutil.copy2(self.directory / filename, out / filename)
        return out

    @classmethod
    def load(cls, directory: str | os.PathLike[str]) -> KernelLibrary:
        """Open an exported library, checking its manifest and files."""
        path = Path(directory)
        manifest_path = path / MANIFEST
        if not manifest_path.is_file():
            raise FileNotFoundError(f"{manifest_path} does not exist: not an exported kernel library")
        manifest = json.loads(manifest_path.read_text())
        if manifest.get("format") != MANIFEST_FORMAT:
            raise ValueError(f"{manifest_path}: format {manifest.get('format')!r}, expected {MANIFEST_FORMAT}")
        if manifest.get("tvm_version") != tvm.__version__:
            raise ValueError(
                f"{manifest_path}: built with TVM {manifest.get('tvm_version')}, this is TVM {tvm.__version__}; rebuild"
            )
        check_runs_here(manifest["target"], str(path))
        missing = [f for f in manifest["files"] if not (path / f).is_file()]
        if missing:
            raise FileNotFoundError(f"{path}: files named in the manifest are missing: {missing}")
        return cls(path, manifest)

    def __repr__(self) -> str:
        target = f"{self.target.kind}:{self.target.arch or '-'}"
        return f"KernelLibrary({target}, {len(self.kernel_names)} kernels, {self.directory})"


def _write_device_artifacts(spec: TargetSpec, executable: Any, code_objects: list[bytes], out: Path) -> list[str]:
    files: list[str] = []
    if spec.kind in ("cpu", "cuda", "rocm"):
        executable.export_library(str(out / "kernels.so"))
        files.append("kernels.so")
    if spec.kind == "cpu":
        return files
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


def _build_into(spec: TargetSpec, src_hash: str, out: Path) -> dict[str, Any]:
    from logitproc.tir_kernels import KERNEL_FACTORIES

    target = spec.tvm_target()
    module = tvm.IRModule({name: factory(target) for name, factory in KERNEL_FACTORIES.items()})
    # CSE adds hidden kernel parameters that launchers of raw WGSL/CUDA would have to know about.
    config = {} if spec.kind == "cpu" else {"tirx.disable_cse_tir": True}
    if spec.kind == "rocm":
        prepare_rocm_env()
    with tvm.transform.PassContext(opt_level=3, config=config), capture_rocm_code_objects() as code_objects:
        executable = tvm.compile(module, target=target)
    (out / "kernels.tir.py").write_text(module.script())
    files = ["kernels.tir.py", *_write_device_artifacts(spec, executable, code_objects, out)]
    manifest = {
        "format": MANIFEST_FORMAT,
        "logitproc_version": __version__,
        "tvm_version": tvm.__version__,
        "target": {"kind": spec.kind, "arch": spec.arch, "tvm": str(target)},
        "source_hash": src_hash,
        "kernels": [{"name": name, "params": _param_list(module[name])} for name in KERNEL_FACTORIES],
        "files": files,
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2))
    return manifest


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
    final = cache_root() / "kernels" / f"{spec.kind}-{spec.arch or 'any'}-{_cache_key(spec, src_hash)}"
    if not (final / MANIFEST).is_file():
        build_in_cache(final, lambda staging: _build_into(spec, src_hash, staging))
    return KernelLibrary.load(final)
