"""Start-up calibration of the cost model: real steps of dummy requests, then all free."""

from __future__ import annotations

from sglang.srt.managers.spec_calibration import calibrate
from sglang.test.scheduler_driver import greedy, make_scheduler, run


def _spec_sched(target: str, draft: str, **kw):
    return make_scheduler(target, speculative_algorithm="STANDALONE",
                          speculative_draft_model_path=draft, speculative_num_steps=4,
                          speculative_num_draft_tokens=5, speculative_disable_cost_model=False,
                          max_running_requests=8, **kw)


def test_calibration_times_plain_and_speculation_then_frees_everything(tiny_llama_dir):
    """The cost model starts serving with plain and speculative step times at the batch
    sizes calibrated; the calibration requests leave no KV, rows, controllers, acceptance
    or counters behind, and what the server answers next is unchanged (lossless)."""
    sched = _spec_sched(tiny_llama_dir, tiny_llama_dir)
    spec, cm = sched.spec, sched.spec.cost_model
    kept = (spec.rate_prior, spec.total_verify_ct, spec.total_accepted_tokens,
            cm.catch_up_token_s)
    report = calibrate(sched, seconds=120)
    assert report is not None and report.stopped
    assert report.batch_sizes[0] == 1
    assert report.batch_sizes == sorted(report.batch_sizes)
    assert set(report.batch_sizes) <= {1, 2, 3, 4, 8}
    for bs in report.batch_sizes:
        assert cm._measured(bs, 1)
    assert cm._measured(1, 2)  # the smallest budget is always timed at batch size 1
    assert report.step_seconds["1/1"] > 0 and report.step_seconds["1/2"] > 0
    # short prompts would misprice a draft token: the price stays unknown
    assert (spec.rate_prior, spec.total_verify_ct, spec.total_accepted_tokens,
            cm.catch_up_token_s) == kept
    assert not spec.policy.forced
    sched.check_all_free()  # also: no controllers left for the calibration requests

    prompts = [[1, 5, 9, 13, 5, 9, 13, 5, 9], [2, 7, 7, 3, 11, 4]]
    got = run(sched, prompts, [greedy(24)] * 2)
    plain = run(make_scheduler(tiny_llama_dir), prompts, [greedy(24)] * 2)
    assert {k: v[0] for k, v in got.items()} == {k: v[0] for k, v in plain.items()}
    sched.check_all_free()


def test_calibration_off_or_without_a_cost_model_does_nothing(tiny_llama_dir):
    sched = _spec_sched(tiny_llama_dir, tiny_llama_dir)
    assert calibrate(sched, seconds=0) is None
    assert not sched.spec.cost_model.times
    no_model = make_scheduler(tiny_llama_dir, speculative_algorithm="STANDALONE",
                              speculative_draft_model_path=tiny_llama_dir)
    assert calibrate(no_model, seconds=30) is None  # cost model disabled
    ngram = make_scheduler(tiny_llama_dir, speculative_algorithm="NGRAM",
                           speculative_disable_cost_model=False)
    assert calibrate(ngram, seconds=30) is None  # no draft model: explored online
    assert not ngram.spec.cost_model.times
    assert calibrate(make_scheduler(tiny_llama_dir), seconds=30) is None  # no speculation


def test_a_negative_calibration_time_is_refused_with_what_to_change(tiny_llama_dir):
    import pytest

    from sglang.srt.server_args import ServerArgs

    with pytest.raises(ValueError, match="--speculative-calibrate-seconds must be >= 0"):
        ServerArgs(model_path=tiny_llama_dir, speculative_calibrate_seconds=-1)
