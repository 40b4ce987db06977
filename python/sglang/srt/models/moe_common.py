"""Shared machinery of the MoE decoder LMs (Mixtral, Qwen2/3-MoE, DeepSeek-V2/V3).

`MoECausalLM` is a Llama-style decoder whose layers each hold an attention module and either
a `SparseMoeBlock` or a dense `LlamaMLP`; subclasses say which (`make_attention`,
`make_mlp`) and under which checkpoint name (`mlp_name`). `load_weights` maps Hugging Face
names generically: q/k/v and gate/up rows into the fused projections, per-expert tensors
into `MoEExperts`, everything else by name. With `config.moe_expert_cache_slots` set (by the
loader, from `--moe-expert-cache-slots`) experts are not loaded here: `attach_expert_store`
serves them from the checkpoint file through an `ExpertStore`.
Invariant: after `load_weights` every parameter and every expert has been found.
"""

from __future__ import annotations

import os
import re
from typing import TYPE_CHECKING, Dict, Iterable, Optional, Set, Tuple

import torch
from torch import nn
from transformers import PretrainedConfig

from sglang.srt.layers.layernorm import RMSNorm
from sglang.srt.layers.moe.experts import EXPERT_LEAVES, MoEExperts, SparseMoeBlock
from sglang.srt.layers.moe.recorder import get_expert_recorder
from sglang.srt.layers.moe.route_calibration import DEFAULT_MIN_PROB
from sglang.srt.layers.rotary_embedding import RotaryEmbedding, rope_parameters_from_config
from sglang.srt.models.llama import LlamaAttention, LlamaMLP, _copy, head_dim_of

if TYPE_CHECKING:
    from sglang.srt.layers.moe.prefetch import ExpertPrefetcher
    from sglang.srt.layers.moe.expert_store import ExpertStore
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
        self.prefetcher: Optional["ExpertPrefetcher"] = None  # --moe-prefetch-predictor

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
        if self.prefetcher is not None:  # layer-ahead predictions start loading now
            self.prefetcher.on_moe_input(self.layer_id, hidden, residual)
        return getattr(self, self.mlp_name)(hidden), residual


class MoEModel(nn.Module):
    def __init__(self, config: PretrainedConfig, layers: Iterable[nn.Module], rotary: nn.Module) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = rotary

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                fb: "ForwardBatch") -> Tuple[torch.Tensor, torch.Tensor]:
        hidden = self.embed_tokens(input_ids)
        cos_sin = self.rotary_emb.cos_sin(positions, hidden.dtype)
        residual = None
        for layer in self.layers:
            hidden, residual = layer(hidden, residual, cos_sin, fb)
        return hidden, residual


