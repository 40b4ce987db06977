"""The EAGLE-3 head in upstream's checkpoint format against a reference written here from the
format's definition (docs/eagle_formats.md), and the target's capture of three layers'
hidden states against transformers' `output_hidden_states`."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from sglang.srt.model_executor.forward_batch import ForwardMode
from sglang.srt.models.llama_eagle3 import aux_hidden_layers, load_eagle3_head
from sglang.test.harness import TinyRunner

H, TARGET_H, HEADS, KV, HD, INTER, VOCAB, DRAFT_VOCAB = 64, 48, 4, 2, 16, 96, 300, 40


def _checkpoint(folder, seed: int = 0, names=lambda n: n) -> dict:
    """A random head saved with upstream's names (as SpecForge writes them)."""
    g = torch.Generator().manual_seed(seed)

    def r(*shape, scale=0.15):
        return (torch.randn(*shape, generator=g) * scale).contiguous()

    used = torch.sort(torch.randperm(VOCAB, generator=g)[:DRAFT_VOCAB]).values
    w = {"fc.weight": r(H, 3 * TARGET_H),
         "midlayer.input_layernorm.weight": 1 + r(H, scale=0.1),
         "midlayer.hidden_norm.weight": 1 + r(H, scale=0.1),
         "midlayer.self_attn.q_proj.weight": r(HEADS * HD, 2 * H),
         "midlayer.self_attn.k_proj.weight": r(KV * HD, 2 * H),
         "midlayer.self_attn.v_proj.weight": r(KV * HD, 2 * H),
         "midlayer.self_attn.o_proj.weight": r(H, HEADS * HD),
         "midlayer.post_attention_layernorm.weight": 1 + r(H, scale=0.1),
         "midlayer.mlp.gate_proj.weight": r(INTER, H),
         "midlayer.mlp.up_proj.weight": r(INTER, H),
         "midlayer.mlp.down_proj.weight": r(H, INTER),
         "norm.weight": 1 + r(H, scale=0.1),
         "lm_head.weight": r(DRAFT_VOCAB, H),
         "d2t": used - torch.arange(DRAFT_VOCAB),
         "t2d": torch.zeros(VOCAB, dtype=torch.bool).index_fill_(0, used, True)}
    config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
              "hidden_size": H, "target_hidden_size": TARGET_H, "num_attention_heads": HEADS,
              "num_key_value_heads": KV, "head_dim": HD, "intermediate_size": INTER,
              "num_hidden_layers": 1, "vocab_size": VOCAB, "draft_vocab_size": DRAFT_VOCAB,
              "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 2048,
              "tie_word_embeddings": False}
    (folder / "config.json").write_text(json.dumps(config))
    save_file({names(k): v for k, v in w.items()}, str(folder / "model.safetensors"))
    return w


