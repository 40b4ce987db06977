"""Speculative vs plain decoding on the real pair, side by side in one run.

Target Qwen2.5-Coder-1.5B, draft Qwen2.5-Coder-0.5B (scripts/fetch_real_models.py), prompts
from the GDPR (scripts/fetch_legal_docs.py) at several context lengths, ending in a request
to quote the document. Configurations: plain, STANDALONE chain (topk 1), STANDALONE trees
(topk 2, 4), NGRAM, NGRAM with the adaptive controller. For each: decode tokens/s, accept
length, draft and verify time per step, the verify step's KV bytes, and the ceiling its
acceptance and step costs allow (expected tokens per step / (draft + verify time), in
plain steps). Peers: transformers' assisted generation and prompt lookup on the same pair.

    python benchmark/long_context_spec/bench_spec.py --contexts 1024,4096 --new-tokens 64
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any, Dict, List

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import machine_info, plot_bars, save  # noqa: E402

QUESTION = ("\n\nQuestion: quote, word for word, the first paragraph of the article above "
            "that defines when processing is lawful.\nAnswer: \"")

CONFIGS = {
    "plain": {},
    "standalone_chain": dict(speculative_algorithm="STANDALONE", speculative_num_steps=4,
                             speculative_eagle_topk=1),
    "standalone_tree2": dict(speculative_algorithm="STANDALONE", speculative_num_steps=4,
                             speculative_eagle_topk=2, speculative_num_draft_tokens=8),
    "standalone_tree4": dict(speculative_algorithm="STANDALONE", speculative_num_steps=3,
                             speculative_eagle_topk=4, speculative_num_draft_tokens=10),
    "ngram": dict(speculative_algorithm="NGRAM", speculative_num_draft_tokens=10),
    "ngram_adaptive": dict(speculative_algorithm="NGRAM", speculative_num_draft_tokens=10,
                           speculative_disable_cost_model=False,
                           speculative_fallback_threshold=0.5),
}


class Timers:
    """Wall time of the draft's proposals and of target forwards, by wrapping methods."""

    def __init__(self, sched) -> None:
        self.draft = 0.0
        self.target = 0.0
        self.target_steps = 0
        if sched.spec is not None:
            drafter = sched.spec.drafter
            orig = drafter.propose

            def propose(*a, **k):
                t = time.perf_counter()
                try:
                    return orig(*a, **k)
                finally:
                    self.draft += time.perf_counter() - t

            drafter.propose = propose
        orig_fwd = sched.runner.forward

        def forward(fb):
            t = time.perf_counter()
            try:
                return orig_fwd(fb)
            finally:
                self.target += time.perf_counter() - t
                self.target_steps += 1

        sched.runner.forward = forward

    def reset(self) -> None:
        self.draft = self.target = 0.0
        self.target_steps = 0


def run_config(name: str, target: str, draft: str, prompts: Dict[int, List[int]], n_new: int,
               dtype: str) -> Dict[int, Dict[str, Any]]:
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.server_args import ServerArgs
    from sglang.test.scheduler_driver import run

    kw = dict(CONFIGS[name])
    if kw.get("speculative_algorithm") == "STANDALONE":
        kw["speculative_draft_model_path"] = draft
    if kw.get("speculative_algorithm"):
        kw.setdefault("speculative_disable_cost_model", True)
        kw.setdefault("speculative_fallback_threshold", 0.0)
    ctx_max = max(prompts) + n_new + 64
    sched = Scheduler(ServerArgs(model_path=target, dtype=dtype, max_total_tokens=ctx_max + 256,
                                 context_length=max(ctx_max, 4096), chunked_prefill_size=2048,
                                 max_running_requests=2, **kw))
    timers = Timers(sched)
    out = {}
    for ctx, ids in prompts.items():
        # Prefill once (cached), so the measured run is decode only.
        run(sched, [ids], [{"max_new_tokens": 0}])
        timers.reset()
        t = time.perf_counter()
        got = run(sched, [ids], [{"max_new_tokens": n_new, "temperature": 0, "ignore_eos": True}])
        wall = time.perf_counter() - t
        tokens, upd = got["0"]
        steps = max(timers.target_steps, 1)
        meta = upd.extra_meta
        out[ctx] = {
            "tokens": tokens, "wall_s": wall, "tok_s": len(tokens) / wall,
            "steps": steps, "accept_length": len(tokens) / steps,
            "draft_s_per_step": timers.draft / steps, "verify_s_per_step": timers.target / steps,
            "spec": meta or None,
            "verify_kv_bytes": sched.spec_state().get("spec_verify_kv_bytes_per_request"),
        }
        print(f"  {name:17s} ctx={ctx:6d} {out[ctx]['tok_s']:.2f} tok/s accept_len="
              f"{out[ctx]['accept_length']:.2f} draft={out[ctx]['draft_s_per_step']*1e3:.0f}ms "
              f"verify={out[ctx]['verify_s_per_step']*1e3:.0f}ms", flush=True)
    del sched
    return out


