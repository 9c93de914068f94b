"""The runtime: devices, paired host/device buffers, the logit processor and the sampler."""

from .config import GenerationConfig
from .device import Device, DeviceInfo
from .logit_processor import LogitProcessor
from .logits_io import empty_aligned
from .logprobs import compute_logits, compute_logprobs, logits_to_logprobs
from .paired_buffer import PairedBuffer
from .mask_source import JumpForward, TokenMaskSource
from .request_state import DraftTree, RequestState
from .sampler import Sampler, SampleResult

__all__ = [
    "Device",
    "DeviceInfo",
    "DraftTree",
    "GenerationConfig",
    "JumpForward",
    "LogitProcessor",
    "PairedBuffer",
    "RequestState",
    "SampleResult",
    "Sampler",
    "TokenMaskSource",
    "compute_logits",
    "compute_logprobs",
    "empty_aligned",
    "logits_to_logprobs",
]