def _rms(x, weight, eps=1e-6):
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x, positions, theta=10000.0):
    """Rotate-half RoPE (Llama's) on [T, heads, HD]."""
    inv = 1.0 / theta ** (torch.arange(0, HD, 2, dtype=torch.float32) / HD)
    ang = positions.float()[:, None] * inv[None]
    cos, sin = torch.cat([ang.cos()] * 2, -1)[:, None], torch.cat([ang.sin()] * 2, -1)[:, None]
    half = torch.cat([-x[..., HD // 2:], x[..., : HD // 2]], -1)
    return x * cos + half * sin


def _reference(w, embed, ids, feats, positions):
    """Logits and outputs of every row, causal over the rows. feats[i]: the row's h (already
    projected: fc(target features) or the head's previous output)."""
    e = embed[ids]
    x = torch.cat([_rms(e, w["midlayer.input_layernorm.weight"]),
                   _rms(feats, w["midlayer.hidden_norm.weight"])], -1)
    t = len(ids)
    q = _rope((x @ w["midlayer.self_attn.q_proj.weight"].T).view(t, HEADS, HD), positions)
    k = _rope((x @ w["midlayer.self_attn.k_proj.weight"].T).view(t, KV, HD), positions)
    v = (x @ w["midlayer.self_attn.v_proj.weight"].T).view(t, KV, HD)
    k, v = k.repeat_interleave(HEADS // KV, 1), v.repeat_interleave(HEADS // KV, 1)
    att = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                         is_causal=True)
    s = att.transpose(0, 1).reshape(t, HEADS * HD) @ w["midlayer.self_attn.o_proj.weight"].T + feats
    n = _rms(s, w["midlayer.post_attention_layernorm.weight"])
    out = (F.silu(n @ w["midlayer.mlp.gate_proj.weight"].T) * (n @ w["midlayer.mlp.up_proj.weight"].T)
           ) @ w["midlayer.mlp.down_proj.weight"].T + s
    return _rms(out, w["norm.weight"]) @ w["lm_head.weight"].T, out


def test_head_matches_the_format_over_a_prefill_and_a_fed_back_step(tmp_path):
    w = _checkpoint(tmp_path)
    head = load_eagle3_head(str(tmp_path))
    embed = torch.nn.Embedding(VOCAB, H)
    torch.nn.init.normal_(embed.weight, std=0.3)
    head.set_embed(embed)
    runner = TinyRunner(None, model=head, config=head.config)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (7,), generator=g)
    aux = torch.randn(7, 3 * TARGET_H, generator=g)
    runner.rows, runner.lens = [runner.req_pool.alloc()], [0]
    logits, out = runner._forward(ForwardMode.EXTEND, [ids.tolist()], True, hidden=aux)
    feats = aux @ w["fc.weight"].T
    ref_logits, ref_out = _reference(w, embed.weight.detach(), ids, feats, torch.arange(7))
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
    # the next draft step: a new token, the head's own last output fed back (no fc), the
    # first 7 rows' K/V from the cache
    nxt = torch.tensor([int(logits[-1].argmax())])
    step_logits, _ = runner._forward(ForwardMode.DECODE, [nxt.tolist()], False,
                                     hidden=out[-1:], from_target=False)
    all_logits, _ = _reference(w, embed.weight.detach(), torch.cat([ids, nxt]),
                               torch.cat([feats, ref_out[-1:]]), torch.arange(8))
    torch.testing.assert_close(step_logits, all_logits[-1:], rtol=1e-5, atol=1e-5)
    # draft ids map to target ids through d2t
    used = torch.nonzero(w["t2d"]).flatten()
    assert torch.equal(head.to_target_ids(torch.arange(DRAFT_VOCAB)), used)


def test_checkpoints_under_model_prefix_load_and_foreign_names_are_refused(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    _checkpoint(tmp_path / "a", names=lambda n: "model." + n)
    load_eagle3_head(str(tmp_path / "a"))
    _checkpoint(tmp_path / "b", names=lambda n: n.replace("midlayer.", "layers.0."))
    with pytest.raises(KeyError, match="midlayer"):
        load_eagle3_head(str(tmp_path / "b"))


def test_default_capture_layers_and_the_targets_captured_states(tiny_llama_dir):
    from types import SimpleNamespace

    from transformers import AutoModelForCausalLM

    assert aux_hidden_layers(SimpleNamespace(), 32) == [1, 15, 28]  # upstream's default
    assert aux_hidden_layers(SimpleNamespace(eagle_config={
        "eagle_aux_hidden_state_layer_ids": [9, 2, 5]}), 12) == [2, 5, 9]
    with pytest.raises(ValueError, match="three target layers"):
        aux_hidden_layers(SimpleNamespace(eagle_config={
            "eagle_aux_hidden_state_layer_ids": [1, 2, 40]}), 12)
    runner = TinyRunner(tiny_llama_dir)
    prompt = [1, 504, 3458, 282, 4649, 314]
    runner.rows, runner.lens = [runner.req_pool.alloc()], [0]
    runner._forward(ForwardMode.EXTEND, [prompt], False, capture_layers=[0, 1, 2])
    got = runner.last_batch.captured_hidden
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    with torch.no_grad():
        states = hf(torch.tensor([prompt]), output_hidden_states=True).hidden_states
    # hidden_states[i + 1] is layer i's output (the last one after the final norm in HF)
    want = torch.cat([states[1][0], states[2][0]], -1)
    torch.testing.assert_close(got[:, : 2 * 64], want, rtol=1e-5, atol=1e-5)
    assert got.shape == (len(prompt), 3 * 64)
