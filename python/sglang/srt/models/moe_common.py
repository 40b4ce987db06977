"""Shared machinery of the MoE decoder LMs (Mixtral, Qwen2/3-MoE, DeepSeek-V2/V3).

`MoECausalLM` is a Llama-style decoder whose layers each hold an attention module and either
a `SparseMoeBlock` or a dense `LlamaMLP`; subclasses say which (`make_attention`,
`make_mlp`) and under which checkpoint name (`mlp_name`). `load_weights` maps Hugging Face
names generically: q/k/v and gate/up rows into the fused projections, per-expert tensors
into `MoEExperts`, everything else by name. With `expert_cache_slots` set (the loader passes
`--moe-expert-cache-slots`) experts are not loaded here: `expert_offload.attach` serves them
from the checkpoint file through an `ExpertStore`.
Invariant: after `load_weights` every parameter and every expert has been found.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Dict, Iterable, Optional, Set, Tuple

import torch
from torch import nn
from transformers import PretrainedConfig

from sglang.srt.layers.layernorm import RMSNorm
from sglang.srt.layers.moe.experts import EXPERT_LEAVES, MoEExperts, SparseMoeBlock
from sglang.srt.layers.moe.hooks import NO_HOOKS, ExpertSlots, MoEHooks
from sglang.srt.layers.moe.recorder import get_expert_recorder
from sglang.srt.layers.rotary_embedding import RotaryEmbedding, rope_parameters_from_config
from sglang.srt.layers.parallel_linear import ParallelLMHead, VocabParallelEmbedding
from sglang.srt.models.llama import LlamaAttention, LlamaMLP, head_dim_of, load_into

if TYPE_CHECKING:
    from sglang.srt.model_executor.forward_batch import ForwardBatch

_EXPERT_RE = re.compile(r"^(.+\.experts)\.(\d+)\.(\w+)\.weight$")
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")


class MoEDecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, self_attn: nn.Module, mlp: nn.Module,
                 mlp_name: str) -> None:
        super().__init__()
        self.self_attn = self_attn
        self.mlp_name = mlp_name
        setattr(self, mlp_name, mlp)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.layer_id = -1  # set by MoECausalLM
        self.hooks: MoEHooks = NO_HOOKS  # expert offload: layer-ahead prefetch listens

    def forward(self, hidden: torch.Tensor, residual: Optional[torch.Tensor], cos_sin,
                fb: "ForwardBatch") -> Tuple[torch.Tensor, torch.Tensor]:
        """(layer output, residual); their sum is the HF hidden state after the layer."""
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, cos_sin, fb)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        if fb.residual_hook is not None:  # an MoE drafting for a target's expert prefetch
            fb.residual_hook(self.layer_id, residual)
        self.hooks.on_moe_input(self.layer_id, hidden, residual)
        return getattr(self, self.mlp_name)(hidden), residual


class MoEModel(nn.Module):
    def __init__(self, config: PretrainedConfig, layers: Iterable[nn.Module], rotary: nn.Module) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = rotary

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                fb: "ForwardBatch") -> Tuple[torch.Tensor, torch.Tensor]:
        hidden = self.embed_tokens(input_ids)
        cos_sin = self.rotary_emb.cos_sin(positions, hidden.dtype)
        residual = None
        capture = fb.capture_layers  # an EAGLE-3 head reads three layers' outputs
        taken: Dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.layers):
            hidden, residual = layer(hidden, residual, cos_sin, fb)
            if capture and i in capture:
                taken[i] = hidden + residual
        if capture:
            fb.captured_hidden = torch.cat([taken[i] for i in capture], dim=-1)
        return hidden, residual


class MoECausalLM(nn.Module):
    mlp_name = "mlp"  # the decoder layer's attribute (and checkpoint) name for its FFN
    # attention heads, dense FFNs, experts (sliced or whole with EP) and vocabulary split
    supports_tensor_parallel = True

    def __init__(self, config: PretrainedConfig, expert_cache_slots: Optional[int] = None) -> None:
        super().__init__()
        self.config = config
        # experts per layer in the fast tier (None: all resident, no store)
        self.num_slots = expert_cache_slots
        layers = [MoEDecoderLayer(config, self.make_attention(config, i), self.make_mlp(config, i),
                                  self.mlp_name) for i in range(config.num_hidden_layers)]
        for i, layer in enumerate(layers):
            layer.layer_id = i
        self.model = MoEModel(config, layers, self.make_rotary(config))
        self.lm_head = ParallelLMHead(config.hidden_size, config.vocab_size)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.expert_store: Optional[ExpertSlots] = None  # set by expert_offload.attach

    # ---- what subclasses define ------------------------------------------------------------

    def make_attention(self, config: PretrainedConfig, layer_id: int) -> nn.Module:
        raise NotImplementedError

    def make_mlp(self, config: PretrainedConfig, layer_id: int) -> nn.Module:
        raise NotImplementedError

    def make_rotary(self, config: PretrainedConfig) -> nn.Module:
        return RotaryEmbedding(head_dim_of(config), config.max_position_embeddings,
                               rope_parameters_from_config(config))

    # ---- forward ---------------------------------------------------------------------------

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                forward_batch: "ForwardBatch") -> torch.Tensor:
        """float32 logits [len(resolved_logits_indices), vocab] (as LlamaForCausalLM)."""
        get_expert_recorder().begin_step(input_ids, positions,
                                         getattr(self.config, "_name_or_path", "") or "")
        hidden, residual = self.model(input_ids, positions, forward_batch)
        rows = forward_batch.resolved_logits_indices()
        hidden = self.model.norm(hidden[rows] + residual[rows])
        return self.lm_head(hidden).float()

    def moe_blocks(self) -> Dict[int, SparseMoeBlock]:
        """layer id -> its SparseMoeBlock (dense layers are left out)."""
        out = {}
        for i, layer in enumerate(self.model.layers):
            mlp = getattr(layer, self.mlp_name)
            if isinstance(mlp, SparseMoeBlock):
                out[i] = mlp
        return out

    # ---- weights ---------------------------------------------------------------------------

    def load_weights(self, weights: Iterable[Tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors in; raise on unknown or missing names."""
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight  # re-tie after to_empty
        params: Dict[str, nn.Parameter] = dict(self.named_parameters(remove_duplicate=False))
        pending = pending_params(self, params) - {("lm_head.weight", 0)}
        saw_lm_head = False
        num_layers = self.config.num_hidden_layers
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            m = _LAYER_RE.match(name)
            if m and int(m.group(1)) >= num_layers:
                continue  # e.g. DeepSeek-V3's multi-token-prediction layer
            if name == "lm_head.weight":
                if self.tie_word_embeddings:
                    continue
                saw_lm_head = True
            pending.discard(place_tensor(self, params, name, tensor))
        if not saw_lm_head and not self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
            self.tie_word_embeddings = True
        for i, block in self.moe_blocks().items():
            missing = block.experts.missing_experts()
            if missing:
                raise ValueError(f"checkpoint lacks weights of layer {i} experts {missing[:5]}")
        if pending:
            missing = sorted({n for n, _ in pending})
            raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:5]}")