class MoECausalLM(nn.Module):
    mlp_name = "mlp"  # the decoder layer's attribute (and checkpoint) name for its FFN

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.config = config
        self.num_slots: Optional[int] = getattr(config, "moe_expert_cache_slots", None)
        layers = [MoEDecoderLayer(config, self.make_attention(config, i), self.make_mlp(config, i),
                                  self.mlp_name) for i in range(config.num_hidden_layers)]
        for i, layer in enumerate(layers):
            layer.layer_id = i
        self.model = MoEModel(config, layers, self.make_rotary(config))
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.expert_store: Optional["ExpertStore"] = None
        self.expert_prefetcher: Optional["ExpertPrefetcher"] = None

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

    @staticmethod
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

    def _pending(self, params: Dict[str, nn.Parameter]) -> Set[Tuple[str, int]]:
        experts = {f"{n}.{p}" for n, m in self.named_modules() if isinstance(m, MoEExperts)
                   for p in ("w13", "w2")}
        shards: Dict[str, int] = {}
        for n, m in self.named_modules():
            if isinstance(m, LlamaAttention):
                shards.update({f"{n}.qkv_proj.{leaf}": 3 for leaf in ("weight", "bias")})
            elif isinstance(m, LlamaMLP):
                shards.update({f"{n}.gate_up_proj.{leaf}": 2 for leaf in ("weight", "bias")})
        return {(n, s) for n in params if n not in experts and n != "lm_head.weight"
                for s in range(shards.get(n, 1))}

    def load_weights(self, weights: Iterable[Tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors in; raise on unknown or missing names."""
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight  # re-tie after to_empty
        params: Dict[str, nn.Parameter] = dict(self.named_parameters(remove_duplicate=False))
        pending = self._pending(params)
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
            m = _EXPERT_RE.match(name)
            if m and m.group(3) in EXPERT_LEAVES:
                experts = self.get_submodule(m.group(1))
                if not isinstance(experts, MoEExperts):
                    raise KeyError(f"checkpoint tensor {name!r} has no place in {type(self).__name__}")
                experts.load_expert(int(m.group(2)), m.group(3), name, tensor)
                continue
            if name in params:
                _copy(params[name], tensor, name)
                pending.discard((name, 0))
                continue
            path, child, leaf = (name.rsplit(".", 2) + ["", ""])[:3]
            try:
                parent = self.get_submodule(path)
            except AttributeError:
                parent = None
            fused = self._fused_rows(parent, child) if parent is not None else None
            target = f"{path}.{fused[0]}.{leaf}" if fused else None
            if target not in params:
                raise KeyError(f"checkpoint tensor {name!r} has no place in {type(self).__name__}")
            _copy(params[target].data[fused[1] : fused[2]], tensor, name)
            pending.discard((target, fused[3]))
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

    # ---- expert store ----------------------------------------------------------------------

    def attach_expert_store(self, model_path: str, drop_page_cache: bool = False) -> Optional["ExpertStore"]:
        """Serve the experts of store-backed layers from `model_path`'s safetensors through an
        ExpertStore (after `load_weights`). With slots >= experts every expert is loaded now."""
        from sglang.srt.layers.moe.expert_source import PinnedHostExpertSource, SafetensorsExpertSource
        from sglang.srt.layers.moe.expert_store import ExpertStore

        blocks = {i: b for i, b in self.moe_blocks().items() if b.experts.store_backed}
        if not blocks:
            return None
        if not os.path.isdir(model_path):
            raise ValueError("--moe-expert-cache-slots needs an HF safetensors checkpoint folder "
                             f"(the experts' slow tier); got {model_path!r}")
        keys = {(i, e): tuple(names) for i, b in blocks.items()
                for e, names in b.experts.expert_keys.items()}
        source = SafetensorsExpertSource(model_path, keys, drop_page_cache)
        first = next(iter(blocks.values())).experts
        device = str(first.w13.device)
        if not device.startswith("cuda"):
            for b in blocks.values():
                b.experts.align_slots()
        if device.startswith("cuda"):
            source = PinnedHostExpertSource(source, {i: b.slot_shapes() for i, b in blocks.items()},
                                            {i: b.experts.num_experts for i, b in blocks.items()},
                                            first.w13.dtype)
        store = ExpertStore(source, {i: (b.experts.w13.detach(), b.experts.w2.detach())
                                     for i, b in blocks.items()},
                            {i: b.experts.num_experts for i, b in blocks.items()}, device)
        for b in blocks.values():
            b.experts.store = store
        if store.num_slots >= first.num_experts:
            for i, b in blocks.items():
                store.prefetch(i, range(b.experts.num_experts))
            store.wait_loads()
            store.reset_stats()
        self.expert_store = store
        self.expert_prefetcher = None
        predictor = getattr(self.config, "moe_prefetch_predictor", None) or "none"
        if predictor != "none":
            self.attach_prefetcher(predictor, getattr(self.config, "moe_prefetch_width", 0),
                                   getattr(self.config, "moe_prefetch_keep_width", 1),
                                   getattr(self.config, "moe_prefetch_min_prob",
                                           DEFAULT_MIN_PROB))
        return store

    def attach_prefetcher(self, name: str, width: int = 0, keep_width: int = 1,
                          min_prob: float = DEFAULT_MIN_PROB) -> "ExpertPrefetcher":
        """Hook predictor `name` into every decoder layer (see layers/moe/prefetch.py)."""
        from sglang.srt.layers.moe.prefetch import ExpertPrefetcher, RouterView, build_predictor

        assert self.expert_store is not None, "a prefetcher needs the expert store"
        blocks = {i: b for i, b in self.moe_blocks().items() if b.experts.store_backed}
        views = {i: RouterView(i, self.model.layers[i].post_attention_layernorm, b.gate,
                               b.gate.cfg.top_k) for i, b in blocks.items()}
        first = next(iter(blocks.values())).experts
        expert_bytes = (first.w13[0].numel() + first.w2[0].numel()) * first.w13.element_size()
        predictor = build_predictor(name, views, self.model.embed_tokens, width,
                                    self.expert_store.num_slots, keep_width, min_prob)
        pf = ExpertPrefetcher(self.expert_store, predictor, expert_bytes)
        for layer in self.model.layers:
            layer.prefetcher = pf
        for b in blocks.values():
            b.prefetcher = pf
        self.expert_prefetcher = pf
        return pf
