"""The GPU check of what users run: the shipped server, unpatched, on `--device cuda`.

For each model (tiny random Llama; Mixtral with 2 of its 8 experts resident and prefetch;
DeepSeek-V2 with MLA; the embedded SmolLM2-135M), it starts
`python -m sglang.launch_server --device cuda` with plain decoding, NGRAM, a STANDALONE
chain and a STANDALONE tree (speculation forced on every step: the verify path is what is
checked), and compares each greedy answer with the same prompts on a CPU float32 server:
float32 must give the same tokens; bf16 (plain and NGRAM) reports its agreement (tokens in
common before the first difference). Then it times decode tok/s, plain (decode CUDA graphs on and off) against NGRAM, on
SmolLM2 at 1K and ~7.5K tokens of context (streamed: after the first token). One JSON file.

    python scripts/gpu_check_server.py [--json PATH] [--cpu-smoke]

`--cpu-smoke` runs the same servers and checks on `--device cpu` with fewer cases and no
timings (CI runs it, so the GPU run takes a path the tests keep working).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from typing import Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "python"))

from sglang.test.server_process import ServerProcess  # noqa: E402

NEW_TOKENS = 16
FORCED = ["--speculative-disable-cost-model", "--speculative-fallback-threshold", "0",
          "--speculative-calibrate-seconds", "0"]


def spec_args(config: str, model_dir: str) -> List[str]:
    if config == "plain":
        return []
    if config == "NGRAM":
        return ["--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "8", *FORCED]
    topk, nodes = {"STANDALONE chain": ("1", "4"), "STANDALONE tree": ("2", "8")}[config]
    return ["--speculative-algorithm", "STANDALONE", "--speculative-draft-model-path", model_dir,
            "--speculative-num-steps", "3", "--speculative-eagle-topk", topk,
            "--speculative-num-draft-tokens", nodes, *FORCED]


def build_models(root: str, smoke: bool) -> Dict[str, Dict]:
    """name -> {dir, args (every server of it), configs}."""
    from sglang.srt.server_args import default_model_path
    from sglang.test.fixtures import build_tiny_model
    from sglang.test.moe_fixtures import build_tiny_moe

    every = ["plain", "NGRAM", "STANDALONE chain", "STANDALONE tree"]
    models = {
        "llama": {"dir": build_tiny_model("llama", os.path.join(root, "llama")), "args": [],
                  "configs": ["plain", "NGRAM", "STANDALONE tree"] if smoke else every},
        "mixtral 2/8 resident + prefetch": {
            "dir": build_tiny_moe("mixtral", os.path.join(root, "mixtral")),
            "args": ["--moe-expert-cache-slots", "2", "--moe-prefetch-predictor", "layer_ahead"],
            "configs": ["plain"] if smoke else every},
        "deepseek_v2 (MLA)": {"dir": build_tiny_moe("deepseek_v2", os.path.join(root, "dsv2")),
                              "args": [], "configs": ["plain"] if smoke else every},
    }
    if not smoke:
        models["SmolLM2-135M"] = {"dir": default_model_path(), "args": [], "configs": every}
    return models


PROMPTS = ["The Licensee shall not sublicense the Software. The Licensee shall not",
           "Article 5. Personal data shall be processed lawfully. Article 6. Personal data"]


def greedy(srv: ServerProcess, text: str, n: int = NEW_TOKENS) -> List[int]:
    """Greedy token ids of exactly `n` new tokens (the server tokenizes: GGUF models too)."""
    resp = srv.post("/generate", json={"text": text, "sampling_params": {
        "max_new_tokens": n, "temperature": 0, "ignore_eos": True}}, timeout=600)
    resp.raise_for_status()
    return resp.json()["output_ids"]


def agreement(a: List[int], b: List[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def check_model(name: str, spec: Dict, device: str, dtypes: List[str]) -> List[Dict]:
    prompts = PROMPTS
    ref_srv = ServerProcess(spec["dir"], ["--device", "cpu", *spec["args"]])
    try:
        want = [greedy(ref_srv, p) for p in prompts]
    finally:
        ref_srv.stop()
    rows = []
    for config in spec["configs"]:
        for dtype in dtypes if config in ("plain", "NGRAM") else dtypes[:1]:
            t0 = time.time()
            row = {"model": name, "config": config, "dtype": dtype, "device": device}
            try:
                srv = ServerProcess(spec["dir"], ["--device", device, *spec["args"],
                                                  *spec_args(config, spec["dir"])], dtype=dtype)
                try:
                    got = [greedy(srv, p) for p in prompts]
                    srv.assert_all_slots_free()
                    # device-to-host reads per decode step, by site (utils/host_sync.py)
                    state = srv.get("/server_info").json()["internal_states"][0]
                    row["host_syncs"] = state["host_syncs"]["per_decode_step"]
                    row["cuda_graph"] = _graph_summary(state)
                finally:
                    srv.stop()
                row["agree_prefix"] = [agreement(g, w) for g, w in zip(got, want)]
                row["tokens_equal"] = got == want
                row["ok"] = row["tokens_equal"] or dtype != "float32"
            except Exception as e:  # report every case; the JSON says which failed
                row.update(ok=False, error=f"{type(e).__name__}: {str(e)[-1500:]}")
            row["seconds"] = round(time.time() - t0, 1)
            print(f"gpu_check_server: {name:32s} {config:17s} {dtype:8s} "
                  f"{'ok' if row['ok'] else 'FAIL'} agree {row.get('agree_prefix')}", flush=True)
            rows.append(row)
    return rows


def decode_rate(srv: ServerProcess, text: str, n: int) -> Dict:
    """Tokens per second after the first, from the streamed chunks' arrival times, and the
    prompt's length in tokens."""
    import requests

    stamps, count = [], 0
    with requests.post(srv.base_url + "/generate", stream=True, timeout=600, json={
            "text": text, "stream": True, "sampling_params": {
                "max_new_tokens": n, "temperature": 0, "ignore_eos": True}}) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if line.startswith(b"data:") and line != b"data: [DONE]":
                chunk = json.loads(line[5:])
                if "error" in chunk:  # the server's own message, not a KeyError here
                    raise RuntimeError(f"stream error: {chunk['error']}")
                meta = chunk["meta_info"]
                if meta["completion_tokens"] > count:
                    count = meta["completion_tokens"]
                    stamps.append((time.perf_counter(), count))
    if not stamps:
        raise RuntimeError("the stream carried no tokens")
    (t0, n0), (t1, n1) = stamps[0], stamps[-1]
    return {"decode_tok_s": round((n1 - n0) / (t1 - t0), 1) if t1 > t0 else None,
            "prompt_tokens": meta["prompt_tokens"]}


