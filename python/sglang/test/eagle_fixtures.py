"""Random EAGLE and EAGLE-3 heads in upstream's checkpoint formats, for a given target, and a
tiny DeepSeek-V3 target carrying an MTP layer (NEXTN) (tests)."""

from __future__ import annotations

import json
import os
from typing import Optional, Sequence

import torch


def build_tiny_eagle3_head(target_dir: str, out_dir: str, seed: int = 0,
                           layer_ids: Sequence[int] = (0, 1, 2),
                           draft_ids: Optional[Sequence[int]] = None,
                           scale: float = 0.15) -> str:
    """Save a random float32 head for the target in `target_dir` (its width, vocabulary
    and rope) into `out_dir`; `draft_ids`: the target ids of a reduced draft vocabulary
    (sorted; None: the whole vocabulary, d2t zeros). Returns `out_dir`."""
    from safetensors.torch import save_file

    with open(os.path.join(target_dir, "config.json")) as f:
        t = json.load(f)
    h, heads = t["hidden_size"], t["num_attention_heads"]
    kv = t.get("num_key_value_heads") or heads
    hd = t.get("head_dim") or h // heads
    inter, vocab = t["intermediate_size"], t["vocab_size"]
    used = torch.tensor(sorted(draft_ids) if draft_ids is not None else range(vocab))
    g = torch.Generator().manual_seed(seed)

    def r(*shape):
        return (torch.randn(*shape, generator=g) * scale).contiguous()

    w = {"fc.weight": r(h, 3 * h),
         "midlayer.input_layernorm.weight": 1 + 0.1 * r(h),
         "midlayer.hidden_norm.weight": 1 + 0.1 * r(h),
         "midlayer.self_attn.q_proj.weight": r(heads * hd, 2 * h),
         "midlayer.self_attn.k_proj.weight": r(kv * hd, 2 * h),
         "midlayer.self_attn.v_proj.weight": r(kv * hd, 2 * h),
         "midlayer.self_attn.o_proj.weight": r(h, heads * hd),
         "midlayer.post_attention_layernorm.weight": 1 + 0.1 * r(h),
         "midlayer.mlp.gate_proj.weight": r(inter, h),
         "midlayer.mlp.up_proj.weight": r(inter, h),
         "midlayer.mlp.down_proj.weight": r(h, inter),
         "norm.weight": 1 + 0.1 * r(h),
         "lm_head.weight": r(len(used), h),
         "d2t": used - torch.arange(len(used)),
         "t2d": torch.zeros(vocab, dtype=torch.bool).index_fill_(0, used, True)}
    config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
              "hidden_size": h, "target_hidden_size": h, "num_attention_heads": heads,
              "num_key_value_heads": kv, "head_dim": hd, "intermediate_size": inter,
              "num_hidden_layers": 1, "vocab_size": vocab, "draft_vocab_size": len(used),
              "rms_norm_eps": t.get("rms_norm_eps", 1e-6),
              "rope_theta": t.get("rope_theta", 10000.0),
              "max_position_embeddings": t.get("max_position_embeddings", 4096),
              "tie_word_embeddings": False, "torch_dtype": "float32",
              "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(layer_ids)}}
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    save_file(w, os.path.join(out_dir, "model.safetensors"))
    return out_dir


