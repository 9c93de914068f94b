"""The CUDA driver calls the runtime makes, as a small typed interface, and its implementation over ``cuda-bindings``.

TVM's PyPI wheel has no CUDA runtime; the CUDA driver (``libcuda``, installed with the NVIDIA driver) and NVIDIA's
``cuda-bindings`` package (the ``cuda`` extra) are all a GPU needs to run the exported PTX. ``CudaDriver`` is the
part of the driver API the runtime uses (memory, copies, streams, modules, launches), in plain integers; the tests
drive the same device code through a fake of it on machines without a GPU.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

#: ctypes type of each scalar kernel argument, by its TIR dtype ("handle": a device pointer).
ARG_CTYPES: dict[str, type] = {
    "handle": ctypes.c_uint64,
    "int32": ctypes.c_int32,
    "int64": ctypes.c_int64,
    "uint32": ctypes.c_uint32,
    "float32": ctypes.c_float,
}


@dataclass(frozen=True)
class GPUProperties:
    """What the runtime reports and checks of one GPU."""

    name: str
    compute_capability: tuple[int, int]
    total_memory: int
    multiprocessors: int
    max_threads_per_block: int
    max_shared_memory_per_block: int


class CudaDriver(Protocol):
    """The driver API calls of the runtime, on the current context of one device (pointers and handles as ints)."""

    def device_count(self) -> int: ...

    def properties(self, index: int) -> GPUProperties: ...

    def activate(self, index: int) -> None:
        """Make device ``index``'s primary context current on this thread (calls below use it)."""

    def alloc(self, nbytes: int) -> int: ...

    def free(self, ptr: int) -> None: ...

    def copy_to_device(self, dst: int, src_host: int, nbytes: int, stream: int) -> None:
        """Queue a host -> device copy on ``stream`` (the host memory is read before the call returns)."""

    def copy_to_host(self, dst_host: int, src: int, nbytes: int) -> None:
        """Copy device -> host after all earlier work on every stream (blocking)."""

    def copy_on_device(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        """Queue a device -> device copy on ``stream``."""

    def time_graph(self, stream: int, enqueue: Callable[[], None], replays: int) -> float:
        """Capture what ``enqueue`` queues on ``stream`` into a CUDA graph, replay it ``replays`` times and return the
        seconds per replay (CUDA events: launch overhead excluded)."""

    def create_stream(self) -> int: ...

    def stream_wait(self, waiting: int, on: int) -> None:
        """Make later work on ``waiting`` wait for the work queued on ``on`` so far (an event; no host wait)."""

    def synchronize(self, stream: int) -> None: ...

    def load_module(self, image: bytes) -> int:
        """Load PTX or a cubin; return the module handle."""

    def function(self, module: int, entry: str) -> int: ...

    def set_max_dynamic_shared(self, function: int, nbytes: int) -> None: ...

    def launch(self, function: int, grid: tuple[int, int, int], block: tuple[int, int, int], shared_bytes: int,
               stream: int, args: Sequence[tuple[str, int | float]]) -> None:
        """Launch ``function`` with ``args`` given as (dtype, value) in the kernel's parameter order."""


class CudaError(RuntimeError):
    """A CUDA driver call failed (its name and the driver's error name)."""


class BindingsDriver:
    """``CudaDriver`` over ``cuda.bindings.driver`` (``pip install 'logitproc[cuda]'``)."""

    def __init__(self) -> None:
        try:
            from cuda.bindings import driver
        except ImportError as exc:
            raise ImportError("running on CUDA without TVM's CUDA runtime needs NVIDIA's cuda-bindings: "
                              "pip install 'logitproc[cuda]'") from exc
        self._cu = driver
        self._contexts: dict[int, Any] = {}
        self._handles: dict[int, Any] = {}  # int -> the bindings' object, for handles passed back in
        self._events: dict[tuple[int, int], Any] = {}  # (waiting stream, stream waited on) -> its event
        try:
            result = driver.cuInit(0)
        except Exception as exc:  # noqa: BLE001 - cuda-bindings raises its loader's own error without libcuda
            raise CudaError(f"no NVIDIA driver here: the CUDA driver library could not be loaded ({exc})") from exc
        self._check("cuInit", result)

    def _check(self, call: str, result: tuple[Any, ...]) -> Any:
        err, *rest = result
        if err != self._cu.CUresult.CUDA_SUCCESS:
            _, name = self._cu.cuGetErrorName(err)
            name = name.decode() if isinstance(name, bytes) else str(err)
            raise CudaError(f"{call} failed: {name}")
        if not rest:
            return None
        return rest[0] if len(rest) == 1 else tuple(rest)

    def _keep(self, handle: Any) -> int:
        key = int(handle)
        self._handles[key] = handle
        return key

    def device_count(self) -> int:
        return int(self._check("cuDeviceGetCount", self._cu.cuDeviceGetCount()))

    def properties(self, index: int) -> GPUProperties:
        cu = self._cu
        dev = self._check("cuDeviceGet", cu.cuDeviceGet(index))
        name = self._check("cuDeviceGetName", cu.cuDeviceGetName(256, dev))
        attr = cu.CUdevice_attribute

        def get(a: Any) -> int:
            return int(self._check("cuDeviceGetAttribute", cu.cuDeviceGetAttribute(a, dev)))

        return GPUProperties(
            name=name.split(b"\0", 1)[0].decode(),
            compute_capability=(get(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR),
                                get(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)),
            total_memory=int(self._check("cuDeviceTotalMem", cu.cuDeviceTotalMem(dev))),
            multiprocessors=get(attr.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT),
            max_threads_per_block=get(attr.CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK),
            max_shared_memory_per_block=get(attr.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN),
        )

    def activate(self, index: int) -> None:
        ctx = self._contexts.get(index)
        if ctx is None:
            dev = self._check("cuDeviceGet", self._cu.cuDeviceGet(index))
            ctx = self._check("cuDevicePrimaryCtxRetain", self._cu.cuDevicePrimaryCtxRetain(dev))
            self._contexts[index] = ctx
        self._check("cuCtxSetCurrent", self._cu.cuCtxSetCurrent(ctx))

    def alloc(self, nbytes: int) -> int:
        return int(self._check("cuMemAlloc", self._cu.cuMemAlloc(max(1, nbytes))))

    def free(self, ptr: int) -> None:
        self._check("cuMemFree", self._cu.cuMemFree(ptr))

    def copy_to_device(self, dst: int, src_host: int, nbytes: int, stream: int) -> None:
        if nbytes:
            self._check("cuMemcpyHtoDAsync",
                        self._cu.cuMemcpyHtoDAsync(dst, src_host, nbytes, self._handles[stream]))

    def copy_to_host(self, dst_host: int, src: int, nbytes: int) -> None:
        if nbytes:
            self._check("cuCtxSynchronize", self._cu.cuCtxSynchronize())
            self._check("cuMemcpyDtoH", self._cu.cuMemcpyDtoH(dst_host, src, nbytes))

    def copy_on_device(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        if nbytes:
            self._check("cuMemcpyDtoDAsync", self._cu.cuMemcpyDtoDAsync(dst, src, nbytes, self._handles[stream]))

    def time_graph(self, stream: int, enqueue: Callable[[], None], replays: int) -> float:
        cu, s = self._cu, self._handles[stream]
        self._check("cuStreamBeginCapture",
                    cu.cuStreamBeginCapture(s, cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL))
        try:
            enqueue()
        finally:
            graph = self._check("cuStreamEndCapture", cu.cuStreamEndCapture(s))
        executable = self._check("cuGraphInstantiate", cu.cuGraphInstantiate(graph, 0))
        start, end = (self._check("cuEventCreate", cu.cuEventCreate(0)) for _ in range(2))
        try:
            self._check("cuGraphLaunch", cu.cuGraphLaunch(executable, s))  # warm-up
            self._check("cuEventRecord", cu.cuEventRecord(start, s))
            for _ in range(replays):
                self._check("cuGraphLaunch", cu.cuGraphLaunch(executable, s))
            self._check("cuEventRecord", cu.cuEventRecord(end, s))
            self._check("cuEventSynchronize", cu.cuEventSynchronize(end))
            milliseconds = self._check("cuEventElapsedTime", cu.cuEventElapsedTime(start, end))
        finally:
            cu.cuEventDestroy(start)
            cu.cuEventDestroy(end)
            cu.cuGraphExecDestroy(executable)
            cu.cuGraphDestroy(graph)
        return float(milliseconds) / 1e3 / replays

    def create_stream(self) -> int:
        stream = self._check("cuStreamCreate",
                             self._cu.cuStreamCreate(self._cu.CUstream_flags.CU_STREAM_NON_BLOCKING))
        return self._keep(stream)

    def stream_wait(self, waiting: int, on: int) -> None:
        # one event per stream pair, made once and recorded again each time (the wait takes the event's state at
        # the time of the call): this runs before every launch that follows a copy
        cu = self._cu
        event = self._events.get((waiting, on))
        if event is None:
            event = self._events[(waiting, on)] = self._check(
                "cuEventCreate", cu.cuEventCreate(cu.CUevent_flags.CU_EVENT_DISABLE_TIMING))
        self._check("cuEventRecord", cu.cuEventRecord(event, self._handles[on]))
        self._check("cuStreamWaitEvent", cu.cuStreamWaitEvent(self._handles[waiting], event, 0))

    def synchronize(self, stream: int) -> None:
        self._check("cuStreamSynchronize", self._cu.cuStreamSynchronize(self._handles[stream]))

    def load_module(self, image: bytes) -> int:
        data = image if image.endswith(b"\0") else image + b"\0"  # PTX is read as a C string
        return self._keep(self._check("cuModuleLoadData", self._cu.cuModuleLoadData(data)))

    def function(self, module: int, entry: str) -> int:
        return self._keep(self._check(f"cuModuleGetFunction({entry})",
                                      self._cu.cuModuleGetFunction(self._handles[module], entry.encode())))

    def set_max_dynamic_shared(self, function: int, nbytes: int) -> None:
        attr = self._cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        self._check("cuFuncSetAttribute", self._cu.cuFuncSetAttribute(self._handles[function], attr, nbytes))

    def launch(self, function: int, grid: tuple[int, int, int], block: tuple[int, int, int], shared_bytes: int,
               stream: int, args: Sequence[tuple[str, int | float]]) -> None:
        values = [ARG_CTYPES[dtype](value) for dtype, value in args]
        pointers = (ctypes.c_void_p * max(1, len(values)))(*[ctypes.addressof(v) for v in values])
        self._check("cuLaunchKernel", self._cu.cuLaunchKernel(
            self._handles[function], *grid, *block, shared_bytes, self._handles[stream],
            ctypes.addressof(pointers), 0))
