"""Opening an exported kernel library (or a compiled model's directory) and calling its kernels: no compiler needed.

The files and the manifest are written by ``logitproc.compile`` (``build_kernels``, ``compile_model``); this module
only reads them; the runtime never imports the compiler (``runtime/targets.py`` describes a target and checks that a
CPU build runs on this CPU).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping, Sequence
from functools import cached_property
from pathlib import Path
from typing import Any

import tvm

from ..cpu_threads import configure as configure_tvm_threads
from .launch_geometry import FunctionLaunches
from .targets import TargetSpec, check_runs_here

MANIFEST = "manifest.json"
MANIFEST_FORMAT = 1


class KernelLibrary:
    """The kernels of an exported directory with a manifest, and the ways to use them.

    The directory is a kernel library (``kernels.so``) or a compiled model (``model.so``, whose one library holds the
    model and the kernels; ``is_model``): either way ``lib[name]`` is a logit-processing kernel.

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
    def is_model(self) -> bool:
        """True for a compiled model's directory (its one module holds the model and the kernels)."""
        return self.manifest.get("kind") == "model"

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

    def launches(self) -> dict[str, FunctionLaunches]:
        """How each function launches its device kernels (manifest key ``launches``, written for CUDA builds): what
        a launcher without TVM's runtime needs (``cuda_device.CudaDevice``)."""
        described = self.manifest.get("launches")
        if described is None:
            raise RuntimeError(f"{self.directory}: this {self.target.kind} library records no kernel launches (built "
                               "by an older logitproc, or not for CUDA): rebuild it with "
                               "`logitproc compile-kernels --target cuda`")
        return {name: FunctionLaunches.from_json(name, data) for name, data in described.items()}

    def device_code(self) -> bytes:
        """The device code the CUDA driver loads (manifest key ``device_code``: the PTX)."""
        filename = self.manifest.get("device_code")
        if filename is None:
            raise RuntimeError(f"{self.directory}: no PTX was exported with this library (nvcc or NVRTC was missing "
                               "at build time): pip install 'logitproc[cuda]' and rebuild it")
        return self.artifact(filename).read_bytes()

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
        configure_tvm_threads()  # before any of its kernels starts TVM's thread pool (cpu_threads.py)
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


def require_kernels(kernels: Mapping[str, Any], owner: str, names: Sequence[str]) -> None:
    """Raise ValueError when a loaded library lacks a kernel ``owner`` launches (checked once, at construction)."""
    missing = [name for name in names if name not in kernels]
    if missing:
        raise ValueError(f"{owner} needs the kernels {missing}, which the library does not have; it has "
                         f"{sorted(kernels)}")
