"""The runtime: devices, kernel libraries, paired host/device buffers, the step's Batch, the logit processor and the
sampler."""

from .batch import Batch, BatchUpdate
from .config import GenerationConfig
from .device import Device, DeviceInfo
from .kernel_library import KernelLibrary
from .logit_processor import LogitProcessor
from .logits_io import empty_aligned
from .logprobs import compute_logits, compute_logprobs, logits_to_logprobs
from .mask_source import JumpForward, TokenMaskSource
from .paired_buffer import PairedBuffer
from .processed_batch import ProcessedBatch
from .request_state import DraftTree, RequestState
from .sampler import Sampler, SampleResult

__all__ = [
    "Batch",
    "BatchUpdate",
    "Device",
    "DeviceInfo",
    "DraftTree",
    "GenerationConfig",
    "JumpForward",
    "KernelLibrary",
    "LogitProcessor",
    "PairedBuffer",
    "ProcessedBatch",
    "RequestState",
    "SampleResult",
    "Sampler",
    "TokenMaskSource",
    "compute_logits",
    "compute_logprobs",
    "empty_aligned",
    "logits_to_logprobs",
]
