"""Compile in the background of a whole test session what its tests will ask for, roughly in the order they ask.

Started by ``conftest.py`` when a session collects most of the test modules, at low priority, into the session's
private cache; it ends with the session. The machine's second core does the builds while the tests (mostly one
thread) run on the first; a test that asks for a build still in progress waits for it (``build_in_cache`` lets one
process build a cache entry at a time) instead of building it again. Every build here is one a test makes anyway,
with the same inputs, so the tests see the same results; a failure here is only logged (the test that asks for the
build then fails with its own error).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import tiny_variants
from logitproc.compile import CUDA_ARCHS, ROCM_ARCHS, build_kernels
from logitproc.compile.model_compile import compile_model
from logitproc.serve.cli_options import tiny_model

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
    from logitproc.compile.model_fetch import FILENAME, fetch_default_model, models_dir, verify_cached

    kept = os.environ.get("LOGITPROC_TEST_MODEL_CACHE")
    if kept and verify_cached(models_dir(kept) / FILENAME):
        compile_model(fetch_default_model(kept))  # the kept file: same name and contents, so the same build
    else:
        compile_model("default")


def _hf_directory() -> None:
    with tempfile.TemporaryDirectory() as parent:
        compile_model(tiny_variants.write_qwen_tiny(tiny_variants.qwen_tiny(), Path(parent)), **tiny_variants.FLOAT32)


def _marker_directory() -> None:
    with tempfile.TemporaryDirectory() as parent:
        compile_model(tiny_variants.write_marker_tiny(Path(parent)))


BUILDS: list[tuple[str, Callable[[], object]]] = [
    ("cpu kernels and --model tiny", _cli_tiny),
    ("default model", _default_model),
    ("tiny, float16 KV cache", lambda: compile_model(tiny_model(), **tiny_variants.FLOAT16_KV)),
    ("tiny Hugging Face directory", _hf_directory),
    ("tiny with marker tokens", _marker_directory),
    ("wide tiny, q8_0 KV cache", lambda: compile_model(tiny_variants.wide_tiny(), **tiny_variants.Q8_KV)),
    ("vulkan kernels", lambda: build_kernels("vulkan")),
    *[(f"cuda {arch} kernels", lambda arch=arch: build_kernels("cuda", arch)) for arch in CUDA_ARCHS],
    *[(f"rocm {arch} kernels", lambda arch=arch: build_kernels("rocm", arch)) for arch in ROCM_ARCHS],
    ("metal kernels", lambda: build_kernels("metal")),
]


def main() -> None:
    os.nice(19)
    for name, build in BUILDS:
        started = time.perf_counter()
        try:
            build()
            print(f"{name}: {time.perf_counter() - started:.1f}s", flush=True)
        except Exception:  # logged only: the test that needs this build reports its own error
            print(f"{name}: failed", flush=True)
            traceback.print_exc(file=sys.stdout)


if __name__ == "__main__":
    main()
