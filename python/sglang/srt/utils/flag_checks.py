"""Checks of ServerArgs' flag groups that are long enough to read on their own: parallelism,
the MoE expert store and prefetch, and long-context drafting. Each raises ValueError with a message
that says what to change. Kept free of torch, like ServerArgs."""

from __future__ import annotations

import os
import warnings
from typing import Any


def check_moe_flags(args: Any) -> None:
    if args.moe_runner_backend not in ("auto", "triton"):
        raise ValueError(f"--moe-runner-backend {args.moe_runner_backend!r} is not available "
                         "on this fork: use auto (the CPU linear kernels on CPU, the fused-MoE "
                         "Triton kernel on CUDA) or triton (CUDA)")
    if (args.moe_runner_backend == "triton" and args.device == "cpu"
            and os.environ.get("TRITON_INTERPRET") != "1"):  # the interpreter: tests
        raise ValueError("--moe-runner-backend triton needs --device cuda (Triton kernels "
                         "compile for GPUs); on CPU leave it at auto")
    if args.moe_expert_cache_slots is not None and args.moe_expert_cache_slots < 1:
        raise ValueError("--moe-expert-cache-slots must be at least 1 (experts per layer kept "
                         "in the fast tier), or left unset to keep every expert resident")
    if args.moe_expert_drop_page_cache and args.moe_expert_cache_slots is None:
        raise ValueError("--moe-expert-drop-page-cache needs --moe-expert-cache-slots")
    if args.moe_prefetch_predictor != "none" and args.moe_expert_cache_slots is None:
        raise ValueError("--moe-prefetch-predictor needs --moe-expert-cache-slots (with every "
                         "expert resident there is nothing to prefetch)")
    if args.moe_prefetch_prune_tree and (
            args.moe_prefetch_predictor not in ("draft", "ensemble")
            or not args.speculative_algorithm):
        raise ValueError("--moe-prefetch-prune-tree prices draft trees by the experts their "
                         "tokens route to: it needs --speculative-algorithm and "
                         "--moe-prefetch-predictor draft or ensemble")
    if args.moe_prefetch_width < 0:
        raise ValueError(f"--moe-prefetch-width must be >= 0, got {args.moe_prefetch_width}")
    if not 0.0 <= args.moe_prefetch_min_prob < 1.0:
        raise ValueError("--moe-prefetch-min-prob must be in [0, 1) (0: fetch every "
                         f"token's top-(k + width)), got {args.moe_prefetch_min_prob}")
    if args.moe_prefetch_keep_width < 0:
        raise ValueError("--moe-prefetch-keep-width must be >= 0, got "
                         f"{args.moe_prefetch_keep_width}")
    fixed_rule = ((args.moe_prefetch_predictor == "draft" and args.moe_prefetch_width)
                  or (args.moe_prefetch_predictor in ("draft", "ensemble")
                      and args.moe_prefetch_keep_width != 1))
    if fixed_rule and args.moe_prefetch_min_prob > 0:
        warnings.warn("--moe-prefetch-width / --moe-prefetch-keep-width do not shape the "
                      "`draft` predictor's calibrated cut (--moe-prefetch-min-prob "
                      f"{args.moe_prefetch_min_prob:g}); add --moe-prefetch-min-prob 0 "
                      "for the fixed top-(k + width) rule they set", stacklevel=4)


