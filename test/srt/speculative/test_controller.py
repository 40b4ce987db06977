"""Fallback controller and cost model on scripted acceptance sequences and step costs."""

from __future__ import annotations

from sglang.srt.speculative.controller import (PLAIN, PROBE, SPEC, FallbackConfig,
                                               RequestController, expected_tokens)
from sglang.srt.speculative.cost_model import CostModel


def ctl(window=50, threshold=0.5, reprobe=100) -> RequestController:
    return RequestController(FallbackConfig(window, threshold, reprobe))


def verify_steps(c: RequestController, n: int, accepted: int, depth: int = 4):
    """n speculative steps, each offering `depth` positions and accepting `accepted`."""
    for _ in range(n):
        if not c.should_speculate():
            return
        c.on_verify(accepted, depth, accepted + 1)


def plain_tokens(c: RequestController, n: int):
    for _ in range(n):
        if c.should_speculate():
            return
        c.on_plain_tokens(1)


def test_high_acceptance_keeps_speculating():
    c = ctl()
    verify_steps(c, 200, accepted=3)
    assert c.mode == SPEC and c.fallback_count == 0


def test_falls_back_within_one_window_of_the_drop():
    c = ctl()
    verify_steps(c, 50, accepted=4)  # prose: everything accepted
    positions = 0
    while c.mode == SPEC:
        c.on_verify(0, 4, 1)  # a table: nothing accepted
        positions += 4
    assert c.mode == PLAIN and c.fallback_count == 1
    assert positions <= 50  # within one window of positions


def test_reprobes_on_schedule_and_backs_off():
    c = ctl(reprobe=100)
    verify_steps(c, 20, accepted=0)
    assert c.mode == PLAIN
    plain_tokens(c, 99)
    assert c.mode == PLAIN
    c.on_plain_tokens(1)
    assert c.mode == PROBE  # after exactly reprobe_interval plain tokens
    verify_steps(c, 13, accepted=0)  # a failed probe (one window)
    assert c.mode == PLAIN and c.backoff == 2 and c.fallback_count == 2
    plain_tokens(c, 199)
    assert c.mode == PLAIN  # the wait doubled
    c.on_plain_tokens(1)
    assert c.mode == PROBE


def test_returns_to_speculation_when_acceptance_recovers():
    c = ctl(reprobe=10)
    verify_steps(c, 20, accepted=0)
    plain_tokens(c, 10)
    assert c.mode == PROBE
    verify_steps(c, 13, accepted=4)
    assert c.mode == SPEC and c.backoff == 1
    verify_steps(c, 100, accepted=3)
    assert c.mode == SPEC
    assert [m for _, m in c.switches] == [PLAIN, PROBE, SPEC]


def test_threshold_zero_never_falls_back():
    c = ctl(threshold=0.0)
    verify_steps(c, 100, accepted=0)
    assert c.mode == SPEC


def test_expected_tokens():
    assert expected_tokens(0.0, 4) == 1.0
    assert abs(expected_tokens(0.5, 1) - 1.5) < 1e-9
    assert expected_tokens(0.99, 4) > 4.8


def test_cost_model_turns_speculation_off_where_plain_is_faster():
    cm = CostModel([1, 2, 4])
    depth = lambda b: b - 1
    # Verifying costs grow steeply with tokens (a CPU without fast small GEMMs).
    cost = {1: 0.010, 2: 0.030, 4: 0.060}
    for _ in range(cm.min_samples * 3):  # every option measured min_samples times
        b = cm.choose([0.6], depth)
        cm.observe(1, b, cost[b])
    assert cm.choose([0.6], depth) == 1
    # The same acceptance with cheap verification: speculation wins.
    cm2 = CostModel([1, 2, 4])
    cheap = {1: 0.010, 2: 0.011, 4: 0.012}
    for _ in range(cm2.min_samples * 3):
        b = cm2.choose([0.6], depth)
        cm2.observe(1, b, cheap[b])
    assert cm2.choose([0.6], depth) == 4


def test_cost_model_is_not_fooled_by_a_one_off_slow_sample():
    """The first plain step of a batch is slow once (say, allocations): the model measures
    again and keeps the fast sample, so it does not keep speculating where plain wins."""
    cm = CostModel([1, 4])
    depth = lambda b: b - 1
    samples = {1: [0.100, 0.010, 0.010], 4: [0.040]}  # plain: one-off 10x outlier first
    for _ in range(4):
        b = cm.choose([0.3], depth)
        cm.observe(1, b, samples[b].pop(0))
    assert cm.choose([0.3], depth) == 1  # 1 token / 10 ms beats ~1.4 tokens / 40 ms