# ---- placing checkpoint tensors (MoE models and DeepSeek's MTP layer alike) -----------------

def _fused_rows(parent: nn.Module, child: str) -> Optional[Tuple[str, int, int, int]]:
    """(fused child, first row, end row, shard) for a q/k/v or gate/up checkpoint piece."""
    if isinstance(parent, LlamaAttention) and child in ("q_proj", "k_proj", "v_proj"):
        sizes = [parent.q_size, parent.kv_size, parent.kv_size]
        shard, fused = ("q_proj", "k_proj", "v_proj").index(child), "qkv_proj"
    elif isinstance(parent, LlamaMLP) and child in ("gate_proj", "up_proj"):
        inter = parent.down_proj.in_features
        sizes = [inter, inter]
        shard, fused = ("gate_proj", "up_proj").index(child), "gate_up_proj"
    else:
        return None
    lo = sum(sizes[:shard])
    return fused, lo, lo + sizes[shard], shard


def pending_params(root: nn.Module, params: Dict[str, nn.Parameter]) -> Set[Tuple[str, int]]:
    """(parameter, shard) pairs a checkpoint must fill: fused projections count one per
    piece; experts are checked by their own MoEExperts."""
    experts = {f"{n}.{p}" for n, m in root.named_modules() if isinstance(m, MoEExperts)
               for p in ("w13", "w2")}
    shards: Dict[str, int] = {}
    for n, m in root.named_modules():
        if isinstance(m, LlamaAttention):
            shards.update({f"{n}.qkv_proj.{leaf}": 3 for leaf in ("weight", "bias")})
        elif isinstance(m, LlamaMLP):
            shards.update({f"{n}.gate_up_proj.{leaf}": 2 for leaf in ("weight", "bias")})
    return {(n, s) for n in params if n not in experts for s in range(shards.get(n, 1))}


def place_tensor(root: nn.Module, params: Dict[str, nn.Parameter], name: str,
                 tensor: torch.Tensor) -> Tuple[str, int]:
    """Copy one HF-named tensor into `root` (an expert, a parameter by name, or a piece
    of a fused projection); returns the (parameter, shard) filled; KeyError if none."""
    m = _EXPERT_RE.match(name)
    if m and m.group(3) in EXPERT_LEAVES:
        experts = root.get_submodule(m.group(1))
        if not isinstance(experts, MoEExperts):
            raise KeyError(f"checkpoint tensor {name!r} has no place in {type(root).__name__}")
        experts.load_expert(int(m.group(2)), m.group(3), name, tensor)
        return ("", 0)
    if name in params:
        owner, leaf = name.rsplit(".", 1)
        load_into(root.get_submodule(owner), leaf, params[name], tensor, 0, name)
        return (name, 0)
    path, child, leaf = (name.rsplit(".", 2) + ["", ""])[:3]
    try:
        parent = root.get_submodule(path)
    except AttributeError:
        parent = None
    fused = _fused_rows(parent, child) if parent is not None else None
    target = f"{path}.{fused[0]}.{leaf}" if fused else None
    if target not in params:
        raise KeyError(f"checkpoint tensor {name!r} has no place in {type(root).__name__}")
    load_into(root.get_submodule(f"{path}.{fused[0]}"), leaf, params[target], tensor,
              fused[3], name)
    return (target, fused[3])
