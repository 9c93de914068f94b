"""The CUDA driver side of ``Device("cuda")``, without TVM: device arrays, copies, graph timing and the launches of
an exported library's functions (the manifest's ``launches`` and the PTX).

Nothing here imports TVM (nor ``logitproc.runtime``'s package, which does): ``cuda_device.CudaDevice`` is this runner
plus the ``Device`` interface, and ``scripts/cuda_check.py`` runs the kernel table and the benchmark on a GPU machine
that has the exported library, numpy and NVIDIA's cuda-bindings but no TVM (``read_exported``).

A function's launch plays the host code's part (``launch_geometry``): it checks the arrays against the function's
parameters, binds the shape variables, allocates the function's workspaces (kept for the next call), computes every
kernel's grid, block and shared memory from them and launches the kernels in order on the compute stream. Host ->
device copies go on a separate copy stream; ``wait_for_copies`` orders them before the next launch with an event.
"""

from __future__ import annotations

import gc
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .cuda_driver import ARG_CTYPES, BindingsDriver, CudaDriver, GPUProperties
from .launch_geometry import FunctionLaunches, evaluate

#: The manifest of an exported library (``kernel_library.MANIFEST``, which imports TVM).
MANIFEST_FILE = "manifest.json"

#: The largest grid CUDA launches along x, and along y and z.
MAX_GRID_X, MAX_GRID_YZ = 2**31 - 1, 65535
#: Dynamic shared memory a kernel gets without opting in (CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES).
DEFAULT_DYNAMIC_SHARED = 48 * 1024


class _Allocation:
    """One device allocation, freed when the last array using it goes."""

    def __init__(self, driver: CudaDriver, nbytes: int) -> None:
        self.driver = driver
        self.ptr = driver.alloc(nbytes)
        self.nbytes = nbytes

    def __del__(self) -> None:
        try:
            self.driver.free(self.ptr)
        except Exception:  # noqa: BLE001 - at interpreter exit the driver may be gone; nothing to recover
            pass


@dataclass(frozen=True)
class CudaArray:
    """A C-contiguous array in GPU memory: a pointer, a shape and a dtype (``base`` keeps the memory alive)."""

    ptr: int
    shape: tuple[int, ...]
    dtype: np.dtype
    base: Any = None

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def __repr__(self) -> str:
        return f"CudaArray(shape={self.shape}, dtype={self.dtype}, ptr=0x{self.ptr:x})"


class CudaFunction:
    """One function of the library: checks its arguments and launches its kernels through the driver."""

    def __init__(self, device: CudaRunner, launches: FunctionLaunches, functions: dict[str, int]) -> None:
        self.device = device
        self.launches = launches
        self.name = launches.name
        self._functions = functions
        #: Each workspace's device memory, kept between calls and grown when a call needs more (an allocation
        #: synchronises the device, and cannot be captured into a CUDA graph: see ``CudaRunner.time_launches``).
        self._workspaces: dict[str, CudaArray] = {}
        unknown = [a.dtype for k in launches.kernels for a in k.args if a.dtype not in ARG_CTYPES]
        if unknown:
            raise NotImplementedError(f"{self.name}: kernel argument types {sorted(set(unknown))} are not supported")

    def __call__(self, *args: Any) -> None:
        """Launch every kernel of the function on the device's compute stream (arguments in parameter order)."""
        self.launch_first(len(self.launches.kernels), *args)

    def launch_first(self, count: int, *args: Any) -> None:
        """Launch the function's first ``count`` kernels only (for a benchmark's per-kernel breakdown: the
        differences between successive counts; the later kernels' inputs are then whatever the workspaces hold)."""
        if not 0 <= count <= len(self.launches.kernels):
            raise ValueError(f"{self.name} has {len(self.launches.kernels)} kernels, asked for the first {count}")
        params = self.launches.params
        if len(args) != len(params):
            raise TypeError(f"{self.name} takes {len(params)} arguments "
                            f"({', '.join(p.name for p in params)}), got {len(args)}")
        buffers: dict[str, CudaArray] = {}
        shapes: list[tuple[int, ...] | None] = []
        scalars: list[int | float | None] = []
        for param, arg in zip(params, args, strict=True):
            if param.shape is None:
                shapes.append(None)
                scalars.append(float(arg) if param.dtype.startswith("float") else int(arg))
                continue
            if not isinstance(arg, CudaArray):
                raise TypeError(f"{self.name}: {param.name} must be a CudaArray of {self.device!r}, "
                                f"got {type(arg).__name__}")
            if str(arg.dtype) != param.dtype:
                raise TypeError(f"{self.name}: {param.name} must be {param.dtype}, got {arg.dtype}")
            buffers[param.name] = arg
            shapes.append(arg.shape)
            scalars.append(None)
        env = self.launches.bind(shapes, scalars)
        for workspace in self.launches.workspaces:
            buffers[workspace.name] = self._workspace(workspace.name, workspace.nbytes(env))
        for kernel in self.launches.kernels[:count]:
            grid, block, shared = kernel.dims(env)
            if min(grid) <= 0 or min(block) <= 0:
                continue  # nothing to do (an empty batch): CUDA refuses an empty grid
            if grid[0] > MAX_GRID_X or max(grid[1:]) > MAX_GRID_YZ:
                raise ValueError(f"{kernel.entry}: grid {grid} exceeds CUDA's limits for these shapes")
            values = [("handle", buffers[a.buffer].ptr) if a.buffer is not None
                      else (a.dtype, evaluate(a.value, env)) for a in kernel.args]  # type: ignore[arg-type]
            self.device.launch(self._functions[kernel.entry], grid, block, shared, values)


    def _workspace(self, name: str, nbytes: int) -> CudaArray:
        """The memory of workspace ``name``, at least ``nbytes`` (at least one byte: a pointer is always passed)."""
        held = self._workspaces.get(name)
        if held is None or held.nbytes < nbytes:
            held = self._workspaces[name] = self.device.empty((max(nbytes, 1),), "uint8")
        return held


