"""CUDA graphs for decode batches and tree verifies (upstream's `--cuda-graph-max-bs`,
`--cuda-graph-bs`, `--disable-cuda-graph`, `--disable-cuda-graph-padding`).

A decode step of a small batch spends most of its GPU time launching kernels; a graph
captured once per batch size replays them in one launch. At start-up the runner captures
the model's forward for each size (largest first, so the smaller graphs share its memory
pool) over static input buffers; a decode batch of n requests then copies its ids,
positions and KV slots into those buffers, pads to the next captured size (padding rows
write their K/V to slot 0, the pool's padding slot, and attend over empty lists), has the
attention backend fill its static metadata outside the graph, replays, and reads its rows
of the static logits. Anything else (prefill, trees, the draft's compressed views, EAGLE
captures, the expert store's host-side loads) runs eagerly.

On a machine without CUDA the same runner takes `EagerGraph`, which re-runs the captured
function on the same static buffers and forbids host reads while capturing, as a CUDA
capture does: that is how the CPU suite checks padding, buffers and metadata.
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
import time
from typing import TYPE_CHECKING, Callable, Dict, List, Optional, Tuple

import torch

from sglang.srt.model_executor.forward_batch import ForwardBatch, ForwardMode
from sglang.srt.utils import host_sync

if TYPE_CHECKING:
    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.srt.server_args import ServerArgs

logger = logging.getLogger(__name__)

DEFAULT_MAX_BS = 256  # upstream's default on H100 / H200 at tp < 4


def default_batch_sizes(max_bs: int) -> List[int]:
    """1, 2, 4, 8, then every 8 up to max_bs (max_bs itself last)."""
    sizes = [s for s in [1, 2, 4, 8] + list(range(16, max_bs + 1, 8)) if s <= max_bs]
    if not sizes or sizes[-1] != max_bs:
        sizes.append(max_bs)
    return sizes


@dataclasses.dataclass(frozen=True)
class GraphConfig:
    """Which decode batch sizes get a graph; none (and why) when graphs are off."""

    batch_sizes: Tuple[int, ...] = ()
    padding: bool = True  # a batch between two sizes replays the larger one
    why_off: str = ""

    @property
    def enabled(self) -> bool:
        return bool(self.batch_sizes)

    @classmethod
    def from_server_args(cls, args: "ServerArgs", device: str,
                         max_running_requests: int) -> "GraphConfig":
        if args.disable_cuda_graph:
            return cls(why_off="--disable-cuda-graph")
        if not str(device).startswith("cuda"):
            return cls(why_off=f"device {device} (CUDA graphs need a GPU)")
        if args.cuda_graph_bs:
            sizes = sorted({s for s in args.cuda_graph_bs if s <= max_running_requests})
        else:
            sizes = default_batch_sizes(min(args.cuda_graph_max_bs or DEFAULT_MAX_BS,
                                            max_running_requests))
        if not sizes:
            return cls(why_off=f"no --cuda-graph-bs size within --max-running-requests "
                               f"{max_running_requests}")
        return cls(batch_sizes=tuple(sizes), padding=not args.disable_cuda_graph_padding)


def why_not_graphable(runner: "ModelRunner") -> Optional[str]:
    """Why this runner's decode forward cannot be captured, or None."""
    backend = runner.attn_backend
    if not getattr(backend, "supports_graphs", False):
        return (f"--attention-backend {runner.server_args.attention_backend} has no graph "
                "support (triton has)")
    if runner.expert_store is not None:
        return "the MoE expert store (--moe-expert-cache-slots) loads experts from the host"
    blocks = getattr(runner.model, "moe_blocks", None)
    if blocks is not None and any(b.experts.runner != "triton" for b in blocks().values()):
        return ("the torch MoE runner reads expert groups on the host: use "
                "--moe-runner-backend triton")
    return None


class CudaGraph:
    """torch.cuda.CUDAGraph behind the protocol GraphRunner uses."""

    def __init__(self) -> None:
        self.graph = torch.cuda.CUDAGraph()

    def capture(self, fn: Callable[[], torch.Tensor], pool) -> torch.Tensor:
        with torch.cuda.graph(self.graph, pool=pool):
            return fn()

    def pool(self):
        return self.graph.pool()

    def replay(self) -> None:
        self.graph.replay()


