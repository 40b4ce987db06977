"""Train an EAGLE-3 head: corpus -> draft vocabulary -> the target's features -> TTT.

The output folder is the head in upstream's format (config.json + model.safetensors with
fc, midlayer.* in the unfused q/k/v and gate/up names, norm, lm_head, d2t, t2d), which
`--speculative-algorithm EAGLE3 --speculative-draft-model-path DIR` serves, plus
`features/` (the dump) and `trainer_state.pt` (resume: a rerun with a larger --max-steps
goes on from the last checkpoint).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import random
import time
from types import SimpleNamespace
from typing import Dict, List, Optional

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from transformers import LlamaConfig

from sglang.eagle_train.corpus import draft_vocabulary, maps, token_sequences
from sglang.eagle_train.features import done_shards, dump_features, iter_shard
from sglang.eagle_train.ttt import unroll
from sglang.srt.model_loader.loader import load_tokenizer
from sglang.srt.models.llama_eagle3 import LlamaForCausalLMEagle3, aux_hidden_layers
from sglang.test.harness import TinyRunner

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class TrainConfig:
    target_model_path: str
    corpus: str
    output_dir: str
    max_steps: int = 1000
    seq_len: int = 256
    max_sequences: int = 0  # 0: the whole corpus
    draft_vocab_size: int = 32000
    ttt_steps: int = 3
    lr: float = 3e-4
    warmup_steps: int = 20
    save_every: int = 200
    aux_layers: Optional[List[int]] = None  # None: upstream's default for the target
    seed: int = 0
    progress: bool = True
    device: str = "auto"  # "auto": the GPU where torch sees one, else the CPU


def resolve_device(name: str) -> str:
    """"auto" -> "cuda" where torch sees a GPU, else "cpu"; others as given (checked)."""
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {name}: torch sees no CUDA device here (install the CUDA "
                         "build of torch, or pass --device cpu)")
    return name


def head_config(target, layers: List[int], draft_vocab: int) -> Dict:
    """An upstream EAGLE-3 config for `target` (its width, heads, rope)."""
    heads = target.num_attention_heads
    return {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
            "hidden_size": target.hidden_size, "target_hidden_size": target.hidden_size,
            "num_attention_heads": heads,
            "num_key_value_heads": getattr(target, "num_key_value_heads", None) or heads,
            "head_dim": getattr(target, "head_dim", None) or target.hidden_size // heads,
            "intermediate_size": target.intermediate_size, "num_hidden_layers": 1,
            "vocab_size": target.vocab_size, "draft_vocab_size": draft_vocab,
            "rms_norm_eps": target.rms_norm_eps,
            "rope_theta": getattr(target, "rope_theta", 10000.0),
            "rope_scaling": getattr(target, "rope_scaling", None),
            "max_position_embeddings": target.max_position_embeddings,
            "tie_word_embeddings": False, "torch_dtype": "bfloat16",
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": layers}}


def _init_head(head: LlamaForCausalLMEagle3, norm_w: torch.Tensor, lm_rows: torch.Tensor,
               d2t: torch.Tensor, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
        head.norm.weight.copy_(norm_w)  # start from the target's own head: faster on CPU
        head.lm_head.weight.copy_(lm_rows)
        head.d2t.copy_(d2t)


def upstream_tensors(head: LlamaForCausalLMEagle3, t2d: torch.Tensor) -> Dict[str, torch.Tensor]:
    """The head's tensors under upstream's names (q/k/v and gate/up unfused)."""
    out: Dict[str, torch.Tensor] = {}
    attn = head.midlayer.self_attn
    q, k, v = attn.qkv_proj.weight.detach().split(
        [attn.q_size, attn.kv_size, attn.kv_size], 0)
    gate, up = head.midlayer.mlp.gate_up_proj.weight.detach().chunk(2, 0)
    for name, p in head.named_parameters():
        if ".qkv_proj." in name or ".gate_up_proj." in name:
            continue
        out[name] = p.detach()
    out.update({"midlayer.self_attn.q_proj.weight": q, "midlayer.self_attn.k_proj.weight": k,
                "midlayer.self_attn.v_proj.weight": v, "midlayer.mlp.gate_proj.weight": gate,
                "midlayer.mlp.up_proj.weight": up, "d2t": head.d2t, "t2d": t2d})
    return {n: t.detach().cpu().contiguous().clone() for n, t in out.items()}


def save_head(folder: str, head: LlamaForCausalLMEagle3, config: Dict, t2d: torch.Tensor) -> None:
    os.makedirs(folder, exist_ok=True)
    tensors = upstream_tensors(head, t2d)
    tensors = {n: (t.bfloat16() if t.is_floating_point() else t) for n, t in tensors.items()}
    tmp = os.path.join(folder, "model.safetensors.tmp")
    save_file(tensors, tmp)
    os.replace(tmp, os.path.join(folder, "model.safetensors"))
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f, indent=1)


def train(cfg: TrainConfig) -> Dict:
    """Returns a summary: sequences, shards, seconds for data and training, last losses."""
    torch.manual_seed(cfg.seed)
    dev = resolve_device(cfg.device)
    t0 = time.perf_counter()
    tokenizer = load_tokenizer(cfg.target_model_path)
    sequences = token_sequences(tokenizer, cfg.corpus, cfg.seq_len, cfg.max_sequences)
    longest = max(len(s) for s in sequences)
    runner = TinyRunner(cfg.target_model_path, dtype="float32", max_reqs=1,
                        max_context=longest + 8, kv_slots=longest + 8, device=dev)
    target = runner.config
    layers = aux_hidden_layers(
        SimpleNamespace(eagle_config={"eagle_aux_hidden_state_layer_ids": cfg.aux_layers}),
        target.num_hidden_layers)
    draft_ids = draft_vocabulary(sequences, cfg.draft_vocab_size, target.vocab_size)
    d2t, t2d = maps(draft_ids, target.vocab_size)
    features = os.path.join(cfg.output_dir, "features")
    shards = dump_features(runner, cfg.target_model_path, sequences, layers, features,
                           progress=cfg.progress)
    data_seconds = time.perf_counter() - t0
    model = runner.model
    embed = model.model.embed_tokens.weight.detach().float()
    norm = model.model.norm
    norm_w, eps = norm.weight.detach().float(), norm.variance_epsilon
    lm_rows = model.lm_head.weight.detach().float()[draft_ids].contiguous()
    del runner

    config = head_config(target, layers, len(draft_ids))
    head = LlamaForCausalLMEagle3(LlamaConfig(**{k: v for k, v in config.items()
                                                 if k != "architectures"})).float()
    _init_head(head, norm_w, lm_rows, d2t, cfg.seed)
    head.to(dev)  # initialised on the CPU first: the same head from one seed on any device
    opt = torch.optim.AdamW(head.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
    state_path = os.path.join(cfg.output_dir, "trainer_state.pt")
    step = 0
    if os.path.exists(state_path):
        state = torch.load(state_path, weights_only=False, map_location=dev)
        head.load_state_dict(state["head"])
        opt.load_state_dict(state["optimizer"])
        step = state["step"]
    data = [s for k in range(shards) for s in iter_shard(features, k)]
    order = list(range(len(data)))
    rng = random.Random(cfg.seed)
    t1 = time.perf_counter()
    history: List[Dict] = []
    bar = _bar(cfg.max_steps, step, cfg.progress)
    head.train()
    while step < cfg.max_steps:
        if step % len(order) == 0:
            rng.shuffle(order)
        ids, aux, last = (t.to(dev) for t in data[order[step % len(order)]])
        aux, last = aux.float(), last.float()
        with torch.no_grad():
            x = last * torch.rsqrt(last.pow(2).mean(-1, keepdim=True) + eps) * norm_w
            target_p = torch.softmax(F.linear(x, lm_rows), -1)
        for group in opt.param_groups:
            group["lr"] = _lr(cfg, step)
        result = unroll(head, embed, ids, aux, target_p, cfg.ttt_steps)
        opt.zero_grad()
        result.loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 0.5)
        opt.step()
        step += 1
        history.append({"step": step, "loss": result.step_losses, "acc": result.step_accuracy})
        bar.set_postfix(loss=f"{result.step_losses[0]:.3f}", acc=f"{result.step_accuracy[0]:.2f}")
        bar.update(1)
        if step % cfg.save_every == 0 or step == cfg.max_steps:
            save_head(cfg.output_dir, head, config, t2d)
            torch.save({"head": head.state_dict(), "optimizer": opt.state_dict(), "step": step},
                       state_path + ".tmp")
            os.replace(state_path + ".tmp", state_path)
    bar.close()
    if not os.path.exists(os.path.join(cfg.output_dir, "model.safetensors")):
        save_head(cfg.output_dir, head, config, t2d)  # resumed at max_steps: still a head
    recent = history[-20:]
    summary = {"device": dev, "sequences": len(sequences), "shards": shards,
               "tokens": sum(len(s) for s in sequences), "draft_vocab_size": len(draft_ids),
               "aux_layers": layers, "steps": step, "data_seconds": round(data_seconds, 1),
               "train_seconds": round(time.perf_counter() - t1, 1),
               "recent_loss": _mean([h["loss"][0] for h in recent]),
               "recent_step0_accuracy": _mean([h["acc"][0] for h in recent])}
    with open(os.path.join(cfg.output_dir, "train_summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    return summary


def _lr(cfg: TrainConfig, step: int) -> float:
    """Linear warmup, then cosine down to a tenth."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    frac = (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps)
    return cfg.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * min(frac, 1.0))))


def _mean(xs: List[float]) -> Optional[float]:
    return round(sum(xs) / len(xs), 4) if xs else None


def _bar(total: int, initial: int, show: bool):
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, desc="EAGLE-3 training (steps)", disable=not show)


__all__ = ["TrainConfig", "train", "done_shards"]
