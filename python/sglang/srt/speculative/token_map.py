"""A draft model's hot vocabulary (`--speculative-token-map`, as upstream's FR-Spec option).

The draft's vocabulary projection is a large part of a small draft's step: Qwen2.5-0.5B's
151,936 x 896 lm_head is ~27% of the bytes one of its decode steps reads (docs/decisions.md).
With a token map the draft scores only the listed tokens (the most frequent ones of the
domain), so every draft step reads a fraction of that matrix. Proposals are limited to the map;
verification is untouched, so the output is still exactly the target's (a token outside the map
is simply never proposed, it comes as the bonus or a correction token).

File formats: a `torch.save`d 1-D tensor or list of token ids (upstream's format), a JSON
list, or a text file with one id per line; `scripts/build_token_map.py` writes one from a
corpus.
"""

from __future__ import annotations

import json
import os

import torch
from torch import nn


def load_token_map(path: str, vocab_size: int) -> torch.Tensor:
    """Sorted unique int64 ids from `path`; ValueError saying what to fix otherwise."""
    if not os.path.isfile(path):
        raise ValueError(f"--speculative-token-map {path!r} is not a file (a torch.save'd "
                         "tensor of token ids, a JSON list, or one id per line)")
    try:
        if path.endswith(".json"):
            with open(path) as f:
                ids = torch.tensor(json.load(f), dtype=torch.int64)
        elif path.endswith(".txt"):
            with open(path) as f:
                ids = torch.tensor([int(x) for x in f.read().split()], dtype=torch.int64)
        else:
            ids = torch.as_tensor(torch.load(path, weights_only=True), dtype=torch.int64)
    except Exception as e:  # unreadable or not a list of integers
        raise ValueError(f"--speculative-token-map {path!r}: cannot read token ids ({e})") from e
    ids = torch.unique(ids.flatten())
    if ids.numel() == 0:
        raise ValueError(f"--speculative-token-map {path!r} lists no tokens")
    if int(ids[0]) < 0 or int(ids[-1]) >= vocab_size:
        raise ValueError(f"--speculative-token-map {path!r} has ids outside the draft's "
                         f"vocabulary [0, {vocab_size})")
    return ids


class HotVocabHead(nn.Module):
    """lm_head over the hot ids only: logits of the other tokens are -inf, so the draft's
    softmax, top-k and sampling see a distribution over the map. Its weight is a contiguous
    copy of the hot rows (tied embeddings stay intact)."""

    def __init__(self, weight: torch.Tensor, ids: torch.Tensor) -> None:
        super().__init__()
        self.vocab_size = weight.shape[0]
        self.register_buffer("ids", ids.clone(), persistent=False)
        self.register_buffer("weight", weight.detach()[ids].contiguous(), persistent=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        from sglang.srt.layers.linear import linear

        hot = linear(hidden, self.weight).float()
        out = hot.new_full((hidden.shape[0], self.vocab_size), float("-inf"))
        out[:, self.ids] = hot
        return out