def check_draft_kv_flags(args: Any) -> None:
    """Long-context drafting flags; checks that need the draft's config run at load
    (DraftKVConfig)."""
    policy = args.speculative_draft_kv_policy
    if policy not in ("full", "streaming", "retrieval"):
        raise ValueError("--speculative-draft-kv-policy must be one of full, streaming, "
                         f"retrieval; got {policy!r}")
    algo = (args.speculative_algorithm or "").upper()
    if policy != "full" and algo not in ("STANDALONE", "HYBRID", "EAGLE", "EAGLE3", "NEXTN"):
        raise ValueError(f"--speculative-draft-kv-policy {policy} needs "
                         "--speculative-algorithm STANDALONE (a draft model with KV)")
    if policy == "retrieval" and algo in ("EAGLE", "EAGLE3", "NEXTN"):
        raise ValueError(f"--speculative-algorithm {algo} reads the draft context in full or "
                         "streaming (--speculative-draft-kv-policy full|streaming): retrieved "
                         "chunks would need every token's target features kept")
    budget = args.speculative_draft_kv_budget
    if args.speculative_draft_max_position is not None and policy == "full":
        raise ValueError("--speculative-draft-max-position applies to the streaming and "
                         "retrieval policies (full keeps every token at its true position)")
    if budget is not None and policy == "full":
        raise ValueError("--speculative-draft-kv-budget bounds the streaming and retrieval "
                         "policies; set --speculative-draft-kv-policy streaming|retrieval "
                         "or drop the budget")
    for name, low in (("speculative_draft_kv_sink", 0), ("speculative_draft_kv_chunk_size", 1),
                      ("speculative_draft_kv_refresh_interval", 1),
                      ("speculative_draft_max_position", 16),
                      ("speculative_draft_max_total_tokens", 16)):
        value = getattr(args, name)
        if value is not None and value < low:
            raise ValueError(f"--{name.replace('_', '-')} must be at least {low}, got {value}")
    if budget is None:
        return
    sink, chunk = args.speculative_draft_kv_sink, args.speculative_draft_kv_chunk_size
    if policy == "streaming" and budget < sink + 4:
        raise ValueError(f"--speculative-draft-kv-budget {budget} leaves no recent window "
                         f"after {sink} sink tokens: use at least {sink + 4}")
    if policy == "retrieval" and budget < sink + 3 * chunk:
        raise ValueError(f"--speculative-draft-kv-budget {budget} is too small for retrieval "
                         f"with {sink} sinks and chunks of {chunk}: use at least "
                         f"{sink + 3 * chunk} (sinks + 3 chunks), or smaller "
                         "--speculative-draft-kv-chunk-size")


def check_parallel_flags(args: Any) -> None:
    """Tensor parallelism in this process group; data parallelism through the router."""
    if args.tp_size < 1:
        raise ValueError(f"--tp-size must be at least 1, got {args.tp_size}")
    if args.ep_size not in (1, args.tp_size):
        raise ValueError(f"--ep-size {args.ep_size} must be 1 (experts split by TP) or equal "
                         f"to --tp-size {args.tp_size} (each rank owns whole experts)")
    if args.tp_size > 1 and args.moe_expert_cache_slots is not None:
        if args.ep_size != args.tp_size:
            raise ValueError("--moe-expert-cache-slots with --tp-size > 1 needs --ep-size "
                             f"{args.tp_size} (each rank's store holds its own whole experts)")
        if args.moe_prefetch_prune_tree:
            raise ValueError("--moe-prefetch-prune-tree prices trees by one rank's residency; "
                             "with --tp-size > 1 the ranks would verify different trees: "
                             "leave it off")
    if args.nnodes < 1 or not 0 <= args.node_rank < args.nnodes:
        raise ValueError(f"--node-rank must be in [0, --nnodes {args.nnodes}), got "
                         f"{args.node_rank}")
    if args.nnodes > 1:
        if args.tp_size % args.nnodes:
            raise ValueError(f"--tp-size {args.tp_size} must be a multiple of --nnodes "
                             f"{args.nnodes} (each node runs as many ranks)")
        if not args.dist_init_addr:
            raise ValueError("--nnodes > 1 needs --dist-init-addr HOST:PORT (node 0's "
                             "address, the same on every node)")
    if args.dist_init_addr and ":" not in args.dist_init_addr:
        raise ValueError(f"--dist-init-addr must be HOST:PORT, got {args.dist_init_addr!r}")
    if args.dp_size < 1:
        raise ValueError(f"--dp-size must be at least 1, got {args.dp_size}")
    if args.grpc_mode:
        raise ValueError("--grpc-mode is not supported on this fork: it serves HTTP (native "
                         "and OpenAI APIs); drop the flag")
    if args.base_gpu_id < 0:
        raise ValueError(f"--base-gpu-id must be >= 0, got {args.base_gpu_id}")


def check_one_replica(args: Any) -> None:
    """This server and the Engine run one data-parallel replica; --dp-size N is the router's
    (its launch_server builds ServerArgs with N, then starts N replicas with 1)."""
    if args.dp_size != 1:
        raise ValueError(f"--dp-size {args.dp_size}: this server runs one replica; start N "
                         "replicas behind the router with `python -m "
                         "sglang_router.launch_server --dp-size N ...` (same flags), or "
                         "start N servers and `python -m sglang_router.launch_router "
                         "--worker-urls ...`")
