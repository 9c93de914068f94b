"""The CUDA driver path (``Device("cuda")`` without TVM's CUDA runtime) on a machine without a GPU: a fake driver.

The fake keeps device memory in host bytes and checks each launch against the exported PTX itself (every entry's
parameter list, its ``.maxntid`` block), so what is tested here is what the real driver would be given: the arguments
in the kernel's order and types, the grid and block computed from the arrays' shapes, copies landing in the right
bytes. ``scripts/cuda_check.py`` runs the same path on a real GPU (kernels, runtime, benchmark).
"""

from __future__ import annotations

import ctypes
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import pytest
from kernel_cases import CASE_BUILDERS, SIZES
from logitproc.compile import build_kernels
from logitproc.compile.device_code import cuda_compiler_available
from logitproc.runtime import LogitProcessor
from logitproc.runtime.cuda_device import CudaArray, CudaDevice
from logitproc.runtime.cuda_driver import CudaError, GPUProperties
from logitproc.tir_kernels._reductions import SPLIT_CHUNK

pytestmark = pytest.mark.skipif(not cuda_compiler_available(), reason="no nvcc or NVRTC to export PTX here")

#: PTX parameter type each kernel argument dtype must meet.
PTX_TYPE = {"handle": ".u64", "int32": ".u32", "float32": ".f32"}


@dataclass
class Launch:
    entry: str
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    shared: int
    args: list[tuple[str, int | float]]


