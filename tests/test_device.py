"""Device and PairedBuffer: errors, prefix views, zero-copy on the CPU, and copy -> compute ordering."""

from __future__ import annotations

import numpy as np
import pytest
from logitproc.runtime import Device, PairedBuffer


def test_available_lists_the_cpu_first() -> None:
    found = Device.available()
    assert found[0].kind == "cpu" and found[0].backend == "tvm-llvm"


@pytest.mark.parametrize(("kind", "index", "error", "match"), [
    ("tpu", 0, ValueError, "'tpu' is not supported"),
    ("cpu", -1, ValueError, "index must be an int >= 0"),
    (3, 0, TypeError, "must be a str"),
    ("rocm", 0, RuntimeError, "no ROCm"),
    ("metal", 0, RuntimeError, "macOS"),
    ("vulkan", 99, RuntimeError, r"Device\('vulkan', 99\) does not exist"),
])
def test_bad_devices_are_clear_errors(kind, index, error, match) -> None:
    with pytest.raises(error, match=match):
        Device(kind, index)


def test_cuda_without_a_gpu_says_so() -> None:
    import tvm

    if tvm.cuda(0).exist or any(info.kind == "cuda" for info in Device.available()):
        pytest.skip("this machine has a CUDA GPU")
    # through TVM's CUDA runtime where it exists, else the CUDA driver: no driver (or no cuda-bindings) says so
    with pytest.raises((RuntimeError, ImportError),
                       match="does not exist on this machine|no NVIDIA driver|cuda-bindings"):
        Device("cuda")


def test_paired_buffer_on_cpu_is_zero_copy_and_checks_capacity() -> None:
    buf = PairedBuffer(Device("cpu"), "token_ids", capacity=8, dtype="int32")
    buf.host_prefix(3)[:] = [4, 5, 6]
    view = buf.to_device(3)
    assert view.shape == (3,)
    np.testing.assert_array_equal(view.numpy(), [4, 5, 6])
    buf.host[0] = 9  # the host array is the device memory
    assert view.numpy()[0] == 9
    with pytest.raises(ValueError, match="token_ids: 9 rows requested, capacity is 8"):
        buf.to_device(9)
    with pytest.raises(ValueError, match="capacity must be >= 1"):
        PairedBuffer(Device("cpu"), "x", capacity=0)


@pytest.mark.parametrize("kind", ["cpu", "vulkan", "cuda"])
def test_kernels_never_run_before_their_inputs_are_copied(device_kernels, kind) -> None:
    """50 steps reuse the same paired buffers with new values and sizes, never synchronising the host in between.

    Each step adds ``step + 1`` at ``(row, token)`` entries; a kernel that ran before its copy finished would add a
    stale value or miss an entry, and the final sums would differ.
    """
    opened = device_kernels[kind]
    if opened is None:
        pytest.skip(f"no {kind} device here")
    device, kernels = opened
    batch, vocab, capacity = 4, 1000, 64
    logits = device.upload(np.zeros((batch, vocab), np.float32))
    rows = PairedBuffer(device, "pos2seq", capacity, dtype="int32")
    tokens = PairedBuffer(device, "token_ids", capacity, dtype="int32")
    bias = PairedBuffer(device, "bias", capacity, dtype="float32")
    expected = np.zeros((batch, vocab), np.float32)
    rng = np.random.default_rng(0)
    for step in range(50):
        n = int(rng.integers(1, capacity + 1))
        flat = rng.choice(batch * vocab, size=n, replace=False)
        rows.host_prefix(n)[:] = flat // vocab
        tokens.host_prefix(n)[:] = flat % vocab
        bias.host_prefix(n)[:] = step + 1
        np.add.at(expected, (flat // vocab, flat % vocab), step + 1)
        args = (rows.to_device(n), tokens.to_device(n), bias.to_device(n))
        device.wait_for_copies()
        kernels["apply_logit_bias_inplace"](logits, *args)
    device.synchronize()
    np.testing.assert_array_equal(device.download(logits), expected)