def test_cost_model_explores_each_budget_and_per_batch_size():
    cm = CostModel([1, 3])
    seen = []
    for _ in range(2 * cm.min_samples):
        b = cm.choose([0.5, 0.5], lambda b: b - 1)
        seen.append(b)
        cm.observe(2, b, 0.01)
    # plain twice (its first sample is often a one-off), each speculative budget once
    assert sorted(seen[: cm.min_samples + cm.spec_samples]) == [1] * cm.min_samples + [3]
    # A new batch size is explored afresh.
    assert cm.choose([0.5] * 8, lambda b: b - 1) == 1


def test_cost_model_skips_budgets_that_cannot_win():
    """Exploration climbs from plain decoding and never measures a budget whose expected
    tokens over a smaller budget's step time already lose to the best measured option: a
    slow speculative step is paid as few times as possible."""
    cm = CostModel([1, 2, 4, 5])
    depth = lambda b: b - 1
    cost = {1: 0.010, 2: 0.030, 4: 0.060, 5: 0.080}  # each draft token ~2 plain steps
    seen = []
    for _ in range(20):
        b = cm.choose([0.3], depth)
        seen.append(b)
        cm.observe(1, b, cost[b])
    assert seen[: cm.min_samples + 1] == [1] * cm.min_samples + [2]
    assert 4 not in seen and 5 not in seen  # 1.4 tokens / >= 30 ms cannot beat 1 / 10 ms
    # plain from then on but for one re-measure of budget 2 after explore_first steps
    assert seen[cm.min_samples + 1:].count(2) == 1 and set(seen[cm.min_samples + 1:]) == {1, 2}
    # When acceptance rises, the bigger budgets may win again: they get measured.
    assert cm.choose([0.99], depth) == 4


def _fake_req(rid: str):
    import types

    return types.SimpleNamespace(rid=rid, spec_verify_ct=0, spec_accept_token_num=0,
                                 spec_accept_histogram=[])


def _standalone_spec(model_dir, plain_s=0.010, spec_s=(0.025, 0.030)):
    """A STANDALONE spec worker (chain of 3, cost model and fallback on) whose cost model has
    measured every budget at batch size 1: plain `plain_s`, budgets 2 and 4 `spec_s`."""
    from sglang.test.scheduler_driver import make_scheduler

    spec = make_scheduler(model_dir, speculative_algorithm="STANDALONE",
                          speculative_draft_model_path=model_dir, speculative_num_steps=3,
                          speculative_num_draft_tokens=4,
                          speculative_disable_cost_model=False,
                          speculative_fallback_threshold=0.5,
                          speculative_calibrate_seconds=0).spec
    cm = spec.cost_model
    assert cm.budgets == [1, 2, 4]
    spec.step_s = {1: plain_s, 2: spec_s[0], 4: spec_s[1]}  # what each step takes
    for _ in range(cm.min_samples):
        cm.observe(1, 1, plain_s)
    for b in (2, 4):
        cm.observe(1, b, spec.step_s[b])
    return spec


def _decode(spec, rid: str, accepted_of, steps: int):
    """Runs `steps` decode steps of one request through the worker's own decisions (budget
    from its policy, the request's fallback mode) with scripted acceptance
    (`accepted_of(depth)`) and step times (`spec.step_s`); returns every step's budget."""
    budgets = []
    for _ in range(steps):
        ctl_ = spec.controller(_fake_req(rid))
        budget = 1
        if ctl_.should_speculate():
            budget = spec.policy.choose([ctl_.decision_rate()], spec.depth_of)
        if budget > 1:
            depth = spec.depth_of(budget)
            got = accepted_of(depth)
            spec.record(_fake_req(rid), depth, got, got + 1)
        else:
            spec.record(_fake_req(rid), 0, 0, 1)
        spec.cost_model.observe(1, budget, spec.step_s[budget])
        budgets.append(budget)
    return budgets


