"""What a verify step costs next to a plain decode step, by context length and tree rows.

One request per context length decodes through the real Scheduler (NGRAM drafts, the
budget fixed per block of steps), alternating plain steps and verifies of 4 / 8 / 12 rows in
interleaved blocks, so every option is timed on the same request at the same context. Each
step's time is split into the target's forward and the rest (draft lookup, verify, KV
bookkeeping). The prompt repeats a passage of a legal text, so the n-gram chains are full.

    python benchmark/long_context_spec/bench_verify_cost.py [--model GGUF] [--contexts 1024,4096]

Writes benchmark/results/verify_cost.json and .png: median forward and step ms per option and
the ratio of a verify step to a plain one (what VERIFY_COST_PRIOR in spec_worker.py guesses
before the cost model has measured both); with --split-kernels, each CPU kernel's median ms
per step (where the verify's time goes).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Dict, List

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import RESULTS, machine_info, plot_bars, prompt_ids, save  # noqa: E402


# sgl_kernel's CPU ops, timed per step to say where a verify's time goes; the rest of the
# forward is torch ops and Python (embedding, KV writes, masks, the logits' gather).
_KERNELS = ("small_m_linear", "decode_attention", "rmsnorm", "silu_and_mul", "rotary_embedding")


def _timed_kernels(split: Dict[str, float]) -> None:
    import sgl_kernel.cpu as cpu

    def wrap(name: str, fn):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            key = f"linear N={args[1].shape[0]}" if name == "small_m_linear" else name
            split[key] = split.get(key, 0.0) + time.perf_counter() - t0
            return out
        return timed

    for name in _KERNELS:  # the layers call these through the module, so wrapping it is enough
        setattr(cpu, name, wrap(name, getattr(cpu, name)))


def _timed_forward(sched, log: List[tuple]):
    inner = sched.runner.forward

    def forward(fb):
        t0 = time.perf_counter()
        out = inner(fb)
        log.append((fb.forward_mode.name, int(fb.input_ids.numel()), time.perf_counter() - t0))
        return out

    sched.runner.forward = forward


def run(model: str, dtype: str, contexts: List[int], budgets: List[int], steps: int,
        rounds: int, split_kernels: bool = False) -> Dict:
    from transformers import AutoTokenizer  # noqa: F401  (the GGUF's tokenizer, below)

    from sglang.srt.managers.io_struct import TokenizedGenerateReqInput
    from sglang.srt.model_loader.loader import load_tokenizer
    from sglang.srt.sampling.sampling_params import SamplingParams
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.server_args import ServerArgs
    from sglang.srt.speculative.budget_policy import FixedBudget

    tok = load_tokenizer(model)
    split: Dict[str, float] = {}
    if split_kernels:
        _timed_kernels(split)
    out: Dict = {"model": model, "dtype": dtype, "steps_per_block": steps, "rounds": rounds,
                 "machine": machine_info(), "contexts": {}}
    for ctx in contexts:
        sched = Scheduler(ServerArgs(
            model_path=model, dtype=dtype, context_length=ctx + 2048,
            max_total_tokens=ctx + 2048, speculative_algorithm="NGRAM",
            speculative_num_draft_tokens=max(budgets), speculative_fallback_threshold=0.0,
            speculative_disable_cost_model=True, chunked_prefill_size=2048))
        log: List[tuple] = []
        _timed_forward(sched, log)
        passage = prompt_ids(tok, ctx // 2)
        ids = (passage + passage)[:ctx]
        new_tokens = rounds * len(budgets) * steps * (max(budgets) + 1) + 8
        params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
        params.normalize()
        sched.add_request(TokenizedGenerateReqInput(rid="r", input_ids=ids,
                                                    sampling_params=params))
        t0 = time.perf_counter()
        while not sched.running or sched.running[0].kv_len < len(ids):
            sched.step()
        prefill_s = time.perf_counter() - t0
        rows: Dict[int, Dict[str, List[float]]] = {b: {"forward": [], "step": [], "rows": []}
                                                   for b in budgets}
        kernels: Dict[int, List[Dict[str, float]]] = {b: [] for b in budgets}
        for _ in range(rounds):
            for b in budgets:  # interleaved blocks: every option at nearly the same context
                sched.spec.use_policy(FixedBudget(b))
                for _ in range(steps):
                    log.clear()
                    split.clear()
                    t = time.perf_counter()
                    sched.step()
                    step_s = time.perf_counter() - t
                    if len(log) != 1:
                        continue
                    mode, n_rows, fwd = log[0]
                    want_rows = 1 if b == 1 else b
                    if n_rows != want_rows:  # the n-grams found a shorter chain: not this option
                        continue
                    rows[b]["forward"].append(fwd)
                    rows[b]["step"].append(step_s)
                    rows[b]["rows"].append(n_rows)
                    kernels[b].append(dict(split))
        sched.abort("r")
        sched.flush_cache()
        med = {b: {k: (statistics.median(v) if v else None) for k, v in r.items() if k != "rows"}
               for b, r in rows.items()}
        plain = med[1]
        entry = {"prefill_s": round(prefill_s, 2), "options": {}}
        for b in budgets:
            m, n = med[b], len(rows[b]["forward"])
            ratio = (m["step"] / plain["step"]) if m["step"] and plain["step"] else None
            entry["options"][str(b)] = {
                "samples": n, "forward_ms": _ms(m["forward"]), "step_ms": _ms(m["step"]),
                "rest_ms": _ms(m["step"] - m["forward"]) if m["step"] else None,
                "step_over_plain": round(ratio, 3) if ratio else None}
            if split_kernels and kernels[b]:  # median ms per step of each kernel
                names = sorted({k for d in kernels[b] for k in d})
                entry["options"][str(b)]["kernels_ms"] = {
                    k: _ms(statistics.median(d.get(k, 0.0) for d in kernels[b])) for k in names}
        out["contexts"][str(ctx)] = entry
        print(f"context {ctx}: prefill {prefill_s:.1f} s; " + ", ".join(
            f"rows {b}: step {e['step_ms']} ms (x{e['step_over_plain']}) forward {e['forward_ms']} ms"
            for b, e in ((int(k), v) for k, v in entry["options"].items())), flush=True)
        del sched
    return out


def _ms(seconds):
    return round(seconds * 1000, 2) if seconds is not None else None


def main() -> None:
    from sglang.test.real_assets import qwen_gguf

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=qwen_gguf("0.5b"))
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--contexts", default="1024,4096,16384")
    ap.add_argument("--budgets", default="1,4,8,12")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--name", default="verify_cost")
    ap.add_argument("--split-kernels", action="store_true",
                    help="also time each sgl_kernel CPU op per step (kernels_ms)")
    args = ap.parse_args()
    if not args.model:
        sys.exit("no --model: run scripts/fetch_real_models.py --only 0.5b first")
    contexts = [int(c) for c in args.contexts.split(",")]
    budgets = [int(b) for b in args.budgets.split(",")]
    assert budgets[0] == 1, "the plain step (budget 1) comes first"
    result = run(args.model, args.dtype, contexts, budgets, args.steps, args.rounds,
                 args.split_kernels)
    result["command"] = " ".join(sys.argv)
    path = save(args.name, result)
    series = {f"{b} rows": [result["contexts"][str(c)]["options"][str(b)]["step_over_plain"]
                            for c in contexts] for b in budgets[1:]}
    plot_bars(os.path.join(RESULTS, args.name + ".png"),
              f"verify step / plain step ({os.path.basename(args.model)}, {args.dtype})",
              [f"{c} ctx" for c in contexts], series, "x plain step")
    print("wrote", path)


if __name__ == "__main__":
    main()
