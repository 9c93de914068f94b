"""TVM's CPU thread pool gets one thread per physical core (TVM alone assumes two hardware threads per x86 core)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from logitproc import cpu_threads


def _topology(root: Path, siblings: dict[int, str]) -> Path:
    for cpu, text in siblings.items():
        folder = root / f"cpu{cpu}" / "topology"
        folder.mkdir(parents=True)
        (folder / "thread_siblings_list").write_text(text + "\n")
    return root


def test_one_thread_per_core_when_cores_have_one_hardware_thread(tmp_path: Path) -> None:
    sysfs = _topology(tmp_path, {0: "0", 1: "1"})
    assert cpu_threads.physical_cores({0, 1}, sysfs) == 2


def test_hardware_threads_of_one_core_count_once(tmp_path: Path) -> None:
    sysfs = _topology(tmp_path, {0: "0,2", 1: "1,3", 2: "0,2", 3: "1,3"})
    assert cpu_threads.physical_cores({0, 1, 2, 3}, sysfs) == 2
    assert cpu_threads.physical_cores({0, 2}, sysfs) == 1  # an affinity mask of one core's two threads


def test_without_topology_every_cpu_counts(tmp_path: Path) -> None:
    assert cpu_threads.physical_cores({0, 1, 2}, tmp_path) == 3


def test_the_user_setting_wins() -> None:
    env = {"TVM_NUM_THREADS": "5"}
    assert cpu_threads.configure(env) == 5 and env == {"TVM_NUM_THREADS": "5"}
    env = {"OMP_NUM_THREADS": "3"}
    assert cpu_threads.configure(env) == 3 and "TVM_NUM_THREADS" not in env


def test_unset_gets_the_physical_cores() -> None:
    env: dict[str, str] = {}
    assert cpu_threads.configure(env) == cpu_threads.physical_cores()
    assert env["TVM_NUM_THREADS"] == str(cpu_threads.physical_cores())


def test_importing_logitproc_sizes_tvms_pool() -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("TVM_NUM_THREADS", "OMP_NUM_THREADS")}
    code = "import logitproc, tvm; print(tvm.get_global_func('runtime.NumThreads')())"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert int(out.stdout.strip()) == cpu_threads.physical_cores()
