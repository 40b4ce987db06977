"""Mixture-of-Experts layers: router, routed experts, the expert store and the recorder.

    router.py         Router / select_experts: softmax or sigmoid top-k, grouped top-k,
                      renormalisation, correction bias, routed scaling
    experts.py        MoEExperts (tokens sorted by expert, one GEMM pair per expert,
                      fixed-order combine), SparseMoeBlock (+ shared experts)
    expert_store.py   ExpertStore: N fast-tier slots per layer over a slow tier, async loads,
                      prefetch(layer, ids) / resident(layer) / stats()
    expert_source.py  slow tiers: memory-mapped safetensors (CPU), pinned host (GPU)
    expert_layout.py  page-aligned checkpoints and slots (direct disk reads into a slot)
    prefetch.py       expert predictors and the prefetcher; route_predict.py (routers run
                      ahead), route_map.py (a draft of another width), prefetch_gate.py
    recorder.py       ExpertDistributionRecorder: per layer and token, the chosen experts

Importing this package stays light: submodules are imported where they are used.
"""
