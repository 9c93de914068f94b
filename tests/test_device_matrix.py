"""Every kernel on every available device (cpu, vulkan through wgpu, cuda), against the numpy references.

Runs in CI on cpu and vulkan (lavapipe); on cuda wherever an NVIDIA GPU exists. A device that is missing skips its
cases with the reason, and the reason is printed in the terminal summary.
"""

from __future__ import annotations

import numpy as np
import pytest
from kernel_cases import all_cases
from logitproc.tir_kernels import KERNEL_FACTORIES

CASES = all_cases()


def test_the_table_covers_every_kernel() -> None:
    assert {case.kernel for case in CASES} == set(KERNEL_FACTORIES)


@pytest.mark.parametrize("kind", ["cpu", "vulkan", "cuda"])
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_kernel_on_device(device_kernels, kind, case) -> None:
    opened = device_kernels[kind]
    if opened is None:
        pytest.skip(f"no {kind} device here")
    device, kernels = opened
    args = [device.upload(np.ascontiguousarray(a)) for a in case.args]
    kernels[case.kernel](*args)
    case.check([device.download(a) for a in args])
