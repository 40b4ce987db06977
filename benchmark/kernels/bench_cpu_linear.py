"""y = x @ W^T on CPU for few rows: torch (bf16, fp32, bf16 upcast to fp32) vs sgl_kernel's
small_m_linear (bf16 and fp32 W), side by side in one run.

The weights of each shape are cycled through enough copies (> 96 MB) that every call reads W
from DRAM, as a model's layers do; the L3 cache does not flatter anyone. Times are wall
clock, the minimum over interleaved repeats (the machine is shared: the minimum is the least
disturbed run). GB/s = bytes of the stored weight / time.

    python benchmark/kernels/bench_cpu_linear.py                 # table + JSON
    python benchmark/kernels/bench_cpu_linear.py --large-ms 128,256,512
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
from common import machine_info, save  # noqa: E402

from sgl_kernel.cpu import is_available, small_m_linear, unavailable_reason  # noqa: E402

# (label, K, N): y[M, N] = x[M, K] @ W[N, K]^T
SHAPES: List[Tuple[str, int, int]] = [
    ("qwen2.5-0.5b gate_up-ish 896x4864", 896, 4864),
    ("qwen2.5-0.5b down 4864x896", 4864, 896),
    ("qwen2.5-0.5b qkv 896x1152", 896, 1152),
    ("smollm2-135m up 576x1536", 576, 1536),
]
VARIANTS = ("torch_bf16", "torch_fp32", "torch_upcast", "ours_bf16", "ours_fp32")
_DRAM_BYTES = 96e6  # > 2x the 32 MB L3 of the machine this was tuned on


def _copies(k: int, n: int, dtype: torch.dtype) -> List[torch.Tensor]:
    w = torch.randn(n, k) * k**-0.5
    count = int(_DRAM_BYTES / (n * k * torch.finfo(dtype).bits // 8)) + 1
    return [w.to(dtype) + 0 for _ in range(count)]  # distinct storage each


def _calls(k: int, n: int, m: int, ws_bf16: List[torch.Tensor],
           ws_f32: List[torch.Tensor]) -> Dict[str, Callable[[], object]]:
    xb = torch.randn(m, k).bfloat16()
    xf = xb.float()
    it = {"b": 0, "f": 0}

    def nb() -> torch.Tensor:
        it["b"] = (it["b"] + 1) % len(ws_bf16)
        return ws_bf16[it["b"]]

    def nf() -> torch.Tensor:
        it["f"] = (it["f"] + 1) % len(ws_f32)
        return ws_f32[it["f"]]

    return {
        "torch_bf16": lambda: F.linear(xb, nb()),
        "torch_fp32": lambda: F.linear(xf, nf()),
        "torch_upcast": lambda: F.linear(xf, nb().float()).bfloat16(),
        "ours_bf16": lambda: small_m_linear(xb, nb()),
        "ours_fp32": lambda: small_m_linear(xf, nf()),
    }


def _time(calls: Dict[str, Callable[[], object]], reps: int) -> Dict[str, float]:
    """Min wall ms per variant; variants interleaved so a noisy moment hits them all."""
    best = {name: float("inf") for name in calls}
    for f in calls.values():
        f()
    with torch.inference_mode():
        for _ in range(reps):
            for name, f in calls.items():
                t = time.perf_counter()
                f()
                best[name] = min(best[name], (time.perf_counter() - t) * 1e3)
    return best


def bench_shape(label: str, k: int, n: int, ms: List[int], reps: int) -> List[Dict[str, object]]:
    ws_bf16, ws_f32 = _copies(k, n, torch.bfloat16), _copies(k, n, torch.float32)
    rows = []
    for m in ms:
        ms_by = _time(_calls(k, n, m, ws_bf16, ws_f32), reps if m <= 64 else max(3, reps // 5))
        gbs = {v: n * k * (4 if v == "torch_fp32" or v == "ours_fp32" else 2) / t / 1e6
               for v, t in ms_by.items()}
        rows.append({"M": m, "ms": ms_by, "weight_GBps": gbs})
    del ws_bf16, ws_f32
    return rows


def print_table(label: str, k: int, n: int, rows: List[Dict[str, object]]) -> None:
    print(f"\n{label}  (K={k}, N={n}; ms and GB/s of weight)")
    print(f"{'M':>4} " + " ".join(f"{v:>18}" for v in VARIANTS) + "  ours/torch bf16  M/M=1 ours bf16")
    base = rows[0]["ms"]["ours_bf16"]
    for r in rows:
        cells = " ".join(f"{r['ms'][v]:8.3f} ({r['weight_GBps'][v]:5.1f})" for v in VARIANTS)
        speed = r["ms"]["torch_bf16"] / r["ms"]["ours_bf16"]
        print(f"{r['M']:>4} {cells}  {speed:14.1f}x  {r['ms']['ours_bf16'] / base:14.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ms", default="1,2,4,8,16,32,64", help="rows of x to time")
    ap.add_argument("--large-ms", default="", help="extra large M (e.g. 128,256,512)")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--out", default="cpu_linear", help="benchmark/results/<out>.json")
    args = ap.parse_args()
    if not is_available():
        sys.exit(f"sgl_kernel CPU linear unavailable: {unavailable_reason()}")
    ms = [int(v) for v in args.ms.split(",")]
    ms += [int(v) for v in args.large_ms.split(",") if v]
    results = []
    for label, k, n in SHAPES:
        rows = bench_shape(label, k, n, ms, args.reps)
        print_table(label, k, n, rows)
        results.append({"shape": label, "K": k, "N": n, "rows": rows})
    info = machine_info()
    info["loadavg_at_end"] = os.getloadavg()
    path = save(args.out, {"benchmark": "cpu_linear", "machine": info,
                           "method": "wall ms, min over interleaved repeats; W cycled over "
                                     f">{_DRAM_BYTES / 1e6:.0f} MB of copies (DRAM reads)",
                           "results": results})
    print(f"\nthreads={info['threads']} loadavg={info['loadavg_at_end']}  -> {path}")


if __name__ == "__main__":
    main()
