"""`python -m sglang.bench_serving` against the test server: every backend completes its
requests and the JSON line has the throughput and latency percentiles."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.slow  # server / engine processes, or a long scenario: not in make test-fast


def _args(server, backend, dataset, out_file):
    return ["--base-url", server.base_url, "--backend", backend, "--dataset-name", dataset,
            "--num-prompts", "6", "--random-input-len", "24", "--random-output-len", "4",
            "--random-range-ratio", "1", "--gsp-num-groups", "2", "--gsp-system-prompt-len", "40",
            "--gsp-question-len", "5", "--gsp-output-len", "4", "--max-concurrency", "3",
            "--request-rate", "50", "--output-file", str(out_file)]


def _check(res):
    assert res["completed"] == 6 and res["failed"] == 0, res
    assert res["total_output_tokens"] == 6 * 4
    assert res["output_throughput"] > 0 and res["request_throughput"] > 0
    for key in ("mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_itl_ms", "p99_itl_ms",
                "mean_tpot_ms", "median_e2e_latency_ms", "p99_e2e_latency_ms"):
        assert res[key] > 0, key
    assert res["p99_ttft_ms"] >= res["median_ttft_ms"]


def test_bench_serving_cli(server, tmp_path, capsys):
    from sglang.bench_serving import main

    out_file = tmp_path / "bench.jsonl"
    main(_args(server, "sglang", "random-ids", out_file))  # what `python -m` runs
    assert "Serving Benchmark Result" in capsys.readouterr().out
    _check(json.loads(out_file.read_text().splitlines()[-1]))


@pytest.mark.parametrize("backend,dataset", [("sglang", "random"), ("sglang-oai", "random"),
                                             ("sglang-oai-chat", "generated-shared-prefix")])
def test_bench_serving_backends(server, tmp_path, backend, dataset):
    from sglang.bench_serving import parse_args, run_benchmark

    out_file = tmp_path / "bench.jsonl"
    res = run_benchmark(parse_args(_args(server, backend, dataset, out_file)))
    _check(res)
    assert json.loads(out_file.read_text().splitlines()[-1]) == res
