"""The corpus as fixed-length token sequences, and the draft vocabulary it uses."""

from __future__ import annotations

import os
from collections import Counter
from typing import List, Sequence

import torch


def corpus_files(path: str) -> List[str]:
    """A .txt file, or every .txt file under a folder (sorted, so runs are repeatable)."""
    if os.path.isfile(path):
        return [path]
    if not os.path.isdir(path):
        raise FileNotFoundError(f"--corpus {path!r} is neither a .txt file nor a folder")
    files = sorted(os.path.join(root, f) for root, _, names in os.walk(path)
                   for f in names if f.endswith(".txt"))
    if not files:
        raise ValueError(f"--corpus {path!r} holds no .txt files")
    return files


def token_sequences(tokenizer, path: str, seq_len: int, max_sequences: int = 0
                    ) -> List[List[int]]:
    """Each document tokenized (BOS as the tokenizer adds it) and cut into pieces of
    `seq_len` tokens (a shorter last piece kept if at least 16 tokens). With
    `max_sequences`, pieces are taken from the documents in turn (every document is
    represented, not only the first long one)."""
    per_doc: List[List[List[int]]] = []
    for name in corpus_files(path):
        with open(name, encoding="utf-8", errors="replace") as f:
            ids = tokenizer(f.read()).input_ids
        pieces = [ids[s: s + seq_len] for s in range(0, len(ids), seq_len)]
        per_doc.append([p for p in pieces if len(p) >= 16])
    out: List[List[int]] = []
    for k in range(max((len(d) for d in per_doc), default=0)):
        for doc in per_doc:
            if k < len(doc):
                out.append(doc[k])
    if not out:
        raise ValueError(f"--corpus {path!r}: no document of at least 16 tokens")
    return out[:max_sequences] if max_sequences else out


def draft_vocabulary(sequences: Sequence[Sequence[int]], size: int, vocab_size: int
                     ) -> torch.Tensor:
    """The `size` most frequent target ids of the corpus, sorted (draft id i is the i-th);
    when the corpus uses fewer, the rest are the lowest unused ids (every draft id means
    a distinct token)."""
    size = min(size, vocab_size)
    counts = Counter(t for s in sequences for t in s)
    used = [t for t, _ in counts.most_common(size)]
    if len(used) < size:
        seen = set(used)
        used += [t for t in range(vocab_size) if t not in seen][: size - len(used)]
    return torch.tensor(sorted(used), dtype=torch.int64)


def maps(draft_ids: torch.Tensor, vocab_size: int):
    """(d2t, t2d) as upstream stores them: target id = draft id + d2t[draft id]; t2d marks
    the target ids the head can draft."""
    d2t = draft_ids - torch.arange(len(draft_ids))
    t2d = torch.zeros(vocab_size, dtype=torch.bool).index_fill_(0, draft_ids, True)
    return d2t, t2d
