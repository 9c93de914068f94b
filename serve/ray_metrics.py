"""The replicas' metrics in the Ray ingress's ``/metrics``: each live replica's latest snapshot, labelled ``replica``.

A replica sends its Prometheus text as soon as it is up, then every ``REPORT_PERIOD_S`` seconds and at the end of
each of its requests (``MetricsSnapshot``). ``ReplicaMetrics`` keeps the latest per replica and, as a
prometheus_client collector in the ingress's registry, exposes every family of them once, each sample with a
``replica`` label (the Ray Serve replica id). Sum over ``replica`` for the service's totals. A replica leaves the
exposition when Ray stops it (``ReplicaLeft``, sent from its shutdown) or when it has not reported for
``STALE_AFTER_S`` seconds (its process died); the one Ray starts instead reports under a new id, from zero.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from .ray_messages import MetricsSnapshot, ReplicaLeft

#: Families the ingress exports itself (a replica answers no HTTP).
INGRESS_FAMILIES = ("logitproc_http_responses",)
#: How often a replica sends its snapshot (seconds), and how long after its last one it is taken for dead.
REPORT_PERIOD_S = 2.0
STALE_AFTER_S = 10.0
#: Replicas that left, remembered so that a snapshot still on its way from one does not bring it back.
LEFT_REMEMBERED = 1024


@dataclass(frozen=True)
class _Report:
    text: bytes
    received: float  # the clock's time when it arrived


class ReplicaMetrics:
    """The latest metrics of each live replica, collected into one exposition with a ``replica`` label.
    ``clock``: monotonic seconds (``time.monotonic``); ``stale_after``: seconds without a report after which a
    replica is dropped."""

    def __init__(self, stale_after: float = STALE_AFTER_S, clock: Callable[[], float] = time.monotonic) -> None:
        if not stale_after > 0:
            raise ValueError(f"ReplicaMetrics: stale_after must be > 0 seconds, got {stale_after}")
        self._stale_after = stale_after
        self._clock = clock
        self._latest: dict[str, _Report] = {}
        self._left: dict[str, None] = {}  # (insertion-ordered: the oldest are forgotten first)
        self._lock = threading.Lock()

    def update(self, message: MetricsSnapshot | ReplicaLeft) -> None:
        """Take a replica's snapshot (ignored if the replica left), or drop a replica that left."""
        with self._lock:
            if isinstance(message, ReplicaLeft):
                self._latest.pop(message.replica, None)
                self._left[message.replica] = None
                while len(self._left) > LEFT_REMEMBERED:
                    del self._left[next(iter(self._left))]
            elif message.replica not in self._left:
                self._latest[message.replica] = _Report(message.text, self._clock())

    def _live(self) -> list[tuple[str, bytes]]:
        """The replicas that reported within ``stale_after`` (the others are dropped), in the order of their ids."""
        now = self._clock()
        with self._lock:
            for replica in [r for r, report in self._latest.items() if now - report.received > self._stale_after]:
                del self._latest[replica]
            return sorted((replica, report.text) for replica, report in self._latest.items())

    @property
    def replicas(self) -> tuple[str, ...]:
        """The live replicas, in the order of their ids."""
        return tuple(replica for replica, _ in self._live())

    def collect(self) -> Iterator[Metric]:
        families: dict[str, Metric] = {}
        for replica, text in self._live():
            for family in text_string_to_metric_families(text.decode("utf-8")):
                if family.name.removesuffix("_created") in INGRESS_FAMILIES:  # (a counter's _created: its own family)
                    continue
                merged = families.get(family.name)
                if merged is None:
                    merged = families[family.name] = Metric(family.name, family.documentation, family.type,
                                                            family.unit)
                for sample in family.samples:
                    merged.add_sample(sample.name, {**sample.labels, "replica": replica}, sample.value,
                                      sample.timestamp, sample.exemplar)
        yield from families.values()
