"""Where a decode step's time goes, plain against one speculative configuration at a fixed
budget: each runs a Scheduler on one held-out prompt in turn (same process), its decode steps
under cProfile, and the per-step split is written as JSON (a diagnosis tool; cProfile adds
its own cost to Python-heavy parts, so compare the rows, not the absolute ms).

    python benchmark/spec_eval/step_profile.py --algorithm EAGLE3 --budget 2 --target 0.5b \
        --draft ~/.cache/sglang-fork/heads/qwen2.5-coder-0.5b-eagle3 --prompt cra/quote/1K
"""
from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from common import machine_info, save  # noqa: E402

# (what, file suffix, function): cumulative seconds of these calls, per step
PARTS = [("step", "managers/scheduler.py", "step"),
         ("target forward", "models/llama.py", "forward"),  # the outer LlamaForCausalLM call
         ("drafting", "speculative/spec_worker.py", "propose"),
         ("verify and outputs", "managers/scheduler.py", "_postprocess")]


def _split(stats: pstats.Stats, steps: int) -> dict:
    out = {}
    for what, suffix, fn in PARTS:
        cands = [(v[3], k) for k, v in stats.stats.items()
                 if k[0].endswith(suffix) and k[2] == fn]
        out[what + " ms"] = round(max(cands)[0] / steps * 1e3, 2) if cands else 0.0
    return out


def profile(algorithm: str, target: str, draft: str, budget: int, ids, new_tokens: int) -> dict:
    from sglang.srt.managers.io_struct import TokenizedGenerateReqInput
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.sampling.sampling_params import SamplingParams
    from sglang.srt.server_args import ServerArgs

    kw = {} if algorithm == "plain" else {
        "speculative_algorithm": algorithm, "speculative_draft_model_path": draft,
        "speculative_disable_cost_model": True, "speculative_fallback_threshold": 0,
        "speculative_num_steps": budget - 1, "speculative_num_draft_tokens": budget,
        "speculative_eagle_topk": 1}
    sched = Scheduler(ServerArgs(model_path=target, dtype="bfloat16",
                                 context_length=len(ids) + new_tokens + 64,
                                 max_total_tokens=2 * len(ids) + 4096, **kw))
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    params.normalize()
    sched.add_request(TokenizedGenerateReqInput(rid="p", input_ids=ids, sampling_params=params))
    sched.step()  # the prefill, not profiled
    prof, steps, tokens = cProfile.Profile(), 0, 0
    start = time.perf_counter()
    prof.enable()
    while not sched.is_idle():
        tokens += sum(len(u.new_output_ids) for u in sched.step())
        steps += 1
    prof.disable()
    seconds = time.perf_counter() - start
    sched.flush_cache()
    sched.check_all_free()
    return {"steps": steps, "tokens": tokens, "ms_per_step": round(seconds / steps * 1e3, 2),
            "tokens_per_step": round(tokens / steps, 3),
            **_split(pstats.Stats(prof), steps)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--algorithm", required=True)
    ap.add_argument("--budget", type=int, default=2, help="tree nodes with the root (a chain)")
    ap.add_argument("--target", default="0.5b", choices=["0.5b", "1.5b"])
    ap.add_argument("--draft", default=None, help="draft model or head (default: the 0.5B)")
    ap.add_argument("--prompt", default="cra/quote/1K")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--name", default="step_profile")
    args = ap.parse_args()
    from sglang.srt.model_loader.loader import load_tokenizer
    from sglang.test.real_assets import qwen_pair
    from spec_eval.eval_set import eval_prompts

    small, large = qwen_pair()
    target = small if args.target == "0.5b" else large
    draft = os.path.expanduser(args.draft) if args.draft else small
    prompt = next(p for p in eval_prompts(load_tokenizer(target)) if p["name"] == args.prompt)
    rows = {}
    for algo in ("plain", args.algorithm):
        rows[algo] = profile(algo, target, draft, args.budget, prompt["ids"], args.new_tokens)
        print(algo, rows[algo], flush=True)
    save(args.name, {"command": " ".join(sys.argv), "machine": machine_info(),
                     "target": target, "draft": draft, "prompt": args.prompt,
                     "budget": args.budget, "rows": rows})


if __name__ == "__main__":
    main()
