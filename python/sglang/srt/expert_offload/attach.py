"""Attach expert offload to a loaded MoE model: its store, and a prefetcher as the layers' hooks."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Optional

import torch

from sglang.srt.distributed.parallel_state import all_gather_last_dim
from sglang.srt.expert_offload.config import OffloadConfig
from sglang.srt.expert_offload.gate import PrefetchGate
from sglang.srt.expert_offload.layout import aligned_empty
from sglang.srt.expert_offload.predictors import build_predictor
from sglang.srt.expert_offload.prefetcher import ExpertPrefetcher
from sglang.srt.expert_offload.routing.router_stack import RouterView
from sglang.srt.expert_offload.sources import SafetensorsExpertSource
from sglang.srt.expert_offload.staging import PinnedStagingSource
from sglang.srt.expert_offload.store import ExpertStore

if TYPE_CHECKING:
    from sglang.srt.models.moe_common import MoECausalLM


def attach_expert_store(model: "MoECausalLM", model_path: str,
                        cfg: OffloadConfig) -> Optional[ExpertStore]:
    """Serve the experts of store-backed layers from `model_path`'s safetensors through an
    ExpertStore (after `load_weights`). With slots >= experts every expert is loaded now."""
    blocks = {i: b for i, b in model.moe_blocks().items() if b.experts.store_backed}
    if not blocks:
        return None
    if not os.path.isdir(model_path):
        raise ValueError("--moe-expert-cache-slots needs an HF safetensors checkpoint folder "
                         f"(the experts' slow tier); got {model_path!r}")
    first = next(iter(blocks.values())).experts
    # this rank's experts (every expert but under expert parallelism)
    owned = range(first.first_expert, first.first_expert + first.num_local_experts)
    keys = {(i, e): tuple(names) for i, b in blocks.items()
            for e, names in b.experts.expert_keys.items() if e in owned}
    source = SafetensorsExpertSource(model_path, keys, cfg.drop_page_cache)
    device = str(first.w13.device)
    if device != "cpu":
        # device slots fill through a bounded staging set (pinned where CUDA is), not every
        # expert pinned in host RAM
        source = PinnedStagingSource(source, {i: b.slot_shapes() for i, b in blocks.items()},
                                     first.w13.dtype)
    else:
        for b in blocks.values():
            b.experts.align_slots(aligned_empty)
    store = ExpertStore(source, {i: (b.experts.w13.detach(), b.experts.w2.detach())
                                 for i, b in blocks.items()},
                        {i: b.experts.num_experts for i, b in blocks.items()}, device,
                        owned=owned if len(owned) < first.num_experts else None)
    for b in blocks.values():
        b.experts.store = store
    if store.num_slots >= len(owned):
        for i in blocks:
            store.prefetch(i, owned)
        store.wait_loads()
        store.reset_stats()
    model.expert_store = store
    return store


def _whole_embedding(embed: torch.nn.Embedding) -> torch.nn.Embedding:
    """Predictors look embedding rows up by token id. Under TP the vocabulary-parallel table
    is gathered once here, so that no prediction runs a collective: each rank's prefetch
    gate decides on its own timings, and a collective only some ranks reached would hang."""
    if getattr(embed, "tp_size", 1) == 1:
        return embed
    whole = all_gather_last_dim(embed.weight.detach().t().contiguous()).t()
    return torch.nn.Embedding.from_pretrained(whole[: embed.vocab_size].contiguous(),
                                              freeze=True)


def attach_prefetcher(model: "MoECausalLM", cfg: OffloadConfig) -> ExpertPrefetcher:
    """Hook predictor `cfg.predictor` into every decoder layer and MoE block."""
    store = model.expert_store
    assert store is not None, "a prefetcher needs the expert store"
    blocks = {i: b for i, b in model.moe_blocks().items() if b.experts.store_backed}
    views = {i: RouterView(i, model.model.layers[i].post_attention_layernorm, b.gate,
                           b.gate.cfg.top_k) for i, b in blocks.items()}
    first = next(iter(blocks.values())).experts
    expert_bytes = (first.w13[0].numel() + first.w2[0].numel()) * first.w13.element_size()
    # a cut over every expert (the ensemble's): this rank's slots times the EP size, so
    # that this rank's share of the ranking can fill its own slots
    slots = (store.num_slots if store.owned is None
             else store.num_slots * first.num_experts // len(store.owned))
    predictor = build_predictor(cfg.predictor, views, _whole_embedding(model.model.embed_tokens),
                                cfg.width, slots, cfg.keep_width, cfg.min_prob)
    pf = ExpertPrefetcher(store, predictor, expert_bytes, PrefetchGate() if cfg.gate else None)
    for layer in model.model.layers:
        layer.hooks = pf
    for b in blocks.values():
        b.hooks = pf
    return pf