class EagerGraph:
    """The same protocol without CUDA: capture runs `fn` once with host reads forbidden (a
    CUDA capture fails on them), replay re-runs it and writes the captured output tensor
    in place, as a graph replay does. Only the static buffers carry a new batch in."""

    def capture(self, fn: Callable[[], torch.Tensor], pool) -> torch.Tensor:
        self.fn = fn
        with host_sync.forbid_reads("a CUDA graph capture"):
            self.out = fn()
        return self.out

    def pool(self):
        return None

    def replay(self) -> None:
        self.out.copy_(self.fn())


@dataclasses.dataclass
class GraphStats:
    replays: int = 0  # decode forwards that replayed a graph
    verify_replays: int = 0  # tree verifies that replayed a graph
    eager: int = 0  # decode / verify forwards that ran eagerly (too large, not graphable)
    padded_rows: int = 0
    capture_seconds: float = 0.0
    memory_bytes: int = 0  # device memory the captures took (CUDA)


@dataclasses.dataclass
class _Family:
    """Graphs of one shape of batch: `tokens` rows per request (1: decode; a verify's tree
    node budget), one graph per batch size, and the static inputs they read."""

    mode: ForwardMode
    tokens: int
    input_ids: torch.Tensor
    positions: torch.Tensor
    out_cache_loc: torch.Tensor
    kv_capacity: int  # slot-list entries the backend's static buffers hold
    graphs: Dict[int, object] = dataclasses.field(default_factory=dict)
    outputs: Dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)


