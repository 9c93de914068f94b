"""Compile in the background of a whole test session what its tests will ask for, roughly in the order they ask.

Started by ``conftest.py`` when a session collects most of the test modules, at low priority, into the session's
private cache; it ends with the session. The machine's second core does the builds while the tests (mostly one
thread) run on the first; a test that asks for a build still in progress waits for it (``build_in_cache`` lets one
process build a cache entry at a time) instead of building it again. Every build here is one a test makes anyway,
with the same inputs, so the tests see the same results; a failure here is only logged (the test that asks for the
build then fails with its own error).
"""

from __future__ import annotations

import fnmatch
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from logitproc.runtime.targets import CUDA_ARCHS, ROCM_ARCHS

#: ``logitproc compile --model tiny`` as conftest's ``tiny_model_compiled_by_cli`` runs it
CLI_COMPILE_TINY = [sys.executable, "-m", "logitproc", "compile", "--model", "tiny"]


def cli_record() -> Path:
    """Where the background's run of ``CLI_COMPILE_TINY`` is recorded (its return code, stdout and stderr) for
    ``tiny_model_compiled_by_cli``: the run's temporary folder (conftest's), which a reused build cache outlives."""
    return Path(tempfile.gettempdir()) / "prebuild-compile-tiny.json"


def _cli_tiny() -> None:
    """The CPU kernel library and ``--model tiny``, built by the command line as the session's first test of it does."""
    done = subprocess.run(CLI_COMPILE_TINY, capture_output=True, text=True, timeout=900, env=dict(os.environ))
    staging = cli_record().with_suffix(".part")
    staging.write_text(json.dumps({"returncode": done.returncode, "stdout": done.stdout, "stderr": done.stderr}))
    staging.rename(cli_record())


def _default_model() -> None:
    """SmolLM2 as the session's first test of it fetches and compiles it (``conftest.default_model_in_cache``)."""
    from logitproc.compile.model_compile import compile_model
    from logitproc.compile.model_fetch import FILENAME, fetch_default_model, models_dir, verify_cached

    kept = os.environ.get("LOGITPROC_TEST_MODEL_CACHE")
    if kept and verify_cached(models_dir(kept) / FILENAME):
        compile_model(fetch_default_model(kept))  # the kept file: same name and contents, so the same build
    else:
        compile_model("default")


def _tiny_variant(which: str) -> Callable[[], object]:
    """The build of one of the tiny model's variants, as the tests that use it make it (``tiny_variants``)."""

    def build() -> None:
        import tiny_variants
        from logitproc.compile.model_compile import compile_model
        from logitproc.serve.cli_options import tiny_model

        with tempfile.TemporaryDirectory() as parent:
            if which == "float16 KV":
                compile_model(tiny_model(), **tiny_variants.FLOAT16_KV)
            elif which == "Hugging Face directory":
                compile_model(tiny_variants.write_qwen_tiny(tiny_variants.qwen_tiny(), Path(parent)),
                              **tiny_variants.FLOAT32)
            elif which == "marker tokens":
                compile_model(tiny_variants.write_marker_tiny(Path(parent)))
            elif which == "wide, q8_0 KV":
                compile_model(tiny_variants.wide_tiny(), **tiny_variants.Q8_KV)
            else:
                raise ValueError(f"no tiny variant {which!r}")

    return build


def _kernels(kind: str, arch: str | None = None) -> Callable[[], object]:
    def build() -> None:
        from logitproc.compile import build_kernels

        build_kernels(kind, arch)

    return build


@dataclass(frozen=True)
class Build:
    """One background build and the tests that ask for it: node-id patterns (``fnmatch``) and fixture names; a run
    makes it in the background only when it selected one of them."""

    name: str
    make: Callable[[], object]
    tests: tuple[str, ...] = ()
    fixtures: tuple[str, ...] = ()

    def wanted_by(self, nodeid: str, fixturenames: Iterable[str]) -> bool:
        return (any(fnmatch.fnmatchcase(nodeid, pattern) for pattern in self.tests)
                or not set(self.fixtures).isdisjoint(fixturenames))


#: The builds, roughly in the order the tests ask for them (a file's tests run in the order of the file names).
BUILDS: list[Build] = [
    # the CPU kernels are linked into every model, and the tiny model is most tests' model
    Build("cpu kernels and --model tiny", _cli_tiny, tests=("tests/*",)),
    Build("default model", _default_model, tests=("*smollm2*",),
          fixtures=("default_model_in_cache", "smollm2_path", "smollm2_args")),
    Build("tiny, float16 KV cache", _tiny_variant("float16 KV"), tests=("tests/test_compiled_model.py::*",)),
    Build("tiny Hugging Face directory", _tiny_variant("Hugging Face directory"),
          tests=("tests/test_compiled_model.py::*",)),
    Build("tiny with marker tokens", _tiny_variant("marker tokens"), tests=("tests/test_marker_tokens.py::*",)),
    Build("wide tiny, q8_0 KV cache", _tiny_variant("wide, q8_0 KV"), tests=("tests/test_kv_q8.py::*",)),
    Build("vulkan kernels", _kernels("vulkan"),
          tests=("*vulkan*", "tests/test_library.py::test_cli_compile_kernels_writes_the_library")),
    *[Build(f"cuda {arch} kernels", _kernels("cuda", arch),
            tests=(f"tests/test_library.py::*cuda*{arch}*",) if arch != CUDA_ARCHS[0] else ("*cuda*",))
      for arch in CUDA_ARCHS],
    *[Build(f"rocm {arch} kernels", _kernels("rocm", arch), tests=(f"tests/test_library.py::*rocm*{arch}*",))
      for arch in ROCM_ARCHS],
    Build("metal kernels", _kernels("metal"), tests=("tests/test_library.py::*metal*",)),
]


def wanted_builds(items: Iterable[tuple[str, Iterable[str]]]) -> list[str]:
    """The names of the builds that the tests ``items`` ((node id, fixture names) each) ask for, in BUILDS' order."""
    items = [(nodeid, set(fixtures)) for nodeid, fixtures in items]
    return [build.name for build in BUILDS if any(build.wanted_by(nodeid, fixtures) for nodeid, fixtures in items)]


def main(names: list[str]) -> None:
    """Make the builds ``names`` (every build when none is named), one after the other, at the lowest priority."""
    unknown = set(names) - {build.name for build in BUILDS}
    if unknown:
        raise SystemExit(f"prebuild: no build named {sorted(unknown)}; builds: {[build.name for build in BUILDS]}")
    os.nice(19)
    for build in BUILDS:
        if names and build.name not in names:
            continue
        started = time.perf_counter()
        try:
            build.make()
            print(f"{build.name}: {time.perf_counter() - started:.1f}s", flush=True)
        except Exception:  # logged only: the test that needs this build reports its own error
            print(f"{build.name}: failed", flush=True)
            traceback.print_exc(file=sys.stdout)


if __name__ == "__main__":
    main(sys.argv[1:])
