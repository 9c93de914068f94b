"""The Ray Serve application of ``logitproc serve --replicas``: an ingress deployment over engine replicas.

``Ingress`` serves the same OpenAI app as the single-process server (``http_server.Server``: every endpoint, the
chat page, errors, the API key, limits and request policy), with a ``RayEngineClient`` in place of the in-process
``EngineLoop``; its ``/metrics`` adds the replicas' metrics (``ray_metrics.py``; the replicas send them to its
``report`` method). ``EngineReplica`` deployments (``ray_replica.py``) each own one engine and reserve ``threads``
CPUs; requests reach them through a ``PrefixAffinityRouter`` (``ray_router.py``) or Ray's power-of-two-choices
router.
"""

from __future__ import annotations

import argparse
from typing import Any

from ray import serve
from ray.serve.handle import DeploymentHandle

from .http_server import AsgiHost, Server, ServerOptions
from .ray_client import RayEngineClient
from .ray_logging import log_to_stderr
from .ray_messages import MetricsSnapshot, ModelFacts, ReplicaLeft
from .ray_metrics import ReplicaMetrics
from .ray_options import ReplicaPlan
from .ray_proxy_guard import CALLBACK_ENV, CALLBACK_IMPORT_PATH
from .ray_replica import EngineReplica
from .server_metrics import ServerMetrics

#: The application's name in Ray Serve (``serve status``), and its engine deployment's.
APP_NAME = "logitproc"
REPLICA_DEPLOYMENT = "EngineReplica"
INGRESS_DEPLOYMENT = "Ingress"
#: Requests one ingress replica holds at once (streams included); each engine replica bounds its own queue.
INGRESS_MAX_ONGOING = 10_000
#: Ray Serve settings of the replicas' processes: the deployments' code on the replica's own event loop (no extra
#: thread hop per call, per streamed item), and calls between deployments (the ingress's streams from the engine
#: replicas) over Ray Serve's gRPC transport rather than Ray's object-returning actor calls, whose every streamed
#: item goes through a thread pool and the object store's ownership protocol (measured with
#: scripts/bench_serve.py --ray: the CPU per streamed token of the ingress and the replica, docs/benchmarks.md).
SERVE_ENV = {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0", "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0",
             "RAY_SERVE_USE_GRPC_BY_DEFAULT": "1"}
#: The same for Ray Serve's HTTP proxy (its calls to the ingress over gRPC, its router on its own event loop rather
#: than a thread of its own, which cost a cross-thread hop per streamed item), and the proxy's header guard
#: (``ray_proxy_guard.py``): read by the proxy's process, which the Serve controller starts with its node's
#: environment (a local instance: this command's; a cluster: `ray start`'s).
PROXY_ENV = {"RAY_SERVE_PROXY_USE_GRPC": "1", "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0",
             CALLBACK_ENV: CALLBACK_IMPORT_PATH}
#: A local instance's background work, which competes with the engines for the CPUs: the Serve controller's loop
#: every 0.5 s instead of 0.1 s, Ray Serve's own metrics exported every 2 s instead of 0.1 s (measured idle, the
#: tiny model on 1 replica: 12% of a core -> 8%).
LOCAL_ENV = {"RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.5", "RAY_SERVE_METRICS_EXPORT_INTERVAL_MS": "2000"}
#: How often Ray checks a replica's health (seconds), and how long a check may take.
HEALTH_CHECK_PERIOD_S = 2.0
HEALTH_CHECK_TIMEOUT_S = 30.0


@serve.ingress()
class Ingress:
    """The OpenAI app over the engine replicas (``replicas``), with ``options`` as the single-process server's."""

    def __init__(self, replicas: DeploymentHandle, options: ServerOptions, wanted: int) -> None:
        log_to_stderr()
        self._options = options
        self._metrics = ServerMetrics(engine=False)
        self._replica_metrics = ReplicaMetrics()
        self._metrics.registry.register(self._replica_metrics)
        self._client = RayEngineClient(replicas, APP_NAME, REPLICA_DEPLOYMENT, wanted, self._replica_metrics,
                                       self._model_known)

    async def report(self, message: MetricsSnapshot | ReplicaLeft) -> None:  # (async: on the event loop)
        """An engine replica's metrics (periodic, from the moment it is up), or its leaving (``ray_metrics.py``)."""
        self._replica_metrics.update(message)

    def _model_known(self, facts: ModelFacts) -> None:
        self._options.sampling_defaults = dict(facts.sampling_defaults)

    def __serve_build_asgi_app__(self) -> Any:
        return Server(None, self._options, client=self._client, metrics=self._metrics,
                      host=AsgiHost.RAY_SERVE).app


def build_application(args: argparse.Namespace, plan: ReplicaPlan, options: ServerOptions) -> Any:
    """The bound application: ``Ingress`` over ``plan``'s ``EngineReplica`` deployment."""
    engine_options: dict[str, Any] = {
        "name": REPLICA_DEPLOYMENT,
        "ray_actor_options": {"num_cpus": plan.threads, "runtime_env": {"env_vars": SERVE_ENV}},
        # the replica's own queue answers 429 (--max-queue): Ray never holds a request back for it
        "max_ongoing_requests": args.max_batch + args.max_queue,
        "health_check_period_s": HEALTH_CHECK_PERIOD_S,
        "health_check_timeout_s": HEALTH_CHECK_TIMEOUT_S,
        "graceful_shutdown_timeout_s": args.drain_timeout,
        "max_constructor_retry_count": 1,  # a model that cannot load fails the command instead of looping
    }
    if plan.autoscale:
        engine_options["autoscaling_config"] = {
            "min_replicas": plan.minimum, "max_replicas": plan.maximum, "initial_replicas": plan.initial,
            "target_ongoing_requests": plan.target_ongoing, "upscale_delay_s": plan.upscale_delay,
            "downscale_delay_s": plan.downscale_delay}
    else:
        engine_options["num_replicas"] = plan.initial
    if args.routing == "prefix":
        engine_options["request_router_config"] = {
            "request_router_class": "logitproc.serve.ray_router.PrefixAffinityRouter"}
    engine = serve.deployment(EngineReplica).options(**engine_options)
    ingress = serve.deployment(Ingress).options(
        name=INGRESS_DEPLOYMENT, ray_actor_options={"num_cpus": 0, "runtime_env": {"env_vars": SERVE_ENV}},
        max_ongoing_requests=INGRESS_MAX_ONGOING,
        graceful_shutdown_timeout_s=args.drain_timeout)
    engines = engine.bind(args, plan.threads, INGRESS_DEPLOYMENT, plan.stream_interval_s)
    return ingress.bind(engines, options, plan.wanted)
