"""Qwen2: the Llama layout with a bias on q/k/v (none on o_proj).

Qwen2's optional sliding window (`use_sliding_window`) is not applied: RadixAttention is
told the window, but the torch_native backend attends over the full context, so outputs
match HF only while sequences stay within the window (all released Qwen2 checkpoints ship
with `use_sliding_window: false`).
"""

from __future__ import annotations

from typing import Optional, Tuple

from transformers import PretrainedConfig

from sglang.srt.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def attention_biases(config: PretrainedConfig) -> Tuple[bool, bool]:
        return True, False

    @staticmethod
    def sliding_window(config: PretrainedConfig) -> Optional[int]:
        return config.sliding_window if getattr(config, "use_sliding_window", False) else None


EntryClass = Qwen2ForCausalLM
