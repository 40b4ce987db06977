"""Shared bits of the benchmarks: machine info, bandwidth probe, prompts, result files."""

from __future__ import annotations

import json
import os
import platform
import time
from typing import Any, Dict, List, Optional

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def machine_info() -> Dict[str, Any]:
    import torch

    cpu = "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    isa = attn_isa = "unavailable"  # which inner kernels our bf16 linear / attention ran on
    try:
        from sgl_kernel import cpu as kernels

        if kernels.is_available():
            isa, attn_isa = kernels.linear_isa(), kernels.attention_isa()
    except Exception:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "threads": torch.get_num_threads(),
            "python": platform.python_version(), "torch": torch.__version__,
            "kernel_isa": isa, "attention_isa": attn_isa, "date": time.strftime("%Y-%m-%d %H:%M:%S")}


def copy_bandwidth_gbs(mb: int = 512, repeats: int = 5) -> float:
    """Read+write bandwidth of a large tensor copy, in GB/s of bytes read (best of repeats)."""
    import torch

    src = torch.empty(mb * 1024 * 1024 // 4, dtype=torch.float32).fill_(1.0)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t)
    # A copy reads and writes every byte: count both, as a streaming read would see it.
    return 2 * src.numel() * 4 / best / 1e9


def legal_text() -> str:
    """A long legal text available offline (real documents; GPL and friends from Debian)."""
    try:
        from sglang.test.real_assets import legal_doc

        path = legal_doc("gdpr")
        if path:
            with open(path) as f:
                return f.read()
    except Exception:
        pass
    parts = []
    folder = "/usr/share/common-licenses"
    for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
        p = os.path.join(folder, name)
        if os.path.isfile(p):
            with open(p, errors="ignore") as f:
                parts.append(f.read())
    if not parts:
        raise RuntimeError("No legal text found: run scripts/fetch_legal_docs.py")
    return "\n\n".join(parts)


def prompt_ids(tokenizer, n_tokens: int) -> List[int]:
    text = legal_text()
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    while len(ids) < n_tokens:
        ids = ids + ids
    return ids[:n_tokens]


def save(name: str, payload: Dict[str, Any]) -> str:
    os.makedirs(RESULTS, exist_ok=True)
    path = os.path.join(RESULTS, name + ".json")
    with open(path, "w") as f:
        json.dump(payload, f, indent=2)
    return path


def plot_bars(path: str, title: str, groups: List[str], series: Dict[str, List[Optional[float]]],
              ylabel: str, rotation: int = 0) -> Optional[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(8, 4.5))
    width = 0.8 / max(len(series), 1)
    for i, (label, values) in enumerate(series.items()):
        xs = [g + i * width for g in range(len(groups))]
        ax.bar(xs, [v or 0 for v in values], width, label=label)
    ax.set_xticks([g + width * (len(series) - 1) / 2 for g in range(len(groups))])
    if rotation:  # long labels (many rows)
        ax.set_xticklabels(groups, rotation=rotation, ha="right", fontsize=8)
    else:
        ax.set_xticklabels(groups)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def keep_large_tensors_mmapped() -> None:
    """Fix glibc's mmap threshold (M_MMAP_THRESHOLD = -3) at 1 MiB. glibc raises it after the
    first large free, so models loaded later land in the heap and freed ones are never
    returned: a run loading a model per setting grew to 24 GB and was killed."""
    import ctypes

    try:
        ctypes.CDLL(None).mallopt(-3, 1 << 20)
    except (OSError, AttributeError):
        pass


def share_dense_weights() -> None:
    """In this process, load each dense checkpoint once per (path, dtype, device) and hand
    every later scheduler the same module: weights are read-only at inference, and each
    scheduler keeps its own KV pools, requests and draft state. Part 1 of bench_adaptive
    runs five settings side by side in one process; with a copy of the Qwen pair each
    (3 + 1 GB in bf16) the worker reached 23 GB and the OOM killer ended it. MoE models
    (an expert store per scheduler, with its own slots) are loaded as before."""
    from sglang.srt.model_loader import loader

    if getattr(loader.load_model, "shared", False):
        return
    load = loader.load_model
    cache: Dict[tuple, Any] = {}

    def shared_load(model_path, dtype="auto", device="cpu", offload=None, **kwargs):
        if (offload is not None and offload.enabled) or kwargs.get("moe_expert_cache_slots"):
            return load(model_path, dtype, device, offload, **kwargs)
        key = (model_path, str(dtype), device)
        if key not in cache:
            cache[key] = load(model_path, dtype, device, None, **kwargs)
        return cache[key]

    shared_load.shared = True
    loader.load_model = shared_load


def run_isolated(fn, *args, **kwargs):
    """fn(*args, **kwargs) in a fresh spawned process; returns its (picklable) result.

    Each configuration of a benchmark loads its own models (3-4 GB for the Qwen pair); in one
    process their memory was not all returned and a run of 8 configurations was killed by
    the OOM killer at 24 GB. A process per configuration also keeps one's allocator state
    and threads from colouring the next one's timings."""
    import multiprocessing as mp

    with mp.get_context("spawn").Pool(1, maxtasksperchild=1) as pool:
        return pool.apply(fn, args, kwargs)


def vllm_env(threads: Optional[int] = None, kv_gb: int = 4) -> Dict[str, str]:
    """Environment for a vLLM CPU subprocess that uses the same cores as our engine.

    Without an explicit binding vLLM's CPU worker ran one OpenMP thread on this 2-core machine
    (0.5B bf16 plain decode 7.9 tok/s; bound to both cores it matches the reference's ~22).
    NUMBA_THREADING_LAYER=workqueue: its n-gram proposer otherwise pins the worker to one core."""
    n = threads or os.cpu_count() or 1
    return {**os.environ, "NUMBA_THREADING_LAYER": "workqueue", "VLLM_CPU_KVCACHE_SPACE": str(kv_gb),
            "VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1",  # the last context + new tokens may pass the max
            "VLLM_CPU_OMP_THREADS_BIND": ",".join(str(i) for i in range(n)),
            "OMP_NUM_THREADS": str(n)}
