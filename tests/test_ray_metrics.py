"""The Ray ingress's view of its replicas' metrics (``serve/ray_metrics.py``), without Ray: every replica that
reported is listed with a ``replica`` label (zeros included), a replica that left or stopped reporting is dropped,
and a snapshot still on its way from a replica that left does not bring it back."""

from __future__ import annotations

import pytest
from logitproc.serve.ray_messages import MetricsSnapshot, ReplicaLeft
from logitproc.serve.ray_metrics import ReplicaMetrics
from logitproc.serve.server_metrics import ServerMetrics
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def snapshot(replica: str, generated: int = 0, http: bool = False) -> MetricsSnapshot:
    """A replica's Prometheus text as ``EngineReplica`` sends it (``generated`` tokens counted)."""
    metrics = ServerMetrics()
    metrics.generation_tokens.inc(generated)
    metrics.kv_capacity.set(4096)
    if http:
        metrics.response("/v1/models", 200)
    return MetricsSnapshot(replica, generate_latest(metrics.registry))


def exposed(collector: ReplicaMetrics) -> dict[tuple[str, str], float]:
    """(sample name, replica) -> value of the ingress's exposition."""
    registry = CollectorRegistry()
    registry.register(collector)
    samples = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in family.samples:
            samples[(s.name, s.labels["replica"])] = s.value
    return samples


def test_a_replica_is_listed_with_zeros_from_its_first_report() -> None:
    metrics = ReplicaMetrics(clock=Clock())
    assert metrics.replicas == () and exposed(metrics) == {}
    metrics.update(snapshot("b"))
    metrics.update(snapshot("a", generated=7))
    assert metrics.replicas == ("a", "b")
    samples = exposed(metrics)
    assert samples[("logitproc_generation_tokens_total", "b")] == 0
    assert samples[("logitproc_generation_tokens_total", "a")] == 7
    assert samples[("logitproc_kv_cache_capacity_tokens", "b")] == 4096


def test_the_latest_snapshot_of_a_replica_replaces_its_earlier_one() -> None:
    metrics = ReplicaMetrics(clock=Clock())
    metrics.update(snapshot("a", generated=3))
    metrics.update(snapshot("a", generated=9))
    assert exposed(metrics)[("logitproc_generation_tokens_total", "a")] == 9


def test_the_ingress_families_are_not_taken_from_replicas() -> None:
    metrics = ReplicaMetrics(clock=Clock())
    metrics.update(snapshot("a", http=True))
    assert not any(name.startswith("logitproc_http_responses") for name, _ in exposed(metrics))


def test_a_replica_that_left_is_dropped_and_stays_dropped() -> None:
    metrics = ReplicaMetrics(clock=Clock())
    metrics.update(snapshot("a"))
    metrics.update(snapshot("b"))
    metrics.update(ReplicaLeft("a"))
    assert metrics.replicas == ("b",)
    metrics.update(snapshot("a", generated=5))  # the end-of-request snapshot of a stream it finished before leaving
    assert metrics.replicas == ("b",)
    assert {replica for _, replica in exposed(metrics)} == {"b"}


def test_a_replica_that_stopped_reporting_is_dropped() -> None:
    clock = Clock()
    metrics = ReplicaMetrics(stale_after=10.0, clock=clock)
    metrics.update(snapshot("dead"))
    metrics.update(snapshot("live"))
    for _ in range(6):  # "live" reports every 2 s, "dead" (its process killed) no more
        clock.now += 2.0
        metrics.update(snapshot("live"))
    assert metrics.replicas == ("live",)
    clock.now += 10.5
    assert metrics.replicas == ()
    metrics.update(snapshot("dead"))  # a replica that comes back (it was only slow) is listed again
    assert metrics.replicas == ("dead",)


def test_a_bad_stale_limit_is_refused() -> None:
    with pytest.raises(ValueError, match="stale_after must be > 0 seconds, got 0"):
        ReplicaMetrics(stale_after=0)
