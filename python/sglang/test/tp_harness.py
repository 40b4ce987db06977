"""Tensor-parallel test runs in real torch.distributed processes (spawned, so the code they
run lives in an importable module): each rank joins the gloo group, drives its shard of a
model through TinyRunner, and puts its results on a queue."""

from __future__ import annotations

import pickle
import time
from typing import Any, Callable, Dict, List

import torch
import torch.multiprocessing as mp

from sglang.srt.utils import free_port


def greedy_run(folder: str, prompts: List[List[int]], new_tokens: int) -> Dict[str, Any]:
    """One prompt's logits at every position, a batch's greedy tokens, and whether every KV
    slot and row is free afterwards."""
    from sglang.test.harness import TinyRunner

    runner = TinyRunner(folder)
    logits = runner.prefill([prompts[-1]], all_logits=True)
    runner.release()
    tokens = runner.generate_greedy(prompts, new_tokens)
    free = (runner.allocator.available_size() == runner.allocator.size
            and runner.req_pool.available_size() == runner.req_pool.size)
    return {"logits": logits, "tokens": tokens, "free": free}


def scheduler_run(folder: str, prompts: List[List[int]], params: List[Dict[str, Any]],
                  server_kw: Dict[str, Any]) -> Dict[str, Any]:
    """The prompts through a Scheduler of this rank (every rank fed alike, in lockstep):
    each request's tokens; with an expert store, the experts it ever loaded, its figures and
    whether its slots are idle; and whether every pool is free afterwards."""
    from sglang.test.scheduler_driver import make_scheduler, run

    sched = make_scheduler(folder, **server_kw)
    done = run(sched, prompts, params)
    sched.check_all_free()  # KV, requests, and expert slots (no pin, no load in flight)
    out: Dict[str, Any] = {"tokens": {rid: ids for rid, (ids, _) in done.items()}}
    store = sched.runner.expert_store
    if store is not None:
        out["owned"] = None if store.owned is None else list(store.owned)
        out["loaded"] = sorted({e for layer in store.layers() for e in store.mapped(layer)})
        out["store"] = store.stats().to_dict()["total"]
        out["moe"] = sched.moe_state()
        store.close()
    return out


def vocab_layers_error(vocab: int = 101, hidden: int = 8) -> float:
    """A vocabulary that does not split evenly: largest error of the padded-block embedding
    and lm_head against the whole table."""
    from sglang.srt.layers.parallel_linear import ParallelLMHead, VocabParallelEmbedding

    torch.manual_seed(0)
    table, x = torch.randn(vocab, hidden), torch.randn(3, hidden)
    emb, head = VocabParallelEmbedding(vocab, hidden), ParallelLMHead(hidden, vocab)
    emb.load_shard("weight", table)
    head.load_shard("weight", table)
    ids = torch.tensor([0, vocab // 2, vocab // 2 + 1, vocab - 1])
    err = (emb(ids) - table[ids]).abs().max().item()
    return max(err, (head(x) - x @ table.T).abs().max().item())


def _rank_main(rank: int, size: int, port: int, job: Callable[[], Any], out,
               ep_size: int) -> None:
    torch.set_num_threads(1)
    from sglang.srt.distributed.parallel_state import (destroy_tensor_parallel,
                                                       init_tensor_parallel)

    init_tensor_parallel(rank, size, f"tcp://127.0.0.1:{port}", backend="gloo",
                         ep_size=ep_size)
    try:
        # as bytes: a tensor put on a torch queue lives in the sender's shared memory, which
        # is gone once the rank exits
        out.put((rank, pickle.dumps(job())))
    finally:
        destroy_tensor_parallel()


def run_ranks(job: Callable[[], Any], size: int = 2, timeout_s: float = 300,
              ep_size: int = 1) -> List[Any]:
    """job() on `size` TP ranks (a picklable callable, e.g. functools.partial of a module
    function); the results in rank order. Raises if a rank dies or the run times out."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, size, port, job, out, ep_size))
             for r in range(size)]
    for p in procs:
        p.start()
    got: Dict[int, Any] = {}
    deadline = time.time() + timeout_s
    try:
        while len(got) < size:
            try:
                rank, result = out.get(timeout=1)
                got[rank] = pickle.loads(result)
            except Exception:  # queue.Empty: check the ranks are alive
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead or time.time() > deadline:
                    raise RuntimeError(f"TP run failed: exit codes {[p.exitcode for p in procs]}")
        for p in procs:
            p.join(60)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
    return [got[r] for r in range(size)]


def dense_checks(folders: List[str], prompts: List[List[int]], new_tokens: int) -> Dict[str, Any]:
    """greedy_run of every folder, and the uneven-vocabulary check."""
    out: Dict[str, Any] = {f: greedy_run(f, prompts, new_tokens) for f in folders}
    out["vocab_err"] = vocab_layers_error()
    return out
