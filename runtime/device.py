"""One interface over the places kernels run: the CPU through TVM's runtime, CUDA, Vulkan through wgpu.

``Device("cpu")``, ``Device("cuda", 0)``, ``Device("vulkan", 0)``. CUDA goes through TVM's CUDA runtime where the TVM
build has one, else through the CUDA driver and the exported PTX (``cuda_device.py``; PyPI's TVM wheel has no CUDA
runtime). Each allocates arrays, copies host <-> device
(blocking, and queued on a copy stream where the backend has one), loads a kernel library and launches its kernels,
and synchronises. ``Device.available()`` lists what this machine has.

Copy ordering, per backend:
- cpu: device arrays are host memory; a "copy" of a paired buffer is no copy at all (the host array is a view of the
  device array), so a kernel always sees the latest host writes;
- cuda: host -> device copies are queued on a separate copy stream; ``wait_for_copies()`` makes the compute stream wait
  for them (an event, not a host sync) before the next launch;
- vulkan: WebGPU has one queue; ``queue.write_buffer`` is ordered before every later submission, so a kernel submitted
  after a copy sees it.
ROCm and Metal code builds (``logitproc.compile``; building is always an explicit call there, never a side effect
of ``load``), but TVM's wheel cannot load it: asking for those devices says so.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import tvm
import tvm_ffi

from ..cpu_threads import configure as configure_tvm_threads
from .kernel_library import KernelLibrary

DEVICE_KINDS = ("cpu", "cuda", "vulkan")
_UNLOADABLE = {
    "rocm": "TVM 0.27's wheel has no ROCm (HIP) runtime; `logitproc compile-kernels --target rocm` still builds the "
    "AMDGPU code object",
    "metal": "TVM's Metal runtime exists only in macOS builds; `logitproc compile-kernels --target metal` still "
    "writes the Metal source",
}

KernelFunction = Callable[..., None]


@dataclass(frozen=True)
class DeviceInfo:
    """What ``Device.available()`` reports for one device."""

    kind: str
    index: int
    name: str
    backend: str
    limits: dict[str, Any] = field(default_factory=dict)

    def __str__(self) -> str:
        limits = ", ".join(f"{k}={v}" for k, v in self.limits.items())
        return f"{self.kind}:{self.index}  {self.name}  [{self.backend}]  {limits}"


class Device:
    """A device to run logitproc's kernels on. ``Device(kind, index)`` returns the backend's subclass."""

    kind: str
    index: int

    def __new__(cls, kind: str = "cpu", index: int = 0) -> Device:
        if cls is not Device:
            return super().__new__(cls)
        if not isinstance(kind, str):
            raise TypeError(f"device kind must be a str, got {type(kind).__name__}")
        if kind in _UNLOADABLE:
            raise RuntimeError(f"Device({kind!r}) is not available: {_UNLOADABLE[kind]}")
        if kind not in DEVICE_KINDS:
            raise ValueError(f"device kind {kind!r} is not supported; expected one of {DEVICE_KINDS}")
        if not isinstance(index, int) or index < 0:
            raise ValueError(f"device index must be an int >= 0, got {index!r}")
        if kind == "vulkan":
            return super().__new__(VulkanDevice)
        if kind == "cuda" and not tvm_has_cuda():
            from .cuda_device import CudaDevice

            return super().__new__(CudaDevice)
        return super().__new__(TVMDevice)

    @staticmethod
    def available() -> list[DeviceInfo]:
        """Every device this machine offers (the CPU always; CUDA GPUs; Vulkan adapters through wgpu)."""
        found = TVMDevice.discover()
        if not tvm_has_cuda():
            from .cuda_device import CudaDevice

            found += CudaDevice.discover()
        return found + VulkanDevice.discover()

    # The backend-specific interface --------------------------------------------------------------------------
    def empty(self, shape: tuple[int, ...], dtype: str | np.dtype) -> Any:
        """An uninitialised device array."""
        raise NotImplementedError

    def upload(self, array: np.ndarray) -> Any:
        """A new device array holding a copy of ``array`` (blocking)."""
        raise NotImplementedError

    def download(self, array: Any) -> np.ndarray:
        """A numpy copy of a device array (waits for the work that writes it)."""
        raise NotImplementedError

    def prefix(self, array: Any, rows: int) -> Any:
        """A view of the first ``rows`` rows of a device array (no copy)."""
        raise NotImplementedError

    def copy_to_device(self, host: np.ndarray, dst: Any) -> None:
        """Queue a copy of ``host`` into the device array ``dst`` (same shape) on the copy stream."""
        raise NotImplementedError

    def copy_rows_to_device(self, host: np.ndarray, dst: Any, lo: int, hi: int) -> None:
        """Queue a copy of rows ``lo:hi`` of ``host`` into the same rows of the device array ``dst``."""
        raise NotImplementedError

    def wait_for_copies(self) -> None:
        """Make later kernel launches wait for every copy queued so far."""

    def load(self, library: KernelLibrary) -> dict[str, KernelFunction]:
        """The library's kernels as callables taking device arrays (a library built for this device's kind)."""
        raise NotImplementedError

    def synchronize(self) -> None:
        """Wait until every queued copy and kernel has finished."""
        raise NotImplementedError

    def host_view(self, array: Any) -> np.ndarray | None:
        """A numpy array sharing the device array's memory where the device is the host; else None."""
        return None

    def __repr__(self) -> str:
        return f"Device({self.kind!r}, {self.index})"


