"""CUDA without TVM's CUDA runtime: the exported PTX loaded and launched through the CUDA driver.

``Device("cuda")`` is this device wherever TVM's own CUDA runtime is missing (PyPI's wheel has none): the ``Device``
interface over ``cuda_launch.CudaRunner``, which plays the host code's part of each kernel function from the
library's manifest (``launch_geometry``) and needs no TVM. Host -> device copies go on a separate copy stream;
``wait_for_copies`` orders them before the next launch with an event, as TVM's CUDA path does.
"""

from __future__ import annotations

from .cuda_driver import BindingsDriver, CudaDriver
from .cuda_launch import CudaArray, CudaFunction, CudaRunner
from .device import Device, DeviceInfo, KernelFunction
from .kernel_library import KernelLibrary

__all__ = ["CudaArray", "CudaDevice", "CudaFunction"]


class CudaDevice(CudaRunner, Device):
    """An NVIDIA GPU through the CUDA driver (arrays are ``CudaArray``); the kernels come from the exported PTX."""

    def __new__(cls, kind: str = "cuda", index: int = 0, driver: CudaDriver | None = None) -> CudaDevice:
        return object.__new__(cls)

    def __init__(self, kind: str = "cuda", index: int = 0, driver: CudaDriver | None = None) -> None:
        self.kind = "cuda"
        CudaRunner.__init__(self, index, driver)

    @staticmethod
    def discover(driver: CudaDriver | None = None) -> list[DeviceInfo]:
        """The GPUs the CUDA driver sees (empty without cuda-bindings or a driver)."""
        try:
            driver = driver if driver is not None else BindingsDriver()
            count = driver.device_count()
        except (ImportError, RuntimeError):
            return []
        found = []
        for index in range(count):
            p = driver.properties(index)
            found.append(DeviceInfo("cuda", index, p.name, "cuda-driver", {
                "compute": f"{p.compute_capability[0]}.{p.compute_capability[1]}",
                "multiprocessors": p.multiprocessors, "max_threads_per_block": p.max_threads_per_block,
                "memory_gib": round(p.total_memory / 2**30, 1)}))
        return found

    def load(self, library: KernelLibrary) -> dict[str, KernelFunction]:
        if library.target.kind != "cuda":
            raise ValueError(f"a {library.target.kind} kernel library cannot run on {self!r}")
        return dict(self.functions(library.launches(), library.device_code(), library.kernel_names))

    def __repr__(self) -> str:
        return f"Device('cuda', {self.index})"
