"""What tensor parallelism costs on this machine: decode step time of one model at TP=1
(1 and 2 threads) and TP=2 (two gloo processes, one thread each), and the seconds the
collectives take per step. On a 2-core CPU TP=2 cannot be faster than TP=1 with both cores
(the same cores, plus the collectives): this measures correctness's price, not a speed-up.

    python benchmark/parallel/bench_tp_overhead.py [--rounds 3] [--steps 32] [--name tp_overhead]

Layouts run in turns, round by round (each in fresh processes), so drift falls on all alike.
JSON + plot under benchmark/results/.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time
from typing import Dict, List

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))

LAYOUTS = ["tp1 x1 thread", "tp1 x2 threads", "tp2 x1 thread"]


def decode_steps(model_path: str, dtype: str, prompt_len: int, steps: int) -> Dict[str, object]:
    """Prefill `prompt_len` tokens, then time `steps` greedy decode steps (batch 1)."""
    import torch

    from sglang.srt.distributed.parallel_state import COLLECTIVES
    from sglang.test.harness import TinyRunner

    runner = TinyRunner(model_path, dtype=dtype, max_context=prompt_len + steps + 8,
                        kv_slots=prompt_len + steps + 64)
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(100, 20000, (prompt_len,), generator=gen).tolist()
    logits = runner.prefill([prompt])
    times, calls, coll = [], [], []
    for _ in range(steps):
        tok = logits.argmax(-1).tolist()
        c0, s0 = COLLECTIVES.calls, COLLECTIVES.seconds
        t0 = time.perf_counter()
        logits = runner.decode(tok)
        times.append(time.perf_counter() - t0)
        calls.append(COLLECTIVES.calls - c0)
        coll.append(COLLECTIVES.seconds - s0)
    runner.release()
    return {"step_s": times, "collective_calls": calls, "collective_s": coll}


def run_layout(layout: str, args) -> Dict[str, object]:
    import torch

    from sglang.test.tp_harness import run_ranks

    job = functools.partial(decode_steps, args.model, args.dtype, args.prompt_len, args.steps)
    if layout.startswith("tp2"):
        return run_ranks(job, size=2)[0]  # rank 0's view (the ranks step in lockstep)
    torch.set_num_threads(2 if "x2" in layout else 1)
    return job()


def main() -> None:
    from common import RESULTS, machine_info, plot_bars, save

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="HF folder or GGUF (default: Qwen2.5-Coder-0.5B)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--name", default="tp_overhead")
    args = ap.parse_args()
    if args.model is None:
        from sglang.test.real_assets import qwen_gguf

        args.model = qwen_gguf("0.5b")
    rounds: Dict[str, List[Dict[str, object]]] = {l: [] for l in LAYOUTS}
    for r in range(args.rounds):
        for layout in LAYOUTS:
            res = run_layout(layout, args)
            rounds[layout].append(res)
            print(f"round {r + 1} {layout}: median step "
                  f"{statistics.median(res['step_s']) * 1e3:.1f} ms, collectives "
                  f"{statistics.median(res['collective_s']) * 1e3:.2f} ms in "
                  f"{statistics.median(res['collective_calls'])} calls", flush=True)
    summary = {}
    for layout, runs in rounds.items():
        steps = [t for run in runs for t in run["step_s"]]
        coll = [t for run in runs for t in run["collective_s"]]
        summary[layout] = {"median_step_ms": round(statistics.median(steps) * 1e3, 2),
                           "median_collective_ms": round(statistics.median(coll) * 1e3, 3),
                           "collective_calls_per_step": runs[0]["collective_calls"][0],
                           "round_medians_ms": [round(statistics.median(run["step_s"]) * 1e3, 2)
                                                for run in runs]}
    base = summary["tp1 x2 threads"]["median_step_ms"]
    for layout in LAYOUTS:
        summary[layout]["x_tp1_2threads"] = round(summary[layout]["median_step_ms"] / base, 3)
    out = {"command": " ".join(["python"] + sys.argv), "machine": machine_info(),
           "model": args.model, "dtype": args.dtype,
           "prompt_len": args.prompt_len, "steps": args.steps, "rounds": args.rounds,
           "summary": summary, "raw": rounds}
    save(args.name, out)
    print(summary)
    plot_bars(os.path.join(RESULTS, args.name + ".png"),
              f"TP overhead, {os.path.basename(args.model)} {args.dtype}, "
              f"{args.prompt_len}-token context", LAYOUTS,
              {"decode step": [summary[l]["median_step_ms"] for l in LAYOUTS],
               "of which collectives": [summary[l]["median_collective_ms"] for l in LAYOUTS]},
              "ms per step (median)")


if __name__ == "__main__":
    main()