class TVMDevice(Device):
    """CPU and CUDA through TVM's runtime (arrays are ``tvm.runtime.Tensor``)."""

    def __init__(self, kind: str = "cpu", index: int = 0) -> None:
        self.kind, self.index = kind, index
        self.tvm_device = tvm.device(kind, index)
        if not self.tvm_device.exist:
            raise RuntimeError(f"Device({kind!r}, {index}) does not exist on this machine")
        self._copy_stream = self.tvm_device.create_raw_stream() if kind == "cuda" else None
        self._set_stream = tvm_ffi.get_global_func("runtime.TVMSetStream")
        self._copy_from_to = tvm_ffi.get_global_func("runtime.TVMTensorCopyFromTo")

    @staticmethod
    def discover() -> list[DeviceInfo]:
        cpu = tvm.cpu()
        found = [DeviceInfo("cpu", 0, _cpu_name(), "tvm-llvm", {"threads": _tvm_threads()})]
        index = 0
        while index < 16 and tvm.cuda(index).exist:
            dev = tvm.cuda(index)
            found.append(DeviceInfo("cuda", index, str(dev.device_name), "tvm-cuda", {
                "compute": dev.compute_version, "max_threads_per_block": dev.max_threads_per_block,
                "memory_gib": round(dev.total_global_memory / 2**30, 1)}))
            index += 1
        del cpu
        return found

    def empty(self, shape: tuple[int, ...], dtype: str | np.dtype) -> tvm.runtime.Tensor:
        return tvm.runtime.empty(tuple(shape), str(np.dtype(dtype)), self.tvm_device)

    def upload(self, array: np.ndarray) -> tvm.runtime.Tensor:
        return tvm.runtime.tensor(np.ascontiguousarray(array), self.tvm_device)

    def download(self, array: tvm.runtime.Tensor) -> np.ndarray:
        return array.numpy()

    def prefix(self, array: tvm.runtime.Tensor, rows: int) -> tvm.runtime.Tensor:
        if rows == array.shape[0]:
            return array
        return array._create_view((rows, *array.shape[1:]))

    def host_view(self, array: tvm.runtime.Tensor) -> np.ndarray | None:
        return np.from_dlpack(array) if self.kind == "cpu" else None

    def copy_to_device(self, host: np.ndarray, dst: tvm.runtime.Tensor) -> None:
        if self.kind == "cpu":
            view = np.from_dlpack(dst)
            if not np.shares_memory(view, host):
                view[...] = host
            return
        # A host-side source of a copy needs no particular alignment (TVM's from_dlpack would insist on 64 bytes).
        source = tvm_ffi.from_dlpack(np.ascontiguousarray(host), require_alignment=0)
        self._set_stream(self.tvm_device.dlpack_device_type(), self.index, self._copy_stream)
        try:
            self._copy_from_to(source, dst)
        finally:
            self._set_stream(self.tvm_device.dlpack_device_type(), self.index, None)

    def copy_rows_to_device(self, host: np.ndarray, dst: tvm.runtime.Tensor, lo: int, hi: int) -> None:
        row_bytes = host[:1].nbytes if host.shape[0] else 0
        view = dst._create_view((hi - lo, *dst.shape[1:]), relative_byte_offset=lo * row_bytes)
        self.copy_to_device(host[lo:hi], view)

    def wait_for_copies(self) -> None:
        if self._copy_stream is not None:
            tvm_ffi.get_global_func("runtime.Device_StreamSyncFromTo")(self.tvm_device, self._copy_stream, 0)

    def load(self, library: KernelLibrary) -> dict[str, KernelFunction]:
        if library.target.kind != self.kind:
            raise ValueError(f"a {library.target.kind} kernel library cannot run on {self!r}")
        return {name: library[name] for name in library.kernel_names}

    def synchronize(self) -> None:
        if self._copy_stream is not None:
            self.tvm_device.sync(self._copy_stream)
        self.tvm_device.sync()


