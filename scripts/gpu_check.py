"""The timing and end-to-end half of scripts/gpu_check.sh (run that; it sets the paths).

1. device copy bandwidth (the ceiling the decode kernel is measured against);
2. each Triton kernel against its torch reference (median of CUDA-event timings);
3. the engine end to end on a random Llama built here (no hub, no tokenizer needed):
   greedy output of the GPU engine (triton backend; plain, NGRAM, STANDALONE) against the
   CPU engine (torch_native) in float32, then decode tokens/s in bfloat16;
4. the expert store and prefetch on the device (gpu_check_moe.py).
Prints one table; `--json PATH` also writes the rows.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import tempfile
import time
import traceback
from typing import Callable, Dict, List

import torch

from gpu_check_moe import moe_prefetch_checks  # scripts/ is on sys.path when run

ROWS: List[Dict] = []
DEV = "cuda"
SMOKE = False  # --cpu-smoke: tiny shapes on the CPU under TRITON_INTERPRET=1 (checks the script)


def row(check: str, result: str = "", ms=None, ref_ms=None, gbs=None, bw=None, note: str = "") -> None:
    ROWS.append(dict(check=check, result=result, ms=ms, ref_ms=ref_ms, gbs=gbs, bw=bw, note=note))
    print(f"[gpu_check] {check}: {result} {note}", flush=True)


def cuda_ms(fn: Callable[[], object], budget_s: float = 1.0, max_reps: int = 50) -> float:
    """Median milliseconds of fn over up to max_reps timed runs after one warm-up."""
    if DEV == "cpu":
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    fn()
    torch.cuda.synchronize()
    times, start = [], time.perf_counter()
    while len(times) < max_reps and (len(times) < 3 or time.perf_counter() - start < budget_s):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def copy_bandwidth() -> float:
    x = torch.empty((1 << 20) if SMOKE else (2 << 30), dtype=torch.uint8, device=DEV).random_()
    y = torch.empty_like(x)
    ms = cuda_ms(lambda: y.copy_(x))
    gbs = 2 * x.numel() / ms / 1e6  # bytes read + written
    row("device copy (2 GiB)", "ok", ms=ms, gbs=gbs, bw=1.0)
    return gbs


def _lists(lens: List[int], slots: int, dev=None):
    dev = dev or DEV
    perm = torch.randperm(slots - 1, device=dev) + 1
    idx = torch.cat([perm[torch.randint(0, slots - 1, (n,), device=dev)] for n in lens])
    indptr = torch.zeros(len(lens) + 1, dtype=torch.int64)
    indptr[1:] = torch.tensor(lens).cumsum(0)
    return indptr.to(dev), idx


def bench_kernels(copy_gbs: float) -> None:
    from sgl_kernel import attention as K
    from sgl_kernel import reference as R

    bf = torch.bfloat16
    heads, kvh, d = (4, 2, 16) if SMOKE else (32, 8, 128)
    decode_cases = ((2, 40), (1, 100)) if SMOKE else ((32, 8192), (2, 131072))
    for bsz, kv_len in decode_cases:  # many requests; few long contexts (split-K)
        slots = bsz * kv_len + 1
        k = torch.randn(slots, kvh, d, dtype=bf, device=DEV)
        v = torch.randn(slots, kvh, d, dtype=bf, device=DEV)
        indptr, idx = _lists([kv_len] * bsz, slots)
        q = torch.randn(bsz, heads, d, dtype=bf, device=DEV)
        ms = cuda_ms(lambda: K.decode_attention(q, k, v, indptr, idx, d**-0.5, max_kv_len=kv_len))
        ref_ms = cuda_ms(lambda: R.decode_attention_reference(q, k, v, indptr, idx, d**-0.5), 2.0, 5)
        err = _err(K.decode_attention(q, k, v, indptr, idx, d**-0.5),  # vs float32 math
                   R.decode_attention_reference(q.float(), k.float(), v.float(), indptr, idx,
                                                d**-0.5))
        moved = bsz * kv_len * (kvh * 2 * d * 2 + 8)  # K + V bf16 + one int64 index per token
        gbs = moved / ms / 1e6
        row(f"decode B={bsz} ctx={kv_len} H={heads}/{kvh} D={d} bf16", f"err {err:.1e}", ms, ref_ms,
            gbs, gbs / copy_gbs)
        del k, v
    # Prefill chunk after a cached prefix, and tree verification (16-node trees).
    extend_cases = ((("extend (prefill)", 2, 20, 10, False), ("tree verify", 2, 6, 30, True))
                    if SMOKE else (("extend (prefill)", 4, 2048, 2048, False),
                                   ("tree verify 16 nodes", 32, 16, 4096, True)))
    for name, bsz, ext, prefix, tree in extend_cases:
        kv_lens = [ext + prefix] * bsz
        slots = sum(kv_lens) + 1
        k = torch.randn(slots, kvh, d, dtype=bf, device=DEV)
        v = torch.randn(slots, kvh, d, dtype=bf, device=DEV)
        kv_indptr, idx = _lists(kv_lens, slots)
        qo = torch.arange(bsz + 1, device=DEV) * ext
        q = torch.randn(bsz * ext, heads, d, dtype=bf, device=DEV)
        masks, packed = None, (None, None, None)
        if tree:
            par = torch.cat([torch.tensor([-1] + [int(torch.randint(0, i, (1,))) for i in range(1, ext)])
                             for _ in range(bsz)]).to(DEV)
            packed = K.build_tree_mask(par, qo, ext)
            masks = [torch.cat([torch.ones(ext, prefix, dtype=torch.bool), m.bool().cpu().view(ext, ext)], 1)
                     for m in packed[0].view(bsz, -1)]
        fn = lambda: K.extend_attention(q, k, v, qo, kv_indptr, idx, d**-0.5, *packed, max_extend_len=ext)
        ref = lambda: R.extend_attention_reference(q, k, v, qo, kv_indptr, idx, d**-0.5, masks)
        ms, ref_ms = cuda_ms(fn), cuda_ms(ref, 2.0, 3)
        err = _err(fn(), R.extend_attention_reference(q.float(), k.float(), v.float(), qo,
                                                      kv_indptr, idx, d**-0.5, masks))
        flops = 4 * heads * d * sum(e * (p + (e + 1) / 2 if not tree else p + e)
                                    for e, p in zip([ext] * bsz, [prefix] * bsz))
        moved = slots * kvh * 2 * d * 2
        row(f"{name} B={bsz} ext={ext} prefix={prefix} bf16", f"err {err:.1e}", ms, ref_ms,
            moved / ms / 1e6, moved / ms / 1e6 / copy_gbs, note=f"{flops / ms / 1e9:.0f} TFLOP/s")
        del k, v
    # Speculative helpers.
    nt = 4 if SMOKE else 64
    trees = [[-1] + [int(torch.randint(0, i, (1,))) for i in range(1, nt)] for _ in range(nt)]
    par = torch.tensor(sum(trees, []), device=DEV)
    tip = torch.arange(nt + 1, device=DEV) * nt
    ms = cuda_ms(lambda: K.build_tree_mask(par, tip, nt))
    ref_ms = cuda_ms(lambda: R.tree_mask_reference(trees), 2.0, 3)
    ok = torch.equal(K.build_tree_mask(par, tip, nt)[0].bool().cpu(),
                     torch.cat([m.reshape(-1) for m in R.tree_mask_reference(trees)]))
    row(f"tree mask {nt} trees x {nt} nodes", "exact" if ok else "MISMATCH", ms, ref_ms)
    layers, n, slots = (2, 4, 100) if SMOKE else (32, 256, 100_000)
    bufs = [torch.randn(slots, kvh, d, dtype=bf, device=DEV) for _ in range(2 * layers)]
    src = torch.randperm(slots - 1, device=DEV)[:n] + 1
    dst = torch.randperm(slots - 1, device=DEV)[:n] + 1
    ms = cuda_ms(lambda: K.move_kv_slots(bufs, src, dst))

    def per_layer():  # what KVPool.move_kv does: one gather + scatter per buffer
        for b in bufs:
            b[dst] = b[src]

    moved = 2 * n * len(bufs) * kvh * d * 2
    row(f"move_kv_slots {n} rows x {len(bufs)} buffers", "ok", ms, cuda_ms(per_layer),
        moved / ms / 1e6, moved / ms / 1e6 / copy_gbs, note="ref = per-buffer torch gather/scatter")
    del bufs
    nr, width = (3, 300) if SMOKE else (64, 32768)
    table = torch.randint(1, 1 << 20, (4 * nr, width), device=DEV)
    rows = torch.randperm(4 * nr, device=DEV)[:nr]
    lens = torch.randint(1, width, (nr,))
    indptr = torch.zeros(nr + 1, dtype=torch.int64)
    indptr[1:] = lens.cumsum(0)
    total, indptr, lens_d = int(indptr[-1]), indptr.to(DEV), lens.to(DEV)
    ms = cuda_ms(lambda: K.gather_kv_indices(table, rows, indptr, total, width))
    ref = lambda: table[rows][torch.arange(width, device=DEV)[None] < lens_d[:, None]]
    ok = torch.equal(K.gather_kv_indices(table, rows, indptr, total, width), ref())
    row(f"gather_kv_indices {nr} rows", "exact" if ok else "MISMATCH", ms, cuda_ms(ref),
        note="ref = masked torch gather")


def bench_moe() -> None:
    try:
        from sgl_kernel.moe import fused_moe, fused_moe_reference
    except ImportError as e:
        row("fused_moe", "SKIP", note=str(e))
        return
    t, h, inter, e, k = (4, 32, 16, 4, 2) if SMOKE else (64, 1024, 512, 16, 2)
    bf = torch.bfloat16
    x = torch.randn(t, h, dtype=bf, device=DEV)
    w13 = (torch.randn(e, 2 * inter, h, device=DEV) / h**0.5).to(bf)
    w2 = (torch.randn(e, h, inter, device=DEV) / inter**0.5).to(bf)
    ids = torch.stack([torch.randperm(e, device=DEV)[:k] for _ in range(t)])
    w = torch.rand(t, k, device=DEV).softmax(-1)
    ms = cuda_ms(lambda: fused_moe(x, w13, w2, w, ids))
    ref_ms = cuda_ms(lambda: fused_moe_reference(x, w13, w2, w, ids), 2.0, 3)
    err = _err(fused_moe(x, w13, w2, w, ids),
               fused_moe_reference(x.float(), w13.float(), w2.float(), w, ids))
    row(f"fused_moe T={t} H={h} I={inter} E={e} k={k} bf16", f"err {err:.1e}", ms, ref_ms)


def _err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-6))


# ------------------------------------------------------------------ engine
def build_random_llama(path: str) -> str:
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816,
                      num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4,
                      max_position_embeddings=8192, rms_norm_eps=1e-5, bos_token_id=1,
                      eos_token_id=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():  # a wide init so greedy continuations vary (no near-ties)
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p) if "norm" in name else 0.08 * torch.randn_like(p))
    model.save_pretrained(path, safe_serialization=True)
    return path


def _sched(model_dir: str, device: str, dtype: str, **kw):
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.server_args import ServerArgs

    if kw.get("speculative_algorithm"):
        kw.setdefault("speculative_disable_cost_model", True)
        kw.setdefault("speculative_fallback_threshold", 0.0)
    return Scheduler(ServerArgs(model_path=model_dir, device=device, dtype=dtype,
                                max_total_tokens=65536, **kw))


SPECS = {"plain": {}, "NGRAM": {"speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": 8},
         "STANDALONE": {"speculative_algorithm": "STANDALONE", "speculative_num_steps": 3,
                        "speculative_eagle_topk": 2, "speculative_num_draft_tokens": 8}}


def _prompts(batch: int, seed: int, base_len: int = 64, repeat: int = 4) -> List[List[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 32000, (base_len,), generator=g).tolist() * repeat for _ in range(batch)]


def engine_checks() -> None:
    from sglang.test.scheduler_driver import greedy, run

    try:  # the CPU reference below must not spend minutes JIT-building the CPU linear kernel
        import sglang.srt.layers.linear as linear

        linear._checked, linear._kernel = True, None
    except (ImportError, AttributeError):
        pass
    model_dir = build_random_llama(tempfile.mkdtemp(prefix="gpu_check_llama_"))
    ps, n = _prompts(4, 1), 32
    ref = run(_sched(model_dir, "cpu", "float32", attention_backend="torch_native"), ps, [greedy(n)] * 4)
    for name, spec in SPECS.items():
        kw = dict(spec)
        if name == "STANDALONE":
            kw["speculative_draft_model_path"] = model_dir
        try:
            got = run(_sched(model_dir, "cuda", "float32", attention_backend="triton", **kw),
                      ps, [greedy(n)] * 4)
            same = sum(got[r][0] == ref[r][0] for r in ref)
            row(f"engine greedy fp32 {name} (GPU triton) == CPU torch_native",
                "PASS" if same == len(ref) else "FAIL", note=f"{same}/{len(ref)} requests equal")
        except Exception as e:  # report and go on: the table must still print
            traceback.print_exc()
            row(f"engine greedy fp32 {name} (GPU triton)", "ERROR", note=f"{type(e).__name__}: {e}"[:120])
    batch, n = 8, 128
    for name, spec in SPECS.items():
        kw = dict(spec)
        if name == "STANDALONE":
            kw["speculative_draft_model_path"] = model_dir  # draft = target: acceptance bound
        try:
            sched = _sched(model_dir, "cuda", "bfloat16", attention_backend="triton", **kw)
            run(sched, _prompts(batch, 2), [greedy(8)] * batch)  # warm-up: Triton compiles
            t0 = time.perf_counter()
            run(sched, _prompts(batch, 3), [greedy(1)] * batch)
            t_prefill = time.perf_counter() - t0
            t0 = time.perf_counter()
            out = run(sched, _prompts(batch, 4), [greedy(n)] * batch)
            t_full = time.perf_counter() - t0
            tps = batch * (n - 1) / max(t_full - t_prefill, 1e-9)
            acc = [u.extra_meta.get("spec_accept_length") for _, u in out.values()
                   if getattr(u, "extra_meta", None)]
            acc = [a for a in acc if a is not None]
            note = f"batch {batch}, prompt {len(_prompts(1, 3)[0])}, {n} new" + (
                f", accept len {sum(acc) / len(acc):.2f}" if acc else "")
            row(f"engine decode tok/s bf16 {name}", f"{tps:.0f} tok/s", note=note)
        except Exception as e:
            traceback.print_exc()
            row(f"engine decode tok/s bf16 {name}", "ERROR", note=f"{type(e).__name__}: {e}"[:120])


def print_table(pytest_summary: str) -> None:
    if pytest_summary and os.path.exists(pytest_summary):
        for line in open(pytest_summary).read().splitlines():
            name, _, result = line.partition("\t")
            ROWS.insert(0, dict(check=f"pytest {name}", result=result, ms=None, ref_ms=None,
                                gbs=None, bw=None, note=""))
    f = lambda x, spec: "" if x is None else format(x, spec)
    print("\n| check | result | triton ms | torch ref ms | speedup | GB/s | % copy BW | note |")
    print("|---|---|---|---|---|---|---|---|")
    for r in ROWS:
        speed = r["ref_ms"] / r["ms"] if r["ms"] and r["ref_ms"] else None
        print(f"| {r['check']} | {r['result']} | {f(r['ms'], '.3f')} | {f(r['ref_ms'], '.3f')} | "
              f"{f(speed, '.1f')} | {f(r['gbs'], '.0f')} | {f(r['bw'] and 100 * r['bw'], '.0f')} | "
              f"{r['note']} |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--pytest-summary", default=None)
    ap.add_argument("--skip", default="", help="comma list of: kernels,moe,engine,prefetch")
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="tiny shapes on the CPU under TRITON_INTERPRET=1: checks this script "
                         "before GPU minutes are spent (kernels, moe and prefetch stages)")
    args = ap.parse_args()
    global DEV, SMOKE
    if args.cpu_smoke:
        DEV, SMOKE = "cpu", True
        os.environ["TRITON_INTERPRET"] = "1"  # before the first `import triton`
        args.skip += ",engine"
    name = "CPU (smoke)" if SMOKE else torch.cuda.get_device_name()
    print(f"[gpu_check] {name} torch {torch.__version__}", flush=True)
    skip = set(args.skip.split(","))

    def on_timeout(signum, frame):  # `timeout` stops us: still print what was measured
        row("gpu_check.py", "TIMEOUT", note="stopped by the time limit; rows so far above")
        print_table(args.pytest_summary)
        os._exit(124)

    signal.signal(signal.SIGTERM, on_timeout)
    stages = [("kernels", lambda: bench_kernels(copy_bandwidth())), ("moe", bench_moe),
              ("engine", engine_checks),
              ("prefetch", lambda: moe_prefetch_checks(row, _sched, _prompts, SMOKE))]
    for name, stage in stages:
        if name in skip:
            continue
        try:
            stage()
        except Exception as e:
            traceback.print_exc()
            row(f"stage {name}", "ERROR", note=f"{type(e).__name__}: {e}"[:120])
    print_table(args.pytest_summary)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"device": name, "rows": ROWS}, fh, indent=1)


if __name__ == "__main__":
    main()