@dataclass
class FakeDriver:
    """``CudaDriver`` in host memory; launches are checked against the loaded PTX and recorded, not run."""

    memory: dict[int, bytearray] = field(default_factory=dict)
    launches: list[Launch] = field(default_factory=list)
    entries: dict[str, tuple[list[str], tuple[int, ...]]] = field(default_factory=dict)
    functions: dict[int, str] = field(default_factory=dict)
    next_ptr: int = 1 << 20

    def device_count(self) -> int:
        return 1

    def properties(self, index: int) -> GPUProperties:
        return GPUProperties("fake", (9, 0), 80 << 30, 132, 1024, 227 * 1024)

    def activate(self, index: int) -> None:
        pass

    def alloc(self, nbytes: int) -> int:
        ptr = self.next_ptr
        self.memory[ptr] = bytearray(max(1, nbytes))
        self.next_ptr += (max(1, nbytes) + 255) // 256 * 256 + 256
        return ptr

    def free(self, ptr: int) -> None:
        del self.memory[ptr]

    def region(self, ptr: int, nbytes: int) -> tuple[bytearray, int]:
        for base, buf in self.memory.items():
            if base <= ptr and ptr + nbytes <= base + len(buf):
                return buf, ptr - base
        raise AssertionError(f"{nbytes} bytes at 0x{ptr:x} are outside every allocation")

    def copy_to_device(self, dst: int, src_host: int, nbytes: int, stream: int) -> None:
        buf, offset = self.region(dst, nbytes)
        buf[offset:offset + nbytes] = ctypes.string_at(src_host, nbytes)

    def copy_to_host(self, dst_host: int, src: int, nbytes: int) -> None:
        buf, offset = self.region(src, nbytes)
        ctypes.memmove(dst_host, bytes(buf[offset:offset + nbytes]), nbytes)

    def copy_on_device(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        s, so = self.region(src, nbytes)
        d, do = self.region(dst, nbytes)
        d[do:do + nbytes] = s[so:so + nbytes]

    def time_graph(self, stream: int, enqueue: Callable[[], None], replays: int) -> float:
        enqueue()
        return 0.0

    def create_stream(self) -> int:
        return 1

    def stream_wait(self, waiting: int, on: int) -> None:
        pass

    def synchronize(self, stream: int) -> None:
        pass

    def load_module(self, image: bytes) -> int:
        ptx = image.decode()
        for m in re.finditer(r"\.entry (\w+)\(([^)]*)\)\s*((?:\.\w+[^\n]*\n\s*)*)", ptx):
            params = re.findall(r"\.param\s+(\.\w+)", m.group(2))
            ntid = re.search(r"\.maxntid\s+(\d+),\s*(\d+),\s*(\d+)", m.group(3))
            self.entries[m.group(1)] = (params, tuple(int(x) for x in ntid.groups()) if ntid else ())
        return 7

    def function(self, module: int, entry: str) -> int:
        if entry not in self.entries:
            raise CudaError(f"cuModuleGetFunction({entry}) failed: CUDA_ERROR_NOT_FOUND")
        handle = 100 + len(self.functions)
        self.functions[handle] = entry
        return handle

    def set_max_dynamic_shared(self, function: int, nbytes: int) -> None:
        pass

    def launch(self, function: int, grid: tuple[int, int, int], block: tuple[int, int, int], shared_bytes: int,
               stream: int, args: Sequence[tuple[str, int | float]]) -> None:
        entry = self.functions[function]
        params, maxntid = self.entries[entry]
        assert [PTX_TYPE[dtype] for dtype, _ in args] == params, f"{entry}: arguments do not match the PTX"
        assert not maxntid or block == maxntid, f"{entry}: block {block}, PTX .maxntid {maxntid}"
        for dtype, value in args:
            if dtype == "handle":
                self.region(int(value), 1)  # every pointer lies in an allocation
        self.launches.append(Launch(entry, grid, block, shared_bytes, list(args)))


@pytest.fixture(scope="module")
def cuda_library():
    return build_kernels("cuda", "sm_80")


@pytest.fixture
def fake() -> tuple[CudaDevice, FakeDriver]:
    driver = FakeDriver()
    return CudaDevice("cuda", 0, driver=driver), driver


def test_arrays_round_trip_and_rows_land_in_place(fake) -> None:
    device, _ = fake
    host = np.arange(5 * 7, dtype=np.float32).reshape(5, 7)
    arr = device.upload(host)
    np.testing.assert_array_equal(device.download(arr), host)
    assert device.download(device.prefix(arr, 2)).shape == (2, 7)
    new = -host
    device.copy_rows_to_device(new, arr, 1, 3)
    expected = host.copy()
    expected[1:3] = new[1:3]
    np.testing.assert_array_equal(device.download(arr), expected)
    other = device.empty((5, 7), "float32")
    device.copy(other, arr)
    np.testing.assert_array_equal(device.download(other), expected)


def _expected_grids(kernel: str, args: Sequence[np.ndarray], batch: int, vocab: int) -> list[tuple[int, int, int]]:
    """What each kernel's TIR binds, per kernel it launches: one block per row, except the sparse and bitmask
    kernels, and the kernels that split each row into chunks of SPLIT_CHUNK values (the softmax's, the threshold
    search's passes, top_n's) or into the draw's segments (16 blocks of 64 a row)."""
    if kernel in ("apply_logit_bias_inplace", "apply_penalty_inplace"):
        return [(-(-args[1].size // 1024), 1, 1)]
    if kernel == "apply_bitmask_inplace":
        return [(-(-vocab // 1024), args[1].size, 1)]
    split = (batch * -(-vocab // SPLIT_CHUNK), 1, 1)
    if kernel == "softmax_with_temperature":  # chunk statistics, row statistics, the chunks' writes
        return [split, (batch, 1, 1), split]
    # the threshold search's passes: first pass, row setup, bound pass, row bound, the list's copy
    search = [split, (batch, 1, 1), split, (batch, 1, 1), split]
    if kernel == "sample_from_logits":  # softmax statistics, the search's passes and steps, segment sums, the draw
        return [split, (batch, 1, 1), *search, (batch, 1, 1), (batch * 16, 1, 1), (batch, 1, 1)]
    if kernel == "renormalize_probs":  # the search's passes, its steps (a block per row), the chunks rescaled
        return [*search, (batch, 1, 1), split]
    if kernel == "top_n":  # group maxima, the row's bound, each chunk's candidates, the merge
        return [split, (batch, 1, 1), split, (batch, 1, 1)]
    return [(batch, 1, 1)]


@pytest.mark.parametrize("builder", CASE_BUILDERS, ids=lambda b: b.__name__)
def test_every_kernel_launches_with_the_ptx_arguments_and_its_grid(cuda_library, fake, builder) -> None:
    device, driver = fake
    kernels = device.load(cuda_library)
    for batch, vocab in SIZES[:4]:
        case = builder(np.random.default_rng(1), batch, vocab)
        arrays = [device.upload(np.ascontiguousarray(a)) for a in case.args]
        driver.launches.clear()
        kernels[case.kernel](*arrays)
        grids = _expected_grids(case.kernel, case.args, batch, vocab)
        assert [launch.entry for launch in driver.launches] == [
            f"{case.kernel}_kernel" + (f"_{i}" if i else "") for i in range(len(grids))]
        assert [launch.grid for launch in driver.launches] == grids
        workspaces = cuda_library.launches()[case.kernel].workspaces
        pointers = {int(v) for launch in driver.launches for d, v in launch.args if d == "handle"}
        # each parameter's own buffer, and as many others as the function has workspaces
        assert {a.ptr for a in arrays} <= pointers and len(pointers) == len(arrays) + len(workspaces)
        scalars = {a for launch in driver.launches for a in launch.args if a[0] != "handle"}
        assert ("int32", vocab) in scalars and ("int32", batch) in scalars


def test_a_split_row_function_passes_one_workspace_per_buffer_between_its_kernels(cuda_library, fake) -> None:
    """The softmax's kernels pass per-block partials and per-row statistics through workspaces: each launch gets
    the same pointers, memory of the size the manifest records, kept for the next call, grown for a larger batch."""
    device, driver = fake
    kernels = device.load(cuda_library)
    (function,) = [f for name, f in cuda_library.launches().items() if name == "softmax_with_temperature"]
    sizes = {w.name: w.nbytes({"batch": 3, "vocab": 5000}) for w in function.workspaces}
    parts = 3 * -(-5000 // SPLIT_CHUNK)
    assert sizes == {"part_max": parts * 4, "part_sum": parts * 4, "part_first": parts * 4,
                     "row_max": 3 * 4, "row_sum": 3 * 4, "row_hot": 3 * 4}

    def call(batch: int, vocab: int) -> set[int]:
        """The workspaces' pointers after one call on fresh arrays."""
        driver.launches.clear()
        arrays = [device.empty((batch, vocab), "float32"), device.empty((batch,), "float32"),
                  device.empty((batch, vocab), "float32")]
        kernels["softmax_with_temperature"](*arrays)
        used = [{int(v) for d, v in launch.args if d == "handle"} - {a.ptr for a in arrays}
                for launch in driver.launches]
        assert used[0] <= used[1] and used[1] - used[0] <= used[2]  # written by one kernel, read by the next
        return set().union(*used)

    held = call(3, 5000)
    assert sorted(len(driver.region(p, 1)[0]) for p in held) == sorted(sizes.values())
    assert call(3, 5000) == held  # kept for the next call
    grown = call(7, 5000)
    assert sorted(len(driver.region(p, 1)[0]) for p in grown) == [7 * 4] * 3 + [7 * -(-5000 // SPLIT_CHUNK) * 4] * 3


def test_bad_arguments_name_the_parameter_and_an_empty_batch_launches_nothing(cuda_library, fake) -> None:
    device, driver = fake
    kernels = device.load(cuda_library)
    logits = device.empty((3, 10), "float32")
    with pytest.raises(TypeError, match="temperature must be float32"):
        kernels["softmax_with_temperature"](logits, device.empty((3,), "int32"), device.empty((3, 10), "float32"))
    with pytest.raises(ValueError, match=r"probs.shape\[1\] = 11 but vocab = 10"):
        kernels["softmax_with_temperature"](logits, device.empty((3,), "float32"), device.empty((3, 11), "float32"))
    with pytest.raises(TypeError, match="must be a CudaArray"):
        kernels["softmax_with_temperature"](np.zeros((3, 10), np.float32), device.empty((3,), "float32"), logits)
    driver.launches.clear()
    kernels["softmax_with_temperature"](device.empty((0, 10), "float32"), device.empty((0,), "float32"),
                                        device.empty((0, 10), "float32"))
    assert driver.launches == []


def test_the_first_k_kernels_of_a_function_launch_alone_for_a_breakdown(cuda_library, fake) -> None:
    """``launch_first(k)`` (scripts/cuda_check.py's per-kernel breakdown) launches the function's first k kernels, in
    order, and refuses a k it does not have."""
    device, driver = fake
    fn = device.load(cuda_library)["sample_from_logits"]
    entries = [k.entry for k in fn.launches.kernels]
    assert len(entries) == 10  # softmax statistics (2), the search's split passes (5), its steps, segments, draw
    batch, vocab = 2, 3000
    args = [device.empty((batch, vocab), "float32"), device.empty((batch,), "float32"),
            device.empty((batch,), "int32"), device.empty((batch,), "float32"), device.empty((batch,), "float32"),
            device.empty((batch,), "int32"), device.empty((batch,), "float32"), device.empty((batch,), "int32"),
            device.empty((1, 94), "int32"), device.empty((batch,), "int32"), device.empty((batch,), "float32"),
            device.empty((batch,), "int32"), device.empty((batch, 2), "float32"), device.empty((batch, 2), "int32")]
    for k in (1, 4, 10):
        driver.launches.clear()
        fn.launch_first(k, *args)
        assert [launch.entry for launch in driver.launches] == entries[:k]
    with pytest.raises(ValueError, match="has 10 kernels"):
        fn.launch_first(11, *args)


def test_a_processor_runs_its_stages_through_the_driver(cuda_library, fake) -> None:
    from logitproc import GenerationConfig, RequestState

    device, driver = fake
    proc = LogitProcessor(cuda_library, vocab_size=50, max_num_token=4, device=device)
    states = [RequestState((1, 2, 3), GenerationConfig(repetition_penalty=1.2, logit_bias={4: 1.0}))]
    driver.launches.clear()
    logits = np.zeros((1, 50), np.float32)
    proc.inplace_update_logits(logits, states)
    assert [launch.entry for launch in driver.launches] == ["apply_logit_bias_inplace_kernel",
                                                           "apply_penalty_inplace_kernel"]


def test_a_library_without_launches_or_ptx_is_refused_clearly(tmp_path, cuda_library, fake) -> None:
    import json

    from logitproc.runtime.kernel_library import KernelLibrary

    device, _ = fake
    copy = cuda_library.export(tmp_path / "lib")
    manifest = json.loads((copy / "manifest.json").read_text())
    del manifest["launches"]
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(RuntimeError, match="records no kernel launches"):
        device.load(KernelLibrary.load(copy))


def test_cuda_array_reports_its_shape() -> None:
    arr = CudaArray(0x1000, (2, 3), np.dtype("float32"))
    assert arr.nbytes == 24 and arr.ndim == 2


def test_the_gpu_check_reads_the_library_and_the_case_table_without_tvm(cuda_library) -> None:
    """scripts/cuda_check.py on a GPU machine without TVM: with ``tvm`` unimportable, its launcher
    (``runtime/cuda_launch.py``), the library's launches and PTX and the case table import and read, and nothing
    imports TVM on the way."""
    import subprocess
    import sys
    from pathlib import Path

    scripts = Path(__file__).resolve().parent.parent / "scripts"
    code = f"""
import sys
sys.modules["tvm"] = None  # `import tvm` raises ImportError from here on
sys.path.insert(0, {str(scripts)!r})
import cuda_check
assert not cuda_check.tvm_installed()
cuda_check.import_logitproc_without_tvm()
from logitproc.runtime.cuda_launch import CudaRunner, read_exported
from kernel_cases import all_cases
launches, ptx = read_exported({str(cuda_library.directory)!r})
assert b".entry top_n_kernel" in ptx, "the PTX"
print(len(launches), len(all_cases()), sorted(m for m in sys.modules if m.startswith("tvm") and sys.modules[m]))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/", timeout=120)
    assert out.returncode == 0, out.stderr
    functions, cases, tvm_modules = out.stdout.split(maxsplit=2)
    assert int(functions) == len(cuda_library.kernel_names) and int(cases) >= 70
    assert tvm_modules.strip() == "[]"
