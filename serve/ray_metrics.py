"""The replicas' metrics in the Ray ingress's ``/metrics``: each replica's latest snapshot, labelled ``replica``.

A replica sends its Prometheus text at the end of each of its requests (``MetricsSnapshot``); ``ReplicaMetrics``
keeps the latest per replica and, as a prometheus_client collector in the ingress's registry, exposes every
family of them once, each sample with a ``replica`` label (the Ray Serve replica id). Sum over ``replica`` for the
service's totals. A replica that died keeps its last figures under its id; the one Ray starts instead reports
under a new id, from zero.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from .ray_messages import MetricsSnapshot

#: Families the ingress exports itself (a replica answers no HTTP).
INGRESS_FAMILIES = ("logitproc_http_responses",)


class ReplicaMetrics:
    """The latest metrics of each replica, collected into one exposition with a ``replica`` label."""

    def __init__(self) -> None:
        self._latest: dict[str, bytes] = {}
        self._lock = threading.Lock()

    def update(self, snapshot: MetricsSnapshot) -> None:
        with self._lock:
            self._latest[snapshot.replica] = snapshot.text

    @property
    def replicas(self) -> tuple[str, ...]:
        """The replicas that reported, in the order of their ids."""
        with self._lock:
            return tuple(sorted(self._latest))

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            latest = sorted(self._latest.items())
        families: dict[str, Metric] = {}
        for replica, text in latest:
            for family in text_string_to_metric_families(text.decode("utf-8")):
                if family.name in INGRESS_FAMILIES:
                    continue
                merged = families.get(family.name)
                if merged is None:
                    merged = families[family.name] = Metric(family.name, family.documentation, family.type,
                                                            family.unit)
                for sample in family.samples:
                    merged.add_sample(sample.name, {**sample.labels, "replica": replica}, sample.value,
                                      sample.timestamp, sample.exemplar)
        yield from families.values()
