"""TVM's CPU thread pool gets one thread per physical core (TVM alone assumes two hardware threads per x86 core), in
the command's process and an Engine's, while importing logitproc changes nothing."""

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


def _without_thread_settings() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("TVM_NUM_THREADS", "OMP_NUM_THREADS")}


def _python(code: str) -> list[str]:
    done = subprocess.run([sys.executable, "-c", code], env=_without_thread_settings(), capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


def test_importing_logitproc_sets_no_variable_and_installs_no_import_hook() -> None:
    code = """
import os, sys
environ, hooks = dict(os.environ), list(sys.meta_path)
import logitproc, logitproc.runtime, logitproc.serve, logitproc.serve.engine
from logitproc import GenerationConfig
from logitproc.serve import Engine
added = [type(hook).__module__ for hook in sys.meta_path if hook not in hooks]
print(dict(os.environ) == environ, [module for module in added if module.split(".")[0] == "logitproc"])
"""
    # (TVM's own import adds finders of its modules to sys.meta_path; logitproc adds none)
    assert _python(code) == ["True", "[]"]


def test_the_command_sizes_tvms_pool_as_it_starts() -> None:
    code = """
import sys, threading
sys.argv = ["logitproc", "devices"]
from logitproc.__main__ import run
assert run() == 0
import tvm
threads = tvm.get_global_func("runtime.NumThreads")
other = []
worker = threading.Thread(target=lambda: other.append(threads()))
worker.start(); worker.join()
print(threads(), other[0])
"""
    out = _python(code)
    assert out[-2:] == [str(cpu_threads.physical_cores())] * 2, out


def test_an_engine_sizes_tvms_pool_when_it_opens_its_model(tiny_model_compiled_by_cli) -> None:
    code = """
import os, threading
from logitproc import GenerationConfig
from logitproc.serve import Engine
from logitproc.serve.cli_options import open_model
import tvm
assert "TVM_NUM_THREADS" not in os.environ
engine = Engine(open_model("tiny", "cpu"))
engine.generate("hi", GenerationConfig(max_tokens=2))
threads = tvm.get_global_func("runtime.NumThreads")
other = []
worker = threading.Thread(target=lambda: other.append(threads()))  # a pool made later, on another thread
worker.start(); worker.join()
print(threads(), other[0])
"""
    assert _python(code) == [str(cpu_threads.physical_cores())] * 2
