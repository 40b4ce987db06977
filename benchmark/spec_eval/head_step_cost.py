"""A draft step of an EAGLE-3 head against a decode step of its target, at a few contexts.

Both run through the engine's own model code, KV pools and CPU attention backend
(sglang.test.harness.TinyRunner), batch 1, bf16: the target decodes one token after a
prefill of `ctx` tokens; the head decodes one row after `ctx` rows of its own KV (what a
draft step of a tree level costs, feeding back its own output). Medians of `--repeats`
steps after two warm-up steps. Python work of the speculative step (tree building, the
verify's bookkeeping) is not in either figure.

    python benchmark/spec_eval/head_step_cost.py --target GGUF_OR_DIR --head DIR
        [--contexts 1024,4096] [--repeats 20] [--name head_step_cost]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
from common import machine_info, save  # noqa: E402


def _median_step(step, repeats: int) -> float:
    times = []
    for i in range(repeats + 2):
        t0 = time.perf_counter()
        step()
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    import torch

    from sglang.srt.model_executor.forward_batch import ForwardMode
    from sglang.srt.models.llama_eagle3 import load_eagle3_head
    from sglang.test.harness import TinyRunner

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", required=True)
    ap.add_argument("--head", required=True)
    ap.add_argument("--contexts", default="1024,4096")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--name", default="head_step_cost")
    a = ap.parse_args()
    torch.manual_seed(0)
    rows = []
    for ctx in [int(c) for c in a.contexts.split(",")]:
        slots = ctx + a.repeats + 64
        target = TinyRunner(os.path.expanduser(a.target), dtype="bfloat16", max_reqs=1,
                            max_context=slots, kv_slots=slots)
        ids = torch.randint(100, 20000, (ctx,)).tolist()
        with torch.inference_mode():
            target.prefill([ids])
            t_step = _median_step(lambda: target.decode([ids[0]]), a.repeats)
            head = load_eagle3_head(os.path.expanduser(a.head), dtype=torch.bfloat16)
            head.set_embed(target.model.model.embed_tokens)
            runner = TinyRunner(None, model=head, config=head.config, max_reqs=1,
                                max_context=slots, kv_slots=slots)
            h = head.config.hidden_size
            runner.rows, runner.lens = [runner.req_pool.alloc()], [0]
            runner._forward(ForwardMode.EXTEND, [ids], False,
                            hidden=torch.randn(ctx, h, dtype=torch.bfloat16), from_target=False)
            feat = torch.randn(1, h, dtype=torch.bfloat16)
            d_step = _median_step(lambda: runner._forward(ForwardMode.DECODE, [[ids[0]]], False,
                                                          hidden=feat, from_target=False),
                                  a.repeats)
            target.release()
            runner.release()
        row = {"context": ctx, "target_step_s": round(t_step, 5), "head_step_s": round(d_step, 5),
               "head_over_target": round(d_step / t_step, 3)}
        print(row, flush=True)
        rows.append(row)
    path = save(a.name, {"target": a.target, "head": a.head, "dtype": "bfloat16",
                         "repeats": a.repeats, "rows": rows, "machine": machine_info(),
                         "command": " ".join(sys.argv)})
    print("wrote", path)


if __name__ == "__main__":
    main()
