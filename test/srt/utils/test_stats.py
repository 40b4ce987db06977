"""Online statistics (srt/utils/stats.py): batch buckets, the windowed minimum, the decayed
average; and that the cost model, the prefetch gate and the tree budget use them."""

from __future__ import annotations

import ast
import pathlib

import pytest

from sglang.srt.utils import stats
from sglang.srt.utils.stats import WindowedMin, batch_bucket, bucket_sizes, ema


def test_buckets_keep_small_batches_and_round_larger_ones_up_to_a_power_of_two() -> None:
    assert [batch_bucket(n) for n in range(1, 10)] == [1, 2, 3, 4, 8, 8, 8, 8, 16]
    assert [batch_bucket(n) for n in (16, 17, 32, 33, 100)] == [16, 32, 32, 64, 128]
    assert bucket_sizes(0) == []
    assert bucket_sizes(3) == [1, 2, 3]
    assert bucket_sizes(7) == [1, 2, 3, 4]
    assert bucket_sizes(40) == [1, 2, 3, 4, 8, 16, 32]
    # every bucket_sizes entry is a bucket, and each size up to the limit maps onto one of
    # them or onto the next one above the limit
    sizes = bucket_sizes(64)
    assert all(batch_bucket(s) == s for s in sizes)
    assert {batch_bucket(n) for n in range(1, 65)} == set(sizes)


def test_the_three_users_share_one_bucket() -> None:
    from sglang.srt.expert_offload.gate import bucket
    from sglang.srt.speculative.cost_model import CostModel

    for n in range(1, 70):
        assert bucket(n) == CostModel._bucket(n) == batch_bucket(n)


def test_windowed_min_is_the_fastest_of_the_last_window_samples() -> None:
    w = WindowedMin(3)
    assert w.value is None and len(w) == 0 and w.window == 3
    w.add(0.5)
    assert w.value == 0.5
    w.add(0.9)  # a slower sample does not raise the minimum
    assert w.value == 0.5
    w.add(0.7)
    assert w.value == 0.5 and list(w) == [0.5, 0.9, 0.7]
    w.add(0.8)  # 0.5 is now older than the window: forgotten
    assert w.value == 0.7 and list(w) == [0.9, 0.7, 0.8]
    w.add(1.0)
    w.add(1.0)  # 0.7 forgotten too
    assert w.value == 0.8
    w.clear()
    assert w.value is None and not w
    w.extend([0.3, 0.2, 0.4, 0.6])
    assert list(w) == [0.2, 0.4, 0.6] and w.value == 0.2
    assert list(WindowedMin(2, [3.0, 1.0, 2.0])) == [1.0, 2.0]


def test_ema_takes_the_first_sample_then_decays_towards_new_ones() -> None:
    assert ema(None, 2.0, 0.8) == 2.0
    assert ema(1.0, 2.0, 0.5) == pytest.approx(1.5)
    assert ema(1.0, 2.0, 0.8) == pytest.approx(1.2)
    assert ema(1.0, 2.0, 0.0) == 2.0  # no memory
    assert ema(1.0, 2.0, 1.0) == 1.0  # no update
    # a step change is followed geometrically: the old value's weight is decay ** n
    v = 0.0
    for n in range(1, 6):
        v = ema(v, 1.0, 0.8)
        assert v == pytest.approx(1 - 0.8 ** n)


def test_cost_model_step_time_forgets_a_fast_sample_older_than_its_window() -> None:
    from sglang.srt.speculative.cost_model import CostModel

    cm = CostModel([1, 2], window=3)
    for seconds in (0.1, 0.3, 0.3):
        cm.observe(5, 1, seconds)  # bucket 8
    assert cm.times[(8, 1)] == 0.1
    cm.observe(6, 1, 0.4)
    assert cm.times[(8, 1)] == 0.3  # the 0.1 s sample fell out of the window
    for _ in range(3):
        cm.observe_catch_up(10, 1.0)
    assert cm.catch_up_token_s == pytest.approx(0.1)
    cm.catch_up_samples.clear()
    cm.catch_up_prior = 0.5
    assert cm.catch_up_token_s == 0.5  # nothing measured: the prior


def test_acceptance_is_a_ratio_of_two_decayed_sums() -> None:
    from sglang.srt.speculative.controller import AcceptanceEMA

    a = AcceptanceEMA(0.7, decay=0.5)
    assert a.rate == pytest.approx(0.7)
    # 2 of 4 accepted: 3 positions decided (the first rejection included)
    assert a.update(2, 4) == pytest.approx((0.5 * 0.7 + 0.5 * 2) / (0.5 * 1.0 + 0.5 * 3))
    assert a.hits == pytest.approx(ema(0.7, 2, 0.5))
    assert a.trials == pytest.approx(ema(1.0, 3, 0.5))


def test_a_prior_of_one_position_gives_way_to_the_first_verifies() -> None:
    """With prior_weight the prior counts as that many decided positions and each verify in
    full: two rejected verifies take the rate from 0.7 to under 0.2 (a history-weighted
    prior is still above 0.4), and after many verifies both forms agree."""
    from sglang.srt.speculative.controller import AcceptanceEMA

    fast, slow = AcceptanceEMA(0.7, 0.8, prior_weight=1.0), AcceptanceEMA(0.7, 0.8)
    for _ in range(2):
        fast.update(0, 3), slow.update(0, 3)
    assert fast.rate == pytest.approx(0.7 * 0.64 / (0.64 + 0.8 + 1))
    assert fast.rate < 0.2 < 0.4 < slow.rate
    for i in range(80):
        fast.update(i % 4, 3), slow.update(i % 4, 3)
    assert fast.rate == pytest.approx(slow.rate, rel=1e-6)


def test_tree_budget_step_seconds_decay() -> None:
    from sglang.srt.expert_offload.tree_budget import TreeBudget

    tb = TreeBudget(decay=0.8)
    tb.observe_step(2, 1.0)
    assert tb.step_s[2] == 1.0
    tb.observe_step(2, 2.0)
    assert tb.step_s[2] == pytest.approx(1.2)
    assert 3 not in tb.step_s


def test_stats_is_a_bottom_layer() -> None:
    """No torch, nothing from sglang: anything may import it."""
    tree = ast.parse(pathlib.Path(stats.__file__).read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            imported.add((node.module or "").split(".")[0])
    assert imported <= {"__future__", "collections", "typing"}, imported
