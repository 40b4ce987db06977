"""Speculation on the held-out evaluation set: ours (plain, NGRAM, STANDALONE, HYBRID) and
vLLM CPU (plain, ngram at several settings), side by side, the same timing for both.

The set is `eval_set.py` (12 prompts, 4 documents x 3 question styles, 1K/4K/16K). Each
configuration runs in its own process, one request at a time, greedy, `--new-tokens` new
tokens with `ignore_eos`, bf16. Inside a process the rounds interleave the prompts (all 12,
then all 12 again; the first round pays the prefills, later rounds hit the prefix cache);
decode tok/s is timed per engine step that emitted tokens, after the first token, so the
prefill is never in it; beside it, the time to the first token and end-to-end tok/s (from
adding the request to its last token: the prefill and a draft's read of the prompt in it). Each configuration's results are kept under
`benchmark/results/<name>_parts/`; a rerun skips the configurations already there
(`--fresh` to redo them), so an interrupted run resumes. With `--groups` the configurations
of a group are loaded together and decode in turns, round by round (`turns.py`): the VM's
drift then falls on every configuration of the group alike.

    python benchmark/spec_eval/bench_spec_eval.py --vllm-python ~/vllm-env/bin/python
        [--rounds 2] [--new-tokens 64] [--only plain,NGRAM]
        [--groups "plain,NGRAM,vllm plain,vllm ngram k10 l1-4;HYBRID,STANDALONE"]
    python benchmark/spec_eval/bench_spec_eval.py --target-path QWEN_0.5B.gguf \
        --eagle3-head ~/.cache/sglang-fork/heads/qwen2.5-coder-0.5b-eagle3 \
        --groups "plain,NGRAM,EAGLE3" --max-doc-tokens 4096 --name spec_eval_eagle3_05b

Writes benchmark/results/spec_eval.json and .png (decode tok/s over our plain).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Dict, List

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
from common import RESULTS, machine_info, plot_bars, save, vllm_env  # noqa: E402
from spec_eval.step_timing import decode_rate, first_token_and_total  # noqa: E402
from spec_eval.turns import Turn, done_turn, ready, wait_turn  # noqa: E402

OURS = {"plain": {}, "NGRAM": {"speculative_algorithm": "NGRAM"},
        "STANDALONE": {"speculative_algorithm": "STANDALONE"},
        "HYBRID": {"speculative_algorithm": "HYBRID"},
        # the head of --eagle3-head: a chain of 3 (the defaults) and a tree of width 2
        "EAGLE3": {"speculative_algorithm": "EAGLE3"},
        "EAGLE3 tree": {"speculative_algorithm": "EAGLE3", "speculative_eagle_topk": 2}}
# vLLM's ngram at three settings: k=10 with short lookups (its best in the run), the
# documented example (k=5, lookup 4..2), and k=10 with longer lookups
VLLM = {"vllm plain": {},
        "vllm ngram k10 l1-2": {"method": "ngram", "num_speculative_tokens": 10,
                                "prompt_lookup_max": 2, "prompt_lookup_min": 1},
        "vllm ngram k5 l2-4": {"method": "ngram", "num_speculative_tokens": 5,
                               "prompt_lookup_max": 4, "prompt_lookup_min": 2},
        "vllm ngram k10 l1-4": {"method": "ngram", "num_speculative_tokens": 10,
                                "prompt_lookup_max": 4, "prompt_lookup_min": 1}}


def ours_worker(config: str, target: str, draft: str, prompts: List[Dict], rounds: int,
                new_tokens: int) -> List[Dict]:
    from sglang.srt.managers.io_struct import TokenizedGenerateReqInput
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.sampling.sampling_params import SamplingParams
    from sglang.srt.server_args import ServerArgs

    longest = max(len(p["ids"]) for p in prompts) + new_tokens + 64
    total = sum(len(p["ids"]) + new_tokens for p in prompts) + 4096  # every prompt stays cached
    kw = dict(OURS[config])
    if kw and kw["speculative_algorithm"] != "NGRAM":
        kw["speculative_draft_model_path"] = draft
    sched = Scheduler(ServerArgs(model_path=target, dtype="bfloat16", context_length=longest,
                                 max_total_tokens=total, **kw))
    sched.calibrate()  # as the server's scheduler process does (the cost model's start-up)
    ready()
    results = []
    for r in range(rounds):
        wait_turn(r)
        for p in prompts:
            params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
            params.normalize()
            start = time.perf_counter()
            sched.add_request(TokenizedGenerateReqInput(rid=f"{p['name']}#{r}",
                                                        input_ids=p["ids"],
                                                        sampling_params=params, stream=True))
            stamps, ids, meta = [], [], {}
            while not sched.is_idle():
                for u in sched.step():
                    if u.new_output_ids:
                        stamps.append((time.perf_counter(), len(u.new_output_ids)))
                        ids += u.new_output_ids
                    if u.finished_reason is not None:
                        meta = dict(u.extra_meta or {})
            rate = decode_rate(stamps)
            ttft, e2e = first_token_and_total(stamps, start)
            results.append({"name": p["name"], "round": r, "decode_tok_s": rate,
                            "ttft_s": ttft, "e2e_tok_s": e2e,
                            "steps": len(stamps), "output_ids": ids,
                            "accept_length": meta.get("spec_accept_length"),
                            "fallbacks": meta.get("spec_fallback_count"),
                            "weights": meta.get("spec_drafter_weights")})
            print(f"[{config}] round {r + 1} {p['name']}: {rate and round(rate, 2)} tok/s, "
                  f"{len(stamps)} steps, accept {meta.get('spec_accept_length')}", flush=True)
        done_turn(r)
    sched.flush_cache()
    sched.check_all_free()  # pools and caches all free after the run
    return results


def part_file(args, config: str) -> str:
    return os.path.join(RESULTS, args.name + "_parts", config.replace(" ", "_") + ".json")


def worker_cmd(config: str, args, prompts_file: str, target: str, draft: str, hf_dir: str,
               tok_dir: str):
    part = part_file(args, config)
    if config.startswith("EAGLE3"):
        if not args.eagle3_head:
            sys.exit("EAGLE3 needs --eagle3-head DIR (scripts/build_qwen_eagle3_head.py)")
        draft = args.eagle3_head
    if config in OURS:
        return [sys.executable, os.path.abspath(__file__), "--worker", config, "--target",
                target, "--draft", draft or "", "--prompts-file", prompts_file, "--out-file", part,
                "--rounds", str(args.rounds), "--new-tokens", str(args.new_tokens)
                ], dict(os.environ)
    return [args.vllm_python, os.path.join(HERE, "vllm_worker.py"), hf_dir, tok_dir,
            json.dumps(VLLM[config]), prompts_file, str(args.rounds), str(args.new_tokens),
            part], vllm_env(kv_gb=args.vllm_kv_gb)


def run_group(group: List[str], args, *cmd_args) -> Dict[str, List[Dict]]:
    """The group's configurations load one after another, then decode in turns round by
    round (`turns.py`); a configuration already kept under the parts folder is read back.
    A group interrupted mid-way is redone whole (a round's prefix cache lives in its process)."""
    todo = [c for c in group if args.fresh or not os.path.isfile(part_file(args, c))]
    for c in group:
        if c not in todo:
            print(f"{c}: kept from {part_file(args, c)}", flush=True)
    turns: List[Turn] = []
    t0 = time.time()
    try:
        for c in todo:
            turns.append(Turn(c, *worker_cmd(c, args, *cmd_args)))
            turns[-1].wait_for("@@ready")  # loads one at a time: a load is not timed anyway
        for r in range(args.rounds):
            for t in turns:
                t.go(r)
        for t in turns:
            t.finish()
    finally:
        for t in turns:
            t.kill()
    if todo:
        print(f"{','.join(todo)}: {time.time() - t0:.0f} s", flush=True)
    out = {}
    for c in group:
        with open(part_file(args, c)) as f:
            out[c] = json.load(f)
    return out


def agreement(a: List[int], b: List[int]) -> int:
    """Tokens from the start on which two outputs agree."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def summarize(prompts: List[Dict], runs: Dict[str, List[Dict]]) -> Dict[str, Dict]:
    table = {}
    for p in prompts:
        row = {}
        for c, res in runs.items():
            mine = [x for x in res if x["name"] == p["name"]]
            rates = [x["decode_tok_s"] for x in mine if x["decode_tok_s"]]
            base = runs.get("plain" if c in OURS else "vllm plain", res)
            # against its own plain in the same round: a prefix-cache hit (later rounds) can
            # change bf16 plain output itself
            ref = {x["round"]: x["output_ids"] for x in base if x["name"] == p["name"]}
            same = [x["output_ids"] == ref.get(x["round"]) for x in mine]
            e2e = [x["e2e_tok_s"] for x in mine if x.get("e2e_tok_s")]
            ttft = [x["ttft_s"] for x in mine if x.get("ttft_s") is not None]
            row[c] = {"median_tok_s": round(statistics.median(rates), 2) if rates else None,
                      "rounds_tok_s": [round(v, 2) for v in rates],
                      # request to last token (prefill and a draft's prompt read included);
                      # absent in parts written before it was recorded
                      "median_e2e_tok_s": round(statistics.median(e2e), 2) if e2e else None,
                      "median_ttft_s": round(statistics.median(ttft), 3) if ttft else None,
                      "steps": mine[-1]["steps"], "accept_length": mine[-1].get("accept_length"),
                      "fallbacks": mine[-1].get("fallbacks"),
                      "same_tokens_as_own_plain": all(same),
                      "rounds_same_as_own_plain": f"{sum(same)}/{len(same)}",
                      "agree_prefix": min(agreement(x["output_ids"], ref.get(x["round"], []))
                                          for x in mine)}
        plain = row["plain"]["median_tok_s"] if "plain" in row else None
        plain_e2e = row["plain"]["median_e2e_tok_s"] if "plain" in row else None
        for c in row:
            v, e = row[c]["median_tok_s"], row[c]["median_e2e_tok_s"]
            row[c]["x_our_plain"] = round(v / plain, 3) if v and plain else None
            row[c]["e2e_x_our_plain"] = round(e / plain_e2e, 3) if e and plain_e2e else None
        table[p["name"]] = row
    return table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--vllm-python", default=None)
    ap.add_argument("--only", default=None, help="comma-separated configurations")
    ap.add_argument("--groups", default=None,
                    help="';'-separated groups of ','-separated configurations that decode in "
                         "turns round by round (each group's processes are alive together: "
                         "mind the RAM); default: each configuration alone, one after another")
    ap.add_argument("--vllm-kv-gb", type=int, default=4, help="VLLM_CPU_KVCACHE_SPACE")
    ap.add_argument("--fresh", action="store_true", help="redo configurations already kept")
    ap.add_argument("--name", default="spec_eval")
    ap.add_argument("--max-doc-tokens", type=int, default=16384, help="a smaller set (smoke)")
    ap.add_argument("--min-doc-tokens", type=int, default=0,
                    help="only the longer prompts (e.g. 16384: the 16K third alone)")
    ap.add_argument("--prompts", default=None,
                    help="comma-separated prompt names (e.g. dora/quote/16K): a part of the set "
                         "per run where one run of all would outlast a session")
    ap.add_argument("--target-path", default=None,
                    help="the target alone (e.g. the 0.5B GGUF) instead of the Qwen pair; "
                         "STANDALONE/HYBRID then need --draft-path")
    ap.add_argument("--draft-path", default=None)
    ap.add_argument("--eagle3-head", default=None, help="an EAGLE-3 head folder for EAGLE3")
    ap.add_argument("--worker", default=None)
    ap.add_argument("--target", default=None)
    ap.add_argument("--draft", default=None)
    ap.add_argument("--prompts-file", default=None)
    ap.add_argument("--out-file", default=None)
    args = ap.parse_args()
    if args.worker:
        with open(args.prompts_file) as f:
            prompts = json.load(f)
        out = ours_worker(args.worker, args.target, args.draft, prompts, args.rounds,
                          args.new_tokens)
        with open(args.out_file, "w") as f:
            json.dump(out, f)
        return

    from decode_throughput.bench_decode import hf_folder_for
    from sglang.srt.model_loader.loader import load_tokenizer
    from sglang.test.real_assets import qwen_pair
    from spec_eval.eval_set import eval_prompts

    if args.target_path:
        target, draft = os.path.expanduser(args.target_path), args.draft_path
    else:
        pair = qwen_pair()
        if not pair:
            sys.exit("run scripts/fetch_real_models.py first (Qwen2.5-Coder 1.5B and 0.5B)")
        draft, target = pair
    tokenizer = load_tokenizer(target)
    prompts = eval_prompts(tokenizer)
    configs = list(OURS) + (list(VLLM) if args.vllm_python else [])
    if not draft:
        configs = [c for c in configs if c not in ("STANDALONE", "HYBRID")]
    if not args.eagle3_head:
        configs = [c for c in configs if not c.startswith("EAGLE3")]
    if args.only:
        configs = [c for c in configs if c in args.only.split(",")]
    prompts = [p for p in prompts
               if args.min_doc_tokens <= p["doc_tokens"] <= args.max_doc_tokens
               and (not args.prompts or p["name"] in args.prompts.split(","))]
    if not prompts:
        sys.exit("no prompt of the set matches --prompts / --min-doc-tokens / --max-doc-tokens")
    os.makedirs(os.path.join(RESULTS, args.name + "_parts"), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix="spec_eval_")
    prompts_file = os.path.join(tmp, "prompts.json")
    with open(prompts_file, "w") as f:
        json.dump(prompts, f)
    hf_dir = tok_dir = None
    if args.vllm_python:
        hf_dir = hf_folder_for(target, tokenizer)  # vLLM 0.32 cannot read the GGUF's config
        tok_dir = hf_dir  # it holds the tokenizer too
    groups = ([g.split(",") for g in args.groups.split(";")] if args.groups
              else [[c] for c in configs])
    unknown = [c for g in groups for c in g if c not in OURS and c not in VLLM]
    if unknown:
        sys.exit(f"unknown configurations {unknown}; known: {list(OURS) + list(VLLM)}")
    runs: Dict[str, List[Dict]] = {}
    for g in groups:
        g = [c for c in g if c in configs]
        if g:
            runs.update(run_group(g, args, prompts_file, target, draft, hf_dir, tok_dir))
    configs = [c for c in configs if c in runs]
    if "plain" not in runs:
        return
    table = summarize(prompts, runs)
    for name, row in table.items():
        print(name, {c: (row[c]["median_tok_s"], row[c]["x_our_plain"]) for c in row})
    result = {"target": target, "draft": draft, "eagle3_head": args.eagle3_head,
              "dtype": "bfloat16",
              "new_tokens": args.new_tokens, "rounds": args.rounds, "configs": configs,
              "vllm": dict(VLLM) if args.vllm_python else None, "machine": machine_info(),
              "command": " ".join(sys.argv), "prompts": table}
    path = save(args.name, result)
    names = list(table)
    plot_bars(os.path.join(RESULTS, args.name + ".png"),
              f"decode tok/s on the held-out set, {os.path.basename(target)} bf16",
              [n.replace("/", "\n") for n in names],
              {c: [table[n][c]["median_tok_s"] for n in names] for c in configs}, "tok/s")
    print("wrote", path)


if __name__ == "__main__":
    main()