def test_draft_model_decisions_are_per_request(tiny_llama_dir):
    """With a draft model, a request decides from its own acceptance: the same request fresh
    or after others whose drafts were all rejected gets the same budgets step by step (the
    server's recent acceptance as the prior had kept it plain, never measured)."""
    def accept_all(depth):
        return depth

    fresh = _standalone_spec(tiny_llama_dir)
    busy = _standalone_spec(tiny_llama_dir)
    for _ in range(60):  # another request whose drafts were all rejected
        busy.record(_fake_req("other"), 3, 0, 1)
    got = _decode(busy, "q", accept_all, 40)
    assert got == _decode(fresh, "q", accept_all, 40)
    assert got.count(4) >= 35  # 4 tokens / 30 ms beat 1 / 10 ms: it speculates


def test_a_new_request_is_probed_where_a_well_drafted_one_would_pay(tiny_llama_dir):
    """A verify costs 3 plain steps: at the prior acceptance (0.7: 2.5 tokens a verify) plain
    wins, yet a request that drafts well (4 tokens a verify) gains. Its first steps are
    weighed optimistically, so it is measured: a request whose drafts are taken keeps
    speculating, one whose drafts are rejected goes plain after its probe. Where even a
    perfect draft cannot pay (a verify at 5 plain steps), no request speculates."""
    assert _decode(_standalone_spec(tiny_llama_dir), "good", lambda d: d, 30).count(1) <= 2
    bad = _decode(_standalone_spec(tiny_llama_dir), "bad", lambda d: 0, 30)
    assert bad[:2] == [4, 4] and bad[2:].count(1) >= 26  # plain but for a re-measure
    dear = _standalone_spec(tiny_llama_dir, spec_s=(0.045, 0.050))
    never = _decode(dear, "any", lambda d: d, 30)
    assert never[:2] == [1, 1] and never.count(1) >= 28  # plain but for a re-measure


def test_a_cheap_verify_that_brings_nothing_stops_right_after_the_probe(tiny_llama_dir):
    """A head-like draft: a verify costs 1.15 / 1.5 plain steps (budgets 2 / 4), so it pays
    from ~0.15 / 0.35 acceptance a position. A request whose drafts are all rejected learns
    that from its own first verifies (the prior counts as one position, not as a history):
    it speculates for its two probe verifies and at most one more step, then decodes
    plainly (with the prior as a whole history it stayed on for ~8 more, each a loss); one
    whose drafts are all taken keeps speculating at the largest budget."""
    cheap = (0.0115, 0.015)
    bad = _decode(_standalone_spec(tiny_llama_dir, spec_s=cheap), "bad", lambda d: 0, 30)
    assert bad[:2] == [4, 4] and sum(b > 1 for b in bad[:12]) <= 3, bad
    good = _decode(_standalone_spec(tiny_llama_dir, spec_s=cheap), "good", lambda d: d, 30)
    assert good.count(4) >= 28, good


def test_a_draft_model_request_weighs_its_prior_as_one_position(tiny_llama_dir):
    """Draft models (and heads) price every verify at several plain steps: their requests'
    acceptance counts the prior as one decided position; a free drafter's (n-grams) keeps it
    as a whole history (its verifies cost next to nothing, trying longer is cheap)."""
    from sglang.test.scheduler_driver import make_scheduler

    standalone = _standalone_spec(tiny_llama_dir).controller(_fake_req("a"))
    ngram = make_scheduler(tiny_llama_dir, speculative_algorithm="NGRAM").spec
    assert standalone.prior_weight == 1.0
    assert ngram.controller(_fake_req("a")).prior_weight is None


def test_the_probe_waits_for_its_verifies_but_not_for_ever():
    """A step where the draft could not run (a catch-up that did not pay) does not use up the
    probe; PROBE_WAIT plain steps without a verify end it (speculation loses even at 0.9)."""
    from sglang.srt.speculative.controller import PROBE_RATE, PROBE_STEPS, PROBE_WAIT

    c = ctl()
    c.on_plain_tokens(1)
    assert c.decision_rate() == PROBE_RATE
    for _ in range(PROBE_STEPS):
        c.on_verify(0, 3, 1)
    assert c.decision_rate() == c.ema_rate < 0.7  # its own (rejected) drafts now
    idle = ctl()
    for _ in range(PROBE_WAIT):
        idle.on_plain_tokens(1)
    assert idle.decision_rate() == idle.ema_rate == 0.7


