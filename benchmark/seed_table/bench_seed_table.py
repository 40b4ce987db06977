"""The seed's table on this machine, scaled down: one long legal document through a MoE target
built from the real Qwen2.5-Coder-1.5B (`qwen1.5b-moefied-16x4`, experts offloaded, 25% and
50% of each layer's experts resident), the real Qwen 0.5B as the draft, greedy, batch 1.

Rows, cumulative as in the seed (plain 47 s -> speculation 21 s -> tree 16 s -> + expert
prefetch 9 s on a GPU, 180K tokens):
  plain            plain decoding, on-demand expert loads
  chain            + speculation, STANDALONE, a chain of --steps draft tokens
  tree             + a tree, width 2 and depth 4 (topk 2, 4 steps, 9 nodes verified)
  tree+prefetch    + the target's experts prefetched from the draft's hints (draft predictor)
First with the fallback, cost model and prefetch gate off (each part's own speed), then the
same rows with the server's defaults (`/default`: fallback, cost model and gate on).
Per row: total seconds for the document (prefill + every new token), TTFT, decode tok/s
after the first token, end-to-end tok/s; median and range over --rounds interleaved rounds
(round r runs every row once; every run in a fresh process, its models loaded anew), and
each row's total time over plain's beside the seed's ratios. Every row must emit the same
tokens. Each finished run is kept in `<name>_parts.json`: an interrupted run resumes there.

    python benchmark/seed_table/bench_seed_table.py [--prompt-tokens 2048] [--new-tokens 64]
        [--fractions 0.25,0.5] [--rounds 2] [--model qwen1.5b-moefied-16x4]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from typing import Any, Dict, List, Tuple

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(_ROOT, "benchmark"))
sys.path.insert(0, os.path.join(_ROOT, "benchmark", "moe_offload"))
sys.path.insert(0, os.path.join(_ROOT, "python"))
from common import (RESULTS, keep_large_tensors_mmapped, machine_info, plot_bars,  # noqa: E402
                    prompt_ids, run_isolated)
from peers.summary import spread  # noqa: E402

# the seed's seconds per 180K-token document on a GPU (the brief)
SEED_SECONDS = {"plain": 47.0, "chain": 21.0, "tree": 16.0, "tree+prefetch": 9.0}
# row -> run_setting options (the draft is added for every row but plain)
ROWS: Dict[str, Dict[str, Any]] = {
    "plain": {},
    "chain": {"topk": 1},
    "tree": {"topk": 2, "steps": 4},
    "tree+prefetch": {"topk": 2, "steps": 4, "predictor": "draft"},
}
KEEP = ("tok_s", "ttft_s", "total_s", "e2e_tok_s", "accept_length", "hit_rate", "stall_s",
        "bytes_loaded", "recall", "precision", "mean_verify_s", "target_passes")


def one_run(path: str, draft: str, prompt: List[int], n_new: int, slots: int, row: str,
            defaults: bool, steps: int, dtype: str) -> Dict[str, Any]:
    """One row in this (spawned) process: the figures and the tokens."""
    import torch

    keep_large_tensors_mmapped()  # a freed model is returned
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    from bench_prefetch import run_setting

    opts = {"steps": steps, **ROWS[row]}
    r = run_setting(path, None if row == "plain" else draft, prompt, n_new, slots, dtype=dtype,
                    server_defaults=defaults, max_total_tokens=len(prompt) + n_new + 64, **opts)
    return {**{k: r.get(k) for k in KEEP}, "tokens": r["tokens"]}


def table(runs: Dict[str, List[Dict[str, Any]]]) -> Dict[str, Dict[str, Any]]:
    """Per row: spreads of the timings, and total time over the same residency's plain."""
    out: Dict[str, Dict[str, Any]] = {}
    for key, rs in runs.items():
        out[key] = {m: dataclasses.asdict(spread([r[m] for r in rs]))
                    for m in ("total_s", "ttft_s", "tok_s", "e2e_tok_s", "accept_length",
                              "hit_rate")}
    for key, row in out.items():
        pct, name = key.split(" ", 1)
        plain = out.get(f"{pct} plain", {}).get("total_s", {}).get("median")
        base = name.split("/")[0]
        if plain and row["total_s"]["median"]:
            row["time_over_plain"] = round(row["total_s"]["median"] / plain, 3)
            row["seed_time_over_plain"] = round(SEED_SECONDS[base] / SEED_SECONDS["plain"], 3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen1.5b-moefied-16x4")
    ap.add_argument("--prompt-tokens", type=int, default=2048)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--steps", type=int, default=3, help="draft tokens of the chain row")
    ap.add_argument("--fractions", default="0.25,0.5")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--name", default="seed_table")
    ap.add_argument("--fresh", action="store_true", help="ignore the kept runs")
    ap.add_argument("--no-warmup", action="store_true",
                    help="skip the untimed run before the first timed one")
    args = ap.parse_args()

    from bench_moe import fixture_path
    from bench_prefetch import draft_for
    from transformers import AutoTokenizer

    path = fixture_path(args.model)
    cfg = json.load(open(os.path.join(path, "config.json")))
    experts = cfg.get("num_local_experts") or cfg.get("num_experts") or cfg["n_routed_experts"]
    prompt = prompt_ids(AutoTokenizer.from_pretrained(path), args.prompt_tokens)
    draft = draft_for(args.model)
    plan: List[Tuple[str, float, str, bool]] = []  # (key, fraction, row, defaults)
    for frac in (float(f) for f in args.fractions.split(",")):
        pct = f"{int(frac * 100)}%"
        plan += [(f"{pct} {row}", frac, row, False) for row in ROWS]
        plan += [(f"{pct} {row}/default", frac, row, True) for row in ROWS if row != "plain"]
    parts_path = os.path.join(RESULTS, args.name + "_parts.json")
    setup = {"model": args.model, "prompt_tokens": len(prompt), "new_tokens": args.new_tokens,
             "steps": args.steps, "dtype": args.dtype}
    kept: Dict[str, Any] = {}
    if os.path.isfile(parts_path) and not args.fresh:
        with open(parts_path) as f:
            kept = json.load(f)
        if kept.get("setup") != setup:
            sys.exit(f"{parts_path} holds runs of another setup {kept.get('setup')}: "
                     "pass --fresh or another --name")
    done: Dict[str, Dict[str, Any]] = kept.get("runs", {})  # "key#round" -> figures
    t0 = time.time()
    if len(done) < len(plan) * args.rounds and not args.no_warmup:
        # one untimed run first: the first timed run of a round paid the experts' cold reads
        # from disk (seed_table.json round 1: plain's first token 29.1 s, round 2 15.7 s)
        key, frac, row, defaults = plan[0]
        run_isolated(one_run, path, draft, prompt, args.new_tokens,
                     max(cfg.get("num_experts_per_tok", 2), round(experts * frac)), row,
                     defaults, args.steps, args.dtype)
    for r in range(args.rounds):
        for key, frac, row, defaults in plan:
            tag = f"{key}#{r}"
            if tag in done:
                continue
            slots = max(cfg.get("num_experts_per_tok", 2), round(experts * frac))
            res = run_isolated(one_run, path, draft, prompt, args.new_tokens, slots, row,
                               defaults, args.steps, args.dtype)
            done[tag] = res
            with open(parts_path, "w") as f:
                json.dump({"setup": setup, "runs": done}, f)
            print(f"round {r + 1}/{args.rounds} {key:26s} total {res['total_s']:7.1f} s, "
                  f"ttft {res['ttft_s']:6.1f} s, decode {res['tok_s']:5.2f} tok/s, accept "
                  f"{res['accept_length'] or 0:.2f}, hit {res['hit_rate']:.2f}", flush=True)
    runs = {key: [done[f"{key}#{r}"] for r in range(args.rounds)] for key, *_ in plan}
    ref = runs[plan[0][0]][0]["tokens"]
    same = {k: all(x["tokens"] == ref for x in rs) for k, rs in runs.items()}
    rows = table(runs)
    for k, v in rows.items():
        print(f"{k:26s} total {v['total_s']['median']:7.1f} s ({v['total_s']['low']}-"
              f"{v['total_s']['high']}), ttft {v['ttft_s']['median']} s, decode "
              f"{v['tok_s']['median']} tok/s, e2e {v['e2e_tok_s']['median']} tok/s, "
              f"{v.get('time_over_plain', 1.0)}x plain's time (seed "
              f"{v.get('seed_time_over_plain', 1.0)}x)")
    print("same tokens in every row and round:", all(same.values()))
    payload = {"command": " ".join(sys.argv), **setup, "draft": os.path.basename(draft),
               "experts_per_layer": experts, "rounds": args.rounds,
               "fractions": args.fractions, "seed_seconds": SEED_SECONDS,
               "machine": machine_info(), "seconds": round(time.time() - t0),
               "same_tokens": same, "table": rows,
               "runs": {k: [{m: x[m] for m in KEEP} for x in rs] for k, rs in runs.items()}}
    out = os.path.join(RESULTS, args.name + ".json")
    with open(out, "w") as f:
        json.dump(payload, f, indent=2)
    keys = list(rows)
    plot_bars(out[:-5] + ".png", f"Seed's table, scaled down: {args.model}, {len(prompt)}-token "
              f"document, {args.new_tokens} new tokens, median of {args.rounds}",
              keys, {"total s": [rows[k]["total_s"]["median"] for k in keys],
                     "TTFT s": [rows[k]["ttft_s"]["median"] for k in keys]}, "seconds",
              rotation=45)
    print("saved", out)


if __name__ == "__main__":
    main()
