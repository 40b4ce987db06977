"""Write a draft token map (`--speculative-token-map`) from a corpus.

The map holds the `--size` most frequent tokens of the corpus under the model's tokenizer,
topped up with the lowest ids (byte-level BPE gives frequent merges low ids) and every
special token, saved with torch.save as a 1-D int64 tensor (upstream's format).

    python scripts/build_token_map.py --model ~/.cache/sglang-fork/models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf \
        --corpus ~/.cache/sglang-fork/legal --size 32768 --out token_map_legal.pt
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
from typing import Iterable, List

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(_ROOT, "python"))


def corpus_files(paths: Iterable[str]) -> List[str]:
    out = []
    for p in paths:
        if os.path.isdir(p):
            out += sorted(os.path.join(p, f) for f in os.listdir(p) if f.endswith(".txt"))
        elif os.path.isfile(p):
            out.append(p)
        else:
            raise SystemExit(f"corpus path {p!r} does not exist")
    if not out:
        raise SystemExit("no .txt files in the corpus")
    return out


def build(tokenizer, files: List[str], size: int) -> List[int]:
    counts: collections.Counter = collections.Counter()
    for path in files:
        with open(path, encoding="utf-8", errors="replace") as f:
            counts.update(tokenizer(f.read(), add_special_tokens=False)["input_ids"])
    vocab = len(tokenizer)
    chosen = {t for t, _ in counts.most_common(size)}
    chosen |= {t for t in tokenizer.all_special_ids if t is not None and 0 <= t < vocab}
    low = 0
    while len(chosen) < min(size, vocab):
        chosen.add(low)
        low += 1
    return sorted(chosen)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="model path (GGUF or HF folder) for its tokenizer")
    ap.add_argument("--corpus", nargs="+", required=True, help=".txt files or folders of them")
    ap.add_argument("--size", type=int, default=32768)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    import torch

    from sglang.srt.model_loader.loader import load_tokenizer

    files = corpus_files(args.corpus)
    ids = build(load_tokenizer(args.model), files, args.size)
    torch.save(torch.tensor(ids, dtype=torch.int64), args.out)
    print(f"wrote {args.out}: {len(ids)} token ids from {len(files)} files")


if __name__ == "__main__":
    main()