def test_free_drafter_decisions_are_per_request(tiny_llama_dir):
    """N-grams: a request decides from its own acceptance; what other requests saw before
    it changes nothing (the same request, fresh or after others, gets the same states)."""
    from sglang.test.scheduler_driver import make_scheduler

    def states(spec, rid):
        out = []
        for accepted in [9, 9, 0, 0, 3, 9, 1, 0] * 8:
            spec.record(_fake_req(rid), 10, accepted, accepted + 1)
            ctl = spec.controller(_fake_req(rid))
            out.append((ctl.mode, ctl.draft_len, round(ctl.ema_rate, 9)))
        return out

    fresh = make_scheduler(tiny_llama_dir, speculative_algorithm="NGRAM").spec
    busy = make_scheduler(tiny_llama_dir, speculative_algorithm="NGRAM").spec
    for _ in range(60):  # another request whose drafts were all rejected
        busy.record(_fake_req("other"), 10, 0, 1)
    assert states(busy, "q") == states(fresh, "q")


def test_free_drafts_that_pay_keep_speculating_at_low_acceptance():
    """Accepting 2 of 10 free drafts emits 3 tokens a verify: faster than plain while a
    verify costs under 3 plain steps. The acceptance rule alone (0.2 < 0.5) would stop."""
    free = ctl()
    for _ in range(100):
        free.on_verify(2, 10, 3, break_even=1.3)
    assert free.mode == SPEC and free.fallback_count == 0
    by_acceptance = ctl()
    verify_steps(by_acceptance, 100, accepted=2, depth=10)
    assert by_acceptance.mode == PLAIN  # today's rule for draft models


def test_free_drafts_that_cost_more_than_they_bring_fall_back():
    c = ctl()
    for _ in range(10):  # a verify costs 4 plain steps here and brings 3 tokens
        if c.should_speculate():
            c.on_verify(2, 10, 3, break_even=4.0)
    assert c.mode == PLAIN and c.fallback_count == 1
    plain_tokens(c, 100)
    assert c.mode == PROBE
    for _ in range(10):  # the probe: now each verify brings 10 tokens
        c.on_verify(9, 10, 10, break_even=4.0)
    assert c.mode == SPEC


def test_threshold_zero_never_falls_back():
    c = ctl(threshold=0.0)
    for _ in range(50):
        c.on_verify(0, 10, 1, break_even=1.3)
    assert c.mode == SPEC


def test_draft_length_grows_with_accepted_runs_and_shrinks_after_rejections():
    c = ctl()
    c.max_draft_len = c.draft_len = 11
    c.on_verify(0, 11, 1)
    assert c.draft_len == 6  # halved towards what was accepted (0)
    c.on_verify(1, 6, 2)
    assert c.draft_len == 4
    c.on_verify(0, 4, 1)
    c.on_verify(0, 2, 1)
    assert c.draft_len == 1  # never below one token
    lengths = []
    for _ in range(5):  # a passage being quoted: every drafted token taken
        c.on_verify(c.draft_len, c.draft_len, c.draft_len + 1)
        lengths.append(c.draft_len)
    assert lengths == [2, 4, 8, 11, 11]  # doubles up to the cap
    c.on_verify(5, 11, 6)
    assert c.draft_len == 8


def test_each_ngram_request_asks_for_its_own_draft_length(tiny_llama_dir):
    from sglang.test.scheduler_driver import make_scheduler

    spec = make_scheduler(tiny_llama_dir, speculative_algorithm="NGRAM",
                          speculative_num_draft_tokens=12).spec
    quoting, prose = _fake_req("quote"), _fake_req("prose")
    for _ in range(6):
        spec.record(prose, 11, 0, 1)
        spec.record(quoting, 11, 11, 12)
    assert spec.decisions.own_budget(quoting, 12) == 12  # the whole budget: 11 drafts + the root
    assert spec.decisions.own_budget(prose, 12) == 2  # one draft token
    standalone = make_scheduler(tiny_llama_dir, speculative_algorithm="STANDALONE",
                                speculative_draft_model_path=tiny_llama_dir).spec
    assert standalone.decisions.own_budget(prose, 4) == 4  # a draft model's levels are not resized


