"""y = x @ W^T on CPU for few rows: torch (bf16, fp32, bf16 upcast to fp32) vs sgl_kernel's
small_m_linear (bf16 and fp32 W), side by side in one run.

The weights of each shape are cycled through enough copies (> 96 MB) that every call reads W
from DRAM, as a model's layers do; the L3 cache does not flatter anyone. Times are wall
clock (or, with --threads 1 --clock thread, the calling thread's CPU time), the minimum over
interleaved repeats (on a shared machine the minimum is the least disturbed run).
GB/s = bytes of the stored weight / time.

    python benchmark/kernels/bench_cpu_linear.py                 # table + JSON
    python benchmark/kernels/bench_cpu_linear.py --large-ms 128,256,512
    python benchmark/kernels/bench_cpu_linear.py --e2e           # + SmolLM2 decode / extend

--e2e times whole forward passes of the SmolLM2-135M GGUF in bf16 through TinyRunner after a
500-token prefix: a 1-token decode, an 8-token extend (last-token logits) and an 8-token
extend with logits for all 8 (what speculative verification needs), with every nn.Linear
on torch's F.linear vs on sglang.srt.layers.linear.linear (patched for the measurement).
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


_CLOCK: Callable[[], float] = time.perf_counter


def _time(calls: Dict[str, Callable[[], object]], reps: int) -> Dict[str, float]:
    """Min ms per variant; variants interleaved so a noisy moment hits them all."""
    best = {name: float("inf") for name in calls}
    for f in calls.values():
        f()
    with torch.inference_mode():
        for _ in range(reps):
            for name, f in calls.items():
                t = _CLOCK()
                f()
                best[name] = min(best[name], (_CLOCK() - t) * 1e3)
    return best


def bench_shape(k: int, n: int, ms: List[int], reps: int) -> Dict[int, Dict[str, float]]:
    """M -> variant -> min ms."""
    ws_bf16, ws_f32 = _copies(k, n, torch.bfloat16), _copies(k, n, torch.float32)
    out = {m: _time(_calls(k, n, m, ws_bf16, ws_f32), reps if m <= 64 else max(3, reps // 5))
           for m in ms}
    del ws_bf16, ws_f32
    return out


def table_rows(k: int, n: int, ms_by_m: Dict[int, Dict[str, float]]) -> List[Dict[str, object]]:
    rows = []
    for m, ms_by in ms_by_m.items():
        gbs = {v: n * k * (4 if v in ("torch_fp32", "ours_fp32") else 2) / t / 1e6
               for v, t in ms_by.items()}
        rows.append({"M": m, "ms": ms_by, "weight_GBps": gbs})
    return rows


def print_table(label: str, k: int, n: int, rows: List[Dict[str, object]]) -> None:
    print(f"\n{label}  (K={k}, N={n}; ms and GB/s of weight)")
    head = " ".join(f"{v:>18}" for v in VARIANTS)
    print(f"{'M':>4} {head}  ours/torch bf16  M/M=1 ours bf16")
    base = rows[0]["ms"]["ours_bf16"]
    for r in rows:
        cells = " ".join(f"{r['ms'][v]:8.3f} ({r['weight_GBps'][v]:5.1f})" for v in VARIANTS)
        speed = r["ms"]["torch_bf16"] / r["ms"]["ours_bf16"]
        print(f"{r['M']:>4} {cells}  {speed:14.1f}x  {r['ms']['ours_bf16'] / base:14.2f}")


def _patch_linears(model: torch.nn.Module, impl: str) -> None:
    """Route every nn.Linear (and subclass) of `model` through layers.linear.linear ("ours"),
    torch's F.linear ("torch"), or back to the class's own forward ("reset")."""
    import types

    from sglang.srt.layers.linear import linear

    fn = {"ours": linear, "torch": F.linear}.get(impl)
    for mod in model.modules():
        if isinstance(mod, torch.nn.Linear):
            if fn is not None:
                mod.forward = types.MethodType(
                    lambda self, x, fn=fn: fn(x, self.weight, self.bias), mod)
            elif "forward" in mod.__dict__:
                del mod.forward


def bench_e2e(reps: int, prefix: int = 500, ext: int = 8) -> Dict[str, object]:
    from sglang.test.fixtures import smollm2_gguf_path
    from sglang.test.harness import TinyRunner

    runner = TinyRunner(smollm2_gguf_path(), dtype="bfloat16", max_reqs=1,
                        max_context=prefix + 4 * reps * (2 * ext + 1) + 64, kv_slots=4096)
    vocab = runner.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    runner.prefill([torch.randint(100, vocab, (prefix,), generator=gen).tolist()])
    steps = {
        "decode_1": lambda: runner.decode([int(torch.randint(100, vocab, (1,)))]),
        f"extend_{ext}": lambda: runner.extend([torch.randint(100, vocab, (ext,)).tolist()]),
        f"extend_{ext}_all_logits": lambda: runner.extend(
            [torch.randint(100, vocab, (ext,)).tolist()], all_logits=True),
    }
    best = {f"{name}/{impl}": float("inf") for name in steps for impl in ("torch", "ours")}
    for rep in range(reps + 1):  # rep 0 warms both paths up
        for name, step in steps.items():
            for impl in ("torch", "ours"):
                _patch_linears(runner.model, impl)
                t = _CLOCK()
                step()
                if rep:
                    best[f"{name}/{impl}"] = min(best[f"{name}/{impl}"], (_CLOCK() - t) * 1e3)
    _patch_linears(runner.model, "reset")
    runner.release()
    print(f"\nSmolLM2-135M bf16, TinyRunner, {prefix}-token prefix (ms, min of {reps})")
    for name in steps:
        t, o = best[f"{name}/torch"], best[f"{name}/ours"]
        print(f"  {name:24s} torch {t:8.2f}   ours {o:8.2f}   speedup {t / o:5.2f}x")
    return {"model": "SmolLM2-135M-Instruct Q4_1 GGUF as bf16", "prefix": prefix,
            "ms": best}


def main() -> None:
    global _CLOCK
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ms", default="1,2,4,8,16,32,64", help="rows of x to time")
    ap.add_argument("--large-ms", default="", help="extra large M (e.g. 128,256,512)")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--out", default="cpu_linear", help="benchmark/results/<out>.json")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="repeat the whole table this many times, keeping the minimum per "
                         "cell: on a shared machine, more chances to catch a quiet moment")
    ap.add_argument("--e2e", action="store_true", help="also time SmolLM2 forward passes")
    ap.add_argument("--skip-kernels", action="store_true", help="only the --e2e part")
    ap.add_argument("--clock", choices=("wall", "thread"), default="wall",
                    help="thread: CPU time of the calling thread, which excludes time the OS "
                         "gave to other processes (a shared machine); needs --threads 1")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.clock == "thread":
        if torch.get_num_threads() != 1:
            sys.exit("--clock thread measures one thread: add --threads 1")
        _CLOCK = time.thread_time
    if not is_available():
        sys.exit(f"sgl_kernel CPU linear unavailable: {unavailable_reason()}")
    ms = [int(v) for v in args.ms.split(",")]
    ms += [int(v) for v in args.large_ms.split(",") if v]
    results = []
    best: Dict[str, Dict[int, Dict[str, float]]] = {}
    for _ in range(args.rounds):  # rounds spread the repeats over time (see --rounds)
        for label, k, n in [] if args.skip_kernels else SHAPES:
            got = bench_shape(k, n, ms, args.reps)
            prev = best.setdefault(label, got)
            for m, by in got.items():
                prev[m] = {v: min(t, prev[m][v]) for v, t in by.items()}
    for label, k, n in [] if args.skip_kernels else SHAPES:
        rows = table_rows(k, n, best[label])
        print_table(label, k, n, rows)
        results.append({"shape": label, "K": k, "N": n, "rows": rows})
    e2e = bench_e2e(max(3, args.reps // 2)) if args.e2e else None
    info = machine_info()
    info["loadavg_at_end"] = os.getloadavg()
    path = save(args.out, {"benchmark": "cpu_linear", "machine": info,
                           "method": f"{args.clock} clock ms, min over interleaved repeats; W "
                                     f"cycled over >{_DRAM_BYTES / 1e6:.0f} MB of copies "
                                     f"(DRAM reads); {args.rounds} round(s) of {args.reps} "
                                     "repeats", "clock": args.clock,
                           "results": results, "e2e": e2e})
    print(f"\nthreads={info['threads']} loadavg={info['loadavg_at_end']}  -> {path}")


if __name__ == "__main__":
    main()
