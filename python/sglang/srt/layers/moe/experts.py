"""Routed experts: dispatch tokens sorted by expert, one GEMM pair per active expert, combine.

`MoEExperts` holds the fast tier of one layer: `w13` [S, 2I, H] (gate rows, then up rows)
and `w2` [S, H, I]. Without an expert store S = num_experts and slot e is expert e. With a
store (`--moe-expert-cache-slots N`) S = N and the store decides which expert sits in which
slot; a forward then runs in waves of at most N experts (resident ones first), each wave
pinned while it computes.

Numerics: every (token, k) pair is computed by exactly one expert GEMM over the same rows in
the same order whatever the waves, and the k results are combined in a fixed order in
float32, so the output does not depend on residency (bit-identical to all-resident).
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from sglang.srt.distributed.parallel_state import all_reduce, divide, tp_group
from sglang.srt.layers.linear import linear
from sglang.srt.layers.mlp import GatedMLP
from sglang.srt.layers.moe.recorder import get_expert_recorder
from sglang.srt.layers.moe.router import Router, RouterConfig, RoutingResult

from sglang.srt.layers.moe.hooks import NO_HOOKS, ExpertSlots, MoEHooks
from sglang.srt.utils import host_sync

# checkpoint leaf name -> (which of gate / up / down): Qwen / DeepSeek / OLMoE and Mixtral
EXPERT_LEAVES = {"gate_proj": 0, "up_proj": 1, "down_proj": 2, "w1": 0, "w3": 1, "w2": 2}


def experts_forward_into(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                         slot_ids: torch.Tensor, out: torch.Tensor) -> None:
    """out[t, k] = expert(slot_ids[t, k])(hidden[t]) for every pair with slot_ids >= 0.

    hidden [T, H]; w13 [S, 2I, H]; w2 [S, H, I]; slot_ids [T, k] int64; out [T, k, H].
    Pairs are sorted by slot (stable), so each expert sees its tokens in token order."""
    k = slot_ids.shape[1]
    order = torch.argsort(slot_ids.reshape(-1), stable=True)
    out_flat = out.view(-1, out.shape[-1])
    start = 0
    # slot -1 first (pairs outside this call), then 0, 1, ...: the sorted order's groups
    groups = host_sync.id_counts(slot_ids, w13.shape[0], "moe_expert_groups")
    for slot, n in enumerate(groups, start=-1):
        rows = order[start : start + n]
        start += n
        if slot < 0 or n == 0:
            continue
        x = hidden[rows // k]  # [n, H]
        # `linear`: on CPU the small-M kernel for the few rows an expert gets while decoding
        gate_up = linear(x, w13[slot])  # [n, 2I]
        inter = gate_up.shape[-1] // 2
        act = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        out_flat[rows] = linear(act, w2[slot])  # [n, H]


def combine(out: torch.Tensor, weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """sum_k weights[t, k] * out[t, k] in float32, k in order: [T, k, H] -> [T, H]."""
    acc = out[:, 0].float() * weights[:, :1]
    for j in range(1, out.shape[1]):
        acc = acc + out[:, j].float() * weights[:, j : j + 1]
    return acc.to(dtype)


class MoEExperts(nn.Module):
    """Under tensor parallelism each rank holds a 1 / tp slice of every expert's
    intermediate features (--ep-size 1) or E / ep whole experts (--ep-size = --tp-size);
    either way its output is a partial sum, all-reduced here. Tokens are already on every
    rank (attention is TP, not DP), so EP needs no dispatch: each rank runs its experts'
    pairs and the all-reduce combines them (all-to-all pays when tokens are split)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int,
                 layer_id: int, num_slots: Optional[int] = None) -> None:
        super().__init__()
        tp = tp_group()
        if tp.size > 1 and tp.ep_size == 1 and num_slots is not None:
            raise ValueError("--moe-expert-cache-slots with --tp-size > 1 needs --ep-size equal "
                             "to --tp-size (a store moves whole experts)")
        self.num_experts = num_experts
        self.layer_id = layer_id
        self.tp_size = tp.size
        self.ep_size = tp.ep_size if tp.size > 1 else 1
        # this rank's experts [first_expert, first_expert + local) (all of them without EP)
        self.num_local_experts = divide(num_experts, self.ep_size, "number of experts")
        self.first_expert = tp.rank * self.num_local_experts if self.ep_size > 1 else 0
        self.intermediate_size = (intermediate_size if self.ep_size > 1 else
                                  divide(intermediate_size, tp.size, "expert width"))
        intermediate_size = self.intermediate_size
        # with a store: that many slots for this rank's experts (its own store, EP included)
        slots = (self.num_local_experts if num_slots is None
                 else min(num_slots, self.num_local_experts))
        self.w13 = nn.Parameter(torch.empty(slots, 2 * intermediate_size, hidden_size))
        self.w2 = nn.Parameter(torch.empty(slots, hidden_size, intermediate_size))
        self.store_backed = num_slots is not None
        self.store: Optional[ExpertSlots] = None
        self.runner = "torch"  # or "triton": the fused-MoE kernel (layers/moe/runner.py)
        # (expert) -> checkpoint names of (gate, up, down), filled while loading weights
        self.expert_keys: Dict[int, list] = {}

    def load_expert(self, expert: int, leaf: str, name: str, tensor: torch.Tensor) -> None:
        """Take one checkpoint tensor of expert `expert`; store-backed layers only note its
        name (the store reads it from the file when the expert is needed)."""
        which = EXPERT_LEAVES[leaf]
        if not 0 <= expert < self.num_experts:
            raise KeyError(f"{name}: expert {expert} out of range for {self.num_experts} experts")
        self.expert_keys.setdefault(expert, [None, None, None])[which] = name
        local = expert - self.first_expert
        if self.store_backed or not 0 <= local < self.num_local_experts:
            return  # read from the file by the store / another rank's expert
        inter = self.intermediate_size
        if self.tp_size > 1 and self.ep_size == 1:  # this rank's slice of the expert's width
            cut = slice(tp_group().rank * inter, (tp_group().rank + 1) * inter)
            tensor = tensor[:, cut] if which == 2 else tensor[cut]
        dst = (self.w13[local, :inter], self.w13[local, inter:], self.w2[local])[which]
        if tuple(dst.shape) != tuple(tensor.shape):
            raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != {tuple(dst.shape)}")
        with torch.no_grad():
            dst.copy_(tensor)

    def align_slots(self, aligned_empty) -> None:
        """Re-allocate the (empty) CPU slots with `aligned_empty(shape, dtype)` (on page
        boundaries: a load from a page-aligned checkpoint then reads straight into its slot)."""
        for p in (self.w13, self.w2):
            p.data = aligned_empty(p.shape, p.dtype)

    def missing_experts(self) -> list:
        return [e for e in range(self.num_experts)
                if None in self.expert_keys.get(e, [None])]

    def forward(self, hidden: torch.Tensor, routing: RoutingResult) -> torch.Tensor:
        ids = routing.topk_ids  # [T, k]
        if self.ep_size > 1:  # other ranks' experts: no pair here (zeros in the sum)
            local = ids - self.first_expert
            elsewhere = (local < 0) | (local >= self.num_local_experts)
            # slot ids without a store; expert ids (the store's) with one
            ids = (ids if self.store_backed else local).masked_fill(elsewhere, -1)
        if self.runner == "triton":
            out = self._fused(hidden, ids, routing.topk_weights)
        else:
            pairs = (hidden.new_zeros if self.ep_size > 1 else hidden.new_empty)(
                (*ids.shape, hidden.shape[-1]))  # [T, k, H]
            self._run(ids, lambda w13, w2, slot_ids: experts_forward_into(
                hidden, w13, w2, slot_ids, pairs))
            out = combine(pairs, routing.topk_weights, hidden.dtype)
        return all_reduce(out) if self.tp_size > 1 else out  # partial sums under TP

    def _fused(self, hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """The fused-MoE Triton kernel: every pair's weighted fp32 row, then the sum over k."""
        from sgl_kernel.moe import fused_moe_pairs

        t, k = ids.shape
        rows = torch.zeros((t * k, hidden.shape[-1]), dtype=torch.float32, device=hidden.device)
        self._run(ids, lambda w13, w2, slot_ids: fused_moe_pairs(
            hidden, w13, w2, weights, slot_ids, rows))
        return rows.view(t, k, -1).sum(1).to(hidden.dtype)

    def _run(self, ids: torch.Tensor, compute) -> None:
        """compute(w13, w2, slot_ids) over the fast tier: at once when every expert is
        resident, else in waves of the store's slots (a pair outside a wave: slot -1)."""
        if self.store is None:
            assert not self.store_backed, "store-backed experts used before attach_expert_store"
            compute(self.w13, self.w2, ids)
            return
        store, layer = self.store, self.layer_id
        # -1: another EP rank's
        needed = host_sync.present_ids(ids, self.num_experts, "expert_store_ids")
        n = store.num_slots
        if len(needed) > n:
            resident, mapped = set(store.resident(layer)), set(store.mapped(layer))
            # hits first (they cost no wait), then loads already under way, then misses
            needed.sort(key=lambda e: (e not in resident, e not in mapped))
        waves = plan_waves(needed, n)
        for w, wave in enumerate(waves):
            lease = store.acquire(layer, wave)
            try:
                if w + 1 < len(waves):
                    # load the next wave into the slots this one leaves unpinned while it
                    # computes; the later waves' experts are kept from eviction
                    store.prefetch_experts(layer, waves[w + 1],
                                           protect=[e for x in waves[w + 2:] for e in x])
                lut = torch.full((self.num_experts + 1,), -1, dtype=torch.int64)  # [-1]: -1
                lut[list(lease.slot_of)] = torch.tensor(list(lease.slot_of.values()))
                lut = lut.to(ids.device)
                w13, w2 = store.weights(layer)
                compute(w13, w2, lut[ids])
            finally:
                store.release(lease)


def plan_waves(needed: List[int], num_slots: int) -> List[List[int]]:
    """Split a layer's experts (hits first) into waves that fit its slots. When they do not
    all fit, wave sizes alternate n - n//2 and n//2, so the next wave loads into the slots
    one leaves unpinned while it computes (double buffering): a pass that needs more experts
    than the fast tier holds then overlaps its loads with its own compute instead of
    alternating them. The first wave holds the hits, computed while wave 2 loads."""
    n = num_slots
    if len(needed) <= n or n < 2:
        return [needed[i : i + n] for i in range(0, len(needed), n)]
    sizes = (n - n // 2, n // 2)
    waves, i = [], 0
    while i < len(needed):
        size = sizes[len(waves) % 2]
        waves.append(needed[i : i + size])
        i += size
    return waves


class SparseMoeBlock(nn.Module):
    """Router + routed experts (+ shared experts, optionally gated by sigmoid(x @ g)).

    `shared_name` is the checkpoint's attribute name: `shared_expert` (Qwen2-MoE) or
    `shared_experts` (DeepSeek)."""

    def __init__(self, hidden_size: int, moe_intermediate_size: int, router: RouterConfig,
                 layer_id: int, num_slots: Optional[int] = None,
                 shared_intermediate_size: int = 0, shared_name: str = "shared_expert",
                 shared_gate: bool = False) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.gate = Router(hidden_size, router)
        self.experts = MoEExperts(router.num_experts, hidden_size, moe_intermediate_size,
                                  layer_id, num_slots)
        self.shared_name = shared_name if shared_intermediate_size > 0 else None
        if self.shared_name:
            setattr(self, shared_name, GatedMLP(hidden_size, shared_intermediate_size))
        self.shared_expert_gate = (nn.Linear(hidden_size, 1, bias=False)
                                   if shared_gate and self.shared_name else None)
        self.hooks: MoEHooks = NO_HOOKS  # expert offload: told what the router chose

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        routing = self.gate(hidden)
        get_expert_recorder().record(self.layer_id, routing.topk_ids, self.experts.num_experts)
        self.hooks.on_routed(self.layer_id, routing.topk_ids)
        out = self.experts(hidden, routing)
        if self.shared_name:
            shared = getattr(self, self.shared_name)(hidden)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(hidden)) * shared
            out = out + shared
        return out

    def slot_shapes(self) -> Tuple[torch.Size, torch.Size]:
        return self.experts.w13.shape[1:], self.experts.w2.shape[1:]
