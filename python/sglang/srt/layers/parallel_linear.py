"""Tensor-parallel linears and vocabulary layers (Megatron's split, upstream's names).

Column-parallel: each rank holds a slice of W's output rows, its output stays split (the
attention heads, the FFN's intermediate features). Row-parallel: each rank holds a slice of
W's input columns; the partial products are summed over the ranks (all-reduce) and the bias
is added once, after. The vocabulary is split in equal row blocks (padded up to a multiple
of the rank count) shared by the embedding and a tied lm_head; the logits are gathered
whole on every rank, so every rank samples the same tokens.

Each layer loads its own shard from a whole checkpoint tensor (`load_shard(leaf, full,
shard)`), so checkpoints load unchanged at any --tp-size. With one rank every layer is the
plain Linear / Embedding (same parameters, same numerics) and no collective runs.
"""

from __future__ import annotations

from typing import List, Optional

import torch
import torch.nn.functional as F
from torch import nn

from sglang.srt.distributed.parallel_state import (all_gather_last_dim, all_reduce, divide,
                                                   kv_head_of_rank, kv_heads_per_rank,
                                                   tp_group)
from sglang.srt.layers.linear import Linear, linear


def _copy_rows(dst: torch.Tensor, src: torch.Tensor, what: str) -> None:
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(f"{what}: checkpoint shard {tuple(src.shape)} != model "
                         f"{tuple(dst.shape)}")
    with torch.no_grad():
        dst.copy_(src)


class MergedColumnParallelLinear(Linear):
    """Output rows are parts of `sizes` (e.g. [gate | up]), each split evenly over the ranks:
    this rank holds its slice of every part, in part order."""

    def __init__(self, in_features: int, sizes: List[int], bias: bool = False,
                 local_sizes: Optional[List[int]] = None) -> None:
        tp = tp_group()
        self.local_sizes = local_sizes or [divide(s, tp.size, "projection width") for s in sizes]
        super().__init__(in_features, sum(self.local_sizes), bias=bias)

    def shard_source_rows(self, shard: int) -> slice:
        """Rows of the whole checkpoint part `shard` this rank holds."""
        n = self.local_sizes[shard]
        start = tp_group().rank * n
        return slice(start, start + n)

    def load_shard(self, leaf: str, full: torch.Tensor, shard: int = 0) -> None:
        lo = sum(self.local_sizes[:shard])
        dst = getattr(self, leaf).data[lo:lo + self.local_sizes[shard]]
        _copy_rows(dst, full[self.shard_source_rows(shard)], f"{leaf} part {shard}")


class ColumnParallelLinear(MergedColumnParallelLinear):
    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__(in_features, [out_features], bias)


class QKVParallelLinear(MergedColumnParallelLinear):
    """Rows [q | k | v]: this rank's query heads and its KV heads (split when there are at
    least as many as ranks, else one per rank, replicated)."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool = False) -> None:
        tp = tp_group()
        self.head_dim = head_dim
        self.num_heads = divide(num_heads, tp.size, "number of attention heads")
        self.num_kv_heads = kv_heads_per_rank(num_kv_heads, tp.size)
        self.total_kv_heads = num_kv_heads
        q, kv = num_heads * head_dim, num_kv_heads * head_dim
        kv_local = self.num_kv_heads * head_dim
        super().__init__(hidden_size, [q, kv, kv], bias,
                         local_sizes=[self.num_heads * head_dim, kv_local, kv_local])

    def shard_source_rows(self, shard: int) -> slice:
        tp = tp_group()
        if shard == 0:
            start = tp.rank * self.num_heads * self.head_dim
        else:
            start = kv_head_of_rank(tp.rank, self.total_kv_heads, tp.size) * self.head_dim
        return slice(start, start + self.local_sizes[shard])


class RowParallelLinear(Linear):
    """Input columns split over the ranks; the outputs are summed (all-reduce)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        self.tp_size = tp_group().size
        super().__init__(divide(in_features, self.tp_size, "projection input width"),
                         out_features, bias=bias)

    def load_shard(self, leaf: str, full: torch.Tensor, shard: int = 0) -> None:
        if leaf == "bias":  # whole on every rank, added once after the sum
            _copy_rows(self.bias.data, full, "bias")
            return
        n = self.in_features
        start = tp_group().rank * n
        _copy_rows(self.weight.data, full[:, start:start + n], "weight")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return linear(x, self.weight, self.bias)
        out = all_reduce(linear(x, self.weight, None))
        return out if self.bias is None else out + self.bias


def vocab_rows(vocab_size: int) -> slice:
    """Token ids this rank's vocabulary block covers (the last block may be short)."""
    tp = tp_group()
    per_rank = -(-vocab_size // tp.size)
    start = tp.rank * per_rank
    return slice(start, min(start + per_rank, vocab_size))


def _load_vocab_block(weight: torch.Tensor, full: torch.Tensor, vocab_size: int,
                      what: str) -> None:
    """This rank's block of a [vocab, hidden] table; the padding rows past the vocabulary
    are zeros (their logits are cut off, their ids never looked up)."""
    rows = vocab_rows(vocab_size)
    n = rows.stop - rows.start
    _copy_rows(weight.data[:n], full[rows], what)
    if n < weight.shape[0]:
        with torch.no_grad():
            weight.data[n:].zero_()


class VocabParallelEmbedding(nn.Embedding):
    """Each rank embeds the ids in its vocabulary block (zeros elsewhere); the sum over the
    ranks is every id's row."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        tp = tp_group()
        self.tp_size, self.vocab_size = tp.size, vocab_size
        self.vocab_start = vocab_rows(vocab_size).start
        super().__init__(-(-vocab_size // tp.size), hidden_size)

    def load_shard(self, leaf: str, full: torch.Tensor, shard: int = 0) -> None:
        _load_vocab_block(self.weight, full, self.vocab_size, "embedding")

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.num_embeddings)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0)
        return all_reduce(out)


class ParallelLMHead(Linear):
    """The vocabulary projection, rows in the embedding's blocks (so it can be tied to it);
    the logits are gathered whole on every rank."""

    def __init__(self, hidden_size: int, vocab_size: int) -> None:
        tp = tp_group()
        self.tp_size, self.vocab_size = tp.size, vocab_size
        super().__init__(hidden_size, -(-vocab_size // tp.size), bias=False)

    def load_shard(self, leaf: str, full: torch.Tensor, shard: int = 0) -> None:
        _load_vocab_block(self.weight, full, self.vocab_size, "lm_head")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return linear(x, self.weight, None)
        return all_gather_last_dim(linear(x, self.weight, None))[..., :self.vocab_size]