def test_hybrid_ngrams_alone_ask_for_their_own_draft_length(tiny_llama_dir):
    """While HYBRID's draft model sits out for a request, its n-grams size the request's
    draft as NGRAM does (prose: one token, not the full tree's rows in every verify); with
    the model back, the tree keeps the step's budget."""
    from sglang.test.scheduler_driver import make_scheduler

    spec = make_scheduler(tiny_llama_dir, speculative_algorithm="HYBRID",
                          speculative_draft_model_path=tiny_llama_dir,
                          speculative_num_draft_tokens=10,
                          speculative_fallback_threshold=0).spec  # decisions aside
    prose = _fake_req("prose")
    ctl_ = spec.controller(prose)
    assert spec.decisions.own_budget(prose, 10) == 10
    ctl_.model_off, ctl_.model_left = True, 100  # as after a window the model did not pay
    for _ in range(6):
        spec.record(prose, 9, 0, 1)
    assert ctl_.model_off and spec.decisions.own_budget(prose, 10) == 2  # one draft token
    for _ in range(3):  # a passage being quoted: every drafted token taken
        spec.record(prose, ctl_.draft_len, ctl_.draft_len, ctl_.draft_len + 1)
    assert spec.decisions.own_budget(prose, 10) == 9  # grew back: 1 -> 2 -> 4 -> 8 drafts (+ root)
    ctl_.model_off = False
    for _ in range(6):
        spec.record(prose, 3, 0, 1)
    assert spec.decisions.own_budget(prose, 10) == 10  # the model's tree: the step's budget


def test_cost_model_says_when_speculation_is_ruled_out():
    """What after_prefill asks before the draft reads new prompts: only a measured plain
    step with every budget measured slower or bounded below it rules speculation out."""
    cm = CostModel([1, 2, 4])
    depth = lambda b: b - 1
    assert not cm.rules_out_speculation([0.5] * 2, depth)  # nothing measured yet
    for _ in range(cm.min_samples):
        cm.observe(2, 1, 0.010)
    assert not cm.rules_out_speculation([0.5] * 2, depth)  # budget 2 may still win
    for _ in range(cm.min_samples):
        cm.observe(2, 2, 0.030)  # 1.5 tokens / 30 ms: slower, and 4 is bounded below too
    assert cm.rules_out_speculation([0.5] * 2, depth)
    assert not cm.rules_out_speculation([0.99] * 2, depth)  # high acceptance: 4 may win
    assert not cm.rules_out_speculation([0.5] * 8, depth)  # another batch size: unknown
    step = cm.step
    cm.rules_out_speculation([0.5] * 2, depth)
    assert cm.step == step  # a question, not a step


def test_cost_model_does_not_explore_what_lost_at_a_smaller_batch():
    """A budget measured slower than plain at 4 requests is not tried at 8 (a bigger batch
    only makes the verify's extra tokens dearer); plain still gets measured there, and a
    budget that won at 4 is explored at 8."""
    cm = CostModel([1, 2, 4])
    depth = lambda b: b - 1
    for b, t in {1: 0.10, 2: 0.25, 4: 0.12}.items():  # at 4: budget 2 loses, 4 wins
        for _ in range(cm.min_samples):
            cm.observe(4, b, t)
    seen = []
    for _ in range(6):
        b = cm.choose([0.6] * 8, depth)
        seen.append(b)
        cm.observe(8, b, {1: 0.2, 2: 0.5, 4: 0.24}[b])
    assert 2 not in seen
    assert seen[: cm.min_samples + 1] == [1] * cm.min_samples + [4]


def test_cost_model_sees_through_steps_slowed_by_a_busy_machine():
    """Plain steps 5x slower now and then (a host stealing the CPU) must not make a slower
    speculation look better: the model keeps the recent fastest time of each option, and
    still follows a step time that really grows."""
    cm = CostModel([1, 2])
    depth = lambda b: b - 1
    for _ in range(cm.min_samples):
        cm.observe(16, 1, 0.4)
    cm.observe(16, 2, 1.1)  # 1.6 tokens / 1.1 s per request: slower than 1 / 0.4 s
    for t in [2.0, 0.45, 2.5, 0.42, 1.9, 0.4]:  # noisy plain steps
        assert cm.choose([0.6] * 16, depth) == 1
        cm.observe(16, 1, t)
    assert cm.choose([0.6] * 16, depth) == 1
    for _ in range(cm.window):  # the context grew: plain really costs 1 s now
        cm.observe(16, 1, 1.0)
    assert cm.times[(16, 1)] == 1.0
    assert cm.choose([0.6] * 16, depth) == 2


