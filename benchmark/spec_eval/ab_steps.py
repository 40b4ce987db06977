"""A/B per step: configurations as Schedulers in one process, stepped in turns on the same
prompts of the held-out set, so the VM's drift falls on all alike; prints tok/s, steps, the
spec meta and every step of each configuration as (seconds, tokens, tree nodes verified)
(a diagnosis tool: bench_spec_eval.py is the evaluation).

    python benchmark/spec_eval/ab_steps.py plain,NGRAM,HYBRID cra/list/4K,dora/summary/4K
    python benchmark/spec_eval/ab_steps.py plain,EAGLE3 cra/list/1K 0.5b ~/.cache/sglang-fork/heads/qwen2.5-coder-0.5b-eagle3

A third argument 0.5b takes the 0.5B as the target; a fourth is an EAGLE / EAGLE-3 head's folder.
"""
import os, sys, time
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from sglang.srt.managers.io_struct import TokenizedGenerateReqInput
from sglang.srt.managers.scheduler import Scheduler
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.server_args import ServerArgs
from sglang.srt.model_loader.loader import load_tokenizer
from sglang.test.real_assets import qwen_pair
from spec_eval.eval_set import eval_prompts
algos, names = sys.argv[1].split(","), sys.argv[2].split(",")
draft, target = qwen_pair()
if len(sys.argv) > 3 and sys.argv[3] == "0.5b":
    target = draft
head = os.path.expanduser(sys.argv[4]) if len(sys.argv) > 4 else None
tok = load_tokenizer(target)
prompts = [p for p in eval_prompts(tok) if p["name"] in names]
longest = max(len(p["ids"]) for p in prompts) + 128
scheds = []
for a in algos:
    kw = {} if a == "plain" else {"speculative_algorithm": a}
    if a in ("HYBRID", "STANDALONE"): kw["speculative_draft_model_path"] = head or draft
    if a in ("EAGLE", "EAGLE3"): kw["speculative_draft_model_path"] = head
    scheds.append(Scheduler(ServerArgs(model_path=target, dtype="bfloat16", context_length=longest,
                             max_total_tokens=sum(len(p["ids"]) + 64 for p in prompts) + 4096, **kw)))
    scheds[-1].calibrate()  # as the server's scheduler process does
for p in prompts:
    st = {}
    for a, s in zip(algos, scheds):
        params = SamplingParams(max_new_tokens=64, temperature=0.0, ignore_eos=True); params.normalize()
        s.add_request(TokenizedGenerateReqInput(rid=p["name"], input_ids=p["ids"], sampling_params=params, stream=True))
        st[a] = {"stamps": [], "ids": [], "meta": None, "steptimes": []}
        while not st[a]["stamps"]:  # prefill each alone
            for u in s.step():
                if u.new_output_ids: st[a]["stamps"].append((time.perf_counter(), len(u.new_output_ids))); st[a]["ids"] += u.new_output_ids
    busy = True
    while busy:
        busy = False
        for a, s in zip(algos, scheds):
            if s.is_idle(): continue
            busy = True
            t0 = time.perf_counter(); ups = s.step(); t1 = time.perf_counter()
            for u in ups:
                if u.new_output_ids:
                    st[a]["stamps"].append((t1, len(u.new_output_ids))); st[a]["ids"] += u.new_output_ids
                    prop = s.spec.proposal.trees if s.spec is not None else []
                    nodes = sum(len(t) for t in prop if t is not None)  # verified this step
                    st[a]["steptimes"].append((round(t1 - t0, 3), len(u.new_output_ids), nodes))
                if u.finished_reason is not None: st[a]["meta"] = u.extra_meta
    for a in algos:
        x = st[a]; tot = sum(t[0] for t in x["steptimes"]); n = sum(t[1] for t in x["steptimes"])
        m = {k: v for k, v in (x["meta"] or {}).items() if k in ("spec_accept_length", "spec_fallback_count", "spec_verify_ct", "spec_draft_token_num")}
        print(p["name"], a, "tok/s", round(n / tot, 2), "steps", len(x["steptimes"]), "same", x["ids"] == st[algos[0]]["ids"], m)
        print("   ", x["steptimes"])
for s in scheds: s.flush_cache(); s.check_all_free()
