"""A host array and a device array of the same shape, allocated once at capacity and used through prefix views.

Every per-step array of the runtime (sparse bias entries, penalty entries, bitmask rows, temperatures, uniforms, ...)
is a PairedBuffer: each step fills ``host_prefix(n)``, then ``to_device(n)`` queues the copy on the device's copy
stream and returns the device view of the same n rows, for a kernel launched after ``device.wait_for_copies()``.
Nothing is allocated per step. On the CPU the host array *is* the device memory, so no copy happens at all.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .device import Device, PrefixViews


class PairedBuffer:
    """``capacity`` rows of ``row_shape`` elements of ``dtype``, on the host and on ``device``."""

    def __init__(self, device: Device, name: str, capacity: int, row_shape: tuple[int, ...] = (),
                 dtype: str | np.dtype = "int32") -> None:
        if capacity < 1:
            raise ValueError(f"{name}: capacity must be >= 1, got {capacity}")
        self.device = device
        self.name = name
        self.capacity = capacity
        self.device_array = device.empty((capacity, *row_shape), dtype)
        self._views = PrefixViews(device, self.device_array)
        shared = device.host_view(self.device_array)
        # Separate host memory only where the device is not the host.
        self.host = shared if shared is not None else np.zeros((capacity, *row_shape), dtype)
        self._shared = shared is not None

    def _check(self, rows: int) -> None:
        if not 0 <= rows <= self.capacity:
            raise ValueError(f"{self.name}: {rows} rows requested, capacity is {self.capacity} "
                             "(raise max_num_token or split the batch)")

    def host_prefix(self, rows: int) -> np.ndarray:
        """The first ``rows`` rows of the host array, to fill in place."""
        self._check(rows)
        return self.host[:rows]

    def to_device(self, rows: int) -> Any:
        """Queue the copy of the first ``rows`` host rows on the copy stream; return the device view of them."""
        self._check(rows)
        view = self._views(rows)
        if rows and not self._shared:
            self.device.copy_to_device(self.host[:rows], view)
        return view

    def device_prefix(self, rows: int) -> Any:
        """The device view of the first ``rows`` rows, without copying anything."""
        self._check(rows)
        return self._views(rows)

    def copy_rows(self, lo: int, hi: int) -> None:
        """Queue the copy of host rows ``lo:hi`` to the device (nothing to do where the host array is the device's)."""
        self._check(hi)
        if hi > lo and not self._shared:
            self.device.copy_rows_to_device(self.host, self.device_array, lo, hi)

    def __repr__(self) -> str:
        return f"PairedBuffer({self.name!r}, capacity={self.capacity}, shape={self.host.shape}, {self.device!r})"
