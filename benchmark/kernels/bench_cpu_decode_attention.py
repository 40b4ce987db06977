"""Attention of a few query rows over a paged KV pool on CPU: sgl_kernel's decode_attention
vs torch SDPA over the gathered slots, side by side in one run.

Shapes are real models' (query heads, KV heads, head dim); T = 1 is a decode step, T = 5 a
speculative verify of 5 tokens (causal among themselves). Each call reads the next of
`--layers` distinct pools, as a model's layers do, so with enough layers the KV comes from
DRAM, not the L3. Times: minimum over interleaved repeats (the least disturbed run).
Printed beside each: GB/s of KV read, GFMA/s, and the bound max(bytes / copy bandwidth,
FMAs / the machine's FMA peak) when `--fma-peak` is given.

    python benchmark/kernels/bench_cpu_decode_attention.py
    python benchmark/kernels/bench_cpu_decode_attention.py --contexts 4096 --rows 1 --reps 50
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Callable, Dict, List, Tuple

import torch
import torch.nn.functional as F

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(_ROOT, "sgl-kernel"))
from common import copy_bandwidth_gbs, machine_info, save  # noqa: E402

from sgl_kernel.cpu import decode_attention, is_available, unavailable_reason  # noqa: E402

# (label, query heads, KV heads, head dim)
SHAPES: List[Tuple[str, int, int, int]] = [
    ("qwen2.5-0.5b", 14, 2, 64),
    ("qwen2.5-1.5b", 12, 2, 128),
    ("smollm2-135m", 9, 3, 64),
]


def _pools(kvh: int, hd: int, ctx: int, layers: int, dtype: torch.dtype):
    slots = ctx + 64
    return [(torch.randn(slots, kvh, hd).to(dtype), torch.randn(slots, kvh, hd).to(dtype))
            for _ in range(layers)]


def _causal_mask(t: int, ctx: int) -> torch.Tensor:
    """Row i sees the prefix and the first i + 1 of the T new tokens (a chain verify)."""
    m = torch.ones(t, ctx, dtype=torch.bool)
    for i in range(t):
        m[i, ctx - t + i + 1:] = False
    return m


def _calls(h: int, kvh: int, hd: int, ctx: int, t: int, pools) -> Dict[str, Callable[[], object]]:
    dtype = pools[0][0].dtype
    q = torch.randn(t, h, hd).to(dtype)
    # a non-contiguous slot order, as a pool that has served other requests gives
    idx = torch.randperm(pools[0][0].shape[0])[:ctx].sort().values
    mask = None if t == 1 else _causal_mask(t, ctx)
    scale = hd**-0.5
    it = {"i": 0}

    def pool():
        it["i"] = (it["i"] + 1) % len(pools)
        return pools[it["i"]]

    def ours():
        k, v = pool()
        return decode_attention(q, k, v, idx, mask, scale)

    def sdpa():
        k, v = pool()
        kk = k[idx].transpose(0, 1)  # [KVH, L, hd]
        vv = v[idx].transpose(0, 1)
        qq = q.transpose(0, 1)  # [H, T, hd]
        am = None if mask is None else mask.unsqueeze(0)
        return F.scaled_dot_product_attention(qq, kk, vv, attn_mask=am, scale=scale,
                                              enable_gqa=True).transpose(0, 1)

    return {"ours": ours, "sdpa_gather": sdpa}


def _time(calls: Dict[str, Callable[[], object]], reps: int) -> Dict[str, float]:
    best = {name: float("inf") for name in calls}
    with torch.inference_mode():
        for f in calls.values():
            f()
        for _ in range(reps):
            for name, f in calls.items():
                t0 = time.perf_counter()
                f()
                best[name] = min(best[name], (time.perf_counter() - t0) * 1e6)
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", default="1024,4096,8192")
    ap.add_argument("--rows", default="1,5", help="query tokens per call (T)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--layers", type=int, default=24, help="distinct pools cycled through")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--shapes", default=",".join(s[0] for s in SHAPES))
    ap.add_argument("--fma-peak", type=float, default=78.4,
                    help="fp32 FMA/s of all cores, in G (2 cores x 2 FMA x 8 lanes x 2.45 GHz)")
    ap.add_argument("--out", default="cpu_decode_attention")
    args = ap.parse_args()
    if not is_available():
        sys.exit(f"sgl_kernel CPU kernels unavailable: {unavailable_reason()}")
    dtype = getattr(torch, args.dtype)
    bw = copy_bandwidth_gbs()
    info = machine_info()
    print(f"machine: {info}; copy bandwidth {bw:.1f} GB/s; threads {torch.get_num_threads()}")
    wanted = set(args.shapes.split(","))
    results: Dict[str, object] = {"machine": info, "bandwidth_gbs": bw, "dtype": args.dtype,
                                  "fma_peak_g": args.fma_peak, "command": " ".join(sys.argv),
                                  "shapes": {}}
    for label, h, kvh, hd in SHAPES:
        if label not in wanted:
            continue
        rows = []
        print(f"\n{label}: H={h} KVH={kvh} hd={hd}")
        print(f"{'ctx':>6} {'T':>3} {'ours us':>9} {'sdpa us':>9} {'speedup':>8} {'GB/s':>6} "
              f"{'GFMA/s':>7} {'bound us':>9} {'of bound':>8}")
        for ctx in [int(c) for c in args.contexts.split(",")]:
            pools = _pools(kvh, hd, ctx, args.layers, dtype)
            for t in [int(r) for r in args.rows.split(",")]:
                us = _time(_calls(h, kvh, hd, ctx, t, pools), args.reps)
                kv_bytes = 2 * ctx * kvh * hd * pools[0][0].element_size()
                fmas = 2 * t * h * ctx * hd
                bound = max(kv_bytes / bw / 1e3, fmas / args.fma_peak / 1e3)
                row = {"ctx": ctx, "T": t, "us": us, "kv_bytes": kv_bytes, "fma": fmas,
                       "bound_us": bound, "speedup_vs_sdpa": us["sdpa_gather"] / us["ours"],
                       "ours_GBps": kv_bytes / us["ours"] / 1e3,
                       "ours_GFMAps": fmas / us["ours"] / 1e3}
                rows.append(row)
                print(f"{ctx:6d} {t:3d} {us['ours']:9.1f} {us['sdpa_gather']:9.1f} "
                      f"{row['speedup_vs_sdpa']:7.2f}x {row['ours_GBps']:6.1f} "
                      f"{row['ours_GFMAps']:7.1f} {bound:9.1f} {bound / us['ours']:7.0%}", flush=True)
            del pools
        results["shapes"][label] = {"H": h, "KVH": kvh, "hd": hd, "rows": rows}
    print("saved", save(args.out, results))


if __name__ == "__main__":
    main()
