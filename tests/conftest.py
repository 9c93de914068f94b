"""Shared fixtures: the devices this machine has, each with its kernels loaded, and why the others are missing; the
tiny model and SmolLM2 in the private cache; and, for a run of the whole suite, its builds in the background."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest
from logitproc import cpu_threads, torch_guard

# Everything a run writes lives in one private folder of the system's temporary directory, removed when the run ends
# (kept, and named, when it fails: its server logs and screenshots are the diagnosis): the build cache (never the
# user's, whatever $LOGITPROC_CACHE says) and the temporary files of the tests and their subprocesses (pytest's
# tmp_path, the cache locks). ``$LOGITPROC_TEST_CACHE`` names a build cache to reuse between runs instead (every build
# is keyed by its sources, so reuse is safe).
RUN_FOLDER = tempfile.mkdtemp(prefix="logitproc-test-run-")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # as the logitproc command sets it, and:
torch_guard.install()  # TVM imported without torch (seconds saved in each test process)
cpu_threads.configure()  # TVM's pool one thread per physical core, whatever a test runs first
os.environ["TMPDIR"] = tempfile.tempdir = os.path.join(RUN_FOLDER, "tmp")
os.mkdir(tempfile.tempdir)
os.environ["LOGITPROC_CACHE"] = os.environ.get("LOGITPROC_TEST_CACHE") or os.path.join(RUN_FOLDER, "cache")
os.makedirs(os.environ["LOGITPROC_CACHE"], exist_ok=True)

MATRIX_DEVICES = ("cpu", "vulkan", "cuda")
_unavailable: dict[str, str] = {}
#: A session that collects at least this many test modules (the whole suite) compiles its builds in the background
#: (``prebuild.py``); ``LOGITPROC_TEST_PREBUILD=1`` / ``0`` forces it on / off.
PREBUILD_MIN_MODULES = 20
_prebuild: subprocess.Popen | None = None


def pytest_collection_finish(session) -> None:
    """Start ``prebuild.py`` for a session of the whole suite (its log: ``prebuild.log`` in the run's folder)."""
    global _prebuild
    wanted = os.environ.get("LOGITPROC_TEST_PREBUILD")
    modules = {item.path for item in session.items}
    if wanted == "0" or (wanted != "1" and len(modules) < PREBUILD_MIN_MODULES) or session.config.option.collectonly:
        return
    log = open(os.path.join(RUN_FOLDER, "prebuild.log"), "w")  # noqa: SIM115 (the child's)
    _prebuild = subprocess.Popen([sys.executable, os.path.join(os.path.dirname(__file__), "prebuild.py")],
                                 stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ),
                                 start_new_session=True)
    log.close()


def pytest_sessionfinish(session, exitstatus) -> None:
    """The background builds end with the session; so does the run's private folder, unless a test failed."""
    if _prebuild is not None and _prebuild.poll() is None:
        os.killpg(_prebuild.pid, signal.SIGTERM)  # its group: a build it runs as a command ends with it
        _prebuild.wait(timeout=30)
    if exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED):
        shutil.rmtree(RUN_FOLDER, ignore_errors=True)


#: ``$LOGITPROC_TEST_RECORD_SKIPS`` names a file to which a run appends the node id of each test it skips (and of each
#: test module skipped whole at import), one per line: CI's second pass, with the optional engines installed, runs
#: only those (``.ci/run``) instead of those files again in full.
RECORD_SKIPS = "LOGITPROC_TEST_RECORD_SKIPS"


def _record_skip(nodeid: str) -> None:
    path = os.environ.get(RECORD_SKIPS)
    if path:
        with open(path, "a", encoding="utf-8") as out:
            out.write(nodeid + "\n")


def pytest_runtest_logreport(report) -> None:
    if report.skipped:
        _record_skip(report.nodeid)


def pytest_collectreport(report) -> None:
    if report.skipped:
        _record_skip(report.nodeid)


