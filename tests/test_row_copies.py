"""The attention's row copies (``compile/row_copies.py``): the same values as numpy's concatenation with zeros and
its slice, on serial and parallel token counts, in float16 and float32; bad sizes refused."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from kernel_harness import built_for_cpu
from logitproc.compile.row_copies import PARALLEL_FROM, first_columns_kernel, pad_rows_kernel

#: one token, just below and at the parallel threshold, 140
TOKENS = (1, PARALLEL_FROM - 1, PARALLEL_FROM, 140)
#: (width, other): SmolLM2's q/k/v heads (15 of 64) padded to 21, query heads 9 of 15; odd widths (a vector's
#: tail), nothing to pad, one column kept
SHAPES = ((960, 1344), (21, 50), (7, 7), (1, 3))


def _tensor(a: np.ndarray) -> tvm.runtime.Tensor:
    return tvm.runtime.tensor(a, tvm.cpu())


@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize(("width", "padded"), SHAPES)
def test_pad_rows_copies_each_row_and_zeros_the_rest(width: int, padded: int, dtype: str) -> None:
    kernel = built_for_cpu(pad_rows_kernel, width, padded, dtype)
    rng = np.random.default_rng(width)
    for n in TOKENS:
        x = rng.standard_normal((n, width)).astype(dtype)
        out = _tensor(np.full((n, padded), np.nan, dtype))
        kernel(_tensor(x), out)
        np.testing.assert_array_equal(out.numpy(), np.concatenate([x, np.zeros((n, padded - width), dtype)], 1))


@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize(("kept", "width"), SHAPES)
def test_first_columns_are_each_rows_first_values(kept: int, width: int, dtype: str) -> None:
    kernel = built_for_cpu(first_columns_kernel, width, kept, dtype)
    rng = np.random.default_rng(kept)
    for n in TOKENS:
        x = rng.standard_normal((n, width)).astype(dtype)
        out = _tensor(np.full((n, kept), np.nan, dtype))
        kernel(_tensor(x), out)
        np.testing.assert_array_equal(out.numpy(), x[:, :kept])


def test_bad_sizes_are_refused() -> None:
    with pytest.raises(ValueError, match="rows of 8 cannot be padded to 7"):
        pad_rows_kernel(8, 7, "float32")
    with pytest.raises(ValueError, match="9 columns cannot be kept of rows of 8"):
        first_columns_kernel(8, 9, "float32")
    with pytest.raises(ValueError, match="row widths must be at least 1, got 0 and 4"):
        pad_rows_kernel(0, 4, "float16")
    with pytest.raises(ValueError, match="float16 or float32 rows, got 'int8'"):
        first_columns_kernel(8, 4, "int8")
