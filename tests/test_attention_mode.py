"""The attention mode packed into ``sm_scale`` (``compile/attention_mode.py``): the window switch and the exact mode
leave the scale bit for bit (float32, as the kernels read it), and scales it cannot carry are refused."""

from __future__ import annotations

import numpy as np
import pytest
from logitproc.compile import attention_mode


@pytest.mark.parametrize("scale", [1 / np.sqrt(64), 1 / np.sqrt(256), 20 ** -0.5, attention_mode.MIN_SCALE, 63.9])
def test_the_switches_keep_the_scale_bit_for_bit(scale: float) -> None:
    for windowed in (False, True):
        for exact in (False, True):
            value = np.float32(attention_mode.encode(scale, windowed=windowed, exact=exact))
            assert (value < 0) == windowed
            assert (abs(value) >= attention_mode.MAX_SCALE) == exact
            back = abs(value) * np.float32(1 / attention_mode.EXACT_FACTOR) if exact else abs(value)
            assert back == np.float32(scale)


@pytest.mark.parametrize("scale", [0.0, -0.125, attention_mode.MAX_SCALE, attention_mode.MIN_SCALE / 2])
def test_a_scale_outside_the_range_is_refused(scale: float) -> None:
    with pytest.raises(ValueError, match=rf"attention scale {scale} is outside \["):
        attention_mode.encode(scale)
