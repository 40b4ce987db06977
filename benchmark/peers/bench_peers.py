"""Every engine measured the same way, side by side in one run: ours, transformers, vLLM CPU
and llama.cpp, plain and with each one's n-gram / prompt-lookup drafting.

The same token ids for every engine, greedy, `--new-tokens` new tokens with EOS ignored, the
same thread count, prefix caching off for all (every TTFT is a cold prefill), one request at
a time. Each configuration runs in its own process (`worker.py`, in its engine's own
environment); the configurations of a group load one after another, then decode in turns,
round by round (`spec_eval/turns.py`): the VM's drift falls on all alike. Timing from the
same event streams for all (`summary.py`): TTFT, decode tok/s after the first token,
end-to-end tok/s; median and range over the rounds. Each plain configuration is checked
against its engine's known speed on this kind of machine (`reference.py`). The JSON holds the
machine: CPU and flags, bandwidth measured at the start, load and steal after every round.
Each configuration's raw event streams are kept under `benchmark/results/<name>_parts/`; a
rerun keeps the configurations already complete there (`--fresh` redoes them).

    python benchmark/peers/bench_peers.py --vllm-python ~/vllm-env/bin/python \
        --llama-python ~/llama-env/bin/python [--rounds 3] [--new-tokens 64] \
        [--contexts 1024,4096] [--groups "ours plain,vllm plain;..."] [--name peers_0.5b]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
from typing import Dict, List

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
from common import (RESULTS, copy_bandwidth_gbs, machine_info, plot_bars, prompt_ids,  # noqa: E402
                    vllm_env)
from peers.configs import CONFIGS, REFERENCE_ENGINE  # noqa: E402
from peers.machine import RunState, cpu_facts  # noqa: E402
from peers.reference import reference_for  # noqa: E402
from peers.summary import summarize  # noqa: E402
from spec_eval.turns import Turn  # noqa: E402

DEFAULT = ["ours plain", "ours NGRAM", "ours plain fp32", "ours NGRAM fp32", "hf plain fp32",
           "hf lookup10 fp32",
           "vllm plain", "vllm ngram k10 l1-2", "vllm ngram k5 l2-4", "vllm ngram k10 l1-4",
           "llama.cpp plain", "llama.cpp lookup k10 n2", "llama.cpp lookup k5 n3"]


OUT = {"dir": RESULTS}  # --out-dir (tests write elsewhere)


def part_file(name: str, cfg: str) -> str:
    return os.path.join(OUT["dir"], name + "_parts", cfg.replace(" ", "_") + ".json")


def complete(path: str, prompts: List[Dict], rounds: int) -> bool:
    if not os.path.isfile(path):
        return False
    with open(path) as f:
        have = {(r["prompt"], r["round"]) for r in json.load(f)}
    return all((p["name"], r) in have for p in prompts for r in range(rounds))


def worker(cfg: str, args, models: Dict[str, str], prompts_file: str, tmp: str):
    pc = CONFIGS[cfg]
    with open(prompts_file) as f:
        prompts = json.load(f)
    model = models["gguf"] if pc.engine in ("ours", "llama_cpp_engine") else models["hf"]
    job = {"name": cfg, "config": pc.settings, "model": model, "prompts": prompts,
           "rounds": args.rounds, "new_tokens": args.new_tokens, "threads": args.threads}
    job_file = os.path.join(tmp, cfg.replace(" ", "_") + ".job.json")
    with open(job_file, "w") as f:
        json.dump(job, f)
    python = {"ours": sys.executable, "vllm": args.vllm_python, "llama": args.llama_python}[pc.env]
    env = (vllm_env(args.threads, kv_gb=args.vllm_kv_gb) if pc.env == "vllm"
           else {**os.environ, "OMP_NUM_THREADS": str(args.threads)})
    return [python, os.path.join(HERE, "worker.py"), pc.engine, job_file,
            part_file(args.name, cfg)], env


def run_group(group: List[str], args, models, prompts_file, prompts, tmp) -> Dict:
    """Load the group's configurations one at a time, then decode in turns round by round;
    a group interrupted mid-way is redone whole (its rounds belong together)."""
    todo = [c for c in group
            if args.fresh or not complete(part_file(args.name, c), prompts, args.rounds)]
    for c in group:
        if c not in todo:
            print(f"{c}: kept from {part_file(args.name, c)}", flush=True)
    state = RunState()
    turns: List[Turn] = []
    try:
        for c in todo:
            turns.append(Turn(c, *worker(c, args, models, prompts_file, tmp)))
            turns[-1].wait_for("@@ready")
        state = RunState()  # loads are not part of the rounds' load and steal
        for r in range(args.rounds):
            for t in turns:
                t.go(r)
            state.round_done(r)
            print(f"round {r + 1}/{args.rounds} done: {state.rounds[-1]}", flush=True)
        for t in turns:
            t.finish()
    finally:
        for t in turns:
            t.kill()
    return {"configs": group, "ran": todo, "state": state.report()}


def references(configs: List[str], prompts: List[Dict], model_size: str) -> Dict:
    out = {}
    for c in configs:
        pc = CONFIGS[c]
        eng = REFERENCE_ENGINE[pc.engine]
        for p in prompts:
            ref = (reference_for(eng, model_size, pc.dtype, len(p["ids"]))
                   if eng and c == pc.plain and p["name"].startswith("gdpr") else None)
            if ref is not None:
                out[(c, p["name"])] = ref
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="a GGUF (default: the Qwen2.5-Coder 0.5B)")
    ap.add_argument("--vllm-python", default=None)
    ap.add_argument("--llama-python", default=None)
    ap.add_argument("--only", default=None, help="comma-separated configurations")
    ap.add_argument("--groups", default=None, help="';'-separated groups of ','-separated "
                    "configurations (default: one group of all; mind the RAM)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--contexts", default="1024,4096", help="GDPR prompts of these lengths")
    ap.add_argument("--eval-set", action="store_true",
                    help="add the held-out prompts of spec_eval/eval_set.py (<= 4K documents)")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--vllm-kv-gb", type=int, default=1)
    ap.add_argument("--fresh", action="store_true")
    ap.add_argument("--name", default="peers_0.5b")
    ap.add_argument("--out-dir", default=RESULTS)
    args = ap.parse_args()
    OUT["dir"] = args.out_dir
    # a SIGTERM ends the run through the `finally`s, so every worker's process group is killed
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    from decode_throughput.bench_decode import hf_folder_for
    from sglang.srt.model_loader.loader import load_tokenizer
    from sglang.test.real_assets import qwen_gguf

    gguf = args.model or qwen_gguf("0.5b")
    if not gguf or not os.path.isfile(gguf):
        sys.exit("no model: run scripts/fetch_real_models.py --only 0.5b, or pass --model GGUF")
    tok = load_tokenizer(gguf)
    prompts = [{"name": f"gdpr-{c // 1024}k" if c % 1024 == 0 else f"gdpr-{c}",
                "ids": prompt_ids(tok, c)}
               for c in map(int, args.contexts.split(","))]
    if args.eval_set:
        from spec_eval.eval_set import eval_prompts

        prompts += [{"name": p["name"], "ids": p["ids"]} for p in eval_prompts(tok)
                    if p["doc_tokens"] <= 4096]
    # --groups names its configurations itself (a name missing from DEFAULT still runs)
    groups = ([g.split(",") for g in args.groups.split(";")] if args.groups
              else [args.only.split(",") if args.only else list(DEFAULT)])
    unknown = [c for g in groups for c in g if c not in CONFIGS]
    if unknown:
        sys.exit(f"unknown configurations {unknown}; known: {list(CONFIGS)}")
    runnable = [c for g in groups for c in g if CONFIGS[c].env == "ours"
                or (CONFIGS[c].env == "vllm" and args.vllm_python)
                or (CONFIGS[c].env == "llama" and args.llama_python)]
    skipped = [c for g in groups for c in g if c not in runnable]
    if skipped:
        print(f"skipped (no --vllm-python / --llama-python for them): {skipped}", flush=True)
    groups = [[c for c in g if c in runnable] for g in groups]
    machine = {**machine_info(), **cpu_facts(), "threads": args.threads,
               "copy_bandwidth_gbs_at_start": round(copy_bandwidth_gbs(), 1)}
    needs_hf = any(CONFIGS[c].engine in ("transformers_hf", "vllm_cpu") for g in groups for c in g)
    # transformers and vLLM 0.32 read the GGUF's weights from an HF folder (dequantized once)
    models = {"gguf": gguf, "hf": hf_folder_for(gguf, tok) if needs_hf else None}
    os.makedirs(os.path.join(args.out_dir, args.name + "_parts"), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix="peers_")
    prompts_file = os.path.join(tmp, "prompts.json")
    with open(prompts_file, "w") as f:
        json.dump(prompts, f)
    t0 = time.time()
    states = [run_group(g, args, models, prompts_file, prompts, tmp) for g in groups if g]
    runs = {}
    for c in [c for g in groups for c in g]:
        with open(part_file(args.name, c)) as f:
            runs[c] = json.load(f)
    size = "1.5b" if "1.5b" in os.path.basename(gguf).lower() else "0.5b"
    refs = references(list(runs), prompts, size)
    table = summarize(runs, {c: CONFIGS[c].plain for c in runs}, "ours plain", refs)
    for p, row in table.items():
        print(p, {c: (cell["decode_tok_s"]["median"], cell["x_own_plain"])
                  for c, cell in row.items()})
    flagged = [(c, p) for p, row in table.items() for c, cell in row.items()
               if cell.get("reference", {}).get("far_below")]
    result = {"command": " ".join(sys.argv), "model": gguf, "hf_folder": models["hf"],
              "new_tokens": args.new_tokens, "rounds": args.rounds, "prefix_caching": False,
              "machine": machine, "groups": states, "seconds": round(time.time() - t0),
              "configs": {c: {"engine": CONFIGS[c].engine, "settings": CONFIGS[c].settings,
                              "plain": CONFIGS[c].plain} for c in runs},
              "prompt_tokens": {p["name"]: len(p["ids"]) for p in prompts},
              "far_below_reference": flagged, "table": table}
    path = os.path.join(args.out_dir, args.name + ".json")
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
    names = list(table)
    plot_bars(os.path.join(args.out_dir, args.name + ".png"),
              f"decode tok/s, {os.path.basename(gguf)}, {args.threads} threads (median of "
              f"{args.rounds} interleaved rounds)", names,
              {c: [table[n].get(c, {}).get("decode_tok_s", {}).get("median") for n in names]
               for c in runs}, "tok/s")
    print("wrote", path, "| far below reference:", flagged or "none")


if __name__ == "__main__":
    main()
