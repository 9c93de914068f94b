"""Shared fixtures: the devices this machine has, each with its kernels loaded, and why the others are missing."""

from __future__ import annotations

import os
import tempfile

import pytest

# Tests build kernel libraries into a private cache, never the user's.
os.environ.setdefault("LOGITPROC_CACHE", tempfile.mkdtemp(prefix="logitproc-test-cache-"))

MATRIX_DEVICES = ("cpu", "vulkan", "cuda")
_unavailable: dict[str, str] = {}


def _open_device(kind: str):
    from logitproc.runtime import Device

    try:
        device = Device(kind)
        return device, device.load()
    except (RuntimeError, ImportError) as err:
        _unavailable[kind] = str(err)
        return None


@pytest.fixture(scope="session")
def device_kernels():
    """kind -> (Device, kernels) for every matrix device; None where the device is missing (reason recorded)."""
    return {kind: _open_device(kind) for kind in MATRIX_DEVICES}


def pytest_terminal_summary(terminalreporter) -> None:
    """No silent skips: say which devices the matrix could not run on, and why."""
    for kind, reason in _unavailable.items():
        terminalreporter.write_line(f"device matrix: {kind} not run: {reason}")
