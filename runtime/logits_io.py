"""Logits in and out of a device: the caller's arrays (numpy, torch, anything with ``__dlpack__``) wrapped, not copied.

On the CPU a C-contiguous float32 host array (numpy, or a CPU tensor of another library through DLPack: torch, JAX,
CuPy's host arrays, ...) is handed to the kernels in place, whatever its alignment: they declare float32's own
(``kernel_abi.CALLER_ARRAY_ALIGN``). Only an array the kernels cannot address (not C-contiguous: a strided
slice, a transposed array; read-only where nothing is written) is staged: copied once into a buffer allocated at
capacity (``copy_host``, the one copy of this module), and copied back where the call writes in place. On CUDA a CUDA
tensor of the same device is wrapped the same way; numpy arrays are uploaded (and downloaded). On Vulkan numpy arrays
are uploaded and downloaded.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import numpy as np
import tvm
import tvm_ffi

from . import kernel_abi
from .cuda_device import CudaArray, CudaDevice
from .device import Device, PrefixViews
from .wgsl import GPUArray

#: Alignment of the buffers TVM allocates (``empty_aligned``); the kernels need only ``kernel_abi.CALLER_ARRAY_ALIGN``.
TVM_ALIGNMENT = 64
#: DLPack device types (``__dlpack_device__()[0]``).
DLPACK_CPU, DLPACK_CUDA, DLPACK_CUDA_HOST = 1, 2, 3


@runtime_checkable
class DLPackArray(Protocol):
    """An array of another library that can be shared without a copy (the DLPack protocol: torch, JAX, CuPy, ...)."""

    def __dlpack__(self, *args: Any, **kwargs: Any) -> Any: ...

    def __dlpack_device__(self) -> tuple[int, int]: ...


@functools.cache
def _dlpack_type(kind: type) -> bool:
    """Whether arrays of type ``kind`` follow the DLPack protocol (once per type: a Protocol check costs tens of
    microseconds)."""
    return issubclass(kind, DLPackArray)


def _is_dlpack(x: Any) -> bool:
    return _dlpack_type(type(x))


def empty_aligned(shape: tuple[int, ...], dtype: str | np.dtype = "float32") -> np.ndarray:
    """A numpy array in memory allocated by TVM (64-byte aligned, C-contiguous)."""
    return np.from_dlpack(tvm.runtime.empty(tuple(shape), str(np.dtype(dtype)), tvm.cpu()))


def copy_host(dst: np.ndarray, src: np.ndarray) -> None:
    """Copy ``src`` into ``dst``: the one place the runtime copies a caller's host array (in or back out)."""
    np.copyto(dst, src)


def caller_array(x: Any, what: str = "logits") -> Any:
    """``x`` as the runtime handles it, without copying: a numpy array (numpy itself, or a numpy view of a CPU DLPack
    tensor such as torch's, sharing its memory) or a device array (a runtime array, or a TVM view of a CUDA tensor).

    Raises TypeError for anything else, and for a tensor DLPack cannot share (torch's ``requires_grad``: detach it).
    """
    if isinstance(x, (np.ndarray, tvm.runtime.Tensor, GPUArray, CudaArray)):
        return x
    if not _is_dlpack(x):
        raise TypeError(f"{what} must be a float32 numpy.ndarray [num_rows, vocab], a tensor with __dlpack__ "
                        f"(torch, ...) or a device array, got {type(x).__name__}")
    kind = int(x.__dlpack_device__()[0])
    try:
        if kind in (DLPACK_CPU, DLPACK_CUDA_HOST):
            return np.from_dlpack(x)
        return tvm_ffi.from_dlpack(x, require_alignment=kernel_abi.CALLER_ARRAY_ALIGN)
    except BufferError as exc:  # e.g. torch: "Can't export tensors that require gradient, use tensor.detach()"
        raise TypeError(f"{what} ({type(x).__name__}) cannot be shared through DLPack: {exc}") from exc


def is_host_array(x: Any) -> bool:
    """True for numpy arrays and CPU DLPack tensors (results come back as numpy for them)."""
    if isinstance(x, np.ndarray):
        return True
    if isinstance(x, (tvm.runtime.Tensor, GPUArray, CudaArray)) or not _is_dlpack(x):
        return False
    return int(x.__dlpack_device__()[0]) in (DLPACK_CPU, DLPACK_CUDA_HOST)


def rows_and_vocab(x: Any, what: str, vocab_size: int) -> int:
    """Validate a ``[N, vocab_size]`` float32 array (numpy, DLPack or device); return N."""
    if isinstance(x, np.ndarray) and x.dtype == np.float32 and x.ndim == 2 and x.shape[1] == vocab_size:
        return x.shape[0]  # (the common case, without the Python-level dtype and shape conversions below)
    x = caller_array(x, what)
    shape = tuple(int(s) for s in x.shape)
    dtype = str(x.dtype)
    if dtype != "float32":
        raise TypeError(f"{what} must be float32, got {dtype}")
    if len(shape) != 2 or shape[1] != vocab_size:
        raise ValueError(f"{what} must have shape [num_rows, {vocab_size}], got {list(shape)}")
    return shape[0]


