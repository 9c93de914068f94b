"""A short soak (scripts/soak.py): random configs, schemas, regexes, stops, n, penalties, aborts, injected runner
faults and streaming threads on a short KV cache (preemptions), every finish reason and invariant checked."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "soak.py"


@pytest.fixture(scope="module")
def soak_module():
    spec = importlib.util.spec_from_file_location("soak", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["soak"] = module  # (its dataclasses look their module up)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def short_kv_model():
    from logitproc.serve.cli_options import tiny_model
    from logitproc.serve.compiled_model import CompiledModel

    return CompiledModel.open(tiny_model(), target="cpu", max_total_tokens=256, max_num_sequences=16)


@pytest.mark.parametrize("jump_forward", [False, True])
def test_short_soak(soak_module, short_kv_model, jump_forward) -> None:
    report = soak_module.soak(short_kv_model, requests=150, seconds=10, seed=3 + jump_forward, threads=3,
                              jump_forward=jump_forward, compare_alone=20)
    assert not report.problems, "\n".join(report.problems[:20])
    # (the soak stops after 10 s: on a loaded machine fewer than the 150 requests get their turn; what matters is
    # that every request that ran kept the invariants)
    assert report.jobs >= 50 and report.preemptions > 0, report.summary()
    assert {"abort", "error", "length", "stop"} <= set(report.finish), report.summary()
