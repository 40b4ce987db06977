"""The seed-table script's summary (benchmark/seed_table/): median and range per row, and
each row's total time over its residency's plain beside the seed's ratio."""

from __future__ import annotations

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmark", "seed_table"))

from bench_seed_table import SEED_SECONDS, table  # noqa: E402


def _run(total, ttft=1.0, tok_s=5.0, accept=None):
    return {"total_s": total, "ttft_s": ttft, "tok_s": tok_s, "e2e_tok_s": 64 / total,
            "accept_length": accept, "hit_rate": 0.5}


def test_rows_get_median_range_and_time_over_their_own_plain():
    runs = {"25% plain": [_run(40.0), _run(44.0), _run(42.0)],
            "25% chain": [_run(30.0, accept=2.0), _run(20.0, accept=2.2), _run(25.0)],
            "50% plain": [_run(10.0)],
            "50% tree+prefetch/default": [_run(12.0)]}
    t = table(runs)
    assert t["25% plain"]["total_s"] == {"median": 42.0, "low": 40.0, "high": 44.0, "n": 3}
    assert t["25% chain"]["time_over_plain"] == pytest.approx(25.0 / 42.0, abs=1e-3)
    assert t["25% chain"]["seed_time_over_plain"] == pytest.approx(21 / 47, abs=1e-3)
    assert t["25% chain"]["accept_length"]["n"] == 2  # a round without a figure is left out
    # a row slower than plain says so (ratio above 1), against its own residency's plain
    assert t["50% tree+prefetch/default"]["time_over_plain"] == pytest.approx(1.2)
    assert t["50% tree+prefetch/default"]["seed_time_over_plain"] == pytest.approx(
        SEED_SECONDS["tree+prefetch"] / SEED_SECONDS["plain"], abs=1e-3)
