"""Expert offload is configured once from ServerArgs; nothing rides in the model's config."""

from __future__ import annotations

from sglang.srt.expert_offload.config import OffloadConfig
from sglang.srt.server_args import ServerArgs
from sglang.test.scheduler_driver import make_scheduler


def test_offload_config_is_built_from_server_args():
    cfg = OffloadConfig.from_server_args(ServerArgs(
        model_path="x", moe_expert_cache_slots=3, moe_prefetch_predictor="reuse",
        moe_prefetch_width=2, moe_prefetch_disable_gate=True))
    assert (cfg.cache_slots, cfg.predictor, cfg.width, cfg.gate) == (3, "reuse", 2, False)
    assert cfg.enabled and cfg.prefetching
    off = OffloadConfig.from_server_args(ServerArgs(model_path="x"))
    assert not off.enabled and not off.prefetching


def test_the_model_config_carries_no_offload_flags(tiny_moe_dir):
    sched = make_scheduler(tiny_moe_dir("mixtral"), moe_expert_cache_slots=2,
                           moe_prefetch_predictor="reuse")
    config = sched.runner.config
    assert not [k for k in vars(config) if k.startswith("moe_expert") or
                k.startswith("moe_prefetch")]
    assert sched.runner.expert_store is not None and sched.prefetcher is not None
    assert all(layer.hooks is sched.prefetcher for layer in sched.runner.model.model.layers)
    sched.runner.expert_store.close()
