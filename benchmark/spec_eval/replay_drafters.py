"""Drafting quality on identical text: our n-gram drafter and vLLM's ngram rule replayed offline
over the same generated answers, so that a step count compares drafters and not texts.

Why: in bf16 the greedy answer of one prompt differs between engines and between a cold
prefill and a radix-cache hit (tables/list/1K: 21 NGRAM steps on round 1's text, 40 on round
2's, which plain decoding produced too), so bench_spec_eval's per-prompt NGRAM / vLLM ratios
compare different answers. Here every answer kept by a run (ours plain, vLLM plain, both
rounds) is replayed token by token: at each step each drafter proposes from prompt + the
answer so far, the accepted length is how far the proposal follows the answer (greedy
verify), and the step count is what a verify loop over that text would take.

- ours: `NgramDrafter` as the server runs it for NGRAM (10-node tree, depth 9);
- ours chain: the same drafter with one branch (all 9 drafted tokens on one path);
- vLLM: its documented rule (the longest suffix n-gram of length lookup_min..lookup_max,
  its earliest occurrence, the k tokens after it; vllm/v1/spec_decode/ngram_proposer.py),
  reimplemented here by brute force at each setting bench_spec_eval runs.

    python benchmark/spec_eval/replay_drafters.py [--runs spec_eval_kernels]

Reads benchmark/results/<runs>_parts/{plain,vllm_plain}.json and the eval set's prompts;
writes benchmark/results/<runs>_replay.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import types
from typing import Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
from common import RESULTS, machine_info, save  # noqa: E402

VLLM_SETTINGS = {"vllm k10 l1-2": (10, 1, 2), "vllm k5 l2-4": (5, 2, 4),
                 "vllm k10 l1-4": (10, 1, 4)}


def vllm_proposal(hist: List[int], k: int, lo: int, hi: int) -> List[int]:
    """vLLM's ngram rule: the longest n in [lo, hi] whose suffix occurred earlier, at its
    earliest occurrence; the (up to) k tokens that followed it."""
    n = len(hist)
    for m in range(min(hi, n - 1), lo - 1, -1):
        suffix = hist[n - m:]
        for start in range(0, n - m):
            if hist[start:start + m] == suffix:
                return hist[start + m:start + m + k]
    return []


def chain_accepted(proposal: List[int], answer: List[int]) -> int:
    a = 0
    while a < len(proposal) and a < len(answer) and proposal[a] == answer[a]:
        a += 1
    return a


def tree_accepted(tree, answer: List[int]) -> int:
    """How far the tree follows `answer` from its root (greedy verify of a token tree)."""
    if tree is None:
        return 0
    children: Dict[int, List[int]] = {}
    for i in range(1, len(tree)):
        children.setdefault(tree.parents[i], []).append(i)
    node = a = 0
    while a < len(answer):
        nxt = [c for c in children.get(node, []) if tree.tokens[c] == answer[a]]
        if not nxt:
            break
        node, a = nxt[0], a + 1
    return a


def replay(propose, prompt: List[int], answer: List[int]) -> int:
    """Steps a verify loop takes to emit `answer` with `propose(history, rest) -> accepted`."""
    pos = steps = 0
    while pos < len(answer):
        pos += propose(prompt + answer[:pos], answer[pos:]) + 1
        steps += 1
    return steps


def ours(budget: int, topk: Optional[int]):
    from sglang.srt.speculative.drafters.ngram import NgramDrafter

    drafter = NgramDrafter(max_depth=budget - 1)
    if topk == 1:  # one branch: the heaviest path only
        drafter.max_candidates = 1
    req = types.SimpleNamespace(rid="replay", cached_tokens=0, fill_ids=None)

    def propose(hist: List[int], rest: List[int]) -> int:
        req.fill_ids = hist
        return tree_accepted(drafter.propose([req], [budget], depth=budget - 1)[0], rest)

    def fresh():
        drafter.release(req)
    return propose, fresh


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", default="spec_eval_kernels")
    ap.add_argument("--budget", type=int, default=10)
    args = ap.parse_args()

    from sglang.srt.model_loader.loader import load_tokenizer
    from sglang.test.real_assets import qwen_pair
    from spec_eval.eval_set import eval_prompts

    _, target = qwen_pair()
    prompts = {p["name"]: p["ids"] for p in eval_prompts(load_tokenizer(target))}
    parts = os.path.join(RESULTS, args.runs + "_parts")
    answers = []  # (source, round, prompt name, ids)
    for source, fname in (("ours plain", "plain.json"), ("vllm plain", "vllm_plain.json")):
        for r in json.load(open(os.path.join(parts, fname))):
            answers.append((source, r["round"], r["name"], r["output_ids"]))
    drafters = {"ours": ours(args.budget, None), "ours chain": ours(args.budget, 1)}
    rows = []
    for source, rnd, name, answer in answers:
        row = {"text": f"{source} round {rnd + 1}", "prompt": name, "tokens": len(answer)}
        for label, (propose, fresh) in drafters.items():
            row[label] = replay(propose, prompts[name], answer)
            fresh()
        for label, (k, lo, hi) in VLLM_SETTINGS.items():
            row[label] = replay(
                lambda h, rest, k=k, lo=lo, hi=hi: chain_accepted(vllm_proposal(h, k, lo, hi),
                                                                  rest),
                prompts[name], answer)
        row["ours / best vllm (steps)"] = round(
            min(row[v] for v in VLLM_SETTINGS) / row["ours"], 3)
        rows.append(row)
        print(row, flush=True)
    path = save(args.runs + "_replay", {"runs": args.runs, "budget": args.budget,
                                        "machine": machine_info(),
                                        "command": " ".join(sys.argv), "rows": rows})
    print("wrote", path)


if __name__ == "__main__":
    main()