@pytest.fixture(scope="session")
def device_kernels():
    """kind -> (Device, kernels) for every matrix device; None where the device is missing (reason recorded)."""
    from kernel_harness import open_device

    opened = {}
    for kind in MATRIX_DEVICES:
        opened[kind], reason = open_device(kind)
        if opened[kind] is None:
            _unavailable[kind] = reason
    return opened


@pytest.fixture(scope="session")
def lib():
    """The kernel library for this CPU (built once per session into the private cache; the kernel tests'
    ``run_cpu`` calls the same build)."""
    from kernel_harness import cpu_library

    return cpu_library()


@pytest.fixture(scope="module")
def proc(lib, request):
    """A LogitProcessor over the test module's vocabulary size ``V``."""
    from logitproc import LogitProcessor

    return LogitProcessor(lib, vocab_size=request.module.V, max_num_token=64)


@pytest.fixture(scope="module")
def sampler(lib, request):
    """A Sampler over the test module's vocabulary size ``V``."""
    from logitproc import Sampler

    return Sampler(lib, vocab_size=request.module.V, max_num_token=64)


@pytest.fixture(scope="session")
def tiny_model_compiled_by_cli() -> subprocess.CompletedProcess:
    """The tiny model compiled once per session by ``logitproc compile --model tiny`` in a subprocess, into the private
    cache where every later subprocess finds it; the finished process (its stderr shows a fresh build's progress,
    unless an earlier test had built the model already). In a session with background builds (``prebuild.py``),
    their run of the command, which is their first build."""
    from prebuild import CLI_COMPILE_TINY, cli_record

    while _prebuild is not None and _prebuild.poll() is None and not cli_record().is_file():
        time.sleep(0.5)  # the session's background builds run this command first
    if cli_record().is_file():
        done = subprocess.CompletedProcess(CLI_COMPILE_TINY, **json.loads(cli_record().read_text()))
    else:
        done = subprocess.run(CLI_COMPILE_TINY, capture_output=True, text=True, timeout=900, env=dict(os.environ))
    assert done.returncode == 0, done.stderr
    return done


@pytest.fixture(scope="session")
def tiny_compiled(tiny_model_compiled_by_cli):
    """The tiny model opened in this process (a cache hit after ``tiny_model_compiled_by_cli``)."""
    from logitproc.serve.cli_options import open_model

    return open_model("tiny", "cpu")


@pytest.fixture(scope="session")
def default_model_in_cache():
    """The default model ("default": SmolLM2), compiled once into the private cache so that subprocesses find it.

    With ``$LOGITPROC_TEST_MODEL_CACHE`` (a cache root that keeps the GGUF between sessions) its verified file is
    linked into the private cache instead of being downloaded again.
    """
    from logitproc.compile.model_fetch import fetch_default_model, models_dir
    from logitproc.serve.cli_options import open_model

    kept = os.environ.get("LOGITPROC_TEST_MODEL_CACHE")
    if kept:
        source = fetch_default_model(kept)
        target = models_dir() / source.name
        target.parent.mkdir(parents=True, exist_ok=True)
        if not target.exists():
            try:  # a hard link keeps the inode, so the verification sidecar still matches
                os.link(source, target)
                os.link(f"{source}.verified.json", f"{target}.verified.json")
            except OSError:  # another file system: a copy, verified again (hashed) when first used
                shutil.copyfile(source, target)
    return open_model("default", "cpu")


def pytest_terminal_summary(terminalreporter, exitstatus) -> None:
    """No silent skips: say which devices the matrix could not run on, and why; name the kept folder of a failed run."""
    if exitstatus not in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED):
        terminalreporter.write_line(f"this run's logs, screenshots and builds are kept in {RUN_FOLDER}")
    for kind, reason in _unavailable.items():
        terminalreporter.write_line(f"device matrix: {kind} not run: {reason}")
