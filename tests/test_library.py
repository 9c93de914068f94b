"""The kernel library: builds for every target kind, generated code holds every kernel, export/load, cache, CLI.

The builds go to the session's private cache (conftest), so the CPU and Vulkan libraries other test modules built
already are reused, as they would be for a user (each is a real build the first time a session asks for it).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tvm
from logitproc.compile import CUDA_ARCHS, ROCM_ARCHS, KernelLibrary, build_kernels, resolve_target
from logitproc.compile.device_code import compile_cuda, cuda_compiler_available, rocm_toolchain_available
from logitproc.tir_kernels import KERNEL_FACTORIES

ELF_MAGIC = b"\x7fELF"
EM_AMDGPU = 224


def test_cpu_library_runs_every_kernel_name_and_records_parameters() -> None:
    lib = build_kernels("cpu")
    assert set(lib.kernel_names) == set(KERNEL_FACTORIES)
    assert lib.target == resolve_target("cpu")
    assert [p["name"] for p in lib.params("apply_bitmask_inplace")] == ["logits", "row_ids", "bitmask"]
    assert lib.params("apply_bitmask_inplace")[0] == {"name": "logits", "dtype": "float32", "shape": ["batch", "vocab"]}
    logits = tvm.runtime.tensor(np.zeros((2, 40), np.float32))
    lib["apply_bitmask_inplace"](logits, tvm.runtime.tensor(np.array([1], np.int32)),
                                 tvm.runtime.tensor(np.zeros((1, 2), np.int32)))
    assert np.all(logits.numpy()[1] == -np.inf) and np.all(logits.numpy()[0] == 0)


def test_build_is_cached_and_export_load_round_trips(tmp_path: Path) -> None:
    first = build_kernels("cpu")
    assert build_kernels("cpu").directory == first.directory
    exported = first.export(tmp_path / "lib")
    manifest = json.loads((exported / "manifest.json").read_text())
    assert manifest["tvm_version"] == tvm.__version__ and manifest["target"]["kind"] == "cpu"
    assert len(manifest["source_hash"]) == 64
    loaded = KernelLibrary.load(exported)
    assert loaded.kernel_names == first.kernel_names
    assert set(loaded.prim_funcs()) == set(KERNEL_FACTORIES)
    x = tvm.runtime.tensor(np.zeros((1, 3), np.float32))
    loaded["apply_logit_bias_inplace"](x, *(tvm.runtime.tensor(a) for a in (
        np.array([0], np.int32), np.array([2], np.int32), np.array([1.5], np.float32))))
    np.testing.assert_array_equal(x.numpy(), [[0, 0, 1.5]])


def test_load_rejects_what_is_not_a_library(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="manifest.json"):
        KernelLibrary.load(tmp_path)
    exported = build_kernels("cpu").export(tmp_path / "lib")
    manifest = json.loads((exported / "manifest.json").read_text())
    (exported / "kernels.so").unlink()
    with pytest.raises(FileNotFoundError, match="kernels.so"):
        KernelLibrary.load(exported)
    manifest["tvm_version"] = "0.1"
    (exported / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match="TVM 0.1"):
        KernelLibrary.load(exported)


def test_unknown_kernel_and_bad_targets_are_clear_errors() -> None:
    with pytest.raises(KeyError, match="nope"):
        build_kernels("cpu")["nope"]
    with pytest.raises(ValueError, match="'tpu'"):
        resolve_target("tpu")
    with pytest.raises(ValueError, match="sm_5"):
        resolve_target("cuda", "sm_5")
    with pytest.raises(ValueError, match="takes no arch"):
        resolve_target("vulkan", "x")


def _kernel_symbols(source: str) -> set[str]:
    return {name for name in KERNEL_FACTORIES if f"{name}_kernel" in source}


@pytest.mark.parametrize("arch", CUDA_ARCHS)
def test_cuda_source_has_every_kernel_and_its_ptx_assembles(arch: str) -> None:
    if not cuda_compiler_available():
        pytest.skip("neither nvcc nor NVRTC (pip install 'logitproc[cuda]') is installed")
    lib = build_kernels("cuda", arch)
    source = lib.artifact("kernels.cu").read_text()
    assert _kernel_symbols(source) == set(KERNEL_FACTORIES)
    ptx = lib.artifact(f"kernels.{arch}.ptx").read_text()
    assert f".target {arch}" in ptx
    assert all(f".entry {name}_kernel" in ptx for name in KERNEL_FACTORIES)
    assert compile_cuda(source, arch, "cubin")[:4] == ELF_MAGIC  # ptxas accepted it


def test_cuda_library_loads_only_where_a_cuda_runtime_exists() -> None:
    if not cuda_compiler_available():
        pytest.skip("neither nvcc nor NVRTC is installed")
    lib = build_kernels("cuda")
    if tvm.cuda(0).exist:
        assert lib["apply_bitmask_inplace"] is not None
    else:
        with pytest.raises(RuntimeError, match="cuda runtime and a device"):
            lib["apply_bitmask_inplace"]


@pytest.mark.parametrize("arch", ROCM_ARCHS)
def test_rocm_code_object_is_an_amdgpu_elf_with_every_kernel(arch: str) -> None:
    if not rocm_toolchain_available():
        pytest.skip("ld.lld or the ROCm device libraries are missing (apt-get install rocm-device-libs lld)")
    lib = build_kernels("rocm", arch)
    code_object = lib.artifact(f"kernels.{arch}.hsaco").read_bytes()
    assert code_object[:4] == ELF_MAGIC
    assert int.from_bytes(code_object[18:20], "little") == EM_AMDGPU
    assert all(f"{name}_kernel".encode() in code_object for name in KERNEL_FACTORIES)
    assert f"amdgcn-amd-amdhsa--{arch}".encode() in code_object or arch.encode() in code_object
    with pytest.raises(RuntimeError, match="no ROCm"):
        _ = lib.runtime_module


def test_vulkan_wgsl_has_a_shader_per_kernel_and_no_float_literal_for_infinity() -> None:
    lib = build_kernels("vulkan")
    wgsl = lib.artifact("kernels.wgsl").read_text()
    assert {name for name in KERNEL_FACTORIES if f"// Function: {name}_kernel" in wgsl} == set(KERNEL_FACTORIES)
    assert "inf" not in wgsl.replace("info", "")  # -inf is a bit cast, never a literal
    assert "@workgroup_size(1024" not in wgsl  # WebGPU's default limit is 256 threads
    func_info = json.loads(lib.artifact("kernels.func_info.json").read_text())
    assert {name for name in KERNEL_FACTORIES if f"{name}_kernel" in func_info} == set(KERNEL_FACTORIES)


def test_metal_source_has_every_kernel() -> None:
    lib = build_kernels("metal")
    assert _kernel_symbols(lib.artifact("kernels.metal").read_text()) == set(KERNEL_FACTORIES)


def test_cli_compile_kernels_writes_the_library(tmp_path: Path) -> None:
    out = tmp_path / "vk"
    command = [sys.executable, "-m", "logitproc", "compile-kernels", "--target", "vulkan", "--out", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    assert (out / "manifest.json").is_file() and (out / "kernels.wgsl").is_file()
    assert KernelLibrary.load(out).target.kind == "vulkan"


def test_cli_rejects_a_bad_arch_with_a_message() -> None:
    done = subprocess.run([sys.executable, "-m", "logitproc", "compile-kernels", "--target", "rocm", "--arch", "x",
                           "--out", "/tmp/unused"], capture_output=True, text=True, check=False)
    assert done.returncode == 2 and "rocm arch 'x'" in done.stderr