def test_cost_model_soon_remeasures_a_budget_one_slow_sample_ruled_out():
    """A quoting request (acceptance 0.9) whose first verify ran while the host was busy
    (5x its real cost): plain wins on that one sample, but the budget is measured again
    after `explore_first` steps, not `explore_every`, and then wins on its real cost. A
    budget that keeps losing is re-measured ever more rarely (the waits double)."""
    cm = CostModel([1, 10])
    depth = lambda b: b - 1
    real = {1: 0.10, 10: 0.19}  # 10 rows cost 1.9 plain steps; 0.9 acceptance: ~6.5 tokens
    seen = []
    for step in range(cm.explore_first + 6):
        b = cm.choose([0.9], depth)
        seen.append(b)
        slow = b == 10 and seen.count(10) == 1  # the first verify: the host was busy
        cm.observe(1, b, 1.0 if slow else real[b])
    first = seen.index(10)
    again = seen.index(10, first + 1)
    assert again - first <= cm.explore_first + 1 < cm.explore_every
    assert seen[again:] == [10] * (len(seen) - again)  # now it wins on its real cost
    # A budget that really loses: measured at waits that double, up to explore_every.
    cm = CostModel([1, 10])
    seen = []
    for _ in range(400):
        b = cm.choose([0.3], depth)
        seen.append(b)
        cm.observe(1, b, {1: 0.10, 10: 0.40}[b])
    at = [i for i, b in enumerate(seen) if b == 10]
    gaps = [y - x for x, y in zip(at, at[1:])]
    assert len(at) <= 6 and gaps == sorted(gaps) and gaps[0] <= cm.explore_first + 1
    assert seen.count(1) >= 394  # speculation that loses costs a handful of steps in 400


def test_cost_model_weighs_a_catch_up_against_what_it_saves():
    """Before the draft reads a backlog (prompts it skipped) the cost model asks whether the
    time speculation saves over the tokens left pays for the read: a few tokens left, or a
    budget no faster than plain, do not; a long answer with a real gain does; an unknown
    price does (the first catch-up measures it)."""
    cm = CostModel([1, 2, 4])
    depth = lambda b: b - 1
    rates = [0.8] * 4
    for _ in range(cm.min_samples):
        cm.observe(4, 1, 0.25)  # plain: 16 tokens/s for the batch
    cm.observe(4, 4, 0.5)  # budget 4: 4 x 2.95 tokens / 0.5 s = 23.6 tokens/s
    assert cm.catch_up_pays(rates, depth, remaining=40, backlog=1024)  # price unknown
    cm.observe_catch_up(1024, 2.5)  # 2.4 ms a draft token
    # 40 tokens left: 2.5 s plain vs 1.7 s speculating saves 0.8 s < 2.5 s of reading
    assert not cm.catch_up_pays(rates, depth, remaining=40, backlog=1024)
    # 400 tokens left: saves 8 s
    assert cm.catch_up_pays(rates, depth, remaining=400, backlog=1024)
    assert cm.catch_up_pays(rates, depth, remaining=400, backlog=1024, budget=4)
    # unmeasured budget 2 at a low acceptance: its optimistic bound (4 x 1.05 tokens in no
    # more than plain's 0.25 s) still beats plain, so a long answer may pay to explore it
    assert cm.catch_up_pays([0.05] * 4, depth, remaining=4000, backlog=1024)
    cm.observe(4, 2, 0.5)  # measured: no budget beats plain at that acceptance
    assert not cm.catch_up_pays([0.05] * 4, depth, remaining=4000, backlog=1024)
    cm.observe_catch_up(2048, 10.0)  # a slower sample: the recent minimum is kept
    assert cm.catch_up_token_s == 2.5 / 1024


def test_cost_model_prices_a_draft_token_from_the_prefill_until_it_measures_one():
    """Before any catch-up: a target prefill's seconds per token times the draft's share of
    the parameters; a measured catch-up then replaces the guess."""
    cm = CostModel([1, 2, 4])
    assert cm.catch_up_token_s is None
    cm.observe_prefill(4096, 45.0, draft_share=0.3)
    cm.observe_prefill(256, 5.0, draft_share=0.3)  # a slower prefill: the fastest is kept
    assert abs(cm.catch_up_token_s - 45.0 / 4096 * 0.3) < 1e-12
    cm.observe_catch_up(1024, 2.0)
    assert cm.catch_up_token_s == 2.0 / 1024


