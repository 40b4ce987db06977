"""Architecture name (config.architectures) -> model class, imported on first use."""

from __future__ import annotations

import importlib
from typing import Dict, List

# architecture -> module under sglang.srt.models holding the class of the same name
_MODELS: Dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "MistralForCausalLM": "mistral",
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "DeepseekV2ForCausalLM": "deepseek_v2",
    "DeepseekV3ForCausalLM": "deepseek_v2",
    "LlamaForCausalLMEagle": "llama_eagle",  # draft heads, not models to serve
    "LlamaForCausalLMEagle3": "llama_eagle3",
    "DeepseekV3ForCausalLMNextN": "deepseek_nextn",  # DeepSeek-V3's MTP layer (NEXTN)
}


def supported_architectures() -> List[str]:
    return sorted(_MODELS)


def get_model_class(architectures: List[str]) -> type:
    """The class of the first supported name in `architectures`."""
    for arch in architectures or []:
        if arch in _MODELS:
            module = importlib.import_module(f"sglang.srt.models.{_MODELS[arch]}")
            return getattr(module, arch)
    raise ValueError(
        f"model architectures {list(architectures or [])} are not supported; "
        f"supported: {', '.join(supported_architectures())}"
    )
