"""What the benchmark scripts share: their process set up as the ``logitproc`` command's, timing and a description of
the machine."""

from __future__ import annotations

import os
import platform
import statistics
import time
from collections.abc import Callable

import numpy as np
from logitproc import cpu_threads, torch_guard

# Importing logitproc sets nothing up; a benchmark's process is the command's (``__main__.py``): TVM imported without
# torch, its thread pool one thread per physical core (unless TVM_NUM_THREADS says otherwise).
torch_guard.install()
cpu_threads.configure()
import tvm  # noqa: E402


def median_us(fn: Callable[[], object], repeat: int) -> float:
    """Median wall time of ``fn`` in microseconds over ``repeat`` calls, after one warm-up call."""
    fn()
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1e6


def machine_line() -> str:
    """CPU model, cores, TVM threads and library versions, for the header of a benchmark table."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    try:
        import torch

        torch_version = torch.__version__
    except ImportError:
        torch_version = "not installed"
    threads = tvm.get_global_func("runtime.NumThreads")()
    return (f"{cpu}, {os.cpu_count()} cores, TVM threads {threads}, TVM {tvm.__version__}, numpy {np.__version__}, "
            f"torch {torch_version}")
