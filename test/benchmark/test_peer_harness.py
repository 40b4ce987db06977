"""The peer harness (benchmark/peers/): timing and summary on recorded event streams, the
reference flag, the machine-state sampling, and one real run of the harness (two of our
configurations in their own processes, decoding in turns)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmark"))

from peers.machine import busy_and_steal, cpu_facts  # noqa: E402
from peers.reference import reference_for  # noqa: E402
from peers.summary import measure, reference_check, spread, summarize  # noqa: E402


def test_measure_times_first_token_decode_and_end_to_end_from_stamps():
    # request at t=10; first token at 12 (prefill), then steps giving 1 and 3 tokens
    m = measure(10.0, [(12.0, 1), (12.5, 1), (13.0, 3)])
    assert m.ttft_s == pytest.approx(2.0)
    assert m.decode_tok_s == pytest.approx(4 / 1.0)  # the first token's prefill left out
    assert m.e2e_tok_s == pytest.approx(5 / 3.0)
    assert (m.tokens, m.steps) == (5, 3)


def test_measure_short_or_broken_streams():
    assert measure(0.0, []).ttft_s is None
    one = measure(0.0, [(1.0, 1)])
    assert one.ttft_s == 1.0 and one.decode_tok_s is None and one.e2e_tok_s == 1.0
    # a speculative first step that gives several tokens: only later tokens count for decode
    assert measure(0.0, [(1.0, 4), (2.0, 2)]).decode_tok_s == pytest.approx(2.0)
    with pytest.raises(ValueError):
        measure(0.0, [(2.0, 1), (1.0, 1)])
    with pytest.raises(ValueError):
        measure(5.0, [(4.0, 1)])


def test_spread_is_median_and_range_over_rounds_with_a_value():
    s = spread([3.0, None, 1.0, 2.0])
    assert (s.median, s.low, s.high, s.n) == (2.0, 1.0, 3.0, 3)
    assert spread([None]).median is None and spread([]).n == 0


def test_reference_flags_a_peer_far_below_its_known_speed():
    low = reference_check(18.0, 22.1)
    assert low["far_below"] and low["ratio"] == pytest.approx(0.814, abs=1e-3)
    assert not reference_check(20.0, 22.1)["far_below"]  # 0.905: within 15%
    assert not reference_check(30.0, 22.1)["far_below"]  # above is never flagged
    assert reference_check(None, 22.1)["checked"] is False
    assert reference_check(20.0, None)["checked"] is False


def test_reference_lookup_only_at_a_recorded_context():
    assert reference_for("llama.cpp", "0.5b", "q4_k_m", 1024) == 40.6
    assert reference_for("vllm", "0.5b", "bfloat16", 4096 + 200) == 23.2
    assert reference_for("vllm", "0.5b", "bfloat16", 16384) is None  # no figure, no guess
    assert reference_for("vllm", "0.5b", "float32", 1024) is None
    assert reference_for("ours", "0.5b", "bfloat16", 1024) is None


def _rec(prompt, rnd, start, stamps, ids):
    return {"prompt": prompt, "round": rnd, "start": start, "stamps": stamps, "output_ids": ids}


def test_summarize_rows_ratios_agreement_and_reference():
    # two engines, two rounds each; every step 0.1 s apart; spec steps give 2 tokens
    plain = [_rec("p", r, 0.0, [(1.0 + 0.1 * i, 1) for i in range(5)], [1, 2, 3, 4, 5])
             for r in range(2)]
    spec = [_rec("p", r, 0.0, [(1.0, 1), (1.1, 2), (1.2, 2)], [1, 2, 3, 9, 9])
            for r in range(2)]
    peer = [_rec("p", 0, 0.0, [(2.0, 1), (2.5, 1)], [7, 7]),
            _rec("p", 1, 0.0, [(2.0, 1), (2.25, 1)], [7, 7])]
    runs = {"ours plain": plain, "ours NGRAM": spec, "vllm plain": peer}
    plain_of = {"ours plain": "ours plain", "ours NGRAM": "ours plain",
                "vllm plain": "vllm plain"}
    table = summarize(runs, plain_of, "ours plain", {("vllm plain", "p"): 10.0})
    row = table["p"]
    assert row["ours plain"]["decode_tok_s"]["median"] == pytest.approx(10.0)
    assert row["ours NGRAM"]["decode_tok_s"]["median"] == pytest.approx(20.0)
    assert row["ours NGRAM"]["x_own_plain"] == pytest.approx(2.0)
    assert row["ours NGRAM"]["agree_with_own_plain"] == 3
    assert row["ours NGRAM"]["same_as_own_plain"] is False
    assert row["ours plain"]["same_as_own_plain"] is True
    v = row["vllm plain"]
    assert (v["decode_tok_s"]["low"], v["decode_tok_s"]["high"]) == (2.0, 4.0)
    assert v["decode_tok_s"]["median"] == pytest.approx(3.0)
    assert v["x_our_plain"] == pytest.approx(0.3)
    assert v["reference"]["far_below"] and v["reference"]["ratio"] == pytest.approx(0.3)
    assert "reference" not in row["ours plain"]


def test_machine_state_from_proc_files(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("model name\t: Test CPU 9000\nflags\t\t: fpu avx2 fma avx512f\n\n"
                    "model name\t: Test CPU 9000\nflags\t\t: fpu\n")
    facts = cpu_facts(str(info))
    assert facts["cpu"] == "Test CPU 9000"
    assert facts["flags"]["avx2"] and facts["flags"]["avx512f"] and not facts["flags"]["amx_bf16"]
    # user nice system idle iowait irq softirq steal: 100 ticks, 20 idle, 10 stolen
    before = [0] * 8
    after = [50, 0, 20, 15, 5, 0, 0, 10]
    assert busy_and_steal(before, after) == {"busy": 0.8, "steal": 0.1}
    assert busy_and_steal(None, after) == {"busy": None, "steal": None}


@pytest.mark.slow
def test_harness_runs_two_configurations_in_turns(tmp_path):
    """The real harness: our plain and NGRAM decoding (float32) in their own processes, in
    turns for 2 rounds; the JSON holds both, with the same tokens and the machine's state."""
    from sglang.test.fixtures import smollm2_gguf_path

    out = tmp_path / "out"
    cmd = [sys.executable, os.path.join(ROOT, "benchmark", "peers", "bench_peers.py"),
           "--model", smollm2_gguf_path(), "--only", "ours plain fp32,ours NGRAM fp32",
           "--contexts", "256", "--rounds", "2", "--new-tokens", "8", "--out-dir", str(out),
           "--name", "t"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((out / "t.json").read_text())
    row = result["table"]["gdpr-256"]
    assert set(row) == {"ours plain fp32", "ours NGRAM fp32"}
    for cell in row.values():
        assert cell["decode_tok_s"]["n"] == 2 and cell["tokens"] == 8
    assert row["ours NGRAM fp32"]["same_as_own_plain"] is True  # float32: lossless
    assert [s["round"] for s in result["groups"][0]["state"]["rounds"]] == [0, 1]
    assert "flags" in result["machine"] and result["machine"]["copy_bandwidth_gbs_at_start"] > 0
    # a rerun keeps the complete configurations instead of redoing them
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0 and "kept from" in again.stdout
