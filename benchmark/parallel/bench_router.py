"""Review traffic through the real sglang-router: throughput and prefix-cache hits of 2
workers (one thread each) behind the router, cache-aware against round-robin, next to 1
worker with both threads served directly. On this 2-core machine the replicas share the
cores: the question is what the routing policy does to cache reuse, not more compute.

Traffic: 4 documents (EU laws, a licence, a table contract; 1K tokens each) x 6 questions,
sent by 4 concurrent clients in a fixed shuffled order; greedy, 32 new tokens, ignore_eos.

    python benchmark/parallel/bench_router.py [--rounds 2] [--name router_review]

Layouts run in turns, round by round, each with fresh processes. JSON + plot under
benchmark/results/.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Dict, List

import requests

from sglang.srt.utils import free_port, wait_until_ready

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(HERE, ".."))

LAYOUTS = ["1 worker x2 threads", "2 workers round_robin", "2 workers cache_aware"]
QUESTIONS = ["Quote the first obligation word for word.", "Summarise the text in two sentences.",
             "List the defined terms.", "Who are the parties?", "What must be kept, and for how long?",
             "Name one deadline in the text."]


def _start(cmd: List[str], ready_url: str, log_path: str, timeout: float = 300):
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "python"))
    proc = subprocess.Popen(cmd, stdout=open(log_path, "w"), stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)
    state = wait_until_ready(proc, lambda: requests.get(ready_url, timeout=5).status_code == 200,
                             timeout, interval=0.5)
    if state != "ready":
        raise RuntimeError(f"{cmd[:4]} {state}; see {log_path}")
    return proc


def _stop(procs) -> None:
    for p in procs:
        try:
            os.killpg(p.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    for p in procs:
        try:
            p.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)


def start_layout(layout: str, model: str, logs: str):
    def worker(threads: int):
        port = free_port()
        cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", model, "--dtype",
               "bfloat16", "--port", str(port), "--num-threads", str(threads),
               "--max-total-tokens", "40000", "--context-length", "2048"]
        return _start(cmd, f"http://127.0.0.1:{port}/health_generate",
                      os.path.join(logs, f"worker-{port}.log")), f"http://127.0.0.1:{port}"

    if layout.startswith("1 worker"):
        proc, url = worker(2)
        return [proc], url
    (p1, u1), (p2, u2) = worker(1), worker(1)
    port = free_port()
    policy = layout.split()[-1]
    cmd = [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port",
           str(port), "--worker-urls", u1, u2, "--policy", policy, "--prometheus-port",
           str(free_port()), "--log-level", "warn"]
    router = _start(cmd, f"http://127.0.0.1:{port}/readiness", os.path.join(logs, "router.log"))
    return [router, p1, p2], f"http://127.0.0.1:{port}"


def traffic(tokenizer) -> List[str]:
    from spec_eval.eval_set import document
    from sglang.test.real_assets import truncate_to_tokens

    docs = [truncate_to_tokens(document(k), 1024, tokenizer) for k in ("dora", "cra", "license",
                                                                       "tables")]
    reqs = [d + "\n\nQuestion: " + q for d in docs for q in QUESTIONS]
    random.Random(0).shuffle(reqs)
    return reqs


def run(url: str, reqs: List[str], new_tokens: int, clients: int) -> Dict[str, float]:
    def one(text: str) -> Dict:
        r = requests.post(url + "/generate", timeout=600, json={"text": text, "sampling_params": {
            "max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}})
        r.raise_for_status()
        return r.json()["meta_info"]

    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(clients) as pool:
        metas = list(pool.map(one, reqs))
    wall = time.perf_counter() - t0
    prompt = sum(m["prompt_tokens"] for m in metas)
    cached = sum(m["cached_tokens"] for m in metas)
    out = sum(m["completion_tokens"] for m in metas)
    return {"wall_s": round(wall, 2), "output_tok_s": round(out / wall, 2),
            "total_tok_s": round((out + prompt - cached) / wall, 2),
            "cache_hit_rate": round(cached / prompt, 3), "requests": len(metas)}


def main() -> None:
    from common import RESULTS, machine_info, save
    from sglang.srt.model_loader.loader import load_tokenizer
    from sglang.test.real_assets import qwen_gguf

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--name", default="router_review")
    args = ap.parse_args()
    model = args.model or qwen_gguf("0.5b")
    reqs = traffic(load_tokenizer(model))
    logs = tempfile.mkdtemp(prefix="bench-router-")
    results: Dict[str, List[Dict]] = {l: [] for l in LAYOUTS}
    for r in range(args.rounds):
        for layout in LAYOUTS:
            procs, url = start_layout(layout, model, logs)
            try:
                res = run(url, reqs, args.new_tokens, args.clients)
            finally:
                _stop(procs)
            results[layout].append(res)
            print(f"round {r + 1} {layout}: {res}", flush=True)
    summary = {l: {k: statistics.median(x[k] for x in runs) for k in runs[0]}
               for l, runs in results.items()}
    save(args.name, {"command": " ".join(["python"] + sys.argv), "machine": machine_info(),
                     "model": model, "new_tokens": args.new_tokens,
                     "clients": args.clients, "rounds": args.rounds, "summary": summary,
                     "raw": results, "logs": logs})
    print(summary)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
        axes[0].bar(LAYOUTS, [summary[l]["total_tok_s"] for l in LAYOUTS])
        axes[0].set_ylabel("tokens/s (prefilled + generated)")
        axes[1].bar(LAYOUTS, [summary[l]["cache_hit_rate"] for l in LAYOUTS])
        axes[1].set_ylabel("prompt tokens from cache")
        for ax in axes:
            ax.tick_params(axis="x", labelrotation=15, labelsize=7)
        fig.suptitle(f"Review traffic through sglang-router, {os.path.basename(model)}")
        fig.tight_layout()
        fig.savefig(os.path.join(RESULTS, args.name + ".png"), dpi=120)
    except ImportError:
        pass


if __name__ == "__main__":
    main()
