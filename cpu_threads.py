"""How many threads TVM's CPU thread pool gets: one per physical core, set before the pool starts.

TVM sizes its pool from ``TVM_NUM_THREADS`` (or ``OMP_NUM_THREADS``), else from ``hardware_concurrency() / 2`` on x86,
on the assumption that every core runs two hardware threads. Where that is false (virtual machines and cloud
instances that expose one thread per core, like this project's 2-core machines), TVM uses half the cores: every
kernel and the whole model ran on one of two cores. ``configure()`` sets ``TVM_NUM_THREADS`` to the number of
physical cores this process may run on, counted from the kernel's topology files, unless the user set either
variable.

When it runs: importing ``logitproc`` sets nothing. The ``logitproc`` command calls ``configure()`` as it starts
(``__main__.py``); a library user's process calls it when it opens its first kernel library or compiled model
(``KernelLibrary.runtime_module``; an Engine opens one) or asks ``Device.available()`` for the CPU's threads. The
variable has to be set, and stay set, before a kernel runs: TVM 0.27 keeps one pool per calling thread, made at that
thread's first parallel kernel (or ``runtime.NumThreads`` call) from the variable as it is then, and its
``runtime.config_threadpool`` only ever lowers a pool's size, never raises it (measured: a pool made with one thread
stays at one after ``config_threadpool(1, 2)``; a thread that starts its pool after the variable was removed gets one).
A pool some code started before (a kernel compiled and run with TVM directly) keeps its size.
"""

from __future__ import annotations

import os
from pathlib import Path

_SYSFS = Path("/sys/devices/system/cpu")


def allowed_cpus() -> set[int]:
    """The logical CPUs this process may run on."""
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return set(range(os.cpu_count() or 1))


def physical_cores(cpus: set[int] | None = None, sysfs: Path = _SYSFS) -> int:
    """Physical cores among ``cpus`` (default: ``allowed_cpus()``): logical CPUs that share a core (its
    ``thread_siblings_list``) count once. Without topology files, every logical CPU counts as a core."""
    cpus = allowed_cpus() if cpus is None else cpus
    cores = set()
    for cpu in cpus:
        try:
            cores.add((sysfs / f"cpu{cpu}" / "topology" / "thread_siblings_list").read_text().strip())
        except OSError:
            return max(1, len(cpus))
    return max(1, len(cores))


def configure(environ: dict[str, str] | None = None) -> int:
    """Set ``TVM_NUM_THREADS`` to ``physical_cores()`` unless ``TVM_NUM_THREADS`` or ``OMP_NUM_THREADS`` is set;
    return the thread count TVM will use."""
    env = os.environ if environ is None else environ
    for name in ("TVM_NUM_THREADS", "OMP_NUM_THREADS"):
        if env.get(name, "").strip():
            try:
                return max(1, int(env[name]))
            except ValueError:
                return 1  # TVM's atoi reads garbage as 0 and clamps it to 1 worker
    env["TVM_NUM_THREADS"] = str(physical_cores())
    return int(env["TVM_NUM_THREADS"])
