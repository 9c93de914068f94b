"""The cpu target is built for the features this machine has, and builds for features it lacks are refused."""

from __future__ import annotations

import json

import pytest
import tvm
from logitproc.runtime.targets import build_features, check_runs_here, host_target, resolve_target


def test_host_target_uses_only_features_this_cpu_has() -> None:
    spec = resolve_target("cpu")
    assert spec == host_target()
    check_runs_here({"kind": "cpu", "arch": spec.arch, "tvm": str(spec.tvm_target())}, "this build")


def test_a_build_for_features_this_cpu_lacks_is_refused() -> None:
    host = host_target().tvm_target()
    lacking = [f for f in ("avx512f", "amx-tile", "avx512fp16", "avxvnni") if f not in build_features(host)]
    if not lacking:
        pytest.skip("this CPU has every feature the test could ask for")
    foreign = tvm.target.Target({"kind": "llvm", "mcpu": host_target().arch, "mattr": [f"+{lacking[0]}"]})
    with pytest.raises(ValueError, match=f"features this CPU lacks.*{lacking[0]}"):
        check_runs_here({"kind": "cpu", "arch": host_target().arch, "tvm": json.dumps(json.loads(str(foreign)))},
                        "a foreign build")


def test_gpu_manifests_are_not_checked_against_the_cpu() -> None:
    check_runs_here({"kind": "cuda", "arch": "sm_80", "tvm": "{}"}, "a cuda build")
