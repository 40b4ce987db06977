"""Where plain and speculative greedy tokens part on the prose document, bfloat16, and why.

Part 1 once reported "not the same tokens as plain" for every speculative setting on prose:
it compared each setting's fastest round, and round 2 reads the document from the radix
cache. This runs plain and STANDALONE (no fallback, no cost model) for two rounds each on
one scheduler apiece and prints where each round first differs from plain's round 1.

    python benchmark/adaptive_spec/round_divergence.py

Measured (commit a227066): plain round 2 and spec round 2 both differ from plain
round 1 at token 15 (',' and 'which' swap places), spec round 1 equals plain round 1: the
cached prefix (other prefill chunks, other bf16 sums) moves the near-tie, speculation not.
"""

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _HERE)
sys.path.insert(0, os.path.dirname(_HERE))

if __name__ == "__main__":
    import torch

    from bench_adaptive import SETTINGS, _drive, documents, traced_scheduler
    from common import share_dense_weights
    from sglang.srt.model_loader.loader import load_tokenizer
    from sglang.test.real_assets import qwen_pair

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    share_dense_weights()
    draft, target = qwen_pair()
    prompt = documents(load_tokenizer(target), 768)["prose"]
    out = {}
    for name in ("plain", "spec"):
        sched = traced_scheduler(target, draft, "bfloat16", SETTINGS[name], 4096)[0]
        for k in range(2):
            out[(name, k + 1)] = _drive(sched, [prompt], 24, f"r{k}-")["tokens"][0]
        sched.abort("", "done")
    ref = out[("plain", 1)]
    for (name, k), tokens in out.items():
        i = next((j for j, (a, b) in enumerate(zip(ref, tokens)) if a != b), None)
        print(f"{name} round {k}: first difference from plain round 1 at token {i}; "
              f"tokens 12-17 {tokens[12:18]}")
