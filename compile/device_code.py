"""Device code that TVM's wheel builds but does not hand out directly: CUDA PTX/cubin and AMDGPU code objects.

Neither needs a GPU. PTX comes from ``nvcc`` when the CUDA toolkit is installed, else from NVRTC (PyPI
``cuda-bindings`` + ``nvidia-cuda-nvrtc``). ROCm code objects are linked by TVM itself through its
``tvm_callback_rocm_link`` hook (``ld.lld`` plus Debian's ``rocm-device-libs``); we wrap that hook to keep the bytes.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import tvm
import tvm_ffi

_ROCM_DEVICE_LIBS_DIRS = ("/usr/lib/x86_64-linux-gnu", "/opt/rocm")
_CUDA_DIRS = ("/usr/local/cuda",)


def find_nvcc() -> str | None:
    """Path of a real nvcc (CUDA_PATH, then the usual install directory, then PATH), or None."""
    candidates = [os.environ.get("CUDA_PATH", ""), *_CUDA_DIRS]
    for root in candidates:
        if root and Path(root, "bin", "nvcc").is_file():
            return str(Path(root, "bin", "nvcc"))
    return shutil.which("nvcc")


def _prepare_cuda_env() -> str | None:
    nvcc = find_nvcc()
    if nvcc and "CUDA_PATH" not in os.environ:
        # /usr/local/bin/nvcc may be a wrapper; TVM's tooling wants the toolkit root.
        os.environ["CUDA_PATH"] = str(Path(nvcc).resolve().parent.parent)
    return nvcc


def compile_cuda(source: str, arch: str, fmt: str = "ptx") -> bytes:
    """Compile CUDA C ``source`` for ``arch`` (e.g. "sm_90") to "ptx" or "cubin" (which runs ptxas: it assembles)."""
    from tvm.support import nvcc as tvm_nvcc

    if fmt not in ("ptx", "cubin"):
        raise ValueError(f"fmt {fmt!r} is not supported; expected 'ptx' or 'cubin'")
    compiler = "nvcc" if _prepare_cuda_env() else "nvrtc"
    try:
        # TVM's nvcc driver reads the architecture from the current target.
        with tvm.target.Target({"kind": "cuda", "arch": arch}):
            return bytes(tvm_nvcc.compile_cuda(source, target_format=fmt, arch=arch, compiler=compiler))
    except RuntimeError as err:
        if compiler == "nvrtc":
            raise RuntimeError(
                "compiling CUDA needs nvcc (the CUDA toolkit) or NVRTC: pip install 'logitproc[cuda]'"
            ) from err
        raise


def cuda_compiler_available() -> bool:
    """True if compile_cuda can run here (nvcc, or NVRTC through cuda-bindings)."""
    if find_nvcc():
        return True
    try:
        from cuda.bindings import nvrtc  # noqa: F401
    except ImportError:
        return False
    return True


def prepare_rocm_env() -> None:
    """Point TVM at Debian's ROCm device libraries when ROCM_PATH is unset."""
    if "ROCM_PATH" in os.environ:
        return
    for root in _ROCM_DEVICE_LIBS_DIRS:
        if Path(root, "amdgcn", "bitcode").is_dir():
            os.environ["ROCM_PATH"] = root
            return


def rocm_toolchain_available() -> bool:
    """True if AMDGPU code objects can be linked here (ld.lld and the ROCm device bitcode libraries)."""
    from tvm.support import rocm as tvm_rocm

    prepare_rocm_env()
    has_libs = Path(os.environ.get("ROCM_PATH", "/opt/rocm"), "amdgcn", "bitcode").is_dir()
    return has_libs and bool(tvm_rocm.find_lld(required=False))


@contextlib.contextmanager
def capture_rocm_code_objects() -> Iterator[list[bytes]]:
    """Within the block, every AMDGPU code object TVM links is appended to the yielded list."""
    from tvm.support import rocm as tvm_rocm

    captured: list[bytes] = []

    def link_and_keep(obj_bin: bytearray) -> bytearray:
        code_object = tvm_rocm.callback_rocm_link(obj_bin)
        captured.append(bytes(code_object))
        return code_object

    tvm_ffi.register_global_func("tvm_callback_rocm_link", link_and_keep, override=True)
    try:
        yield captured
    finally:
        tvm_ffi.register_global_func("tvm_callback_rocm_link", tvm_rocm.callback_rocm_link, override=True)