def test_cost_model_rules_out_a_batch_size_where_every_budget_lost_below():
    """Where every budget lost to plain at a smaller batch (the start-up calibration stops
    there), a bigger batch is ruled out before plain is even measured at its size: the
    draft does not read its prompts. A high acceptance opens it again."""
    cm = CostModel([1, 2, 4])
    depth = lambda b: b - 1
    for b, t in {1: 0.10, 2: 0.25, 4: 0.25}.items():
        for _ in range(cm.min_samples):
            cm.observe(4, b, t, calibration=True)
    assert cm.rules_out_speculation([0.6] * 4, depth)
    assert cm.rules_out_speculation([0.6] * 16, depth)  # plain unmeasured at 16
    assert not cm.catch_up_pays([0.6] * 16, depth, remaining=512, backlog=4096)
    # 3.94 tokens / 0.25 s beats 1 / 0.10 s: budget 4 may win at 16
    assert not cm.rules_out_speculation([0.99] * 16, depth)
    assert cm.catch_up_pays([0.99] * 16, depth, remaining=512, backlog=4096)


def test_calibration_samples_give_way_to_the_first_real_step():
    """Start-up samples (short random prompts) stand in until the option runs for real;
    the first real sample replaces them, so an optimistic start-up time is not kept as the
    window's fastest for `window` more steps."""
    cm = CostModel([1, 2])
    for _ in range(cm.min_samples):
        cm.observe(4, 1, 0.10, calibration=True)
    assert cm.times[(4, 1)] == 0.10 and cm._measured(4, 1)
    cm.observe(4, 1, 0.30)
    assert cm.times[(4, 1)] == 0.30
    cm.observe(4, 1, 0.25)
    cm.observe(4, 1, 0.40)
    assert cm.times[(4, 1)] == 0.25  # real samples: the window's fastest, as before


def test_acceptance_rate_is_per_decided_position():
    """The rate the cost model weighs a chain by is the per-position acceptance: a verify
    that accepts 2 of 4 decided 3 positions (the third was rejected, the fourth never
    tested), so a steady 2 of 4 is a rate of 2/3, not 1/2, and expected_tokens of the chain
    then matches the 3 tokens such a step emits."""
    c = ctl(threshold=0.0)
    for _ in range(60):
        c.on_verify(2, 4, 3)
    assert abs(c.ema_rate - 2 / 3) < 1e-3
    assert abs(expected_tokens(c.ema_rate, 2) - 19 / 9) < 1e-2  # depth 2: 1 + 2/3 + 4/9
    for _ in range(60):
        c.on_verify(4, 4, 5)  # everything accepted: the rate goes to 1
    assert c.ema_rate > 0.99
    for _ in range(60):
        c.on_verify(0, 4, 1)
    assert c.ema_rate < 0.01
    assert c.rate() == 0.0  # the fallback window still counts offered positions


def test_a_close_start_up_time_gets_one_real_step():
    """A budget that the start-up calibration found a little slower than plain (one sample,
    maybe a slow moment of the host) is tried once on real text; one found far slower is
    not; the real sample then decides."""
    cm = CostModel([1, 2, 4])
    depth = lambda b: b - 1
    rates = [0.7]
    for b, t in {1: 0.10, 2: 0.20, 4: 0.50}.items():  # speeds 10, 8.5, 5.1 tokens/s
        for _ in range(cm._samples(b)):
            cm.observe(1, b, t, calibration=True)
    for _ in range(cm.min_samples):
        cm.observe(1, 1, 0.10)  # plain measured for real
    assert cm.choose(rates, depth) == 2  # 8.5 >= 0.75 x 10: once, for real
    cm.observe(1, 2, 0.15)  # real: 11.3 tokens/s, faster than plain
    assert [cm.choose(rates, depth) for _ in range(5)] == [2] * 5  # 4 (5.1) never tried
    cm2 = CostModel([1, 2])
    cm2.observe(1, 2, 0.40, calibration=True)  # 4.25 tokens/s: far below plain
    for _ in range(cm2.min_samples):
        cm2.observe(1, 1, 0.10)
    assert [cm2.choose(rates, depth) for _ in range(5)] == [1] * 5


def test_a_window_pays_when_its_tokens_cover_the_sum_of_its_prices():
    """Each verify carries its own price in plain steps (HYBRID: dearer when its draft model
    ran): the window pays when what it emitted covers what its verifies cost."""
    c = ctl()
    for i in range(40):  # average price 2.65 plain steps, 3 tokens a verify
        c.on_verify(2, 10, 3, break_even=4.0 if i % 2 else 1.3)
    assert c.mode == SPEC
    c = ctl()
    for i in range(40):  # the same prices, 2 tokens a verify: slower than plain
        if c.should_speculate():
            c.on_verify(1, 10, 2, break_even=4.0 if i % 2 else 1.3)
    assert c.mode == PLAIN and c.fallback_count == 1