def refuse_read_only(x: Any, what: str = "logits") -> None:
    """ValueError for a read-only host array given to a call that writes it in place."""
    if isinstance(x, np.ndarray) and not x.flags.writeable:
        raise ValueError(f"{what} is read-only: it is updated in place (pass a writable array, e.g. {what}.copy())")


def non_finite_rows(logits: np.ndarray) -> np.ndarray:
    """bool ``[N]``: rows of ``logits`` ``[N, V]`` holding a NaN or a +inf (-inf is a masked token, not an error).

    Such a row has no distribution to sample from (softmax gives NaN): the engine ends its sequence with finish
    reason "error" instead of sampling it. One reduction over the logits (``max`` propagates NaN).
    """
    with np.errstate(invalid="ignore"):
        return ~(np.max(logits, axis=1) < np.inf)


def _in_place_ok(host: np.ndarray) -> bool:
    """The kernels can address ``host`` directly: C-contiguous, writable (DLPack cannot share a read-only numpy
    array), aligned to float32."""
    return host.flags.c_contiguous and host.flags.writeable and host.ctypes.data % kernel_abi.CALLER_ARRAY_ALIGN == 0


class LogitsStaging:
    """Brings ``[N, V]`` logits onto a device and back: in place where it can, else through one staging array
    allocated at capacity."""

    def __init__(self, device: Device, capacity: int, vocab_size: int) -> None:
        self.device = device
        self._capacity, self._vocab_size = capacity, vocab_size
        self._staging: PrefixViews | None = None  # allocated on first need: in-place callers never pay for it

    def _staging_view(self, rows: int) -> Any:
        if self._staging is None:
            self._staging = PrefixViews(self.device, self.device.empty((self._capacity, self._vocab_size), "float32"))
        return self._staging(rows)

    def to_device(self, logits: Any, writes: bool = True) -> tuple[Any, Callable[[], None] | None]:
        """(device array holding the logits, a function writing device results back into ``logits`` or None).

        ``writes``: the caller's kernels write the array in place (a staged copy is then written back).
        """
        array = caller_array(logits)
        if not isinstance(array, np.ndarray):
            self._check_device(array)
            if isinstance(self.device, CudaDevice) and isinstance(array, tvm.runtime.Tensor):
                # the driver path launches on raw pointers: the same memory, held by the caller's tensor
                return CudaArray(int(array.data_ptr()), tuple(int(s) for s in array.shape), np.dtype(str(array.dtype)),
                                 base=array), None
            return array, None
        if self.device.kind == "cpu" and _in_place_ok(array):
            return tvm_ffi.from_dlpack(array, require_alignment=kernel_abi.CALLER_ARRAY_ALIGN), None
        rows = array.shape[0]
        view = self._staging_view(rows)
        host = self.device.host_view(view)
        if host is not None:
            copy_host(host, array)
            return view, (lambda: copy_host(array, host)) if writes else None
        self.device.copy_to_device(np.ascontiguousarray(array), view)
        return view, (lambda: copy_host(array, self.device.download(view))) if writes else None

    def _check_device(self, array: Any) -> None:
        """A device array must live on this staging's device (a CUDA tensor is never copied through the host)."""
        if isinstance(array, tvm.runtime.Tensor):
            kind = array.device.dlpack_device_type()
            expected = {"cpu": DLPACK_CPU, "cuda": DLPACK_CUDA}.get(self.device.kind)
            if kind != expected or (kind == DLPACK_CUDA and array.device.index != self.device.index):
                raise ValueError(f"the array is on {array.device} but the runtime's device is {self.device!r}: "
                                 "pass an array of that device (or a host array)")
            if kind == DLPACK_CUDA and not _tvm_compact(array):
                raise ValueError("a CUDA tensor must be contiguous to be used in place (call .contiguous() on it)")

    def from_device(self, result: Any, like: Any) -> Any:
        """``result`` as the caller gave its input: a numpy host view (cpu) or copy for a host input (numpy or a CPU
        DLPack tensor), else the device array.

        A host view aliases the processor's buffer: it is valid until the next call that writes that buffer.
        """
        if not is_host_array(like):
            return result
        host = self.device.host_view(result)
        return host if host is not None else self.device.download(result)


def _tvm_compact(array: tvm.runtime.Tensor) -> bool:
    strides = array.strides
    if strides is None:
        return True
    expected, compact = 1, True
    for size, stride in zip(reversed(tuple(array.shape)), reversed(tuple(strides)), strict=True):
        compact = compact and (size == 1 or stride == expected)
        expected *= size
    return compact
