"""Long-context drafting on the real pair: plain vs speculation with full / streaming /
retrieval draft context, side by side in one run, document warmed once.

Target Qwen2.5-Coder-1.5B, draft Qwen2.5-Coder-0.5B (scripts/fetch_real_models.py); the
document is the start of a legal text (scripts/fetch_legal_docs.py) cut at each context
length, followed by a question. Per configuration and context: decode tokens/s and its ratio
to plain decoding measured in the same scheduler round by round (the host's speed swings
between minutes), acceptance length, the draft KV bytes its largest view reads and its time
per step, and the time to first token of the question on a warmed document vs cold. `retrieval_pos4k`
caps the draft's positions at 4096 (re-indexing on) to compare against `retrieval` (the
draft's own range, which holds up to 32K: no re-indexing there).

    python benchmark/long_context_spec/bench_draft_kv.py --contexts 2048,8192,16384

Long: minutes per context on a CPU. Results: benchmark/results/draft_kv.json + plots.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any, Dict, List, Tuple

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import RESULTS, machine_info, plot_bars, run_isolated, save  # noqa: E402

QUESTION = ("\n\nQuestion: quote, word for word, the sentence of the text above that says "
            "who the regulation applies to.\nAnswer: \"")
QUESTION2 = "\n\nQuestion: which article of the text above defines its territorial scope?\nAnswer:"
SPEC = dict(speculative_algorithm="STANDALONE", speculative_num_steps=3, speculative_eagle_topk=1,
            speculative_disable_cost_model=True, speculative_fallback_threshold=0.0)


def configs(budget: int, chunk: int) -> Dict[str, Dict[str, Any]]:
    bounded = dict(speculative_draft_kv_budget=budget, speculative_draft_kv_chunk_size=chunk)
    return {
        "plain": {},
        "full": dict(SPEC),
        "streaming": dict(SPEC, speculative_draft_kv_policy="streaming", **bounded),
        "retrieval": dict(SPEC, speculative_draft_kv_policy="retrieval", **bounded),
        "retrieval_pos4k": dict(SPEC, speculative_draft_kv_policy="retrieval",
                                speculative_draft_max_position=4096, **bounded),
    }


def timed_request(sched, ids: List[int], n_new: int, rid: str = "q"
                  ) -> Tuple[List[int], Any, float, float]:
    """(output ids, final update, seconds to first token, seconds for the rest)."""
    from sglang.srt.managers.io_struct import TokenizedGenerateReqInput
    from sglang.srt.sampling.sampling_params import SamplingParams

    params = {"max_new_tokens": n_new, "temperature": 0, "ignore_eos": True}
    sched.add_request(TokenizedGenerateReqInput(
        rid=rid, input_ids=ids, sampling_params=SamplingParams.from_dict(params),
        stream=True))  # an update per step, so the first token is seen when it comes
    out: List[int] = []
    t0 = time.perf_counter()
    first = None
    final = None
    while not sched.is_idle():
        for upd in sched.step():
            out += upd.new_output_ids
            if first is None and out:
                first = time.perf_counter() - t0
            if upd.finished_reason is not None:
                final = upd
    return out, final, first or 0.0, time.perf_counter() - t0 - (first or 0.0)


def hold_plain(sched, rid: str) -> None:
    """Make request `rid` decode plainly in a speculative scheduler: its fallback controller
    starts in plain mode with no re-probe in sight. Plain steps there cost what they cost in
    a plain scheduler (one-process A/B at 16 requests, step by step: 0.98x)."""
    from sglang.srt.speculative.controller import PLAIN

    ctl = sched.spec.controller(type("R", (), {"rid": rid})())
    ctl.mode, ctl.plain_left = PLAIN, 10 ** 9


def run_config(name: str, kw: Dict[str, Any], target: str, draft: str,
               prompts: Dict[int, Tuple[List[int], List[int]]], n_new: int,
               dtype: str, question2: List[int], rounds: int = 1,
               token_map: str = "") -> Dict[int, Dict[str, Any]]:
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.server_args import ServerArgs

    kw = dict(kw)
    if kw:
        kw["speculative_draft_model_path"] = draft
        if token_map:
            kw["speculative_token_map"] = token_map
    ctx_max = max(prompts) + n_new + 64
    sched = Scheduler(ServerArgs(model_path=target, dtype=dtype, max_total_tokens=2 * ctx_max,
                                 context_length=max(ctx_max, 4096), chunked_prefill_size=2048,
                                 max_running_requests=2, **kw))
    drafter = sched.spec.drafter if sched.spec is not None else None
    # peak: the longest view a draft forward read (its own KV and the shared prefix's).
    probe = {"draft_s": 0.0, "steps": 0, "peak": 0, "min_free": 10**12}
    if drafter is not None:
        propose, forward = drafter.propose, drafter.runner.forward

        def timed_propose(*a, **k):
            t = time.perf_counter()
            try:
                return propose(*a, **k)
            finally:
                probe["draft_s"] += time.perf_counter() - t
                probe["steps"] += 1

        def viewed_forward(fb):
            probe["peak"] = max(probe["peak"], max(len(k) for k in fb.kv_indices))
            probe["min_free"] = min(probe["min_free"], drafter.allocator.available_size())
            return forward(fb)

        drafter.propose, drafter.runner.forward = timed_propose, viewed_forward
    # Warm-up: the first forwards of a process pay one-off costs (kernel loading, allocator
    # growth) that would otherwise land in the first configuration's cold TTFT.
    first_doc = next(iter(prompts.values()))[0]
    timed_request(sched, first_doc[:256], 4)
    sched.flush_cache()
    out = {}
    for ctx, (doc, question) in prompts.items():
        # One prefill per configuration and context (a 16K prefill of the 1.5B takes ~10
        # minutes here): the first question arrives cold (TTFT cold, then its decode rate),
        # a second question on the same document finds it warm for both models.
        sched.flush_cache()
        probe.update(draft_s=0.0, steps=0, peak=0, min_free=10**12)
        tokens, upd, cold_ttft, rest = timed_request(sched, doc + question, n_new)
        meta = upd.extra_meta or {}
        _, upd2, ttft, _ = timed_request(sched, doc + question2, 1)
        meta2 = upd2.extra_meta or {}
        # This machine's decode rate swings by 30% between minutes (the host steals CPU):
        # the first question is asked again on the warm document (no prefill, same tokens),
        # round by round beside a PLAIN decode of it in this same scheduler (its request
        # held in fallback), so each round's ratio compares neighbouring seconds.
        rates = [(len(tokens) - 1) / max(rest, 1e-9)]
        plain_rates: List[float] = []
        for k in range(rounds):
            if drafter is not None:
                hold_plain(sched, f"plain-{ctx}-{k}")
                again, _, _, rest_p = timed_request(sched, doc + question, n_new,
                                                    rid=f"plain-{ctx}-{k}")
                assert again == tokens, f"{name}: plain decoding changed the output"
                plain_rates.append((len(again) - 1) / max(rest_p, 1e-9))
            if k == rounds - 1:
                break
            again, _, _, rest2 = timed_request(sched, doc + question, n_new)
            assert again == tokens, f"{name}: a warm repeat changed the output"
            rates.append((len(again) - 1) / max(rest2, 1e-9))
        row = {"tokens": tokens, "tok_s": max(rates), "tok_s_rounds": rates,
               "ttft_cold_s": cold_ttft, "ttft_warm_s": ttft,
               "ttft_warm_over_cold": ttft / max(cold_ttft, 1e-9),
               "warm_cached_tokens": upd2.cached_tokens,
               "warm_draft_cached_tokens": meta2.get("draft_cached_tokens"),
               "accept_length": meta.get("spec_accept_length")}
        if plain_rates:
            # round k: speculative rate / the plain rate measured right before it
            row.update(plain_tok_s_rounds=plain_rates,
                       speedup_rounds=[r / p for r, p in zip(rates, plain_rates)],
                       speedup_side_by_side=max(rates) / max(plain_rates))
        if drafter is not None:
            per_token = drafter.runner.kv_pool.bytes_per_token(
                drafter.runner.num_layers, drafter.runner.num_kv_heads, drafter.runner.head_dim,
                drafter.runner.kv_dtype)
            row.update(draft_s_per_step=probe["draft_s"] / max(probe["steps"], 1),
                       draft_kv_view_tokens=probe["peak"],
                       draft_kv_view_bytes=probe["peak"] * per_token,
                       # draft slots held at the fullest moment (the prefix the radix
                       # cache keeps included): flat in context for bounded policies
                       draft_pool_peak_tokens=drafter.allocator.size - probe["min_free"])
        out[ctx] = row
        side = (f" ({row['speedup_side_by_side']:.2f}x plain side by side)"
                if plain_rates else "")
        print(f"  {name:16s} ctx={ctx:6d} {row['tok_s']:.2f} tok/s{side} "
              f"accept={row['accept_length']} "
              f"draft_kv={row.get('draft_kv_view_tokens')} ttft cold={cold_ttft:.1f}s "
              f"warm={ttft:.2f}s ({row['ttft_warm_over_cold']:.3f})", flush=True)
    sched.check_all_free()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", default="2048,8192,16384")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--doc", default="gdpr", help="legal document name (gdpr, ai_act, ...)")
    ap.add_argument("--budget", type=int, default=1024)
    ap.add_argument("--chunk", type=int, default=64)
    ap.add_argument("--configs", default="plain,full,streaming,retrieval,retrieval_pos4k")
    ap.add_argument("--out", default="draft_kv")
    ap.add_argument("--rounds", type=int, default=1,
                    help="decode runs per context (repeats on the warm document); best kept")
    ap.add_argument("--token-map", action="store_true",
                    help="draft scores only a 32K legal token map (GDPR held out)")
    args = ap.parse_args()
    from sglang.srt.model_loader.loader import load_tokenizer
    from sglang.test.real_assets import legal_text, qwen_pair

    pair = qwen_pair()
    text = legal_text(args.doc)
    if not pair or text is None:
        sys.exit("Real assets missing: run scripts/fetch_real_models.py and fetch_legal_docs.py")
    draft, target = pair
    tok = load_tokenizer(target)
    doc = tok(text, add_special_tokens=False)["input_ids"]
    q = tok(QUESTION, add_special_tokens=False)["input_ids"]
    q2 = tok(QUESTION2, add_special_tokens=False)["input_ids"]
    contexts = [int(c) for c in args.contexts.split(",")]
    while len(doc) < max(contexts):
        doc = doc + doc  # a short document repeats (it quotes itself, as contracts do)
    prompts = {c: (doc[: c - len(q)], q) for c in contexts}
    info = machine_info()
    print(f"machine {info}\ntarget {target}\ndraft {draft}", flush=True)
    table = configs(args.budget, args.chunk)
    token_map = ""
    if args.token_map:
        from bench_spec import legal_token_map

        token_map = legal_token_map(draft)
    results: Dict[str, Any] = {"machine": info, "target": target, "draft": draft,
                               "document": args.doc, "dtype": args.dtype,
                               "new_tokens": args.new_tokens, "budget": args.budget,
                               "chunk": args.chunk, "rounds": args.rounds,
                               "token_map": token_map, "command": " ".join(sys.argv), "configs": {}}
    for name in args.configs.split(","):
        results["configs"][name] = run_isolated(run_config, name, table[name], target, draft,
                                                prompts, args.new_tokens, args.dtype,
                                                q2, args.rounds, token_map)
    plain = results["configs"].get("plain")
    for name, per_ctx in results["configs"].items():
        for ctx, row in per_ctx.items():
            if plain:
                row["speedup"] = row["tok_s"] / plain[ctx]["tok_s"]
                row["same_as_plain"] = row["tokens"] == plain[ctx]["tokens"]
    for per_ctx in results["configs"].values():
        for row in per_ctx.values():
            row.pop("tokens", None)
    print(f"wrote {save(args.out, results)}")
    groups = [str(c) for c in contexts]
    spec_names = [n for n in results["configs"] if n != "plain"]
    for key, label in (("speedup_side_by_side", "tokens/s vs plain (same process, interleaved)"),
                       ("speedup", "tokens/s vs the plain configuration's run"), ("accept_length", "acceptance length"),
                       ("draft_kv_view_bytes", "draft KV bytes read (largest view)"),
                       ("draft_s_per_step", "draft s/step"),
                       ("ttft_warm_over_cold", "TTFT warm / cold")):
        series = {n: [results["configs"][n][c].get(key) for c in contexts] for n in spec_names}
        plot_bars(os.path.join(RESULTS, f"{args.out}_{key}.png"),
                  f"{label} vs context ({os.path.basename(target)}, {args.doc})", groups, series,
                  label)


if __name__ == "__main__":
    main()
