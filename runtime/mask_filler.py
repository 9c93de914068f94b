"""Filling the bitmask rows of a batch on worker threads, optionally while the model computes the logits.

Each row whose sequence has mask sources gets a slot in the host bitmask; rows are filled by a small thread pool
(the grammar engines release the GIL while computing a mask) in contiguous chunks. ``start`` queues a batch and
returns at once, so the caller can run the model forward meanwhile; the processor waits for the job when it applies
the masks. A row whose sources all decline to constrain keeps all bits set (applying it changes nothing). A source
that raises gets its row cleared (no token allowed) and its message recorded on the job (``MaskJob.errors``, by
row); the other rows are filled as usual.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from .batch import Batch
from .mask_source import TokenMaskSource

#: Rows per worker task: below this, threads cost more than they save.
MIN_ROWS_PER_TASK = 4


@dataclass
class MaskJob:
    """One batch's masks: ``row_ids[:count]`` are the logits rows, ``bitmask[:count]`` their words."""

    batch: Batch
    count: int
    futures: list[Future] = field(default_factory=list)
    fill_seconds: float = 0.0  # summed over workers
    #: Row -> what the row's failing mask source raised (``"TypeName: message"``); the row allows no token.
    errors: dict[int, str] = field(default_factory=dict)

    def wait(self) -> None:
        for future in self.futures:
            future.result()
        self.futures.clear()

    def matches(self, batch: Batch) -> bool:
        return batch is self.batch or batch.same_rows(self.batch)


class MaskFiller:
    """Fills ``bitmask`` / ``row_ids`` host arrays for a batch, on ``workers`` threads (0 = in the caller)."""

    def __init__(self, bitmask: np.ndarray, row_ids: np.ndarray, workers: int = 2) -> None:
        self.bitmask, self.row_ids = bitmask, row_ids
        self.workers = workers
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="logitproc-mask") if workers > 0 else None
        self._scratch = [np.empty(bitmask.shape[1], np.int32) for _ in range(max(1, workers))]

    def start(self, batch: Batch, asynchronous: bool = True) -> MaskJob:
        rows = [r for r, state in enumerate(batch.row_states) if state.mask_sources] if batch.any_masks else []
        self.row_ids[: len(rows)] = rows
        job = MaskJob(batch, len(rows))
        if not rows:
            return job
        use_pool = self._pool is not None and (asynchronous or len(rows) >= 2 * MIN_ROWS_PER_TASK)
        if not use_pool:
            self._fill(job, rows, 0, 0)
            return job
        tasks = max(1, min(self.workers, len(rows) // MIN_ROWS_PER_TASK))
        # Split at sequence boundaries: the rows of one sequence (its draft positions) share mutable sources.
        owner = batch.row_sequence
        starts = [i for i in range(len(rows)) if i == 0 or owner[rows[i]] != owner[rows[i - 1]]]
        cuts = sorted({starts[min(len(starts) - 1, round(k * len(starts) / tasks))] for k in range(tasks)})
        bounds = [*cuts, len(rows)]
        assert self._pool is not None
        job.futures = [self._pool.submit(self._fill, job, rows[lo:hi], lo, w)
                       for w, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)) if hi > lo]
        return job

    def _fill(self, job: MaskJob, rows: list[int], first_slot: int, worker: int) -> None:
        started = time.perf_counter()
        scratch = self._scratch[worker]
        for slot, r in enumerate(rows, first_slot):
            row = self.bitmask[slot]
            try:
                self._fill_row(row, scratch, job.batch.row_states[r].mask_sources, job.batch.paths[r])
            except Exception as err:  # one sequence's failing constraint must not stop the batch
                row[:] = 0
                job.errors[r] = f"{type(err).__name__}: {err}"
        job.fill_seconds += time.perf_counter() - started

    @staticmethod
    def _fill_row(row: np.ndarray, scratch: np.ndarray, sources: list[TokenMaskSource], path: tuple[int, ...]) -> None:
        row[:] = -1
        if len(sources) == 1:  # the common case: straight into the row, no scratch copy
            if not sources[0].fill_bitmask(row, path):
                row[:] = -1
            return
        for source in sources:
            scratch[:] = -1
            if source.fill_bitmask(scratch, path):
                np.bitwise_and(row, scratch, out=row)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
