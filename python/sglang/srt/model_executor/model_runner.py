"""ModelRunner: one model, its KV pool and its attention backend.

The scheduler owns requests and the req_to_token table; a runner only turns a
ForwardBatch into logits. The target and (later) the draft model each get a runner,
each with its own KV pool sized here.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Optional, Tuple

import torch

from sglang.srt.layers.attention.base import create_attention_backend
from sglang.srt.expert_offload.attach import attach_prefetcher
from sglang.srt.layers.moe.runner import resolve_moe_runner, set_moe_runner
from sglang.srt.expert_offload.config import OffloadConfig
from sglang.srt.expert_offload.prefetcher import ExpertPrefetcher
from sglang.srt.expert_offload.store import ExpertStore
from sglang.srt.mem_cache.memory_pool import TokenSlotAllocator
from sglang.srt.distributed.parallel_state import kv_heads_per_rank, min_over_ranks, tp_group
from sglang.srt.mem_cache.mla_pool import create_kv_pool, kv_bytes_per_token  # MLA-aware
from sglang.srt.model_executor.cuda_graph_runner import (CudaGraph, GraphConfig, GraphRunner,
                                                         why_not_graphable)
from sglang.srt.model_executor.forward_batch import ForwardBatch
from sglang.srt.server_args import ServerArgs

logger = logging.getLogger(__name__)


def free_ram_bytes() -> int:
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except ImportError:  # pragma: no cover
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


# Defaults of --mem-fraction-static: on CPU a share of the free RAM for the KV pool (the
# host runs everything else too); on a GPU, as upstream, the share of the device's memory
# that weights and KV pool together may take.
CPU_KV_FRACTION = 0.3
GPU_STATIC_FRACTION = 0.85


def kv_pool_bytes(device: str, fraction: Optional[float], free_bytes: int,
                  total_bytes: int) -> int:
    """Bytes the KV pool may take. CPU: `fraction` of the free RAM. CUDA (upstream's rule,
    measured after the weights are loaded): what is free less the (1 - fraction) of the
    device's memory kept back for activations, graphs and the allocator; raises when the
    weights already took it all, naming what to change."""
    if not str(device).startswith("cuda"):
        return int(free_bytes * (fraction or CPU_KV_FRACTION))
    fraction = fraction or GPU_STATIC_FRACTION
    rest = int(free_bytes - total_bytes * (1 - fraction))
    if rest <= 0:
        gib = 1 << 30
        raise ValueError(
            f"No GPU memory left for the KV cache: {free_bytes / gib:.1f} GiB free of "
            f"{total_bytes / gib:.1f} GiB after the weights, and --mem-fraction-static "
            f"{fraction} keeps {(1 - fraction) * total_bytes / gib:.1f} GiB back. Raise "
            "--mem-fraction-static, or keep fewer experts on the GPU with "
            "--moe-expert-cache-slots")
    return rest


def device_memory(device: str) -> Tuple[int, int]:
    """(free, total) bytes of the device: the GPU's, else the host's RAM (total unused)."""
    if str(device).startswith("cuda"):
        return torch.cuda.mem_get_info(torch.device(device))
    return free_ram_bytes(), 0


class ModelRunner:
    def __init__(self, server_args: ServerArgs, model_path: Optional[str] = None,
                 max_context_len: Optional[int] = None, max_total_tokens: Optional[int] = None,
                 max_running_requests: int = 256, architecture: Optional[str] = None,
                 graphs: bool = True) -> None:
        from sglang.srt.model_loader.loader import load_model

        self.server_args = server_args
        self.model_path = model_path or server_args.model_path
        self.device = server_args.torch_device(tp_group().device_rank)
        t0 = time.perf_counter()
        # MoE experts beyond the fast tier's slots stay in the checkpoint file
        offload = OffloadConfig.from_server_args(server_args)
        self.model, self.config = load_model(self.model_path, dtype=server_args.dtype,
                                             device=self.device, offload=offload,
                                             architecture=architecture)
        set_moe_runner(self.model, resolve_moe_runner(server_args.moe_runner_backend,
                                                      self.device))
        self.expert_store: Optional[ExpertStore] = getattr(self.model, "expert_store", None)
        self.prefetcher: Optional[ExpertPrefetcher] = None
        if self.expert_store is not None and offload.prefetching:
            self.prefetcher = attach_prefetcher(self.model, offload)
        self.model.eval()
        self.dtype = next(self.model.parameters()).dtype
        self.load_seconds = time.perf_counter() - t0
        cfg = self.config
        self.vocab_size = cfg.vocab_size
        self.context_len = max_context_len or server_args.context_length or getattr(
            cfg, "max_position_embeddings", 4096)
        self.num_layers = cfg.num_hidden_layers
        self.tp_size = tp_group().size
        # this TP rank's KV heads (all of them at one rank)
        self.num_kv_heads = kv_heads_per_rank(
            getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads, self.tp_size)
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.kv_dtype = self.dtype
        # TP ranks schedule alike only with pools alike: the smallest rank's size for all
        self.max_total_num_tokens = min_over_ranks(
            max_total_tokens or self._profile_max_tokens(max_running_requests))
        # MLA: DeepSeek-V2/V3 get a pool of compressed latents, others a KVPool.
        self.kv_pool = create_kv_pool(cfg, self.max_total_num_tokens, self.kv_dtype, self.device,
                                      self.tp_size)
        self.allocator = TokenSlotAllocator(self.max_total_num_tokens, self.device)
        self.attn_backend = create_attention_backend(server_args.attention_backend)
        logger.info("Loaded %s (%s) in %.1fs; KV pool %d tokens", self.model_path, self.dtype,
                    self.load_seconds, self.max_total_num_tokens)
        # decode batches replay CUDA graphs where the model and backend allow (the target's
        # runner; `graphs=False`: a draft model's, whose forwards are trees and views)
        self.graph_runner: Optional[GraphRunner] = None
        self.graph_config = (GraphConfig.from_server_args(server_args, self.device,
                                                          max_running_requests)
                             if graphs else GraphConfig(why_off="a draft model's runner"))
        if self.graph_config.enabled:
            self.attach_graphs(self.graph_config)

    def attach_graphs(self, config: GraphConfig, graph_factory=CudaGraph,
                      verify_tokens: int = 0) -> None:
        """Capture decode graphs for `config`'s batch sizes (and tree verifies of up to
        `verify_tokens` nodes a request; CPU tests pass EagerGraph); where this model cannot
        be captured, say why and run eagerly."""
        why = why_not_graphable(self)
        if why is not None:
            logger.info("CUDA graphs off: %s", why)
            self.graph_config = GraphConfig(why_off=why)
            return
        self.graph_config = config
        self.graph_runner = GraphRunner(self, config, self.context_len, graph_factory)
        self.graph_runner.capture(verify_tokens)

    def capture_verify_graphs(self, tokens: int) -> None:
        """A speculative server's tree verifies of up to `tokens` nodes a request replay
        graphs too (where decode does)."""
        if self.graph_runner is not None and tokens > 1:
            self.graph_runner.capture_verify(tokens)

    def graph_info(self) -> dict:
        """What /server_info shows of the decode graphs."""
        if self.graph_runner is None:
            return {"enabled": False, "why_off": self.graph_config.why_off}
        return self.graph_runner.info()

    def _profile_max_tokens(self, max_running_requests: int) -> int:
        if self.server_args.max_total_tokens:
            return self.server_args.max_total_tokens
        per_token = kv_bytes_per_token(self.config, self.kv_dtype, self.tp_size)
        by_ram = kv_pool_bytes(self.device, self.server_args.mem_fraction_static,
                               *device_memory(self.device)) // per_token
        # No use for more slots than every running request filling its context.
        by_need = max_running_requests * self.context_len
        return max(64, min(by_ram, by_need))

    @torch.inference_mode()
    def forward(self, fb: ForwardBatch, **model_inputs):
        """The model's output for `fb` (logits; an EAGLE-3 head also takes its features
        and returns its own output beside them, `model_inputs`)."""
        fb.attn_backend = self.attn_backend
        fb.token_to_kv_pool = self.kv_pool
        if self.graph_runner is not None and self.graph_runner.can_run(fb, model_inputs):
            return self.graph_runner.replay(fb)
        self.attn_backend.init_forward_metadata(fb)
        return self.model(fb.input_ids, fb.positions, fb, **model_inputs)
