"""Weights handed to TVM in numpy-allocated (huge-page) memory: the same values, aligned, alive on their own."""

from __future__ import annotations

import gc

import numpy as np
import pytest
from logitproc.serve.host_weights import ALIGNMENT, weight_tensor


@pytest.mark.parametrize(("shape", "dtype"), [((3, 5), np.float16), ((7,), np.uint8), ((2, 3, 4), np.float32),
                                              ((0, 4), np.int8), ((1 << 21,), np.uint8)])
def test_values_equal_and_aligned(shape: tuple[int, ...], dtype: type) -> None:
    source = np.random.default_rng(0).integers(0, 100, shape).astype(dtype)
    tensor = weight_tensor(source)
    out = tensor.numpy()
    assert out.shape == source.shape and out.dtype == source.dtype
    assert np.array_equal(out, source)
    assert np.from_dlpack(tensor).ctypes.data % ALIGNMENT == 0


def test_tensor_keeps_its_buffer_after_the_source_goes() -> None:
    source = np.arange(1 << 20, dtype=np.float32)
    tensor = weight_tensor(source)
    del source
    gc.collect()
    np.testing.assert_array_equal(tensor.numpy(), np.arange(1 << 20, dtype=np.float32))


def test_a_copy_not_a_view_of_the_source() -> None:
    source = np.ones(16, np.float32)
    tensor = weight_tensor(source)
    source[:] = 5
    assert np.array_equal(tensor.numpy(), np.ones(16, np.float32))
