"""Logits in and out of a device: numpy arrays or device arrays, without copies where the memory allows.

On the CPU a C-contiguous float32 numpy array aligned to 64 bytes (what TVM's kernels assume) is used in place;
any other numpy array is staged through an aligned buffer allocated at capacity and written back. ``empty_aligned``
makes arrays that never need staging. On Vulkan numpy arrays are uploaded and downloaded.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import tvm
import tvm_ffi

from .device import Device, PrefixViews
from .wgsl import GPUArray

TVM_ALIGNMENT = 64


def empty_aligned(shape: tuple[int, ...], dtype: str | np.dtype = "float32") -> np.ndarray:
    """A numpy array whose memory TVM's CPU kernels can use in place (64-byte aligned, C-contiguous)."""
    return np.from_dlpack(tvm.runtime.empty(tuple(shape), str(np.dtype(dtype)), tvm.cpu()))


def is_device_array(x: Any) -> bool:
    return not isinstance(x, np.ndarray)


def rows_and_vocab(x: Any, what: str, vocab_size: int) -> int:
    """Validate a ``[N, vocab_size]`` float32 array (numpy or device); return N."""
    if isinstance(x, np.ndarray) and x.dtype == np.float32 and x.ndim == 2 and x.shape[1] == vocab_size:
        return x.shape[0]  # (the common case, without the Python-level dtype and shape conversions below)
    if not isinstance(x, (np.ndarray, tvm.runtime.Tensor, GPUArray)):
        raise TypeError(f"{what} must be a float32 numpy.ndarray [num_rows, {vocab_size}] or a device array, "
                        f"got {type(x).__name__}")
    shape = tuple(int(s) for s in x.shape)
    dtype = str(x.dtype)
    if dtype != "float32":
        raise TypeError(f"{what} must be float32, got {dtype}")
    if len(shape) != 2 or shape[1] != vocab_size:
        raise ValueError(f"{what} must have shape [num_rows, {vocab_size}], got {list(shape)}")
    return shape[0]


def non_finite_rows(logits: np.ndarray) -> np.ndarray:
    """bool ``[N]``: rows of ``logits`` ``[N, V]`` holding a NaN or a +inf (-inf is a masked token, not an error).

    Such a row has no distribution to sample from (softmax gives NaN): the engine ends its sequence with finish
    reason "error" instead of sampling it. One reduction over the logits (``max`` propagates NaN).
    """
    with np.errstate(invalid="ignore"):
        return ~(np.max(logits, axis=1) < np.inf)


class LogitsStaging:
    """Brings ``[N, V]`` logits onto a device and back, through one staging array allocated at capacity."""

    def __init__(self, device: Device, capacity: int, vocab_size: int) -> None:
        self.device = device
        self.staging = PrefixViews(device, device.empty((capacity, vocab_size), "float32"))

    def to_device(self, logits: Any) -> tuple[Any, Callable[[], None] | None]:
        """(device array holding the logits, a function writing device results back into ``logits`` or None)."""
        if is_device_array(logits):
            return logits, None
        rows = logits.shape[0]
        if self.device.kind == "cpu" and logits.flags.c_contiguous and logits.ctypes.data % TVM_ALIGNMENT == 0:
            return tvm_ffi.from_dlpack(logits, require_alignment=TVM_ALIGNMENT), None
        view = self.staging(rows)
        host = self.device.host_view(view)
        if host is not None:
            host[...] = logits
            return view, lambda: np.copyto(logits, host)
        self.device.copy_to_device(np.ascontiguousarray(logits), view)
        return view, lambda: np.copyto(logits, self.device.download(view))

    def from_device(self, result: Any, like: Any) -> Any:
        """``result`` as the caller gave its input: a host view (cpu) or copy for numpy input, else the device array.

        A host view aliases the processor's buffer: it is valid until the next call that writes that buffer.
        """
        if is_device_array(like):
            return result
        host = self.device.host_view(result)
        return host if host is not None else self.device.download(result)
