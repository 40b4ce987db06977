"""The scheduler's process: receive requests over ZMQ, step the scheduler, send updates.

Start-up protocol over `ready_pipe` (the launcher reads it): first `{"tokenizer": tok}`
(tok may be None when it cannot be pickled), sent as soon as the tokenizer is loaded so the
HTTP process and the detokenizer need not load it again; then the scheduler info dict, or
`{"error": ..., "traceback": ...}` if start-up failed.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import traceback
from typing import List, Optional

from sglang.srt.managers.expert_record_handler import handle_expert_distribution_req
from sglang.srt.managers.io_struct import (AbortReq, BatchTokenIDOut, ExpertDistributionReq,
                                           FlushCacheOutput,
                                           FlushCacheReq, GetInternalStateOutput,
                                           GetInternalStateReq, ReqUpdate,
                                           TokenizedGenerateReqInput)

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class PortArgs:
    """ZMQ IPC addresses of the three parts (tokenizer side, scheduler, detokenizer)."""

    tokenizer: str
    scheduler: str
    detokenizer: str

    @classmethod
    def new(cls, folder: str) -> "PortArgs":
        return cls(tokenizer=f"ipc://{folder}/tokenizer", scheduler=f"ipc://{folder}/scheduler",
                   detokenizer=f"ipc://{folder}/detokenizer")


def shareable(tokenizer):
    """The tokenizer if it survives pickling (custom remote-code tokenizers may not)."""
    try:
        pickle.dumps(tokenizer)
        return tokenizer
    except Exception:  # pragma: no cover - depends on the tokenizer class
        return None


def run_scheduler_process(server_args, addrs: PortArgs, ready_pipe, tp_rank: int = 0,
                          dist_init: Optional[str] = None) -> None:
    """One TP rank's scheduler (the only one without tensor parallelism). Rank 0 talks to
    the tokenizer and the detokenizer; every step it hands what it received to all ranks,
    which then step alike in lockstep (same requests, same pools, same decisions)."""
    try:
        import torch
        import zmq

        from sglang.srt.distributed.parallel_state import init_tensor_parallel
        from sglang.srt.managers.scheduler import Scheduler
        from sglang.srt.model_loader.loader import load_tokenizer
        from sglang.srt.utils.process import configure_child_logging, watch_parent

        tp = server_args.tp_size
        configure_child_logging(server_args.log_level, "scheduler" + (f" tp{tp_rank}" if tp > 1 else ""))
        watch_parent()
        # the ranks of one machine share its cores
        torch.set_num_threads(server_args.num_threads or max(1, (os.cpu_count() or 1) // tp))
        if tp > 1:
            init_tensor_parallel(tp_rank, tp, dist_init, ep_size=server_args.ep_size)
        tokenizer = None if server_args.skip_tokenizer_init else load_tokenizer(server_args.tokenizer_path)
        ready_pipe.send({"tokenizer": shareable(tokenizer) if tp_rank == 0 else None})
        scheduler = Scheduler(server_args, tokenizer=tokenizer)
        scheduler.calibrate()
    except Exception as e:  # the launcher shows this and exits non-zero
        ready_pipe.send({"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()})
        return
    if tp_rank > 0:
        ready_pipe.send(scheduler_info(scheduler))
        _follow(scheduler)
        return
    ctx = zmq.Context()
    recv = ctx.socket(zmq.PULL)
    recv.bind(addrs.scheduler)
    send = ctx.socket(zmq.PUSH)
    send.connect(addrs.detokenizer)
    ready_pipe.send(scheduler_info(scheduler))
    poller = zmq.Poller()
    poller.register(recv, zmq.POLLIN)
    while True:
        # Block only when there is nothing to compute (under TP, wake every second: the
        # other ranks wait in the broadcast, which must not time out).
        timeout = (None if tp == 1 else _IDLE_BEAT_MS) if scheduler.is_idle() else 0
        msgs = []
        if poller.poll(timeout):
            while True:
                try:
                    msgs.append(recv.recv_pyobj(zmq.NOBLOCK))
                except zmq.Again:
                    break
        for reply in _lockstep(scheduler, msgs):
            send.send_pyobj(reply)
        updates = scheduler.step()
        if updates:
            send.send_pyobj(BatchTokenIDOut(updates))


_IDLE_BEAT_MS = 1000


def _lockstep(scheduler, msgs: List) -> List:
    """Every rank handles rank 0's messages of this step, in order; the replies (rank 0
    sends them) as a list."""
    if scheduler.server_args.tp_size > 1:
        from sglang.srt.distributed.parallel_state import broadcast_objects

        msgs = broadcast_objects(msgs)
    replies = [handle_message(scheduler, m) for m in msgs]
    return [r for r in replies if r is not None]


def _follow(scheduler) -> None:
    """Ranks > 0: take rank 0's messages, step; what they would send is rank 0's too."""
    while True:
        _lockstep(scheduler, [])
        scheduler.step()


def handle_message(scheduler, msg):
    if isinstance(msg, TokenizedGenerateReqInput):
        limit = scheduler.server_args.max_queued_requests
        probe = msg.rid.startswith("HEALTH_CHECK")  # a busy server is still healthy
        if limit is not None and len(scheduler.waiting) >= limit and not probe:
            return BatchTokenIDOut([queue_full_update(msg, limit)])
        upd = scheduler.add_request(msg)
        return BatchTokenIDOut([upd]) if upd is not None else None
    if isinstance(msg, AbortReq):
        updates = scheduler.abort(msg.rid, msg.message)
        return BatchTokenIDOut(updates) if updates else None
    if isinstance(msg, FlushCacheReq):
        ok = scheduler.flush_cache()
        return FlushCacheOutput(ok, "" if ok else "Cannot flush the cache while requests are running or waiting.")
    if isinstance(msg, GetInternalStateReq):
        return GetInternalStateOutput(scheduler_info(scheduler, every_rank=True))
    if isinstance(msg, ExpertDistributionReq):
        return handle_expert_distribution_req(msg)
    logger.warning("Unknown message %r", type(msg))
    return None


def queue_full_message(limit: int) -> str:
    return (f"The request queue is full ({limit} requests waiting; --max-queued-requests "
            f"{limit}). Retry later.")


def queue_full_update(msg: TokenizedGenerateReqInput, limit: int) -> ReqUpdate:
    """Refuse a request at once: the waiting queue already holds --max-queued-requests."""
    reason = {"type": "abort", "status_code": 503, "err_type": "ServiceUnavailable",
              "message": queue_full_message(limit)}
    return ReqUpdate(rid=msg.rid, new_output_ids=[], finished_reason=reason,
                     prompt_tokens=len(msg.input_ids), cached_tokens=0, completion_tokens=0)


def scheduler_info(scheduler, every_rank: bool = False) -> dict:
    """What /server_info shows (rank 0's); with `every_rank` under TP (all ranks call it
    in lockstep) also each rank's free KV slots, which must agree."""
    cfg = scheduler.runner.config
    info = {
        "max_total_num_tokens": scheduler.allocator.size,
        "available_kv_tokens": scheduler.allocator.available_size(),
        "context_len": scheduler.context_len,
        "max_req_input_len": scheduler.context_len - 1,
        "vocab_size": scheduler.runner.vocab_size,
        "max_running_requests": scheduler.max_running,
        "num_running_reqs": len(scheduler.running),
        "num_waiting_reqs": len(scheduler.waiting),
        "cache_evictable_tokens": scheduler.tree_cache.evictable_size(),
        "load_seconds": scheduler.runner.load_seconds,
        "dtype": str(scheduler.runner.dtype).replace("torch.", ""),
        "model_type": getattr(cfg, "model_type", None),
        "architectures": getattr(cfg, "architectures", None),
        **scheduler.spec_state(),
        **scheduler.moe_state(),
        "tp_size": scheduler.server_args.tp_size,
        # device-to-host reads per step by call site (utils/host_sync.py)
        "host_syncs": scheduler.sync_stats.to_dict(),
        "cuda_graph": scheduler.runner.graph_info(),  # decode graphs: sizes, replays
    }
    if every_rank and scheduler.server_args.tp_size > 1:
        from sglang.srt.distributed.parallel_state import gather_objects

        # pools and radix trees alike on every rank: free slots and cached (evictable) ones
        ranks = gather_objects((scheduler.allocator.available_size(),
                                scheduler.tree_cache.evictable_size()))
        info["tp_available_kv_tokens"] = [free for free, _ in ranks]
        info["tp_cache_evictable_tokens"] = [cached for _, cached in ranks]
    return info
