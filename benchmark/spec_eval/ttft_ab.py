"""Time to first token, A/B: configurations as Schedulers in one process, the same prompts of
the held-out set prefilled cold in turns (the cache flushed before each), so the VM's drift
falls on all alike. Per request: seconds from add_request to the first token, the steps it
took and each step's seconds, and the time outside step() (a diagnosis tool for issue 28's
"a STANDALONE server's first token comes later although its draft reads nothing").

    python benchmark/spec_eval/ttft_ab.py plain,STANDALONE tables/list/1K,cra/quote/1K [repeats]

Prints one line per request and the medians; writes benchmark/results/ttft_ab.json.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from common import RESULTS, machine_info  # noqa: E402


def main() -> None:
    from sglang.srt.managers.io_struct import TokenizedGenerateReqInput
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.model_loader.loader import load_tokenizer
    from sglang.srt.sampling.sampling_params import SamplingParams
    from sglang.srt.server_args import ServerArgs
    from sglang.test.real_assets import qwen_pair
    from spec_eval.eval_set import eval_prompts

    algos, names = sys.argv[1].split(","), sys.argv[2].split(",")
    repeats = int(sys.argv[3]) if len(sys.argv) > 3 else 3
    draft, target = qwen_pair()
    prompts = [p for p in eval_prompts(load_tokenizer(target)) if p["name"] in names]
    longest = max(len(p["ids"]) for p in prompts) + 128
    scheds = {}
    for a in algos:
        kw = {} if a == "plain" else {"speculative_algorithm": a}
        if a in ("HYBRID", "STANDALONE"):
            kw["speculative_draft_model_path"] = draft
        scheds[a] = Scheduler(ServerArgs(model_path=target, dtype="bfloat16",
                                         context_length=longest,
                                         max_total_tokens=2 * longest + 4096, **kw))
        scheds[a].calibrate()  # as the server's scheduler process does
    rows = []
    for rep in range(repeats):
        for p in prompts:
            for a, s in scheds.items():
                s.flush_cache()
                params = SamplingParams(max_new_tokens=2, temperature=0.0, ignore_eos=True)
                params.normalize()
                start = time.perf_counter()
                s.add_request(TokenizedGenerateReqInput(rid=f"{p['name']}#{rep}",
                                                        input_ids=p["ids"],
                                                        sampling_params=params, stream=True))
                added = time.perf_counter()
                steps, first = [], None
                while first is None:
                    t0 = time.perf_counter()
                    ups = s.step()
                    t1 = time.perf_counter()
                    steps.append(round(t1 - t0, 3))
                    if any(u.new_output_ids for u in ups):
                        first = t1
                while not s.is_idle():
                    s.step()
                ttft = first - start
                row = {"config": a, "prompt": p["name"], "repeat": rep, "ttft_s": round(ttft, 3),
                       "add_request_s": round(added - start, 4), "steps_s": steps,
                       "outside_steps_s": round(ttft - sum(steps) - (added - start), 4)}
                rows.append(row)
                print(row, flush=True)
    summary = {}
    for p in prompts:
        for a in algos:
            xs = [r["ttft_s"] for r in rows if r["config"] == a and r["prompt"] == p["name"]]
            summary[f"{p['name']} {a}"] = {"median_ttft_s": round(statistics.median(xs), 3),
                                           "low": min(xs), "high": max(xs)}
            print(p["name"], a, summary[f"{p['name']} {a}"])
    for s in scheds.values():
        s.flush_cache()
        s.check_all_free()
    out = os.path.join(RESULTS, "ttft_ab.json")
    with open(out, "w") as f:
        json.dump({"command": " ".join(sys.argv), "machine": machine_info(), "target": target,
                   "draft": draft, "summary": summary, "rows": rows}, f, indent=2)
    print("wrote", out)


if __name__ == "__main__":
    main()