def read_exported(directory: str | Path) -> tuple[dict[str, FunctionLaunches], bytes]:
    """An exported CUDA library's launches (manifest key ``launches``) and its PTX (key ``device_code``), read
    without TVM; a clear error where the library has neither (built for another target, or without nvcc/NVRTC)."""
    path = Path(directory)
    manifest = json.loads((path / MANIFEST_FILE).read_text())
    described, code = manifest.get("launches"), manifest.get("device_code")
    if described is None or code is None:
        raise RuntimeError(f"{path}: not a CUDA library with launches and PTX (target {manifest.get('target')!r}); "
                           "export one with `logitproc compile-kernels --target cuda --arch sm_90 --out DIR`")
    return ({name: FunctionLaunches.from_json(name, data) for name, data in described.items()},
            (path / code).read_bytes())


class CudaRunner:
    """One GPU through the CUDA driver: arrays (``CudaArray``), copies, launches, graph timing, loaded functions."""

    def __init__(self, index: int = 0, driver: CudaDriver | None = None) -> None:
        self.index = index
        self.driver = driver if driver is not None else BindingsDriver()
        count = self.driver.device_count()
        if index >= count:
            raise RuntimeError(f"Device('cuda', {index}) does not exist: {count} CUDA device(s) found")
        self.properties: GPUProperties = self.driver.properties(index)
        self.driver.activate(index)
        self._compute = self.driver.create_stream()
        self._copies = self.driver.create_stream()
        self._opted_in: set[int] = set()

    # Arrays and copies -------------------------------------------------------------------------------------------
    def empty(self, shape: tuple[int, ...], dtype: str | np.dtype) -> CudaArray:
        shape = tuple(int(s) for s in shape)
        dtype = np.dtype(dtype)
        allocation = _Allocation(self.driver, int(np.prod(shape, dtype=np.int64)) * dtype.itemsize)
        return CudaArray(allocation.ptr, shape, dtype, allocation)

    def upload(self, array: np.ndarray) -> CudaArray:
        host = np.ascontiguousarray(array)
        out = self.empty(host.shape, host.dtype)
        self.driver.copy_to_device(out.ptr, host.ctypes.data, host.nbytes, self._copies)
        self.driver.synchronize(self._copies)
        return out

    def download(self, array: CudaArray) -> np.ndarray:
        host = np.empty(array.shape, array.dtype)
        self.driver.copy_to_host(host.ctypes.data, array.ptr, array.nbytes)
        return host

    def prefix(self, array: CudaArray, rows: int) -> CudaArray:
        if rows == array.shape[0]:
            return array
        if not 0 <= rows <= array.shape[0]:
            raise ValueError(f"a prefix of {rows} rows of an array of {array.shape[0]}")
        return CudaArray(array.ptr, (rows, *array.shape[1:]), array.dtype, array.base)

    def copy_to_device(self, host: np.ndarray, dst: CudaArray) -> None:
        host = np.ascontiguousarray(host)
        if host.shape != dst.shape or host.dtype != dst.dtype:
            raise ValueError(f"copy of {host.shape} {host.dtype} into {dst.shape} {dst.dtype}")
        self.driver.copy_to_device(dst.ptr, host.ctypes.data, host.nbytes, self._copies)

    def copy_rows_to_device(self, host: np.ndarray, dst: CudaArray, lo: int, hi: int) -> None:
        if not 0 <= lo <= hi <= min(host.shape[0], dst.shape[0]):
            raise ValueError(f"rows {lo}:{hi} of arrays of {host.shape[0]} and {dst.shape[0]} rows")
        rows = np.ascontiguousarray(host[lo:hi])
        row_bytes = dst.nbytes // dst.shape[0] if dst.shape[0] else 0
        self.driver.copy_to_device(dst.ptr + lo * row_bytes, rows.ctypes.data, rows.nbytes, self._copies)

    def copy(self, dst: CudaArray, src: CudaArray) -> None:
        """Queue a device -> device copy of ``src`` into ``dst`` (same shape and dtype) on the compute stream."""
        if dst.shape != src.shape or dst.dtype != src.dtype:
            raise ValueError(f"copy of {src.shape} {src.dtype} into {dst.shape} {dst.dtype}")
        self.driver.copy_on_device(dst.ptr, src.ptr, src.nbytes, self._compute)

    def time_launches(self, enqueue: Callable[[], None], launches: int, replays: int = 10) -> float:
        """Seconds per launch of ``enqueue`` (kernel calls or ``copy`` on this device): ``launches`` calls captured
        into one CUDA graph, replayed ``replays`` times (for benchmarks: no Python launch overhead in the time).
        ``enqueue`` runs once first, outside the capture: kernel functions allocate their workspaces then."""
        enqueue()
        self.synchronize()

        def repeated() -> None:
            for _ in range(launches):
                enqueue()

        collecting = gc.isenabled()
        gc.disable()  # a collection freeing device memory (cuMemFree) during the capture would invalidate it
        try:
            return self.driver.time_graph(self._compute, repeated, replays) / launches
        finally:
            if collecting:
                gc.enable()

    def wait_for_copies(self) -> None:
        self.driver.stream_wait(self._compute, self._copies)

    def synchronize(self) -> None:
        self.driver.synchronize(self._copies)
        self.driver.synchronize(self._compute)

    # Kernels -----------------------------------------------------------------------------------------------------
    def functions(self, launches: Mapping[str, FunctionLaunches], image: bytes,
                  names: Sequence[str]) -> dict[str, CudaFunction]:
        """Functions ``names`` of a library (its launches and device code) loaded on this GPU."""
        module = self.driver.load_module(image)
        entries = {k.entry for f in launches.values() for k in f.kernels}
        handles = {entry: self.driver.function(module, entry) for entry in sorted(entries)}
        return {name: CudaFunction(self, launches[name], handles) for name in names}

    def launch(self, function: int, grid: tuple[int, int, int], block: tuple[int, int, int], shared_bytes: int,
               args: Sequence[tuple[str, int | float]]) -> None:
        """Launch a kernel on the compute stream (opting in to its dynamic shared memory beyond the default)."""
        threads = block[0] * block[1] * block[2]
        if threads > self.properties.max_threads_per_block:
            raise ValueError(f"{threads} threads per block exceed the GPU's {self.properties.max_threads_per_block}")
        if shared_bytes > DEFAULT_DYNAMIC_SHARED and function not in self._opted_in:
            if shared_bytes > self.properties.max_shared_memory_per_block:
                raise ValueError(f"{shared_bytes} bytes of shared memory exceed the GPU's "
                                 f"{self.properties.max_shared_memory_per_block}")
            self.driver.set_max_dynamic_shared(function, self.properties.max_shared_memory_per_block)
            self._opted_in.add(function)
        self.driver.launch(function, grid, block, shared_bytes, self._compute, args)

    def __repr__(self) -> str:
        return f"CudaRunner({self.index}, {self.properties.name!r})"