class GraphRunner:
    """Captured decode (and tree verify) graphs of one ModelRunner, and their buffers."""

    def __init__(self, runner: "ModelRunner", config: GraphConfig, max_kv_len: int,
                 graph_factory: Callable[[], object] = CudaGraph) -> None:
        self.runner = runner
        self.config = config
        self.sizes = sorted(config.batch_sizes)
        self.max_kv_len = max_kv_len
        self.factory = graph_factory
        self.families: Dict[ForwardMode, _Family] = {}
        self.pool = None  # one memory pool for every graph (captured largest first)
        self.stats = GraphStats()

    def _family(self, mode: ForwardMode, tokens: int) -> _Family:
        dev, rows = self.runner.device, self.sizes[-1] * tokens
        zeros = lambda: torch.zeros(rows, dtype=torch.int64, device=dev)  # noqa: E731
        # the longest batch the slot lists hold: every request at the longest context
        capacity = self.sizes[-1] * (self.max_kv_len + tokens)
        fam = _Family(mode, tokens, zeros(), zeros(), zeros(), capacity)
        self.runner.attn_backend.init_graph_state(tokens, self.sizes[-1], capacity, dev)
        self.families[mode] = fam
        return fam

    def _static_batch(self, fam: _Family, bs: int) -> ForwardBatch:
        r, t = self.runner, fam.tokens
        rows = bs * t
        ones = torch.full((bs,), t, dtype=torch.int64, device=r.device)
        return ForwardBatch(
            forward_mode=fam.mode, batch_size=bs, input_ids=fam.input_ids[:rows],
            positions=fam.positions[:rows], req_pool_indices=torch.zeros_like(ones),
            seq_lens=ones, extend_seq_lens=ones, out_cache_loc=fam.out_cache_loc[:rows],
            req_to_token_pool=None, token_to_kv_pool=r.kv_pool, attn_backend=r.attn_backend,
            seq_lens_cpu=[t] * bs, extend_seq_lens_cpu=[t] * bs, req_pool_indices_cpu=[0] * bs)

    def capture(self, verify_tokens: int = 0) -> None:
        """Decode graphs; with `verify_tokens` > 1 also graphs of tree verifies of that
        many nodes a request (a speculative server's)."""
        self._capture(self._family(ForwardMode.DECODE, 1))
        if verify_tokens > 1:
            self.capture_verify(verify_tokens)

    def capture_verify(self, tokens: int) -> None:
        self._capture(self._family(ForwardMode.TARGET_VERIFY, tokens))

    @torch.inference_mode()
    def _capture(self, fam: _Family) -> None:
        t0 = time.perf_counter()
        dev = self.runner.device
        cuda = str(dev).startswith("cuda")
        before = torch.cuda.memory_allocated(dev) if cuda else 0
        backend, kvh = self.runner.attn_backend, self.runner.kv_pool.num_kv_heads
        for bs in reversed(self.sizes):
            fb = self._static_batch(fam, bs)
            backend.init_forward_metadata_capture(bs, fam.tokens, kvh, self.max_kv_len)
            fn = (lambda fb=fb: self.runner.model(fb.input_ids, fb.positions, fb))
            for _ in range(2):  # warm-up outside the capture: autotuning, lazy allocations
                fn()
            if cuda:
                torch.cuda.synchronize(dev)
            graph = self.factory()
            fam.outputs[bs] = graph.capture(fn, self.pool)
            self.pool = graph.pool()
            fam.graphs[bs] = graph
        if cuda:
            torch.cuda.synchronize(dev)
            self.stats.memory_bytes += torch.cuda.memory_allocated(dev) - before
        seconds = time.perf_counter() - t0
        self.stats.capture_seconds += seconds
        logger.info("Captured CUDA graphs for %s batches of sizes %s (%d rows a request) in "
                    "%.1fs", fam.mode.name, self.sizes, fam.tokens, seconds)

    def _bucket(self, n: int) -> Optional[int]:
        i = bisect.bisect_left(self.sizes, n)
        if i == len(self.sizes):
            return None
        bs = self.sizes[i]
        return bs if bs == n or self.config.padding else None

    def can_run(self, fb: ForwardBatch, model_inputs: dict) -> bool:
        """Whether `fb` replays a graph (a decode, or a verify of trees within the captured
        node budget, and nothing a graph cannot carry); counts those that cannot."""
        fam = self.families.get(fb.forward_mode)
        if fam is None:
            if fb.forward_mode == ForwardMode.TARGET_VERIFY:
                self.stats.eager += 1
            return False
        lens = fb.seq_lens_cpu
        ok = (not model_inputs and fb.capture_layers is None and fb.residual_hook is None
              and len(lens) == fb.batch_size
              and self._bucket(fb.batch_size) is not None
              and sum(lens) + fam.tokens * fb.batch_size <= fam.kv_capacity
              and max(lens, default=0) <= self.max_kv_len
              and self.runner.attn_backend.graph_can_run(fb, fam.tokens))
        if not ok:
            self.stats.eager += 1
        return ok

    def replay(self, fb: ForwardBatch) -> torch.Tensor:
        """`fb`'s logits (rows `fb.logits_indices`, as the eager forward returns them)."""
        fam = self.families[fb.forward_mode]
        n, t = fb.batch_size, fam.tokens
        bs = self._bucket(n)
        rows = None  # where each of fb's tokens sits among the graph's rows
        if t > 1:
            dst = [i * t + j for i, e in enumerate(fb.extend_seq_lens_cpu) for j in range(e)]
            rows = torch.tensor(dst, dtype=torch.int64).to(self.runner.device)
        for buf, src in ((fam.input_ids, fb.input_ids), (fam.positions, fb.positions),
                         (fam.out_cache_loc, fb.out_cache_loc)):
            if rows is None:
                buf[:n].copy_(src)
                buf[n:bs].zero_()  # padding rows: token 0 at position 0, K/V into slot 0
            else:
                buf[: bs * t].zero_()
                buf.index_copy_(0, rows, src)
        self.runner.attn_backend.init_forward_metadata_replay(fb, bs, t)
        fam.graphs[bs].replay()
        if t > 1:
            self.stats.verify_replays += 1
        else:
            self.stats.replays += 1
        self.stats.padded_rows += bs * t - fb.num_tokens
        logits = fam.outputs[bs]
        if rows is None:
            rows = fb.logits_indices
            # a copy either way: the static output is overwritten by the next replay
            return logits[rows] if rows is not None else logits[:n].clone()
        if fb.logits_indices is not None:
            rows = rows[fb.logits_indices]
        return logits[rows]

    def info(self) -> dict:
        verify = self.families.get(ForwardMode.TARGET_VERIFY)
        return {"enabled": True, "batch_sizes": self.sizes, "padding": self.config.padding,
                "verify_tokens": verify.tokens if verify else 0,
                **dataclasses.asdict(self.stats)}
