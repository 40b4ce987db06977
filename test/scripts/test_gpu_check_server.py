"""scripts/gpu_check_server.py --cpu-smoke: the GPU check's own servers and comparisons on
the CPU (tiny Llama plain / NGRAM / STANDALONE tree, Mixtral with 2 of 8 experts resident
and prefetch, DeepSeek-V2 MLA), so the run a GPU session makes takes a path CI keeps
working. It starts the shipped server, unpatched."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # starts real servers

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "gpu_check_server.py")


def test_gpu_check_server_smoke_passes_on_cpu(tmp_path):
    out = tmp_path / "check.json"
    proc = subprocess.run([sys.executable, SCRIPT, "--cpu-smoke", "--json", str(out)],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["passed"] and result["complete"] and result["device"] == "cpu"
    rows = {(r["model"], r["config"]) for r in result["rows"]}
    assert ("llama", "STANDALONE tree") in rows and ("deepseek_v2 (MLA)", "plain") in rows
    assert all(r["tokens_equal"] for r in result["rows"])
    syncs = {(r["model"], r["config"]): r["host_syncs"] for r in result["rows"]}
    # one read of the batch's tokens per plain greedy decode step, in a real server process
    assert syncs[("llama", "plain")] == {"next_token_ids": 1.0}
    assert syncs[("llama", "STANDALONE tree")].get("draft_topk", 0) > 0
    # /server_info says whether decode replayed CUDA graphs, and why not here
    graph = {(r["model"], r["config"]): r["cuda_graph"] for r in result["rows"]}
    assert graph[("llama", "plain")]["enabled"] is False
    assert "cpu" in graph[("llama", "plain")]["why_off"]
