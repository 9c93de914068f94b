"""The runtime: devices, paired host/device buffers, and (next) the logit processor and the sampler."""

from .device import Device, DeviceInfo
from .paired_buffer import PairedBuffer

__all__ = ["Device", "DeviceInfo", "PairedBuffer"]