def build_tiny_eagle_head(target_dir: str, out_dir: str, seed: int = 0, layers: int = 1,
                          scale: float = 0.15) -> str:
    """Save a random float32 EAGLE (EAGLE-1/2) head for the target in `target_dir` into
    `out_dir`, with upstream's names (fc with a bias, layer 0 without input_layernorm, an
    embed_tokens copy the loader skips). Returns `out_dir`."""
    from safetensors.torch import save_file

    with open(os.path.join(target_dir, "config.json")) as f:
        t = json.load(f)
    h, heads = t["hidden_size"], t["num_attention_heads"]
    kv = t.get("num_key_value_heads") or heads
    hd = t.get("head_dim") or h // heads
    inter, vocab = t["intermediate_size"], t["vocab_size"]
    g = torch.Generator().manual_seed(seed)

    def r(*shape):
        return (torch.randn(*shape, generator=g) * scale).contiguous()

    w = {"fc.weight": r(h, 2 * h), "fc.bias": r(h), "embed_tokens.weight": r(vocab, h)}
    for i in range(layers):
        p = f"layers.{i}."
        w.update({p + "self_attn.q_proj.weight": r(heads * hd, h),
                  p + "self_attn.k_proj.weight": r(kv * hd, h),
                  p + "self_attn.v_proj.weight": r(kv * hd, h),
                  p + "self_attn.o_proj.weight": r(h, heads * hd),
                  p + "post_attention_layernorm.weight": 1 + 0.1 * r(h),
                  p + "mlp.gate_proj.weight": r(inter, h),
                  p + "mlp.up_proj.weight": r(inter, h),
                  p + "mlp.down_proj.weight": r(h, inter)})
        if i:
            w[p + "input_layernorm.weight"] = 1 + 0.1 * r(h)
    config = {"architectures": ["LlamaForCausalLMEagle"], "model_type": "llama",
              "hidden_size": h, "num_attention_heads": heads, "num_key_value_heads": kv,
              "head_dim": hd, "intermediate_size": inter, "num_hidden_layers": layers,
              "vocab_size": vocab, "rms_norm_eps": t.get("rms_norm_eps", 1e-6),
              "rope_theta": t.get("rope_theta", 10000.0),
              "max_position_embeddings": t.get("max_position_embeddings", 4096),
              "tie_word_embeddings": False, "torch_dtype": "float32"}
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    save_file(w, os.path.join(out_dir, "model.safetensors"))
    return out_dir


def build_tiny_deepseek_mtp(out_dir: str, seed: int = 0, layers: int = 3,
                            scale: float = 0.15) -> str:
    """Save a tiny random DeepSeek-V3 target whose checkpoint carries an MTP layer as real
    V3 checkpoints do: `model.layers.{layers}.*` = a decoder layer (MoE) plus enorm, hnorm,
    eh_proj, shared_head.norm and copies of the embedding (embed_tokens) and lm_head
    (shared_head.head); config `num_hidden_layers` = layers, `num_nextn_predict_layers` 1.
    The MTP decoder layer is layer `layers` of a (layers + 1)-layer model, so transformers
    reads it with `num_hidden_layers=layers + 1`. Returns `out_dir`."""
    from safetensors.torch import load_file, save_file

    from sglang.test.moe_fixtures import build_tiny_moe

    build_tiny_moe("deepseek_v3", out_dir, seed=seed, num_hidden_layers=layers + 1,
                   num_nextn_predict_layers=1)
    path = os.path.join(out_dir, "model.safetensors")
    w = dict(load_file(path))
    h = w["model.embed_tokens.weight"].shape[1]
    g = torch.Generator().manual_seed(seed + 1)
    p = f"model.layers.{layers}."
    w.update({p + "enorm.weight": 1 + 0.1 * torch.randn(h, generator=g),
              p + "hnorm.weight": 1 + 0.1 * torch.randn(h, generator=g),
              p + "eh_proj.weight": torch.randn(h, 2 * h, generator=g) * scale,
              p + "shared_head.norm.weight": 1 + 0.1 * torch.randn(h, generator=g),
              p + "embed_tokens.weight": w["model.embed_tokens.weight"].clone(),
              p + "shared_head.head.weight": w["lm_head.weight"].clone()})
    save_file({k: v.contiguous() for k, v in w.items()}, path, metadata={"format": "pt"})
    with open(os.path.join(out_dir, "config.json")) as f:
        config = json.load(f)
    config["num_hidden_layers"] = layers
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    return out_dir