class VulkanDevice(Device):
    """Vulkan through wgpu, running the WGSL of TVM's webgpu target (arrays are ``wgsl.GPUArray``)."""

    def __init__(self, kind: str = "vulkan", index: int = 0) -> None:
        from . import wgsl

        self.kind, self.index = kind, index
        self._wgsl = wgsl
        adapters = wgsl.vulkan_adapters()
        if index >= len(adapters):
            raise RuntimeError(
                f"Device('vulkan', {index}) does not exist: {len(adapters)} Vulkan adapter(s) found "
                "(pip install 'logitproc[vulkan]'; without a GPU, apt-get install mesa-vulkan-drivers for lavapipe)"
            )
        self.adapter = adapters[index]
        self.wgpu_device = wgsl.create_device(self.adapter)
        #: The kernels of each library this device loaded (its directory: a build's own): loading lowers the whole
        #: library's TIR to WGSL and makes its pipelines (seconds), and a processor and a sampler load the same one.
        self._loaded: dict[Path, Any] = {}

    @staticmethod
    def discover() -> list[DeviceInfo]:
        from . import wgsl

        found = []
        for index, adapter in enumerate(wgsl.vulkan_adapters()):
            limits = adapter.limits
            found.append(DeviceInfo("vulkan", index, str(adapter.info["device"]), "wgpu-vulkan", {
                "type": adapter.info["adapter_type"],
                "max_invocations": limits["max-compute-invocations-per-workgroup"],
                "max_storage_mib": limits["max-storage-buffer-binding-size"] // 2**20}))
        return found

    def empty(self, shape: tuple[int, ...], dtype: str | np.dtype) -> Any:
        return self._wgsl.GPUArray.empty(self.wgpu_device, tuple(shape), dtype)

    def upload(self, array: np.ndarray) -> Any:
        return self._wgsl.GPUArray.from_numpy(self.wgpu_device, array)

    def download(self, array: Any) -> np.ndarray:
        return array.numpy()

    def prefix(self, array: Any, rows: int) -> Any:
        if rows == array.shape[0]:
            return array
        return self._wgsl.GPUArray(self.wgpu_device, array.buffer, (rows, *array.shape[1:]), array.dtype)

    def copy_to_device(self, host: np.ndarray, dst: Any) -> None:
        dst.write(host)  # ordered before every later submission on the device's one queue

    def copy_rows_to_device(self, host: np.ndarray, dst: Any, lo: int, hi: int) -> None:
        data = np.ascontiguousarray(host[lo:hi]).view(np.uint8).reshape(-1)
        if data.size:  # 4-byte elements: offsets and sizes stay multiples of 4 as WebGPU requires
            self.wgpu_device.queue.write_buffer(dst.buffer, lo * host[:1].nbytes, data)

    def load(self, library: KernelLibrary) -> dict[str, KernelFunction]:
        if library.target.kind != "vulkan":
            raise ValueError(f"a {library.target.kind} kernel library cannot run on {self!r}")
        kernels = self._loaded.get(library.directory.resolve())
        if kernels is None:
            kernels = self._wgsl.WGSLKernels.from_prim_funcs(self.wgpu_device, library.prim_funcs())
            self._loaded[library.directory.resolve()] = kernels
        return {name: kernels[name] for name in library.kernel_names}

    def synchronize(self) -> None:
        self._wgsl.sync_queue(self.wgpu_device)


class PrefixViews:
    """A device array allocated at capacity, and its views of the first rows, each made once per row count.

    Making a view costs more than some kernels (about 10 us through TVM's FFI); a step asks for the same few.
    """

    def __init__(self, device: Device, array: Any) -> None:
        self.device = device
        self.array = array
        self._views: dict[int, Any] = {}

    def __call__(self, rows: int) -> Any:
        view = self._views.get(rows)
        if view is None:
            view = self._views[rows] = self.device.prefix(self.array, rows)
        return view


def tvm_has_cuda() -> bool:
    """Whether this TVM build has its own CUDA runtime (PyPI's wheel has none: ``Device("cuda")`` then runs the
    exported PTX through the CUDA driver, ``cuda_device.CudaDevice``)."""
    return bool(tvm.runtime.enabled("cuda"))


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return "cpu"


def _tvm_threads() -> int:
    """The threads of TVM's CPU pool (this thread's: asking starts it, so it is sized first, ``cpu_threads.py``)."""
    configure_tvm_threads()
    return int(tvm.get_global_func("runtime.NumThreads")())
