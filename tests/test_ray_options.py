"""``logitproc serve``'s Ray options, checked without Ray: bad values and combinations refused before anything
loads, the replica plan they give, and the single-process server never importing Ray."""

from __future__ import annotations

import subprocess
import sys

import pytest
from logitproc.serve.cli import build_parser
from logitproc.serve.ray_options import DEFAULT_STREAM_INTERVAL_MS, check_ray_arguments, replica_plan


def parsed(*options: str):
    return build_parser().parse_args(["serve", "--model", "tiny", *options])


@pytest.mark.parametrize(("options", "says"), [
    (("--ray-address", "10.0.0.1:6379"), "--ray-address serves through Ray: give --replicas N"),
    (("--replica-threads", "2"), "--replica-threads serves through Ray"),
    (("--routing", "pow2"), "--routing chooses among Ray replicas"),
    (("--replicas", "0"), "--replicas must be >= 1, got 0"),
    (("--replicas", "2", "--replica-threads", "0"), "--replica-threads must be >= 1, got 0"),
    (("--replicas", "2", "--target-ongoing-requests", "4"), "give --autoscale MIN:MAX too"),
    (("--autoscale", "2"), "--autoscale takes MIN:MAX"),
    (("--autoscale", "0:2"), "MIN must be >= 1"),
    (("--autoscale", "3:2"), "MAX must be >= MIN"),
    (("--autoscale", "1:2", "--replicas", "3"), "must lie within --autoscale 1:2"),
    (("--autoscale", "1:2", "--target-ongoing-requests", "0"), "--target-ongoing-requests must be > 0"),
    (("--autoscale-delays", "5:20"), "--autoscale-delays serves through Ray"),
    (("--ray-dashboard", "8265"), "--ray-dashboard serves through Ray"),
    (("--replicas", "1", "--ray-dashboard", "8265", "--ray-address", "10.0.0.1:6379"),
     "the cluster's dashboard comes with its head node"),
    (("--replicas", "1", "--ray-dashboard", "0"), "--ray-dashboard takes a TCP port (1-65535), got 0"),
    (("--replicas", "2", "--autoscale-delays", "5:20"), "--autoscale-delays sets the autoscaler's delays"),
    (("--autoscale", "1:2", "--autoscale-delays", "5"), "--autoscale-delays takes UP:DOWN"),
    (("--autoscale", "1:2", "--autoscale-delays", "5:soon"), "--autoscale-delays takes UP:DOWN"),
    (("--ray-stream-interval", "20"), "--ray-stream-interval serves through Ray"),
    (("--replicas", "1", "--ray-stream-interval", "-1"), "--ray-stream-interval takes milliseconds from 0 to 1000, "
                                                          "got -1"),
    (("--replicas", "1", "--ray-stream-interval", "1001"), "got 1001"),
    (("--replicas", "1", "--ray-stream-interval", "nan"), "got nan"),
    (("--autoscale", "1:2", "--ray-stream-interval", "inf"), "got inf"),
])
def test_bad_ray_options_are_refused_naming_the_option(options, says) -> None:
    with pytest.raises(ValueError) as err:
        check_ray_arguments(parsed(*options))
    assert says in str(err.value)


def test_the_replica_plan() -> None:
    fixed = replica_plan(parsed("--replicas", "2"), cores=4)
    assert (fixed.initial, fixed.minimum, fixed.maximum, fixed.threads, fixed.autoscale) == (2, 2, 2, 2, False)
    assert replica_plan(parsed("--replicas", "3"), cores=2).threads == 1  # never below one thread
    scaled = replica_plan(parsed("--autoscale", "1:4", "--max-batch", "8"), cores=8)
    assert (scaled.initial, scaled.wanted, scaled.maximum, scaled.threads, scaled.target_ongoing) == (1, 1, 4, 2, 8.0)
    assert (scaled.upscale_delay, scaled.downscale_delay) == (30.0, 600.0)  # Ray Serve's own
    quick = replica_plan(parsed("--autoscale", "1:2", "--autoscale-delays", "2:20.5"), cores=2)
    assert (quick.upscale_delay, quick.downscale_delay) == (2.0, 20.5)
    assert fixed.stream_interval_s == quick.stream_interval_s == DEFAULT_STREAM_INTERVAL_MS / 1000
    assert replica_plan(parsed("--replicas", "1", "--ray-stream-interval", "25"), cores=2).stream_interval_s == 0.025


def test_the_single_process_server_does_not_import_ray() -> None:
    code = ("import sys, logitproc.serve.server_cli, logitproc.serve.http_server, logitproc.serve.cli as c; "
            "c.build_parser().parse_args(['serve']); print(sorted(m for m in sys.modules if m.split('.')[0] == 'ray'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_a_bad_ray_option_exits_2_with_its_message() -> None:
    done = subprocess.run([sys.executable, "-m", "logitproc", "serve", "--autoscale", "0:2"], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2 and "MIN must be >= 1" in done.stderr
