"""Start the scheduler and detokenizer processes and the in-process TokenizerManager.

Shared by the HTTP server and the offline Engine: the same three parts either way.

Start-up cost: the tokenizer is loaded once, by the scheduler (which imports torch and
transformers anyway), and handed to this process and to the detokenizer by pickle, so
neither of them imports torch or re-reads the tokenizer files. The detokenizer starts at
once and waits for it; this process pre-imports transformers' tokenizer classes meanwhile.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import tempfile
import threading
import time
from typing import Any, Callable, List, Tuple

from sglang.srt.managers.detokenizer_manager import (_preimport_tokenizer_modules,
                                                     run_detokenizer_process)
from sglang.srt.managers.scheduler_process import PortArgs, run_scheduler_process
from sglang.srt.server_args import ServerArgs
from sglang.srt.utils import free_port

logger = logging.getLogger(__name__)


class ChildStartError(RuntimeError):
    pass


def launch_subprocesses(server_args: ServerArgs):
    """Returns (tokenizer_manager, processes, scheduler_info, ipc_folder)."""
    from sglang.srt.managers.tokenizer_manager import TokenizerManager
    from sglang.srt.utils.process import kill_process_tree

    folder = tempfile.mkdtemp(prefix="sglang-ipc-")
    addrs = PortArgs.new(folder)
    ctx = mp.get_context("spawn")
    detok_r, detok_w = ctx.Pipe(duplex=False)
    tok_r, tok_w = ctx.Pipe(duplex=False)  # this process -> detokenizer: the tokenizer
    ranks = start_ranks(server_args, addrs, ctx)
    (sched, sched_r), followers = ranks[0], ranks[1:]
    detok = ctx.Process(target=run_detokenizer_process,
                        args=(server_args, addrs, detok_w, tok_r),
                        name="sglang-detokenizer", daemon=True)
    detok.start()
    procs = [p for p, _ in ranks] + [detok]
    try:
        skip = server_args.skip_tokenizer_init
        if not skip:
            _preimport_tokenizer_modules()
        first = _wait_ready(sched_r, sched, "scheduler")
        tokenizer = first.get("tokenizer") if isinstance(first, dict) else None
        if not skip:
            # A pipe write blocks until the reader drains it: never block the launcher on a
            # child that may have died.
            threading.Thread(target=_send_quietly, args=(tok_w, tokenizer), daemon=True).start()
        info = _wait_ready(sched_r, sched, "scheduler")
        wait_ranks_ready(followers)
        _wait_ready(detok_r, detok, "detokenizer")
    except BaseException:
        kill_process_tree(procs)
        raise
    tm = TokenizerManager(server_args, addrs, info, tokenizer=tokenizer)
    return tm, procs, info, folder


def start_ranks(server_args: ServerArgs, addrs: PortArgs, ctx=None) -> List[Tuple[Any, Any]]:
    """This node's scheduler processes, one per TP rank: [(process, ready pipe)], rank 0
    first where this node has it (node 0)."""
    ctx = ctx or mp.get_context("spawn")
    tp, nodes = server_args.tp_size, server_args.nnodes
    per_node = tp // nodes
    first = server_args.node_rank * per_node
    dist_init = None
    if tp > 1:
        addr = server_args.dist_init_addr or f"127.0.0.1:{free_port()}"
        dist_init = f"tcp://{addr}"
    out = []
    for rank in range(first, first + per_node):
        r, w = ctx.Pipe(duplex=False)
        name = "sglang-scheduler" if rank == 0 else f"sglang-scheduler-tp{rank}"
        proc = ctx.Process(target=run_scheduler_process,
                           args=(server_args, addrs, w, rank, dist_init), name=name, daemon=True)
        proc.start()
        out.append((proc, r))
    return out


def wait_ranks_ready(ranks: List[Tuple[Any, Any]]) -> None:
    """Ranks > 0 report like rank 0: the tokenizer message (no tokenizer), then ready."""
    for proc, pipe in ranks:
        _wait_ready(pipe, proc, proc.name.replace("sglang-", ""))
        _wait_ready(pipe, proc, proc.name.replace("sglang-", ""))


def run_follower_node(server_args: ServerArgs) -> int:
    """--node-rank > 0: this node runs its TP ranks only (node 0 serves HTTP and holds rank
    0). Returns the exit code once one of them ended (1: a rank died or failed to start)."""
    from sglang.srt.utils.process import kill_process_tree

    folder = tempfile.mkdtemp(prefix="sglang-ipc-")
    ranks = start_ranks(server_args, PortArgs.new(folder))
    procs = [p for p, _ in ranks]
    try:
        wait_ranks_ready(ranks)
        logger.info("Node %d: %d TP rank(s) serving with node 0.", server_args.node_rank,
                    len(procs))
        while all(p.is_alive() for p in procs):
            time.sleep(0.5)
        dead = next(p for p in procs if not p.is_alive())
        logger.error("The %s process died (exit code %s).", dead.name, dead.exitcode)
        return 1
    finally:
        kill_process_tree(procs)




def _send_quietly(pipe, obj: Any) -> None:
    try:
        pipe.send(obj)
    except (OSError, EOFError):  # the detokenizer died; its watcher reports that
        pass


def _wait_ready(pipe, proc, name: str):
    while not pipe.poll(0.2):
        if not proc.is_alive():
            raise ChildStartError(f"The {name} process exited during start-up "
                                  f"(exit code {proc.exitcode}); see its log above.")
    msg = pipe.recv()
    if isinstance(msg, dict) and "error" in msg:
        raise ChildStartError(f"The {name} failed to start: {msg['error']}\n{msg.get('traceback', '')}")
    return msg


def watch_children(procs: List, on_death: Callable[[str], None], interval: float = 0.5) -> threading.Thread:
    """Call on_death(message) once if any child process dies."""

    def loop() -> None:
        while True:
            time.sleep(interval)
            for p in procs:
                if not p.is_alive():
                    on_death(f"The {p.name} process died (exit code {p.exitcode}).")
                    return

    t = threading.Thread(target=loop, daemon=True, name="sglang-child-watch")
    t.start()
    return t
