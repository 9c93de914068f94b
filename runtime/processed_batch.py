"""ProcessedBatch: what ``LogitProcessor.inplace_update_logits`` returns and the sampler takes for one step.

The Batch describes the step's rows and nothing else; what processing them produced travels here, returned by the
processor and passed by the caller: the logits (the caller's array and the device array the kernels wrote), the
masks left for the sampling kernel to read (``defer_masks=True``), and per row the error of a mask source that
failed (that row allows no token).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .batch import Batch
from .request_state import RequestState


@dataclass(frozen=True)
class DeferredMasks:
    """Masks filled for a step but not yet applied to its logits (``inplace_update_logits(defer_masks=True)``):
    row ``row_ids[i]`` allows the tokens whose bits are set in ``bitmask[i]``. ``row_ids`` is on the host,
    ``row_ids_on_device`` and ``bitmask`` ([len(row_ids), words] int32) on the processor's device."""

    row_ids: np.ndarray
    row_ids_on_device: Any
    bitmask: Any


@dataclass(frozen=True)
class ProcessedBatch:
    """One step's logits after ``inplace_update_logits``: its ``batch``; ``logits``, the caller's array, and
    ``logits_on_device``, the device array holding them (a later stage given the same array does not copy it again);
    ``deferred_masks``, the masks the sampling kernel reads (None: applied to the logits already, or none);
    ``mask_errors``, row -> ``"ExceptionType: message"`` of a mask source that failed (the row allows no token)."""

    batch: Batch
    logits: Any
    logits_on_device: Any
    deferred_masks: DeferredMasks | None = None
    mask_errors: Mapping[int, str] = field(default_factory=dict)

    # the rows, as the Batch describes them
    @property
    def states(self) -> tuple[RequestState, ...]:
        return self.batch.states

    @property
    def row_states(self) -> tuple[RequestState, ...]:
        return self.batch.row_states

    @property
    def paths(self) -> tuple[tuple[int, ...], ...]:
        return self.batch.paths

    @property
    def num_rows(self) -> int:
        return self.batch.num_rows

    def device_array_of(self, array: Any) -> Any | None:
        """The device array of ``array`` when it is this step's processed logits, else None."""
        return self.logits_on_device if array is self.logits else None
