"""Draft-guided expert prefetch on a real MoE fixture with few experts resident.

For each residency (25% and 50% of the experts per layer, pages of the slow tier dropped
after every load so misses are disk reads), through the real Scheduler (batch 1, greedy, a
legal-text prompt):
  plain              plain decoding, on-demand expert loads (the baseline)
  spec               speculative decoding (STANDALONE, chain of --steps), on-demand loads
  spec+<predictor>   the same with --moe-prefetch-predictor reuse|layer_ahead|draft|ensemble
                     on every step (--moe-prefetch-disable-gate: the predictor's own figures)
  spec+<p>+gate      the server default: the gate times steps with and without prefetch and
                     keeps the faster (--gate-predictors; expert_offload/gate.py)
  spec+<p>/p<m>      --moe-prefetch-min-prob m (--min-prob-predictors, --min-probs; every
                     other setting runs the server's default cut, 0.4; m = 0: the fixed
                     top-(k + width) rule)
  spec+<p>+prune     prefetch with budget-aware trees (--moe-prefetch-prune-tree, every step:
                     --prune-predictors; expert_offload/tree_budget.py)
  plain/serial,      (--serial-waves) a layer needing more experts than its slots runs them in
  spec/serial        waves of all its slots, each wave's loads after the last one's compute,
                     instead of the double-buffered waves of experts.plan_waves
Reported per setting: decode tokens/s, mean verify-pass time (the target forward of a
speculative step), the store's hit rate / stall time / bytes, and the prefetcher's recall,
precision and over-fetch, per layer in the JSON. All settings must emit the same tokens.

    python benchmark/moe_offload/bench_prefetch.py --model smollm2-upcycled-8x-perturbed
    python benchmark/moe_offload/bench_prefetch.py --model qwen1.5b-moefied-16x4
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any, Dict, List, Optional

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(_ROOT, "benchmark"))
sys.path.insert(0, os.path.join(_ROOT, "python"))
from common import keep_large_tensors_mmapped, machine_info, plot_bars, prompt_ids, save  # noqa: E402

PREDICTORS = ("reuse", "layer_ahead", "draft", "ensemble")


def draft_for(model: str) -> str:
    from sglang.test import real_assets

    if model.startswith("qwen"):
        pair = real_assets.qwen_pair()
        if pair is None:
            raise FileNotFoundError("Qwen GGUFs missing: run scripts/fetch_real_models.py")
        return pair[0]  # the 0.5B
    return real_assets.smollm2_gguf()


def run_setting(path: str, draft: Optional[str], prompt: List[int], n_new: int, slots: int,
                predictor: str = "none", steps: int = 3, dtype: str = "bfloat16",
                keep_width: int = 1, gate: bool = False, prune: bool = False, topk: int = 1,
                draft_tokens: Optional[int] = None, route_map: bool = True,
                serial: bool = False, min_prob: Optional[float] = None,
                server_defaults: bool = False,
                max_total_tokens: int = 4096) -> Dict[str, Any]:
    """One setting in a fresh Scheduler. `server_defaults`: speculation keeps the server's
    fallback and cost model, and prefetch its gate (else both off: each part's own figures)."""
    from sglang.srt.layers.moe import experts as moe_experts
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.server_args import ServerArgs

    kw: Dict[str, Any] = dict(model_path=path, dtype=dtype, max_total_tokens=max_total_tokens,
                              moe_expert_cache_slots=slots, moe_expert_drop_page_cache=True,
                              moe_prefetch_predictor=predictor, moe_prefetch_width=0,
                              moe_prefetch_keep_width=keep_width,
                              moe_prefetch_disable_gate=not (gate or server_defaults),
                              moe_prefetch_prune_tree=prune)
    if min_prob is not None:  # else the server's default
        kw["moe_prefetch_min_prob"] = min_prob
    if draft is not None:
        kw.update(speculative_algorithm="STANDALONE", speculative_draft_model_path=draft,
                  speculative_num_steps=steps, speculative_eagle_topk=topk,
                  speculative_num_draft_tokens=draft_tokens)
        if not server_defaults:
            kw.update(speculative_disable_cost_model=True, speculative_fallback_threshold=0.0)
    planner = moe_experts.plan_waves
    if serial:  # benchmark instrumentation: waves of every slot, loads alternating with compute
        moe_experts.plan_waves = lambda needed, n: [needed[i: i + n]
                                                    for i in range(0, len(needed), n)]
    try:
        return _run(Scheduler(ServerArgs(**kw)), prompt, n_new, route_map)
    finally:
        moe_experts.plan_waves = planner


def _run(sched, prompt: List[int], n_new: int, route_map: bool) -> Dict[str, Any]:
    from sglang.srt.managers.io_struct import TokenizedGenerateReqInput
    from sglang.srt.sampling.sampling_params import SamplingParams

    if not route_map and sched.spec is not None and sched.spec.draft_kv.enabled:
        sched.spec.draft_kv.observer.learning = False  # a draft of another width: estimate only
    forward_times: List[float] = []
    inner = sched.runner.forward

    def timed_forward(fb):  # benchmark instrumentation: time the target's passes
        t0 = time.perf_counter()
        out = inner(fb)
        forward_times.append((time.perf_counter() - t0, fb.forward_mode.name))
        return out

    sched.runner.forward = timed_forward
    sp = SamplingParams.from_dict({"max_new_tokens": n_new, "temperature": 0, "ignore_eos": True})
    t_start = time.perf_counter()
    sched.add_request(TokenizedGenerateReqInput(rid="r", input_ids=prompt, sampling_params=sp))
    tokens: List[int] = []
    t_first = None
    store = sched.runner.model.expert_store
    while not sched.is_idle():
        for u in sched.step():
            tokens.extend(u.new_output_ids)
        started = tokens or any(r.output_ids for r in sched.running)
        if t_first is None and started:  # prefill done: decoding (and the figures) start here
            t_first = time.perf_counter()
            store.reset_stats()
            if sched.prefetcher is not None:
                sched.prefetcher.stats.reset()
            forward_times.clear()
    t_end = time.perf_counter()
    decode_s = t_end - t_first
    out: Dict[str, Any] = {"tokens": tokens, "tok_s": (len(tokens) - 1) / decode_s,
                           "decode_s": decode_s, "ttft_s": t_first - t_start,
                           "total_s": t_end - t_start, "e2e_tok_s": len(tokens) / (t_end - t_start)}
    passes = [t for t, mode in forward_times]
    verify = [t for t, mode in forward_times if mode == "TARGET_VERIFY"]
    out["target_passes"] = len(passes)
    out["mean_pass_s"] = sum(passes) / len(passes) if passes else None
    out["mean_verify_s"] = sum(verify) / len(verify) if verify else None
    # the rest of a step: the draft's forwards, the predictors' routing, the scheduler (a
    # prefetch that wins in the verify can lose it here, to loads competing for the cores)
    out["mean_outside_target_s"] = (decode_s - sum(passes)) / len(passes) if passes else None
    st = store.stats().to_dict()["total"]
    out.update(hit_rate=st["hit_rate"], stall_s=st["stall_seconds"], loads=st["loads"],
               bytes_loaded=st["bytes_loaded"], misses=st["misses"], late=st["late"],
               dropped=st["dropped"])
    if sched.spec is not None:
        out["accept_length"] = sched.spec.avg_accept_length()
    if sched.prefetcher is not None:
        figs = sched.prefetcher.figures()
        tot = figs["total"]
        out.update(recall=tot["recall"], precision=tot["precision"], overfetch=tot["overfetch"],
                   bytes_fetched=tot["bytes_fetched"], bytes_fetched_used=tot["bytes_fetched_used"],
                   predicted_recall=tot["predicted_recall"],
                   predicted_overfetch=tot["predicted_overfetch"],
                   recall_ceiling=tot["recall_ceiling"], per_layer=figs["layers"])
        if "gate" in figs:
            out["gate"] = figs["gate"]
        if "calibration" in figs:
            out["calibration"] = figs["calibration"]
        if sched.tree_budget is not None:
            out["tree_budget"] = sched.tree_budget.to_dict()
        rm = getattr(sched.prefetcher.predictor, "routemap", None)
        if rm is not None:
            out["route_map_samples"] = rm.samples
    sched.abort("", "benchmark done")
    store.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-upcycled-8x-perturbed")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--fractions", default="0.25,0.5")
    ap.add_argument("--predictors", default=",".join(PREDICTORS))
    ap.add_argument("--keep-widths", default="1",
                    help="--moe-prefetch-keep-width values to run draft/ensemble with "
                         "(0: protect only the fetched experts)")
    ap.add_argument("--gate-predictors", default="draft",
                    help="predictors also run with the prefetch gate on (the server default)")
    ap.add_argument("--prune-predictors", default="",
                    help="predictors also run with budget-aware trees (--moe-prefetch-prune-tree)")
    ap.add_argument("--min-prob-predictors", default="",
                    help="predictors also run with --moe-prefetch-min-prob (each of --min-probs)")
    ap.add_argument("--min-probs", default="0.2",
                    help="--moe-prefetch-min-prob values for --min-prob-predictors")
    ap.add_argument("--nomap-predictors", default="",
                    help="predictors also run without the RoutingMap (a draft of another "
                         "width then predicts from the embedding estimate only)")
    ap.add_argument("--serial-waves", action="store_true",
                    help="also run plain and spec with serial waves (no double buffering)")
    ap.add_argument("--topk", type=int, default=1, help="--speculative-eagle-topk (1: a chain)")
    ap.add_argument("--draft-tokens", type=int, default=None,
                    help="--speculative-num-draft-tokens (trees: nodes verified per step)")
    ap.add_argument("--text", default=None,
                    help="a text file for the prompt (default: the legal corpus), e.g. a "
                         "table-heavy contract from scripts/build_adversarial_docs.py")
    ap.add_argument("--tag", default="", help="suffix of the results' file name")
    ap.add_argument("--repeats", type=int, default=1,
                    help="rounds over all settings of a fraction, one after another; each "
                         "setting reports its median round (the disk's speed drifts 2x "
                         "between minutes here, so one run each ranks settings by luck)")
    args = ap.parse_args()

    import gc
    import json

    import torch
    from transformers import AutoTokenizer

    # Every setting loads the models anew (the Qwen run grew to 24 GB without this); a
    # collect after each setting frees the cycles.
    keep_large_tensors_mmapped()

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_moe import fixture_path

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    path = fixture_path(args.model)
    cfg = json.load(open(os.path.join(path, "config.json")))
    num_experts = cfg.get("num_local_experts") or cfg.get("num_experts") or cfg["n_routed_experts"]
    tok = AutoTokenizer.from_pretrained(path)
    if args.text:
        ids = tok(open(args.text).read(), add_special_tokens=False)["input_ids"]
        prompt = (ids * (1 + args.prompt_tokens // max(1, len(ids))))[: args.prompt_tokens]
    else:
        prompt = prompt_ids(tok, args.prompt_tokens)
    draft = draft_for(args.model)
    results: Dict[str, Dict[str, Any]] = {}
    predictors = [p for p in args.predictors.split(",") if p]
    for frac in (float(f) for f in args.fractions.split(",")):
        slots = max(cfg.get("num_experts_per_tok", 2), round(num_experts * frac))
        # (name, draft, run_setting options)
        settings: List[tuple] = [("plain", None, {}), ("spec", draft, {})]
        if args.serial_waves:
            settings += [("plain/serial", None, {"serial": True}),
                         ("spec/serial", draft, {"serial": True})]
        for p in predictors:
            widths = ([int(w) for w in args.keep_widths.split(",")]
                      if p in ("draft", "ensemble") else [1])
            settings += [(f"spec+{p}" + ("" if w == 1 else f"/keep{w}"), draft,
                          {"predictor": p, "keep_width": w}) for w in widths]
        settings += [(f"spec+{p}/p{m:g}", draft, {"predictor": p, "min_prob": m})
                     for p in args.min_prob_predictors.split(",") if p
                     for m in (float(x) for x in args.min_probs.split(","))]
        settings += [(f"spec+{p}/nomap", draft, {"predictor": p, "route_map": False})
                     for p in args.nomap_predictors.split(",") if p]
        settings += [(f"spec+{p}+gate", draft, {"predictor": p, "gate": True})
                     for p in args.gate_predictors.split(",") if p]
        settings += [(f"spec+{p}+prune", draft, {"predictor": p, "prune": True})
                     for p in args.prune_predictors.split(",") if p]
        runs: Dict[str, List[Dict[str, Any]]] = {}
        for _ in range(args.repeats):
            for name, d, opts in settings:
                key = f"{int(frac * 100)}% {name}"
                runs.setdefault(key, []).append(run_setting(
                    path, d, prompt, args.new_tokens, slots, steps=args.steps,
                    dtype=args.dtype, topk=args.topk, draft_tokens=args.draft_tokens, **opts))
                gc.collect()
        for key, rs in runs.items():
            r = sorted(rs, key=lambda x: x["tok_s"])[len(rs) // 2]
            r["slots"] = slots
            r["rounds_tok_s"] = [x["tok_s"] for x in rs]
            r["rounds_verify_s"] = [x["mean_verify_s"] for x in rs]
            results[key] = r
            fig = (f" recall {r['recall']:.2f} (ceiling {r['recall_ceiling']:.2f}, predicted "
                   f"{r['predicted_recall']:.2f} at {r['predicted_overfetch'] or 0:.2f}x) "
                   f"precision {r['precision'] or 0:.2f}" if "recall" in r else "")
            if "gate" in r:
                fig += f" gate on/off steps {r['gate']['steps_on']}/{r['gate']['steps_off']}"
            if "tree_budget" in r:
                tb = r["tree_budget"]
                fig += (f" pruned {tb['nodes_removed']} nodes in {tb['steps_pruned']}/"
                        f"{tb['steps']} steps (loads saved {tb['loads_saved']})")
            if r.get("route_map_samples") is not None:
                fig += f" route map samples {r['route_map_samples']}"
            if r.get("accept_length"):
                fig += f" accept length {r['accept_length']:.2f}"
            verify = (f" verify {r['mean_verify_s'] * 1e3:.0f} ms, rest of step "
                      f"{r['mean_outside_target_s'] * 1e3:.0f} ms" if r["mean_verify_s"] else "")
            print(f"{key:28s} {r['tok_s']:6.2f} tok/s{verify} hit {r['hit_rate']:.2f} "
                  f"stall {r['stall_s']:.2f}s "
                  f"GB loaded {r['bytes_loaded'] / 1e9:.2f} (misses {r['misses']}, late "
                  f"{r['late']}, prefetches dropped {r['dropped']}){fig} (rounds "
                  + " ".join(f"{v:.2f}" for v in r["rounds_tok_s"]) + ")", flush=True)
    ref = next(iter(results.values()))["tokens"]
    same = {k: v["tokens"] == ref for k, v in results.items()}
    ratios = {}
    for frac in (float(f) for f in args.fractions.split(",")):
        pct = f"{int(frac * 100)}%"
        plain, spec = results[f"{pct} plain"], results[f"{pct} spec"]
        for k, v in results.items():
            if k.startswith(pct) and k != f"{pct} plain":
                ratios[k] = {"speedup_vs_plain": v["tok_s"] / plain["tok_s"],
                             "speedup_vs_spec_on_demand": v["tok_s"] / spec["tok_s"]}
                if v.get("mean_verify_s") and spec.get("mean_verify_s"):
                    ratios[k]["verify_speedup_vs_on_demand"] = spec["mean_verify_s"] / v["mean_verify_s"]
    for k, v in ratios.items():
        print(f"{k:28s} " + "  ".join(f"{a} {b:.2f}x" for a, b in v.items()))
    bounds = {}
    for frac in (float(f) for f in args.fractions.split(",")):
        # What overlap could win at most, from the on-demand run's own parts (a model, not a
        # measurement): per verify, V ms of which Y stalled on loads, and Z ms of draft work
        # before it. Perfect prefetch of the same bytes hides loads behind the draft and the
        # verify's compute: verify >= max(V - Y, Y - Z).
        spec = results[f"{int(frac * 100)}% spec"]
        if spec.get("mean_verify_s") and spec["target_passes"]:
            v, z = spec["mean_verify_s"], spec["mean_outside_target_s"]
            y = min(v, spec["stall_s"] / spec["target_passes"])
            bound = v / max(v - y, y - z, 1e-9)
            bounds[f"{int(frac * 100)}%"] = {"verify_s": v, "stall_s": y, "draft_window_s": z,
                                             "verify_speedup_bound": bound}
            print(f"{int(frac * 100)}% on-demand verify {v * 1e3:.0f} ms (stalled {y * 1e3:.0f}), "
                  f"draft {z * 1e3:.0f} ms: perfect overlap of the same bytes bounds the "
                  f"verify speedup at {bound:.2f}x")
    print("same tokens in every setting:", all(same.values()))
    payload = {"command": " ".join(sys.argv), "model": args.model, "draft": os.path.basename(draft),
               "experts_per_layer": num_experts,
               "prompt_tokens": len(prompt), "new_tokens": args.new_tokens, "steps": args.steps,
               "topk": args.topk, "draft_tokens": args.draft_tokens, "text": args.text,
               "dtype": args.dtype, "machine": machine_info(), "same_tokens": same,
               "ratios": ratios, "overlap_bounds": bounds, "results": results}
    out = save(f"moe_prefetch_{args.model}{args.tag}", payload)
    keys = list(results)
    plot_bars(out[:-5] + ".png", f"Expert prefetch, {args.model} (tokens/s, batch 1)", keys,
              {"tok/s": [results[k]["tok_s"] for k in keys]}, "tokens/s")
    print("saved", out)


if __name__ == "__main__":
    main()
