"""Mistral: the Llama layout (no biases, explicit head_dim allowed).

Mistral's sliding window (`config.sliding_window`, e.g. 4096 in v0.1) is not applied:
RadixAttention records it, but the attention backends attend over the full context, so
outputs match HF only for sequences no longer than the window. Later Mistral releases set
`sliding_window: null`, where there is no difference.
"""

from __future__ import annotations

from typing import Optional

from transformers import PretrainedConfig

from sglang.srt.models.llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    @staticmethod
    def sliding_window(config: PretrainedConfig) -> Optional[int]:
        return getattr(config, "sliding_window", None)


EntryClass = MistralForCausalLM
