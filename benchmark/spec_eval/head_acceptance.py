"""Tokens per verify of EAGLE-3 heads on text they trained on and on the held-out set: how
far a head generalises (the learning curve between heads trained on more data).

Each head drafts through the engine (bf16 target, greedy, a chain of 3 tokens: the head's
own quality, no tree), with the cost model and the fallback off so that every step
speculates: the accept length then depends on the drafts and the answer only, not on the
VM's timing. Prompts: the held-out evaluation's (benchmark/spec_eval/eval_set.py, up to
`--max-doc-tokens`) and `--train-prompts` of the head's own self-generated chat samples
(its corpus/chat/, the prompt up to the assistant's turn; the first head's are used for all,
so every head answers the same questions).

    python benchmark/spec_eval/head_acceptance.py --target GGUF --heads DIR1,DIR2
        [--max-doc-tokens 4096] [--train-prompts 6] [--name head_acceptance]
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import sys
from typing import Dict, List

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
from common import RESULTS, machine_info, plot_bars, save  # noqa: E402

ASSISTANT = "<|im_start|>assistant\n"


def train_prompts(tokenizer, head: str, n: int) -> Dict[str, List[int]]:
    """n of the head's chat samples spread over its corpus, cut after the assistant tag."""
    files = sorted(glob.glob(os.path.join(head, "corpus", "chat", "*.txt")))
    if not files:
        raise SystemExit(f"{head}/corpus/chat holds no samples: a head built with "
                         "--chat-answers has them")
    out = {}
    for f in files[:: max(1, len(files) // n)][:n]:
        text = open(f, encoding="utf-8").read()
        cut = text.rindex(ASSISTANT) + len(ASSISTANT)
        out["train/" + os.path.basename(f)[:-4]] = tokenizer(
            text[:cut], add_special_tokens=False).input_ids
    return out


def accept_lengths(target: str, head: str, prompts: Dict[str, List[int]], steps: int,
                   topk: int, draft_tokens, new_tokens: int) -> Dict[str, float]:
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.server_args import ServerArgs
    from sglang.test.scheduler_driver import run

    longest = max(len(p) for p in prompts.values()) + new_tokens + 16
    sched = Scheduler(ServerArgs(
        model_path=target, dtype="bfloat16", context_length=longest,
        max_total_tokens=4 * longest, speculative_algorithm="EAGLE3",
        speculative_draft_model_path=head, speculative_num_steps=steps,
        speculative_eagle_topk=topk, speculative_num_draft_tokens=draft_tokens,
        speculative_disable_cost_model=True, speculative_fallback_threshold=0.0,
        disable_radix_cache=True))
    out = {}
    for name in prompts:  # one at a time: batch 1 as in the evaluation
        got = run(sched, [prompts[name]], [dict(max_new_tokens=new_tokens, temperature=0.0,
                                                ignore_eos=True)])
        out[name] = round(got["0"][1].extra_meta["spec_accept_length"], 3)
        print(f"{os.path.basename(head)} {steps}x{topk} {name}: {out[name]}", flush=True)
    sched.check_all_free()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", required=True)
    ap.add_argument("--heads", required=True, help="comma-separated head folders")
    ap.add_argument("--max-doc-tokens", type=int, default=4096)
    ap.add_argument("--train-prompts", type=int, default=6)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--name", default="head_acceptance")
    a = ap.parse_args()
    sys.path.insert(0, HERE)
    from eval_set import eval_prompts
    from sglang.srt.model_loader.loader import load_tokenizer

    heads = [os.path.expanduser(h) for h in a.heads.split(",")]
    tok = load_tokenizer(a.target)
    prompts = train_prompts(tok, heads[0], a.train_prompts)
    prompts.update({p["name"]: p["ids"] for p in eval_prompts(tok)
                    if len(p["ids"]) <= a.max_doc_tokens + 512})
    settings = {"chain 3": (3, 1, None)}
    result = {"target": a.target, "machine": machine_info(), "new_tokens": a.new_tokens,
              "command": " ".join(sys.argv), "heads": {}}
    for head in heads:
        summary = {}
        path = os.path.join(head, "train_summary.json")
        if os.path.exists(path):
            with open(path) as f:
                summary = json.load(f)
        per = {s: accept_lengths(a.target, head, prompts, *v, a.new_tokens)
               for s, v in settings.items()}
        result["heads"][os.path.basename(head)] = {"train_summary": summary, "accept": per}
        for s, vals in per.items():
            held = [v for k, v in vals.items() if not k.startswith("train/")]
            train = [v for k, v in vals.items() if k.startswith("train/")]
            print(f"{os.path.basename(head)} {s}: train median {statistics.median(train)}, "
                  f"held-out median {statistics.median(held)}", flush=True)
    print(save(a.name, result))
    names = list(prompts)
    series = {f"{h} ({s})": [v["accept"][s][n] for n in names]
              for h, v in result["heads"].items() for s in settings}
    plot_bars(os.path.join(RESULTS, a.name + ".png"), "EAGLE-3 heads: tokens per verify "
              "(bf16, greedy, every step speculates)", names, series, "accept length",
              rotation=45)


if __name__ == "__main__":
    main()
