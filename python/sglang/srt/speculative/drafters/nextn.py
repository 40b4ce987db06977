"""NEXTN drafter: DeepSeek-V3's multi-token-prediction layer (models/deepseek_nextn.py),
read from the target's own checkpoint, drafts as an EAGLE head does.

What a row reads is EAGLE's: the next token beside the target's final hidden state (its
last layer's output after its final norm), so this is the EAGLE drafter with another head:
the MTP layer is built from the target's folder (`--speculative-draft-model-path` defaults
to `--model-path`, as upstream's) with one layer of KV, shares the target's embedding and
lm_head, and feeds back its post-norm output for deeper draft levels.
"""

from __future__ import annotations

from typing import Optional

from sglang.srt.models.deepseek_nextn import DeepseekV3ForCausalLMNextN
from sglang.srt.speculative.drafters.eagle import EagleDrafter
from sglang.srt.utils.checkpoint_files import folder_architectures

# the targets whose checkpoints carry an MTP layer this fork reads
MTP_TARGETS = ("DeepseekV3ForCausalLM", "DeepseekV3ForCausalLMNextN")


def is_mtp_checkpoint(path: Optional[str]) -> bool:
    return any(a in MTP_TARGETS for a in folder_architectures(path))


class NextNDrafter(EagleDrafter):
    """The target's MTP layer as the draft model."""

    name = "nextn"
    algorithm, kind, head_class = "NEXTN", "NEXTN", DeepseekV3ForCausalLMNextN
    draft_architecture = "DeepseekV3ForCausalLMNextN"

    def _input_width(self) -> int:
        return self.head.model.eh_proj.weight.shape[1]  # [enorm(embedding), hnorm(hidden)]

    @property
    def num_params(self) -> int:
        """What one draft step computes with (the cost model's prior): the layer's attention
        and shared parts, its routed experts at top_k of n_routed_experts, and the target's
        lm_head."""
        experts, rest = 0, 0
        for name, p in self.head.named_parameters():
            if ".experts." in name:
                experts += p.numel()
            else:
                rest += p.numel()
        cfg = self.head.config
        active = experts * cfg.num_experts_per_tok // max(cfg.n_routed_experts, 1)
        head = self.head.lm_head
        return rest + active + (head.weight.numel() if head is not None else 0)


def build(cfg, server_args, max_running: int, context_len: int, max_total_tokens: int,
          chunk_size: int) -> NextNDrafter:
    """NEXTN: the MTP layer of the DeepSeek-V3 checkpoint at --speculative-draft-model-path
    (the target's own folder unless given)."""
    path = cfg.draft_model_path or server_args.model_path
    if not is_mtp_checkpoint(path):
        raise ValueError(
            f"--speculative-algorithm NEXTN drafts with DeepSeek-V3's multi-token-prediction "
            f"layer: {path!r} has architectures {folder_architectures(path) or 'unknown'}, not "
            f"one of {', '.join(MTP_TARGETS)} (for other targets use EAGLE/EAGLE3 with a head, "
            "or NGRAM)")
    return NextNDrafter(server_args, max_running, context_len, max_total_tokens, cfg.num_steps,
                        cfg.topk, chunk_size)
