"""The replays of ``scripts/bench_speculative.py --bounds`` (``draft_bound``): a copy, a text with nothing to copy,
and the order of the three plans (perfect foresight >= every draft, adaptive; the engine's own planner replayed)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_speculative.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_speculative", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


CONTEXT = [9, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 0]
COPY = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20]  # the context's run, after a prefill


def test_a_copy_is_verified_six_tokens_at_a_time(bench) -> None:
    # token 1 from the prefill; then 19 tokens: verifies of 5 drafts (6 tokens) x 3 and one of the last token
    assert bench.draft_bound(CONTEXT, COPY, 5, 0.0) == pytest.approx(19 / 4)
    assert bench.draft_bound(CONTEXT, COPY, 5, 0.2) == pytest.approx(19 / (3 * 2.0 + 1.0))
    assert bench.draft_bound(CONTEXT, COPY, 5, 0.2, "every") == pytest.approx(19 / (3 * 2.0 + 1.0))


def test_nothing_to_copy_is_plain_decoding_at_best(bench) -> None:
    answer = [50 + i for i in range(20)]
    assert bench.draft_bound(CONTEXT, answer, 5, 0.2) == 1.0
    assert bench.draft_bound(CONTEXT, answer, 5, 0.2, "adaptive") <= 1.0


@pytest.mark.parametrize("slope", [0.1, 0.25])
def test_perfect_foresight_bounds_the_other_plans(bench, slope: float) -> None:
    answer = [1, 2, 3, 30, 31, 5, 6, 7, 8, 40, 12, 13, 14, 15, 16, 41, 42]  # copies broken by new tokens
    perfect = bench.draft_bound(CONTEXT, answer, 5, slope)
    for plan in ("every", "adaptive"):
        assert 0 < bench.draft_bound(CONTEXT, answer, 5, slope, plan) <= perfect
    need = bench.slope_for(CONTEXT, COPY, 5, 2.0, "perfect")
    assert bench.draft_bound(CONTEXT, COPY, 5, need) >= 2.0 > bench.draft_bound(CONTEXT, COPY, 5, need + 0.01)