def hybrid_ctl(reprobe=100) -> RequestController:
    return RequestController(FallbackConfig(50, 0.5, reprobe), can_drop_model=True)


MODEL_PRICE = expected_tokens(0.5, 3)  # a verify its draft model ran for (3 steps)


def test_hybrid_drops_its_draft_model_before_its_ngrams():
    """A window where the draft model's verifies do not pay switches the model off, not
    speculation: n-gram drafts that pay go on (cra/list/4K fell back to plain here, 0.39x
    NGRAM); the model is asked again after `reprobe_interval` tokens, then twice as late."""
    c = hybrid_ctl()
    while not c.model_off:  # the draft model's drafts: 1.2 tokens a verify for 1.9 steps
        c.on_verify(0, 10, 1, break_even=MODEL_PRICE)
    assert c.mode == SPEC and c.fallback_count == 0 and c.model_left == 100
    tokens = 0
    while c.model_off:  # the n-grams alone: 3 tokens a verify for 1.3 plain steps
        c.on_verify(2, 10, 3, break_even=1.3)
        tokens += 3
    assert c.mode == SPEC and c.fallback_count == 0 and 100 <= tokens < 103
    while not c.model_off:  # the model is still no help: off for twice as long
        c.on_verify(0, 10, 1, break_even=MODEL_PRICE)
    assert c.model_left == 200 and c.mode == SPEC


def test_hybrid_falls_back_to_plain_when_its_ngrams_do_not_pay_either():
    c = hybrid_ctl()
    while not c.model_off:
        c.on_verify(0, 10, 1, break_even=MODEL_PRICE)
    while c.mode == SPEC:  # n-grams alone: one token a verify at 1.3 plain steps
        c.on_verify(0, 10, 1, break_even=1.3)
    assert c.mode == PLAIN and c.fallback_count == 1


def test_hybrid_model_that_pays_keeps_running():
    c = hybrid_ctl()
    for _ in range(100):  # 3 tokens a verify for 1.9 plain steps
        c.on_verify(2, 10, 3, break_even=MODEL_PRICE)
    assert c.mode == SPEC and not c.model_off and c.model_backoff == 1


def test_hybrid_prices_reading_a_prompt_at_its_draft_models_depth(tiny_llama_dir):
    """HYBRID's n-grams fill a tree 9 deep with no draft KV; reading a prompt buys only the
    draft model's 3 levels. A catch-up that would pay at the n-grams' depth but not at the
    model's is not made: the request drafts with n-grams alone, at its own draft length."""
    from sglang.test.scheduler_driver import make_scheduler

    spec = make_scheduler(tiny_llama_dir, speculative_algorithm="HYBRID",
                          speculative_draft_model_path=tiny_llama_dir,
                          speculative_num_steps=3, speculative_num_draft_tokens=10,
                          speculative_disable_cost_model=False).spec
    assert spec.depth_of(10) == 9 and spec.catch_up_depth(10) == 3
    cm = spec.cost_model
    for budget, seconds in {1: 0.010, 10: 0.020}.items():
        for _ in range(cm.min_samples):
            cm.observe(1, budget, seconds)
    cm.observe_catch_up(100, 0.35)  # 3.5 ms a draft token
    rates = [0.9]  # a new request's probe rate
    # 64 tokens: 0.64 s plain; 9 deep at 0.9 saves 0.44 s, 3 deep 0.27 s; reading 100: 0.35 s
    assert cm.catch_up_pays(rates, spec.depth_of, 64, 100, 10)
    assert not cm.catch_up_pays(rates, spec.catch_up_depth, 64, 100, 10)
    assert cm.catch_up_pays(rates, spec.catch_up_depth, 640, 100, 10)  # a long answer: read
    prose = _fake_req("prose")
    for _ in range(6):
        spec.record(prose, 9, 0, 1)  # n-gram drafts rejected: its own length shrinks
    assert spec.decisions.own_budget(prose, 10) == 10  # with its model: the step's budget
    assert spec.decisions.own_budget(prose, 10, model_sits_out=True) == 2  # n-grams alone
    standalone = make_scheduler(tiny_llama_dir, speculative_algorithm="STANDALONE",
                                speculative_draft_model_path=tiny_llama_dir).spec
    assert standalone.catch_up_depth(4) == standalone.depth_of(4) == 3
    assert standalone.decisions.own_budget(prose, 4, model_sits_out=True) == 4