def _graph_summary(state: Dict) -> Dict:
    """Whether decode replayed CUDA graphs (/server_info's cuda_graph), in brief."""
    g = state.get("cuda_graph", {})
    return {k: g[k] for k in ("enabled", "why_off", "replays", "eager", "capture_seconds",
                              "memory_bytes") if k in g}


TIMED = {"plain": [], "plain, no CUDA graphs": ["--disable-cuda-graph"],
         "NGRAM": ["--speculative-algorithm", "NGRAM"]}


def timings(device: str) -> List[Dict]:
    """SmolLM2 bf16: plain (with and without decode graphs) against NGRAM at ~1K and ~7.5K
    tokens of context (its window is 8K), 128 new tokens."""
    from sglang.srt.server_args import default_model_path

    model = default_model_path()
    out = []
    for config, extra in TIMED.items():
        try:
            srv = ServerProcess(model, ["--device", device, *extra], dtype="bfloat16")
        except Exception as e:  # reported, as check_model does
            out.append({"config": config, "error": f"{type(e).__name__}: {str(e)[-1500:]}"})
            continue
        try:
            for ctx in (1024, 7680):  # at most ~4 characters a token in this text
                prompt = (PROMPTS[0] + " ") * (ctx * 4 // (len(PROMPTS[0]) + 1))
                try:
                    greedy(srv, prompt, 4)  # warm: the prefix is cached, kernels compiled
                    got = decode_rate(srv, prompt, 128)
                    # the step's device-to-host reads per decode step, by site (host_sync.py)
                    state = srv.get("/server_info").json()["internal_states"][0]
                    got["host_syncs_per_decode_step"] = state["host_syncs"]["per_decode_step"]
                    got["cuda_graph"] = _graph_summary(state)
                except Exception as e:
                    got = {"error": f"{type(e).__name__}: {str(e)[-1500:]}"}
                out.append({"config": config, "context": ctx, **got})
                print(f"gpu_check_server: SmolLM2 {config} ~{ctx}: {got}", flush=True)
        finally:
            srv.stop()
    return out


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None, help="default: benchmark/results/gpu_check_server"
                    ".json (cpu_smoke: a temp file)")
    ap.add_argument("--cpu-smoke", action="store_true")
    args = ap.parse_args(argv)
    t0 = time.time()
    device = "cpu" if args.cpu_smoke else "cuda"
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("gpu_check_server: no CUDA device here; --cpu-smoke checks the script on CPU")
            return 0
    dtypes = ["float32"] if args.cpu_smoke else ["float32", "bfloat16"]
    path = args.json or (tempfile.mktemp(suffix=".json") if args.cpu_smoke else os.path.join(
        os.path.dirname(HERE), "benchmark", "results", "gpu_check_server.json"))
    result: Dict = {"device": device, "rows": [], "timings": [], "complete": False}

    def save() -> None:  # after every model: a run stopped by its time limit keeps its rows
        result["passed"] = all(r["ok"] for r in result["rows"])
        result["seconds"] = round(time.time() - t0, 1)
        with open(path, "w") as f:
            json.dump(result, f, indent=1)

    with tempfile.TemporaryDirectory(prefix="gpu_check_server_") as root:
        for name, spec in build_models(root, args.cpu_smoke).items():
            if name == "SmolLM2-135M":  # the speed figures before the last model's checks:
                result["timings"] = timings(device)  # a time limit then cuts correctness rows
                save()
            result["rows"] += check_model(name, spec, device, dtypes)
            save()
    result["complete"] = True
    save()
    print(f"gpu_check_server: {'PASS' if result['passed'] else 'FAIL'} in {result['seconds']} s;"
          f" {path}")
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
