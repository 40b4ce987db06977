"""Adaptive speculation on the real Qwen pair: fallback, HYBRID drafting and the cost model.

Part 1, three documents (batch 1, greedy): legal prose, a table-heavy contract and a
document whose register shifts (scripts/build_adversarial_docs.py), each cut so that the
model continues it. Settings, side by side in one run:
  plain            plain decoding
  spec             STANDALONE chain, speculation at every step (no fallback, no cost model)
  spec+fallback    the same with per-request fallback (window 50, threshold 0.5, re-probe 100)
  hybrid+fallback  HYBRID (n-gram + draft model under one budget) with fallback
  spec (server default)  fallback + the cost model, calibrated at start-up
Part 2, concurrency sweep on prose (1, 4, 16 requests at once): plain, spec without and
with the cost model, side by side in one process round by round. Reported: decode and
end-to-end tokens/s, ratios to plain, acceptance, fallbacks;
per-step acceptance traces with the switch points go to the JSON and a plot.

    python benchmark/adaptive_spec/bench_adaptive.py --new-tokens 96
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any, Dict, List

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(_ROOT, "benchmark"))
sys.path.insert(0, os.path.join(_ROOT, "python"))
sys.path.insert(0, os.path.join(_ROOT, "scripts"))
from common import machine_info, run_isolated, save, share_dense_weights  # noqa: E402

SPEC = dict(speculative_algorithm="STANDALONE", speculative_num_steps=4, speculative_eagle_topk=1)
NO_ADAPT = dict(speculative_disable_cost_model=True, speculative_fallback_threshold=0.0)
FALLBACK = dict(speculative_disable_cost_model=True, speculative_fallback_threshold=0.5,
                speculative_fallback_window=50, speculative_reprobe_interval=100)
SETTINGS = {
    "plain": {},
    "spec": {**SPEC, **NO_ADAPT},
    "spec+fallback": {**SPEC, **FALLBACK},
    "hybrid+fallback": {**SPEC, **FALLBACK, "speculative_algorithm": "HYBRID",
                        "speculative_num_draft_tokens": 8},
    # what `launch_server --speculative-algorithm STANDALONE` runs: fallback, cost model
    # and its start-up calibration all on
    "spec (server default)": dict(SPEC),
}
SWEEP = {
    "plain": {},
    "spec": {**SPEC, **NO_ADAPT},
    "spec+cost_model": {**SPEC, "speculative_disable_cost_model": False,
                        "speculative_fallback_threshold": 0.5},
}


def documents(tokenizer, prompt_tokens: int) -> Dict[str, List[int]]:
    """name -> prompt ids: the document cut inside the register the name promises."""
    import tempfile

    import build_adversarial_docs as adv
    from common import legal_text

    out = {}
    prose = tokenizer(legal_text(), add_special_tokens=False)["input_ids"]
    out["prose"] = prose[:prompt_tokens]
    folder = tempfile.mkdtemp(prefix="adversarial_")
    index = adv.build(folder, seed=7, table_rows=60)
    table = open(os.path.join(folder, "table_contract.txt")).read()
    ids = tokenizer(table, add_special_tokens=False)["input_ids"]
    out["table_contract"] = ids[:prompt_tokens]  # cut inside the schedules
    shifting = open(os.path.join(folder, "shifting_register.txt")).read()
    first_table_end = [s for s in index["shifting_register"]["spans"] if s["kind"] == "table"][0]["end"]
    # prose, a table, then a few words of prose: the continuation switches register
    cut = shifting[: first_table_end + 200]
    ids = tokenizer(cut, add_special_tokens=False)["input_ids"]
    out["shifting_register"] = ids[-prompt_tokens:]
    return out


def traced_scheduler(target: str, draft: str, dtype: str, extra: Dict[str, Any],
                     max_total_tokens: int = 16384):
    """(scheduler, trace, switches): every decode step's acceptance per request goes to
    `trace` (and, with the cost model on, every step's batch size, budget, seconds and
    whether the cost model counted it, as entries with "step"), each finished request's
    fallback switches to `switches`."""
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.server_args import ServerArgs

    kw: Dict[str, Any] = dict(model_path=target, dtype=dtype, max_total_tokens=max_total_tokens,
                              **extra)
    if extra.get("speculative_algorithm"):
        kw["speculative_draft_model_path"] = draft
    sched = Scheduler(ServerArgs(**kw))
    sched.calibrate()  # as the server does before it reports ready (not traced)
    trace: List[Dict[str, Any]] = []
    switches: Dict[str, list] = {}
    spec = sched.spec
    if spec is not None:  # benchmark instrumentation: per-step acceptance and switches
        record, forget = spec.record, spec.forget

        def traced_record(req, offered, accepted, emitted):
            trace.append({"rid": req.rid, "token": len(req.output_ids), "offered": offered,
                          "accepted": accepted, "emitted": emitted})
            return record(req, offered, accepted, emitted)

        def traced_forget(req):
            ctl = spec.controllers.get(req.rid)
            if ctl is not None:
                switches[req.rid] = list(ctl.switches)
            return forget(req)

        spec.record, spec.forget = traced_record, traced_forget
        if spec.cost_model is not None:
            end_step = spec.end_step

            def traced_end_step(batch_size, had_prefill):
                trace.append({"step": len(trace), "batch": batch_size, "budget": spec.proposal.budget,
                              "seconds": round(spec.timer.elapsed(), 4),
                              "counted": bool(batch_size and not had_prefill
                                              and spec.proposal.typical)})
                return end_step(batch_size, had_prefill)

            spec.end_step = traced_end_step
    return sched, trace, switches


def interleaved(target: str, draft: str, settings: Dict[str, Dict[str, Any]],
                rounds: List[List[List[int]]], n_new: int, dtype: str,
                max_total_tokens: int = 16384) -> Dict[str, List[Dict[str, Any]]]:
    """Every setting on its own scheduler, all in this process, round by round: round k runs
    each setting on the round's prompts back to back (order rotated each round). Run one
    setting after another, minutes apart, the machine's drift (up to 2x on this shared box:
    the host steals CPU) swamped the differences between settings; side by side it cancels.
    Per setting and round: _drive's figures, the round's acceptance trace and rate."""
    share_dense_weights()  # five copies of the Qwen pair did not fit in 24 GB
    built = {name: traced_scheduler(target, draft, dtype, extra, max_total_tokens)
             for name, extra in settings.items()}
    names = list(settings)
    out: Dict[str, List[Dict[str, Any]]] = {name: [] for name in names}
    for k, prompts in enumerate(rounds):
        for name in names[k % len(names):] + names[: k % len(names)]:
            sched, trace, _ = built[name]
            before = len(trace)
            r = _drive(sched, prompts, n_new, f"r{k}-")
            r["trace"] = [t for t in trace[before:] if "step" not in t]
            steps = [t for t in trace[before:] if "step" in t]
            if steps:  # the cost model's choices: budget -> (steps, seconds)
                r["cost_model_steps"] = {
                    b: (sum(1 for t in steps if t["budget"] == b),
                        round(sum(t["seconds"] for t in steps if t["budget"] == b), 3))
                    for b in sorted({t["budget"] for t in steps})}
                r["steps"] = steps
            offered = sum(t["offered"] for t in r["trace"])
            r["accept_rate"] = (sum(t["accepted"] for t in r["trace"]) / offered
                                if offered else None)
            out[name].append(r)
    for name, (sched, _, switches) in built.items():
        if out[name]:
            out[name][0]["switches"] = {rid: sw for rid, sw in switches.items()
                                        if rid.startswith("r0-")}
            if sched.spec_calibration is not None:  # start-up, before round 1
                out[name][0]["calibration"] = sched.spec_calibration.to_dict()
        sched.abort("", "benchmark done")
    return out


def doc_interleaved(target: str, draft: str, prompt: List[int], n_new: int, dtype: str,
                    rounds: int) -> Dict[str, Dict[str, Any]]:
    """Part 1 for one document: `interleaved` over SETTINGS, `rounds` times over the
    document; per setting the figures of its fastest round, the trace / switches of its
    first."""
    runs = interleaved(target, draft, SETTINGS, [[prompt]] * rounds, n_new, dtype,
                       max_total_tokens=4096)
    out = {}
    for name, rs in runs.items():
        best = max(rs, key=lambda r: r["tok_s"])
        out[name] = {**best, "trace": rs[0]["trace"], "switches": rs[0]["switches"],
                     "calibration": rs[0].get("calibration"),
                     "rounds_tok_s": [r["tok_s"] for r in rs],
                     "rounds_tokens": [r["tokens"] for r in rs]}
    return out


def _drive(sched, prompts: List[List[int]], n_new: int, prefix: str) -> Dict[str, Any]:
    """Run `prompts` at once to the end; decode tokens/s after every prompt's first decode
    step (for speculation that step includes the draft's catch-up on the prompt)."""
    from sglang.srt.managers.io_struct import TokenizedGenerateReqInput
    from sglang.srt.sampling.sampling_params import SamplingParams

    sp = SamplingParams.from_dict({"max_new_tokens": n_new, "temperature": 0, "ignore_eos": True})
    rids = [f"{prefix}{i}" for i in range(len(prompts))]
    for rid, p in zip(rids, prompts):
        sched.add_request(TokenizedGenerateReqInput(rid=rid, input_ids=p, sampling_params=sp))
    tokens: Dict[str, List[int]] = {}
    metas: Dict[str, dict] = {}
    t0 = time.perf_counter()
    t_first = t_second = None
    counted: Dict[str, int] = {}
    while not sched.is_idle():
        for u in sched.step():
            tokens.setdefault(u.rid, []).extend(u.new_output_ids)
            if u.finished_reason is not None:
                metas[u.rid] = u.extra_meta or {}
        now = time.perf_counter()
        if t_first is None and sched.running and all(r.output_ids for r in sched.running):
            t_first = now  # every prompt prefilled
        elif t_first is not None and t_second is None:
            t_second = now
            counted = {r.rid: len(r.output_ids) for r in sched.running}
    end = time.perf_counter()
    decode_s = end - t_second
    total = sum(len(t) - counted.get(rid, 0) for rid, t in tokens.items())
    out = {"tok_s": total / decode_s, "decode_s": decode_s, "e2e_s": end - t0,
           "e2e_tok_s": sum(len(t) for t in tokens.values()) / (end - t0),
           "prefill_s": t_first - t0, "first_decode_step_s": t_second - t_first,
           "tokens": [tokens[rid] for rid in rids],
           "fallbacks": sum(m.get("spec_fallback_count", 0) for m in metas.values()),
           "accept_length": (sum(m.get("spec_accept_length", 0) for m in metas.values())
                             / len(metas) if sched.spec is not None else None)}
    if sched.spec is not None and "spec_drafter_weights" in next(iter(metas.values()), {}):
        out["drafter_weights"] = {rid: m["spec_drafter_weights"] for rid, m in metas.items()}
    return out


def plot_traces(path: str, results: Dict[str, Dict[str, Any]]) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    docs = sorted({k.split(" | ")[0] for k in results})
    fig, axes = plt.subplots(len(docs), 1, figsize=(9, 2.6 * len(docs)), squeeze=False)
    for ax, doc in zip(axes[:, 0], docs):
        for setting in ("spec", "spec+fallback", "hybrid+fallback"):
            r = results.get(f"{doc} | {setting}")
            if not r or not r["trace"]:
                continue
            xs, ys = [], []
            for t in r["trace"]:
                if t["offered"]:
                    xs.append(t["token"])
                    ys.append(t["accepted"] / t["offered"])
            ax.plot(xs, ys, ".-", label=setting, alpha=0.7)
            for token, mode in r["switches"].get("r0-0", []):
                ax.axvline(token, color="red" if mode == "plain" else "green", ls=":", alpha=0.6)
        ax.set_title(f"{doc}: per-step acceptance (red: fall back, green: speculate again)",
                     fontsize=9)
        ax.set_ylim(-0.05, 1.05)
        ax.legend(fontsize=7)
    axes[-1, 0].set_xlabel("output token")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompt-tokens", type=int, default=768)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--sweep-new-tokens", type=int, default=32)
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--sweep-prompt-tokens", type=int, default=256,
                    help="prompt length in the sweep (16 x 768 tokens took ~5 min to prefill)")
    ap.add_argument("--sweep-rounds", type=int, default=2,
                    help="batches per server: round 1 is cold (the cost model explores), "
                         "later rounds are the steady state of a long-lived server; the "
                         "settings run side by side in one process, round by round")
    ap.add_argument("--rounds", type=int, default=2,
                    help="part 1: runs of each setting over each document, side by side in "
                         "one process (the fastest is kept)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--skip-sweep", action="store_true")
    ap.add_argument("--only-sweep", action="store_true",
                    help="run part 2 only (saved as adaptive_spec_sweep.json)")
    args = ap.parse_args()

    import torch

    from sglang.srt.model_loader.loader import load_tokenizer
    from sglang.test.real_assets import qwen_pair

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    pair = qwen_pair()
    if pair is None:
        raise SystemExit("the Qwen pair is missing: run scripts/fetch_real_models.py")
    draft, target = pair
    tok = load_tokenizer(target)
    docs = documents(tok, args.prompt_tokens)
    results: Dict[str, Dict[str, Any]] = {}
    ratios: Dict[str, float] = {}
    for doc, prompt in ([] if args.only_sweep else docs.items()):
        by_setting = run_isolated(doc_interleaved, target, draft, prompt, args.new_tokens,
                                  args.dtype, args.rounds)
        base = by_setting["plain"]["tok_s"]
        for name, r in by_setting.items():
            results[f"{doc} | {name}"] = r
            ratios[f"{doc} | {name}"] = r["tok_s"] / base
            acc = f" accept {r['accept_rate']:.2f}" if r["accept_rate"] is not None else ""
            print(f"{doc:18s} {name:16s} {r['tok_s']:6.2f} tok/s  {r['tok_s'] / base:5.2f}x plain"
                  f"{acc} fallbacks {r['fallbacks']} (rounds "
                  + " ".join(f"{v:.2f}" for v in r["rounds_tok_s"]) + ")", flush=True)
    sweep: Dict[str, Dict[str, Any]] = {}
    if not args.skip_sweep:
        prose = docs["prose"]
        for n in (int(c) for c in args.concurrency.split(",")):
            # distinct prompts (no shared prefix), a fresh set per round
            rounds = [[prose[(k * n + i) * 8:][: args.sweep_prompt_tokens] for i in range(n)]
                      for k in range(args.sweep_rounds)]
            by_setting = run_isolated(interleaved, target, draft, SWEEP, rounds,
                                      args.sweep_new_tokens, args.dtype)
            plain_tokens = [x["tokens"] for x in by_setting["plain"]]
            for name, rs in by_setting.items():
                same_tokens = [x.pop("tokens") == t for x, t in zip(rs, plain_tokens)]
                for x in rs:
                    x.pop("trace")
                    x.pop("switches", None)
                r = {"rounds": rs, "same_tokens_as_plain": same_tokens,
                     "rounds_tok_s": [x["tok_s"] for x in rs],
                     "rounds_e2e_tok_s": [x["e2e_tok_s"] for x in rs],
                     "accept_length": [x["accept_length"] for x in rs]}
                sweep[f"{n} | {name}"] = r
                print(f"concurrency {n:2d} {name:16s} decode tok/s by round "
                      + " ".join(f"{v:6.2f}" for v in r["rounds_tok_s"])
                      + "  end-to-end (TTFT included) "
                      + " ".join(f"{v:6.2f}" for v in r["rounds_e2e_tok_s"]), flush=True)
            for k in range(args.sweep_rounds):
                for metric, key in (("rounds_tok_s", "vs_better"),
                                    ("rounds_e2e_tok_s", "vs_better_e2e")):
                    best = max(sweep[f"{n} | plain"][metric][k], sweep[f"{n} | spec"][metric][k])
                    for name in SWEEP:
                        v = sweep[f"{n} | {name}"][metric][k]
                        sweep[f"{n} | {name}"].setdefault(key, []).append(v / best)
                cm = sweep[f"{n} | spec+cost_model"]
                print(f"concurrency {n:2d} round {k + 1}: cost model {cm['vs_better'][k]:.2f}x "
                      f"(decode) / {cm['vs_better_e2e'][k]:.2f}x (end to end) the better of "
                      f"plain/spec; its steps by budget (count, seconds) "
                      f"{cm['rounds'][k].get('cost_model_steps')}", flush=True)
            # All rounds pooled (tokens over seconds): one noisy round weighs its share only.
            # Two schedulers doing the very same plain steps differed by up to 15% a round
            # on this host (an A/B of plain against spec forced to budget 1).
            for metric, rate, secs in (("total_tok_s", "tok_s", "decode_s"),
                                       ("total_e2e_tok_s", "e2e_tok_s", "e2e_s")):
                for name in SWEEP:
                    rs = sweep[f"{n} | {name}"]["rounds"]
                    toks = sum(x[rate] * x[secs] for x in rs)
                    sweep[f"{n} | {name}"][metric] = toks / sum(x[secs] for x in rs)
            cm = sweep[f"{n} | spec+cost_model"]
            for metric, label in (("total_tok_s", "decode"), ("total_e2e_tok_s", "end to end")):
                best = max(sweep[f"{n} | plain"][metric], sweep[f"{n} | spec"][metric])
                cm[f"vs_better_{metric}"] = cm[metric] / best
                print(f"concurrency {n:2d} all rounds: cost model {cm[metric] / best:.2f}x "
                      f"the better of plain/spec ({label})", flush=True)
    # Round by round: round 2 reads the document's prefix from the radix cache (prefilled
    # in other chunks), and in bfloat16 that alone moved a near-tie of plain decoding on
    # prose (',' against 'which' at token 15): the fastest rounds of two settings may be
    # different rounds, so comparing them compared caches, not speculation.
    same = {k: v["rounds_tokens"] == results[k.split(" | ")[0] + " | plain"]["rounds_tokens"]
            for k, v in results.items()}
    print("same tokens as plain:", same)
    payload = {"command": " ".join(sys.argv), "target": os.path.basename(target),
               "draft": os.path.basename(draft),
               "dtype": args.dtype, "prompt_tokens": args.prompt_tokens,
               "new_tokens": args.new_tokens, "machine": machine_info(),
               "ratios_to_plain": ratios, "same_tokens_as_plain": same,
               "results": results, "sweep": sweep}
    out = save("adaptive_spec_sweep" if args.only_sweep else "adaptive_spec", payload)
    if results:
        plot_traces(out[:-5] + ".png", results)
    print("saved", out)


if __name__ == "__main__":
    main()
