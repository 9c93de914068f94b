"""Penalty entries kept in paired buffers between steps, so that a step's host work does not grow with length.

Each sequence with penalties owns a segment of the (row, token, output count) arrays, sized with slack. A step
writes only what changed since the last one: entries for tokens seen for the first time, counts that the new
output tokens bumped (replayed from ``RequestState.touch_log``), and the row index if the sequence moved to another
row. The segments of the sequences a batch says have left (``BatchUpdate.left``, through ``forget``) become padding
as soon as the batch is made. Slack and those segments are padding (row -1, which the kernel skips). Only the written
ranges are copied to the device. A segment that fills up moves to the end with twice the room; when the arrays are
full the layout is rebuilt from the current batch. Rows with draft tokens get temporary entries after the
persistent ones, rebuilt every step (they need the counts as if the draft path were appended).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .batch import Batch
from .device import Device
from .paired_buffer import PairedBuffer
from .request_state import RequestState

PADDING_ROW = -1
MIN_SEGMENT = 64


@dataclass
class _Segment:
    start: int
    capacity: int
    synced: int  # entries [0, synced) of the state are in the arrays
    log_pos: int  # touch_log consumed up to here
    row: int
    epoch: int  # the state's rollback_epoch when mirrored


class _Full(Exception):
    """The arrays have no room left for a segment."""


class PenaltyLayout:
    """The penalty stage's sparse entries, mirrored incrementally from the batch's RequestStates."""

    def __init__(self, device: Device, capacity: int) -> None:
        self.capacity = capacity
        self.rows = PairedBuffer(device, "penalty entries (raise max_penalty_entries)", capacity, dtype="int32")
        self.tokens = PairedBuffer(device, "penalty tokens", capacity, dtype="int32")
        self.counts = PairedBuffer(device, "penalty counts", capacity, dtype="int32")
        self._segments: dict[RequestState, _Segment] = {}
        self._end = 0
        self._dirty: list[tuple[int, int]] = []

    def forget(self, states: Sequence[RequestState]) -> None:
        """The sequences left the batch: their segments become padding."""
        for state in states:
            seg = self._segments.pop(state, None)
            if seg is not None:
                self._blank(seg)

    def prepare(self, batch: Batch) -> int:
        """Bring the arrays up to date for ``batch``; return how many entries the kernel must cover (0 = none)."""
        current = {s: batch.first_row[s] for s in batch.states if s.config.has_penalties}
        try:
            for state, row in current.items():
                self._sync(state, row)
        except _Full:
            self._rebuild(current)
        end = self._with_drafts(batch)
        for lo, hi in self._coalesced():
            for buf in (self.rows, self.tokens, self.counts):
                buf.copy_rows(lo, hi)
        self._dirty.clear()
        return end

    def device_arrays(self, n: int) -> list[object]:
        return [buf.device_prefix(n) for buf in (self.rows, self.tokens, self.counts)]

    # ----------------------------------------------------------------------------------------------------------
    def _sync(self, state: RequestState, row: int) -> None:
        size = state.appeared_token_ids.size
        seg = self._segments.get(state)
        if seg is None or size > seg.capacity or seg.epoch != state.rollback_epoch:
            if seg is not None:
                self._blank(self._segments.pop(state))
            self._segments[state] = self._allocate(state, row)
            return
        start = seg.start
        if seg.row != row:
            self.rows.host[start : start + seg.synced] = row
            self._dirty.append((start, start + seg.synced))
            seg.row = row
        if size > seg.synced:
            lo, hi = start + seg.synced, start + size
            self.rows.host[lo:hi] = row
            self.tokens.host[lo:hi] = state.appeared_token_ids[seg.synced :]
            self.counts.host[lo:hi] = state.output_counts[seg.synced :]
            self._dirty.append((lo, hi))
            seg.synced = size
        touched = state.touch_log[seg.log_pos :]
        if touched:
            positions = np.frombuffer(touched, np.int32)
            self.counts.host[start + positions] = state.output_counts[positions]
            self._dirty.extend((start + int(p), start + int(p) + 1) for p in np.unique(positions))
            seg.log_pos = len(state.touch_log)

    def _allocate(self, state: RequestState, row: int) -> _Segment:
        size = state.appeared_token_ids.size
        capacity = max(MIN_SEGMENT, 2 * size)
        if self._end + capacity > self.capacity:
            capacity = size  # no slack rather than no room
            if self._end + capacity > self.capacity:
                raise _Full
        start = self._end
        self._end += capacity
        self.rows.host[start : start + size] = row
        self.rows.host[start + size : start + capacity] = PADDING_ROW
        self.tokens.host[start : start + size] = state.appeared_token_ids
        self.counts.host[start : start + size] = state.output_counts
        self._dirty.append((start, start + capacity))
        return _Segment(start, capacity, size, len(state.touch_log), row, state.rollback_epoch)

    def _blank(self, seg: _Segment) -> None:
        self.rows.host[seg.start : seg.start + seg.capacity] = PADDING_ROW
        self._dirty.append((seg.start, seg.start + seg.capacity))

    def _rebuild(self, current: dict[RequestState, int]) -> None:
        self._segments.clear()
        self._end = 0
        self._dirty.clear()
        for state, row in current.items():
            try:
                self._segments[state] = self._allocate(state, row)
            except _Full:
                needed = sum(s.appeared_token_ids.size for s in current)
                raise ValueError(f"penalty entries: the batch needs {needed} entries, capacity is {self.capacity} "
                                 "(raise max_penalty_entries)") from None

    def _with_drafts(self, batch: Batch) -> int:
        end = self._end
        for r, state in enumerate(batch.row_states):
            if not batch.paths[r] or not state.config.has_penalties:
                continue
            tokens, counts = state.penalty_entries(batch.paths[r])
            if end + tokens.size > self.capacity:
                raise ValueError(f"penalty entries: draft rows need {end + tokens.size} entries, capacity is "
                                 f"{self.capacity} (raise max_penalty_entries)")
            self.rows.host[end : end + tokens.size] = r
            self.tokens.host[end : end + tokens.size] = tokens
            self.counts.host[end : end + tokens.size] = counts
            self._dirty.append((end, end + tokens.size))
            end += tokens.size
        return end

    def _coalesced(self) -> list[tuple[int, int]]:
        merged: list[tuple[int, int]] = []
        for lo, hi in sorted(self._dirty):
            if merged and lo <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(merged[-1][1], hi))
            else:
                merged.append((lo, hi))
        return merged
