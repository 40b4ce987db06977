"""The expert-store half of scripts/gpu_check.py (issue 7 on the device): a random Mixtral
with half its experts resident, speculative decoding with prefetch off and on, greedy
equality against all-resident decoding. gpu_check.py runs it with its own table helpers."""

from __future__ import annotations

import tempfile
import time
import traceback
from typing import Callable

import torch


def build_random_mixtral(path: str, smoke: bool) -> str:
    """A random Mixtral (8 experts, top-2) for the expert store and prefetch on the device."""
    from transformers import AutoModelForCausalLM, MixtralConfig

    big = not smoke
    cfg = MixtralConfig(vocab_size=32000, hidden_size=1024 if big else 64,
                        intermediate_size=2048 if big else 96, num_hidden_layers=8 if big else 2,
                        num_attention_heads=16 if big else 4, num_key_value_heads=4 if big else 2,
                        num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=8192,
                        rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
                        tie_word_embeddings=False)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p) if "norm" in name else 0.08 * torch.randn_like(p))
    model.save_pretrained(path, safe_serialization=True)
    return path


def moe_prefetch_checks(row: Callable, sched_of: Callable, prompts: Callable,
                        smoke: bool) -> None:
    """Issue 7 on the device: the expert store with half the experts resident (pinned host
    memory -> device copies on the store's own stream), speculative decoding (the model
    drafting for itself, chain of 3) with prefetch off and with the `draft` predictor.
    Greedy output must equal all-resident decoding; reported: decode tok/s, mean verify
    pass, in-time recall and the store's stall time. `row`, `sched_of` and `prompts` are
    gpu_check.py's table row, scheduler and prompt builders; `smoke`: its --cpu-smoke."""
    from sglang.test.scheduler_driver import greedy, run

    dev = "cpu" if smoke else "cuda"
    model_dir = build_random_mixtral(tempfile.mkdtemp(prefix="gpu_check_mixtral_"), smoke)
    spec = dict(speculative_algorithm="STANDALONE", speculative_draft_model_path=model_dir,
                speculative_num_steps=3, speculative_eagle_topk=1,
                speculative_num_draft_tokens=4)
    backend = "torch_native" if smoke else "triton"
    ps, n = prompts(2, 5, base_len=16 if smoke else 64), 8 if smoke else 48
    try:
        ref = run(sched_of(model_dir, dev, "float32", attention_backend=backend, **spec), ps,
                  [greedy(n)] * len(ps))
    except Exception as e:
        traceback.print_exc()
        row("moe prefetch: all-resident reference", "ERROR", note=f"{type(e).__name__}: {e}"[:120])
        return
    # draft+prune: budget-aware trees price every tree on the device's tensors;
    # draft/p0.4: the calibrated cut scores each verify's device-side routing on the host
    for arm in ("none", "draft", "draft+prune", "draft/p0.4"):
        pred = arm.split("+")[0].split("/")[0]
        min_prob = float(arm.split("/p")[1]) if "/p" in arm else 0.0
        try:
            sched = sched_of(model_dir, dev, "float32", attention_backend=backend,
                           moe_expert_cache_slots=4, moe_prefetch_predictor=pred,
                           moe_prefetch_disable_gate=True,
                           moe_prefetch_prune_tree=arm.endswith("prune"),
                           moe_prefetch_min_prob=min_prob, **spec)
            verify = []
            inner = sched.runner.forward

            def timed(fb, inner=inner, verify=verify):
                t0 = time.perf_counter()
                out = inner(fb)
                if fb.forward_mode.name == "TARGET_VERIFY":
                    verify.append(time.perf_counter() - t0)
                return out

            sched.runner.forward = timed
            t0 = time.perf_counter()
            got = run(sched, ps, [greedy(n)] * len(ps))
            secs = time.perf_counter() - t0
            same = sum(got[r][0] == ref[r][0] for r in ref)
            state = sched.moe_state()
            store = state["moe_expert_store"]["total"]
            figs = state.get("moe_prefetch", {}).get("total", {})
            sched.check_all_free()
            sched.runner.model.expert_store.close()
            note = (f"{same}/{len(ref)} equal, {len(ps) * n / secs:.0f} tok/s, verify "
                    f"{1e3 * sum(verify) / max(1, len(verify)):.1f} ms, stall "
                    f"{store['stall_seconds']:.2f} s, hit {store['hit_rate']:.2f}"
                    + (f", recall {figs['recall']:.2f}" if "recall" in figs else ""))
            row(f"moe prefetch {arm}, 4 of 8 experts resident, fp32 spec chain 3",
                "PASS" if same == len(ref) else "FAIL", note=note)
        except Exception as e:
            traceback.print_exc()
            row(f"moe prefetch {arm}", "ERROR", note=f"{type(e).__name__}: {e}"[:120])
