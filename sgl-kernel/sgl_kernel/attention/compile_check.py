"""Compile the Triton kernels (attention, fused MoE) for a GPU target without a GPU (Triton's
bundled ptxas).

`python -m sgl_kernel.attention.compile_check [--all] [--arch 90]` compiles each kernel with
the exact launch configuration its launcher picks on a GPU, and fails when compilation
fails or a kernel needs more shared memory than the target has. This catches lowering
errors (types, shapes, tile sizes) on a CPU-only machine; the CPU tests catch the rest in
the interpreter. Must run in a process where TRITON_INTERPRET is not set.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Dict, List, Tuple

# Shared memory per block: Ampere A100 (sm_80) 163 KiB, Hopper (sm_90) 227 KiB.
_SHARED_LIMIT = {80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024}


def _signature(fn, consts: Dict, types: Dict[str, str]) -> Dict[str, str]:
    """Argument types: constexprs by name, pointers/scalars from `types` (default i32)."""
    return {n: ("constexpr" if n in consts else types.get(n, "i32")) for n in fn.arg_names}


def _cases(full: bool) -> List[Tuple[str, object, Dict, Dict, Dict]]:
    import torch
    import triton.language as tl

    from sgl_kernel.attention import decode, extend, kv_indices, spec_ops
    from sgl_kernel.attention.common import dot_dtype

    cuda = torch.device("cuda")
    tl_name = {torch.bfloat16: "bf16", torch.float32: "fp32", torch.float16: "fp16"}
    out = []
    # (group, head dim, v head dim, dtype): a tail block (80 = 64 + 16) by default; with
    # --all also 128, float32, and MLA (576 = 512 + 64 keys, 512 values).
    attn = [(4, 80, 80, torch.bfloat16)]
    if full:
        attn += [(4, 128, 128, torch.bfloat16), (8, 64, 64, torch.float32),
                 (16, 576, 512, torch.bfloat16), (16, 576, 512, torch.float32)]
    for group, d, dv, dtype in attn:
        t = tl_name[dtype]
        cfg = decode.decode_config(group, d, dv, dtype, on_cpu=False)
        opts = {k: cfg.pop(k) for k in ("num_warps", "num_stages")}
        for direct in (False, True) if full else (False,):
            consts = dict(cfg, DOT=dot_dtype(dtype, cuda), DIRECT=direct)
            types = {"q_ptr": f"*{t}", "k_ptr": f"*{t}", "v_ptr": f"*{t}", "o_ptr": f"*{t}",
                     "kv_indptr_ptr": "*i64", "kv_indices_ptr": "*i64", "mid_o_ptr": "*fp32",
                     "mid_lse_ptr": "*fp32", "sm_scale_log2": "fp32"}
            out.append((f"decode {t} group={group} d={d}/{dv} direct={direct}",
                        decode._decode_split_kernel, consts, types, opts))
        cfg = extend.extend_config(d, dv, dtype, on_cpu=False)
        opts = {k: cfg.pop(k) for k in ("num_warps", "num_stages")}
        types = {"q_ptr": f"*{t}", "k_ptr": f"*{t}", "v_ptr": f"*{t}", "o_ptr": f"*{t}",
                 "qo_indptr_ptr": "*i64", "kv_indptr_ptr": "*i64", "kv_indices_ptr": "*i64",
                 "mask_ptr": "*u8", "mask_indptr_ptr": "*i64", "mask_width_ptr": "*i64",
                 "sm_scale_log2": "fp32"}
        out.append((f"extend {t} d={d}/{dv}", extend._extend_kernel,
                    dict(cfg, DOT=dot_dtype(dtype, cuda)), types, opts))
    out.append(("decode merge", decode._decode_merge_kernel, dict(BLOCK_S=16, BLOCK_DV=128),
                {"mid_o_ptr": "*fp32", "mid_lse_ptr": "*fp32", "o_ptr": "*bf16"}, {}))
    out.append(("tree mask", spec_ops._tree_mask_kernel, dict(BLOCK_R=16, BLOCK_C=64),
                {"parents_ptr": "*i64", "tree_indptr_ptr": "*i64", "mask_indptr_ptr": "*i64",
                 "mask_ptr": "*u8"}, {}))
    out.append(("move rows", spec_ops._move_rows_kernel, dict(ELEM=tl.int16, BLOCK=1024),
                {"ptr_table": "*i64", "row_stride_ptr": "*i64", "row_elems_ptr": "*i64",
                 "src_ptr": "*i64", "dst_ptr": "*i64"}, {}))
    out.append(("gather kv indices", kv_indices._gather_rows_kernel, dict(BLOCK=1024),
                {"table_ptr": "*i64", "rows_ptr": "*i64", "kv_indptr_ptr": "*i64",
                 "out_ptr": "*i64"}, {}))
    out += _moe_cases(full)
    return out


def _moe_cases(full: bool) -> List[Tuple[str, object, Dict, Dict, Dict]]:
    """The fused-MoE grouped GEMM at the tiles `fused_moe_pairs` launches: gate/up (output in
    the activations' dtype) and down (fp32 rows times the routing weight)."""
    from sgl_kernel.moe import fused_moe_triton as moe

    tiles = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32)
    out = []
    for t in ("bf16", "fp32") if full else ("bf16",):
        for mul, c in ((False, t), (True, "fp32")):
            # without weights the launcher passes the output buffer as w_ptr
            types = {"a_ptr": f"*{t}", "b_ptr": f"*{t}", "c_ptr": f"*{c}",
                     "w_ptr": "*fp32" if mul else f"*{c}",
                     "sorted_ids_ptr": "*i32", "block_experts_ptr": "*i32"}
            out.append((f"fused moe {t} {'down' if mul else 'gate_up'}", moe._moe_gemm_kernel,
                        dict(tiles, MUL_WEIGHT=mul), types, {}))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--all", action="store_true", help="also float32 and MLA shapes (minutes)")
    ap.add_argument("--arch", type=int, default=90)
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("compile_check: unset TRITON_INTERPRET (the interpreter compiles nothing)")
        return 2
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", args.arch, 32)
    limit = _SHARED_LIMIT.get(args.arch, 99 * 1024)
    failures = 0
    for name, kernel, consts, types, opts in _cases(args.all):
        t0 = time.perf_counter()
        try:
            src = ASTSource(fn=kernel, signature=_signature(kernel, consts, types), constexprs=consts)
            shared = triton.compile(src, target=target, options=opts).metadata.shared
            status = "ok" if shared <= limit else f"TOO MUCH SHARED MEMORY (> {limit})"
        except Exception as e:  # report every case, fail at the end
            shared, status = -1, f"FAILED: {type(e).__name__}: {str(e).splitlines()[-1][:200]}"
        failures += status != "ok"
        print(f"{name:45s} shared={shared:7d} B  {time.perf_counter() - t0:5.1f}s  {status}",
              flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
