"""``logitproc serve --replicas N`` / ``--autoscale MIN:MAX``: the server as a Ray Serve application.

Without ``--ray-address`` a local Ray instance is started (its CPUs: enough for the replicas' threads; no
dashboard; its workers at the command's CPU priority) and stopped with the command; with it, the command joins that
cluster, deploys the application there and deletes it on exit (the cluster and its Serve instance stay). Ray
Serve's HTTP proxy listens on ``--host:--port``. The command returns once the application runs (every replica has
loaded its model), prints the URL, then waits: SIGTERM stops it (exit 0) after Ray Serve has let running requests
finish for up to ``--drain-timeout`` seconds; Ctrl-C does the same and exits 130 (``cli.main``).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time
import urllib.error
import urllib.request

from ..cpu_threads import physical_cores
from .cli_options import log
from .ray_options import replica_plan

#: How long the command waits for Ray Serve's HTTP proxy to answer once the application runs (seconds).
PROXY_WAIT_SECONDS = 30.0
#: Ray's object store for a local instance (bytes): requests and deltas are small.
OBJECT_STORE_BYTES = 200 * 1024 * 1024


def _proxy_answers(url: str, timeout: float) -> bool:
    """Whether an HTTP server answers ``url`` (any status) within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=5):
                return True
        except urllib.error.HTTPError:
            return True
        except OSError:
            time.sleep(0.5)
    return False


def _proxy_guarded(url: str) -> bool:
    """Whether Ray Serve's proxy at ``url`` runs ``ray_proxy_guard.ProxyHeaderGuard`` (it refuses a request that
    asks to run on after its client left)."""
    request = urllib.request.Request(f"{url}/health", headers={"x-request-disconnect-disabled": "?1"})
    try:
        with urllib.request.urlopen(request, timeout=10):
            return False
    except urllib.error.HTTPError as err:
        return err.code == 400
    except OSError:
        return False


def serve_on_ray(args: argparse.Namespace) -> int:
    """Run the command (see the module doc)."""
    import ray
    from ray import serve

    from .ray_app import APP_NAME, LOCAL_ENV, PROXY_ENV, build_application
    from .ray_proxy_guard import CALLBACK_ENV, CALLBACK_IMPORT_PATH
    from .server_cli import server_options

    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    plan = replica_plan(args, physical_cores())
    local = args.ray_address is None
    if local:
        # Ray lowers its workers' CPU priority (worker_niceness) below the raylet's; here the replicas are the
        # workload, as the engine is in the single-process server: they keep the command's priority.
        os.environ.setdefault("RAY_worker_niceness", "0")
        for name, value in {**PROXY_ENV, **LOCAL_ENV}.items():  # (inherited by the instance's processes)
            os.environ.setdefault(name, value)
        cpus = max(physical_cores(), plan.maximum * plan.threads)
        # address="local": a new instance even where `ray start` once ran here (ray.init() alone would join the
        # cluster named in /tmp/ray/ray_current_cluster or $RAY_ADDRESS)
        dashboard = args.ray_dashboard is not None
        ray.init(address="local", num_cpus=cpus, include_dashboard=dashboard, dashboard_host=args.host,
                 dashboard_port=args.ray_dashboard if dashboard else None, object_store_memory=OBJECT_STORE_BYTES,
                 logging_level=logging.WARNING, log_to_driver=True)
        log(f"ray: started a local instance ({cpus} CPUs)"
            + (f"; its dashboard at http://{args.host}:{args.ray_dashboard}" if dashboard else ""))
    else:
        try:
            ray.init(address=args.ray_address, logging_level=logging.WARNING)
        except (ConnectionError, RuntimeError) as err:
            raise RuntimeError(f"cannot join the Ray cluster at --ray-address {args.ray_address}: {err} (with "
                               "token authentication, set RAY_AUTH_MODE=token and the cluster's token: "
                               "docs/server.md)") from None
        log(f"ray: joined the cluster at {args.ray_address}")
    url = f"http://{args.host}:{args.port}"
    stop = threading.Event()
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: stop.set())
    try:
        # (the proxies' and the controller's log at WARNING, as the app's: no line for each client that disconnects)
        serve.start(http_options={"host": args.host, "port": args.port},
                    logging_config={"log_level": "WARNING", "enable_access_log": False})
        scaling = (f"autoscaling {plan.minimum}..{plan.maximum} (up after {plan.upscale_delay:g} s, down after "
                   f"{plan.downscale_delay:g} s)" if plan.autoscale else f"{plan.initial}")
        log(f"deploying {scaling} replica(s) of {plan.threads} thread(s) each, routing: {args.routing} "
            "(each replica loads the model; the first use compiles it)")
        try:
            serve.run(build_application(args, plan, server_options(args)), name=APP_NAME, route_prefix="/",
                      logging_config={"log_level": "WARNING", "enable_access_log": False})
        except RuntimeError as err:
            raise RuntimeError(f"the replicas did not start: {err}") from None
        if not _proxy_answers(f"{url}/health", PROXY_WAIT_SECONDS):
            raise RuntimeError(f"Ray Serve's HTTP proxy does not answer at {url} (a Serve instance already "
                               "running on the cluster keeps its own host and port)")
        if not _proxy_guarded(url):
            log(f"warning: Ray Serve's HTTP proxy at {url} runs without logitproc's header guard (export "
                f"{CALLBACK_ENV}={CALLBACK_IMPORT_PATH} before `ray start` on each node: docs/server.md); a "
                "request header that is not UTF-8 gets a 500 from the proxy")
        log(f"ready: serving at {url}/v1 through Ray Serve")
        while not stop.wait(0.5):
            pass
        log("stopped (SIGTERM)")
        return 0
    finally:
        signal.signal(signal.SIGTERM, previous)
        try:
            if local:
                serve.shutdown()
            else:
                serve.delete(APP_NAME)
        finally:
            ray.shutdown()