def run_hf_peers(target: str, draft: str, prompts: Dict[int, List[int]], n_new: int,
                 dtype: str) -> Dict[str, Dict[int, float]]:
    import torch
    from transformers import AutoModelForCausalLM

    tdtype = torch.bfloat16 if dtype == "bfloat16" else torch.float32

    def load(path):
        folder, name = os.path.split(path)
        return AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=tdtype).eval()

    tgt, dft = load(target), load(draft)
    out: Dict[str, Dict[int, float]] = {"hf_plain": {}, "hf_assisted": {}, "hf_prompt_lookup": {}}
    for ctx, ids in prompts.items():
        x = torch.tensor([ids])
        for key, extra in (("hf_plain", {}), ("hf_assisted", {"assistant_model": dft}),
                           ("hf_prompt_lookup", {"prompt_lookup_num_tokens": 10})):
            with torch.inference_mode():
                t = time.perf_counter()
                tgt.generate(x, max_new_tokens=1, do_sample=False, **extra)
                t1 = time.perf_counter() - t
                t = time.perf_counter()
                tgt.generate(x, max_new_tokens=n_new, min_new_tokens=n_new, do_sample=False, **extra)
                tn = time.perf_counter() - t
            out[key][ctx] = (n_new - 1) / max(tn - t1, 1e-9)
            print(f"  {key:17s} ctx={ctx:6d} {out[key][ctx]:.2f} tok/s", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", default="1024,4096")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--skip-hf", action="store_true")
    args = ap.parse_args()
    from sglang.srt.model_loader.loader import load_tokenizer
    from sglang.test.real_assets import legal_text, qwen_pair

    pair = qwen_pair()
    if not pair:
        sys.exit("Real models missing: run scripts/fetch_real_models.py")
    draft, target = pair
    tok = load_tokenizer(target)
    doc = tok(legal_text("gdpr"), add_special_tokens=False)["input_ids"]
    q = tok(QUESTION, add_special_tokens=False)["input_ids"]
    contexts = [int(c) for c in args.contexts.split(",")]
    # The document's start up to the context, ending with the question (so the answer quotes it).
    prompts = {c: doc[: c - len(q)] + q for c in contexts}
    info = machine_info()
    print(f"machine {info}\ntarget {target}\ndraft {draft}", flush=True)
    results: Dict[str, Any] = {"machine": info, "target": target, "draft": draft,
                               "dtype": args.dtype, "new_tokens": args.new_tokens,
                               "command": " ".join(sys.argv), "configs": {}}
    for name in args.configs.split(","):
        results["configs"][name] = run_config(name, target, draft, prompts, args.new_tokens, args.dtype)
    plain = results["configs"].get("plain")
    if plain:
        for name, per_ctx in results["configs"].items():
            for ctx, row in per_ctx.items():
                p = plain[ctx]
                row["speedup"] = row["tok_s"] / p["tok_s"]
                step = p["verify_s_per_step"]
                row["ceiling"] = row["accept_length"] * step / max(
                    row["draft_s_per_step"] + row["verify_s_per_step"], 1e-9)
                row["agrees_with_plain"] = row["tokens"] == p["tokens"]
                row["first_divergence"] = next(
                    (i for i, (a, b) in enumerate(zip(row["tokens"], p["tokens"])) if a != b), None)
    if not args.skip_hf:
        results["peers"] = run_hf_peers(target, draft, prompts, args.new_tokens, args.dtype)
    for name, per_ctx in results["configs"].items():
        for ctx, row in per_ctx.items():
            row.pop("tokens", None)
            print(f"{name:17s} ctx={ctx:6d} {row['tok_s']:.2f} tok/s speedup "
                  f"{row.get('speedup', 1):.2f}x (ceiling {row.get('ceiling', 1):.2f}x) accept "
                  f"{row['accept_length']:.2f} same-as-plain={row.get('agrees_with_plain')}")
    out = save("spec_decode", results)
    groups = [str(c) for c in contexts]
    series = {n: [results["configs"][n][c]["tok_s"] for c in contexts] for n in results["configs"]}
    for key, per in results.get("peers", {}).items():
        series[key] = [per.get(c) for c in contexts]
    plot_bars(out.replace(".json", ".png"), f"decode tok/s, Qwen 1.5B target / 0.5B draft "
              f"({args.dtype}, {info['cpu']})", groups, series, "tokens/s")
    print("saved", out)


if __name__ == "__main__":
    main()
