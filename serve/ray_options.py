"""The ``logitproc serve`` options that put the server on Ray Serve (``--replicas``, ``--ray-address``, ...).

argparse only: these options are read and checked without importing Ray, which loads only when they are used
(``ray_command.py``).
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass
from typing import Any

#: ``--routing`` choices: the prefix-affinity router (``ray_router.py``) or Ray Serve's default power-of-two-choices.
ROUTING_CHOICES = ("prefix", "pow2")
#: Ray Serve's own delays before it scales up / down (seconds): ``--autoscale-delays``' default.
DEFAULT_DELAYS = (30.0, 600.0)
#: ``--ray-stream-interval``: how often (at most) a replica sends a request's deltas to the ingress, in milliseconds
#: (``ray_stream.py``), its default and its bounds; the default comes from scripts/bench_serve.py --ray
#: (docs/server.md).
DEFAULT_STREAM_INTERVAL_MS = 0.0
MAX_STREAM_INTERVAL_MS = 1000.0


@dataclass(frozen=True)
class ReplicaPlan:
    """How many engine replicas, with how many CPU threads each; autoscaling between ``minimum`` and ``maximum``
    on queue depth when ``autoscale`` (``target_ongoing`` requests per replica, after the load has called for it
    ``upscale_delay`` / ``downscale_delay`` seconds), else a fixed ``initial``; each replica sends a request's
    deltas at most every ``stream_interval_s`` seconds."""

    initial: int
    minimum: int
    maximum: int
    threads: int
    autoscale: bool
    target_ongoing: float
    upscale_delay: float = DEFAULT_DELAYS[0]
    downscale_delay: float = DEFAULT_DELAYS[1]
    stream_interval_s: float = DEFAULT_STREAM_INTERVAL_MS / 1000

    @property
    def wanted(self) -> int:
        """The replicas below which ``/health`` says degraded: the fixed count, or the autoscaling minimum."""
        return self.minimum


def add_ray_arguments(parser: Any) -> None:
    group = parser.add_argument_group("replicas on Ray Serve (the `ray` extra; docs/server.md)")
    group.add_argument("--replicas", type=int, default=None, metavar="N",
                       help="serve with N engine replicas behind a Ray Serve ingress, each with its own model load "
                            "and KV cache (default: one engine in this process, without Ray)")
    group.add_argument("--replica-threads", type=int, default=None, metavar="T",
                       help="CPU threads (and Ray CPUs) of each replica (default: the physical cores / replicas)")
    group.add_argument("--ray-address", default=None, metavar="ADDR",
                       help="join this Ray cluster (`ray start --head` printed it, e.g. 10.0.0.1:6379) (default: "
                            "start a local Ray instance, stopped with the command)")
    group.add_argument("--ray-dashboard", type=int, default=None, metavar="PORT",
                       help="start the local Ray instance's dashboard on --host:PORT (its Serve page shows the "
                            "deployments and replicas) (default: no dashboard; a cluster's comes with its head node)")
    group.add_argument("--autoscale", default=None, metavar="MIN:MAX",
                       help="scale the replicas between MIN >= 1 and MAX on queue depth (default: a fixed --replicas)")
    group.add_argument("--target-ongoing-requests", type=float, default=None, metavar="R",
                       help="with --autoscale: requests per replica (running and waiting) the autoscaler aims at "
                            "(default: --max-batch)")
    group.add_argument("--autoscale-delays", default=None, metavar="UP:DOWN",
                       help="with --autoscale: seconds the load must call for more (UP) or fewer (DOWN) replicas "
                            "before Ray Serve scales (default: Ray's 30:600)")
    group.add_argument("--ray-stream-interval", type=float, default=None, metavar="MS",
                       help="each replica sends a request's tokens to the ingress at most every MS milliseconds, "
                            "what came meanwhile in one message (the end of an answer at once); fewer, longer "
                            f"messages cost Ray less CPU per token (0 to {MAX_STREAM_INTERVAL_MS:g}; default: "
                            f"{DEFAULT_STREAM_INTERVAL_MS:g}: each step's tokens at once)")
    group.add_argument("--routing", choices=ROUTING_CHOICES, default="prefix",
                       help="replica choice: prefix (a request goes to the replica holding the longest prefix of its "
                            "prompt, load permitting) or pow2 (Ray's power of two choices) (default: %(default)s)")


def uses_ray(args: argparse.Namespace) -> bool:
    """Whether the command serves through Ray (``--replicas`` or ``--autoscale``)."""
    return args.replicas is not None or args.autoscale is not None


def check_ray_arguments(args: argparse.Namespace) -> None:
    """ValueError naming the option for a bad or contradictory value (before anything loads)."""
    ray_only = (("--ray-address", args.ray_address), ("--replica-threads", args.replica_threads),
                ("--target-ongoing-requests", args.target_ongoing_requests),
                ("--autoscale-delays", args.autoscale_delays), ("--ray-dashboard", args.ray_dashboard),
                ("--ray-stream-interval", args.ray_stream_interval))
    if not uses_ray(args):
        for option, value in ray_only:
            if value is not None:
                raise ValueError(f"{option} serves through Ray: give --replicas N or --autoscale MIN:MAX too")
        if args.routing != "prefix":
            raise ValueError("--routing chooses among Ray replicas: give --replicas N or --autoscale MIN:MAX too")
        return
    if args.ray_dashboard is not None:
        if args.ray_address is not None:
            raise ValueError("--ray-dashboard starts the dashboard of a local Ray instance; with --ray-address the "
                             "cluster's dashboard comes with its head node (`ray start --head --include-dashboard="
                             "true`)")
        if not 0 < args.ray_dashboard < 65536:
            raise ValueError(f"--ray-dashboard takes a TCP port (1-65535), got {args.ray_dashboard}")
    replica_plan(args, cores=1)


def replica_plan(args: argparse.Namespace, cores: int) -> ReplicaPlan:
    """The ReplicaPlan of the options; ``cores``: the physical cores the default thread count divides."""
    if args.replicas is not None and args.replicas < 1:
        raise ValueError(f"--replicas must be >= 1, got {args.replicas}")
    if args.replica_threads is not None and args.replica_threads < 1:
        raise ValueError(f"--replica-threads must be >= 1, got {args.replica_threads}")
    if args.autoscale is None:
        if args.target_ongoing_requests is not None:
            raise ValueError("--target-ongoing-requests sets the autoscaler's target: give --autoscale MIN:MAX too")
        if args.autoscale_delays is not None:
            raise ValueError("--autoscale-delays sets the autoscaler's delays: give --autoscale MIN:MAX too")
        count = args.replicas
        threads = args.replica_threads or max(1, cores // count)
        return ReplicaPlan(count, count, count, threads, False, 0.0, stream_interval_s=_stream_interval(args))
    found = re.fullmatch(r"(\d+):(\d+)", args.autoscale.strip())
    if found is None:
        raise ValueError(f"--autoscale takes MIN:MAX (two integers, e.g. 1:4), got {args.autoscale!r}")
    low, high = int(found[1]), int(found[2])
    if low < 1:
        raise ValueError(f"--autoscale: MIN must be >= 1 (a replica loads its model for minutes: no scaling to "
                         f"zero), got {low}")
    if high < low:
        raise ValueError(f"--autoscale: MAX must be >= MIN, got {args.autoscale!r}")
    initial = low if args.replicas is None else args.replicas
    if not low <= initial <= high:
        raise ValueError(f"--replicas {initial} (the initial count) must lie within --autoscale {low}:{high}")
    target = args.target_ongoing_requests if args.target_ongoing_requests is not None else float(args.max_batch)
    if not target > 0:
        raise ValueError(f"--target-ongoing-requests must be > 0, got {target}")
    threads = args.replica_threads or max(1, cores // high)
    return ReplicaPlan(initial, low, high, threads, True, target, *_delays(args.autoscale_delays),
                       stream_interval_s=_stream_interval(args))


def _stream_interval(args: argparse.Namespace) -> float:
    """``--ray-stream-interval MS`` in seconds (the default without it)."""
    interval = args.ray_stream_interval
    if interval is None:
        return DEFAULT_STREAM_INTERVAL_MS / 1000
    if not 0 <= interval <= MAX_STREAM_INTERVAL_MS:  # (NaN too)
        raise ValueError(f"--ray-stream-interval takes milliseconds from 0 to {MAX_STREAM_INTERVAL_MS:g}, got "
                         f"{interval:g}")
    return interval / 1000


def _delays(option: str | None) -> tuple[float, float]:
    """``--autoscale-delays UP:DOWN`` in seconds (Ray's defaults without it)."""
    if option is None:
        return DEFAULT_DELAYS
    found = re.fullmatch(r"(\d+(?:\.\d*)?):(\d+(?:\.\d*)?)", option.strip())
    if found is None:
        raise ValueError(f"--autoscale-delays takes UP:DOWN (two numbers of seconds >= 0, e.g. 30:600), got "
                         f"{option!r}")
    return float(found[1]), float(found[2])
