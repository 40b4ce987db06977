"""The head's training forward: training-time test (EAGLE-3) unrolled over draft steps.

Rows as at serving time (speculative/drafters/eagle3.py): row i reads token i + 1 beside
the target's features at token i, at position i, and predicts token i + 2. Step k of the
unroll plays the draft's k-th level for a chain rooted at every row at once: row i reads
token i + 1 + k beside the head's own step k-1 output of row i, at position i + k, and
attends to the step-0 rows up to i (the context) and to its own rows of steps 1..k (its
ancestors in the chain). Its label is the target's distribution at token i + 1 + k over
the draft vocabulary; step k's loss weighs 0.8^k (upstream's decay).

Written with the head's own parameters and plain torch ops (autograd), so the checkpoint
it trains is the one the engine serves; test_eagle3_trainer.py checks that step 0 equals
the engine's forward of the same head.
"""

from __future__ import annotations

import dataclasses
from typing import List

import torch
import torch.nn.functional as F

from sglang.srt.layers.rotary_embedding import apply_rotary
from sglang.srt.models.llama_eagle3 import LlamaForCausalLMEagle3

DECAY = 0.8


@dataclasses.dataclass
class TTTResult:
    loss: torch.Tensor  # weighted over steps
    step_losses: List[float]
    step_accuracy: List[float]  # the head's argmax equals the target's, per step


def _rms(x: torch.Tensor, norm) -> torch.Tensor:
    return norm.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon))


def _linear(x: torch.Tensor, layer) -> torch.Tensor:
    return F.linear(x, layer.weight, getattr(layer, "bias", None))


def unroll(head: LlamaForCausalLMEagle3, embed: torch.Tensor, ids: torch.Tensor,
           aux: torch.Tensor, target_p: torch.Tensor, steps: int) -> TTTResult:
    """ids [T] one sequence; aux [T, 3H] the target's features at each token; target_p
    [T, Vd] the target's next-token distribution at each token over the draft vocabulary.
    `embed`: the target's embedding matrix (frozen)."""
    layer, attn = head.midlayer, head.midlayer.self_attn
    t = ids.shape[0]
    rows = t - 1
    heads, kv_heads, hd = attn.num_heads, attn.num_kv_heads, attn.head_dim
    q_size, kv_size = heads * hd, kv_heads * hd
    group = heads // kv_heads
    scale = hd ** -0.5
    dev = aux.device
    causal = torch.ones(rows, rows, dtype=torch.bool, device=dev).tril()
    hidden = _linear(aux[:rows], head.fc)  # step 0 reads the target's features
    keys: List[torch.Tensor] = []  # [heads, rows, hd] per step (GQA repeated)
    values: List[torch.Tensor] = []
    losses, accs = [], []
    total = torch.zeros((), device=dev)
    for k in range(steps):
        valid = rows - k  # rows whose token i + 1 + k and label exist
        if valid <= 0:
            break
        tok = torch.zeros(rows, dtype=torch.int64, device=dev)
        tok[:valid] = ids[1 + k: 1 + k + valid]
        x = torch.cat([_rms(embed[tok], layer.input_layernorm), _rms(hidden, layer.hidden_norm)], -1)
        q, kk, v = _linear(x, attn.qkv_proj).split([q_size, kv_size, kv_size], -1)
        pos = torch.arange(rows, device=dev) + k
        cos_sin = head.rotary_emb.cos_sin(pos, q.dtype)
        q = apply_rotary(q, cos_sin, heads, hd).view(rows, heads, hd).transpose(0, 1)
        kk = apply_rotary(kk, cos_sin, kv_heads, hd).view(rows, kv_heads, hd).transpose(0, 1)
        v = v.reshape(rows, kv_heads, hd).transpose(0, 1)
        keys.append(kk.repeat_interleave(group, 0))
        values.append(v.repeat_interleave(group, 0))
        # the context: step-0 rows j <= i; the chain: this row's own rows of steps 1..k
        ctx = (q @ keys[0].transpose(1, 2)) * scale
        ctx = ctx.masked_fill(~causal, float("-inf"))
        chain = [(q * keys[m]).sum(-1, keepdim=True) * scale for m in range(1, k + 1)]
        weights = torch.softmax(torch.cat([ctx] + chain, -1), -1)
        out = weights[..., :rows] @ values[0]
        for m in range(1, k + 1):
            out = out + weights[..., rows + m - 1: rows + m] * values[m]
        out = out.transpose(0, 1).reshape(rows, q_size)
        residual = _linear(out, attn.o_proj) + hidden
        normed = _rms(residual, layer.post_attention_layernorm)
        gate, up = _linear(normed, layer.mlp.gate_up_proj).chunk(2, -1)
        hidden = _linear(F.silu(gate) * up, layer.mlp.down_proj) + residual
        logits = _linear(_rms(hidden[:valid], head.norm), head.lm_head).float()
        label = target_p[1 + k: 1 + k + valid]
        loss = -(label * torch.log_softmax(logits, -1)).sum(-1).mean()
        total = total + DECAY ** k * loss
        losses.append(float(loss.detach()))
        accs.append(float((logits.argmax(-1) == label.argmax(-1)).float().mean()))
    return TTTResult(total, losses, accs)
