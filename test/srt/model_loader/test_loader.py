"""Model loading: the GGUF header parser, GGUF -> config, dtype choice, weight-name mapping
and the tokenizer cache."""

from __future__ import annotations

import os
import types

import numpy as np
import pytest
import torch

from sglang.srt.layers.rotary_embedding import rope_parameters_from_config
from sglang.srt.model_loader.gguf_loader import GGUFFile, hf_name
from sglang.srt.model_loader.loader import load_config, load_model, load_tokenizer, resolve_dtype
from sglang.srt.models.registry import get_model_class


def test_gguf_parser_agrees_with_gguf_reader(smollm2_path: str) -> None:
    from gguf import GGUFReader

    reader, ours = GGUFReader(smollm2_path), GGUFFile(smollm2_path)
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue  # header pseudo-fields
        value = field.contents()
        expected = pytest.approx(value) if isinstance(value, float) else value
        assert ours.metadata[key] == expected, key
    assert list(ours.tensors) == [t.name for t in reader.tensors]
    for t in reader.tensors:
        info = ours.tensors[t.name]
        assert info.shape == tuple(int(d) for d in reversed(t.shape)) and info.qtype == t.tensor_type
        assert info.offset == t.data_offset and info.nbytes == t.n_bytes
    for name in ("token_embd.weight", "blk.0.attn_q.weight", "blk.3.ffn_norm.weight"):
        raw = np.asarray(ours.raw(name))
        assert np.array_equal(raw.reshape(-1).view(np.uint8),
                              np.asarray(reader.get_tensor(list(ours.tensors).index(name)).data)
                              .reshape(-1).view(np.uint8))


def test_gguf_config_agrees_with_transformers(smollm2_path: str) -> None:
    from transformers import AutoConfig

    ref = AutoConfig.from_pretrained(os.path.dirname(smollm2_path),
                                     gguf_file=os.path.basename(smollm2_path))
    ours = load_config(smollm2_path)
    assert ours.architectures == ["LlamaForCausalLM"]
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "max_position_embeddings",
                "tie_word_embeddings", "bos_token_id", "eos_token_id"):
        assert getattr(ours, key) == getattr(ref, key), key
    assert ours.rms_norm_eps == pytest.approx(ref.rms_norm_eps)
    assert rope_parameters_from_config(ours)["rope_theta"] == \
        rope_parameters_from_config(ref)["rope_theta"]


def test_gguf_names_map_to_hf() -> None:
    assert hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_name("blk.7.attn_output.weight") == "model.layers.7.self_attn.o_proj.weight"
    assert hf_name("blk.0.attn_q.bias") == "model.layers.0.self_attn.q_proj.bias"
    assert hf_name("blk.2.ffn_norm.weight") == "model.layers.2.post_attention_layernorm.weight"
    assert hf_name("rope_freqs.weight") is None


def test_dtype_resolution() -> None:
    cfg = types.SimpleNamespace(dtype="float16")
    assert resolve_dtype("auto", cfg, gguf=True) == torch.bfloat16
    assert resolve_dtype("auto", cfg, gguf=False) == torch.bfloat16  # fp16 -> bf16 on CPU
    assert resolve_dtype("auto", types.SimpleNamespace(dtype=torch.float32), gguf=False) == torch.float32
    assert resolve_dtype("auto", types.SimpleNamespace(), gguf=False) == torch.float32
    assert resolve_dtype("float", cfg, gguf=True) == torch.float32
    with pytest.raises(ValueError, match="bfloat16"):
        resolve_dtype("int8", cfg, gguf=False)


def test_old_style_rope_config() -> None:
    cfg = types.SimpleNamespace(rope_theta=5e5, rope_scaling={"type": "linear", "factor": 4.0})
    assert rope_parameters_from_config(cfg) == {
        "type": "linear", "factor": 4.0, "rope_theta": 5e5, "rope_type": "linear"}


def test_unknown_architecture_names_supported_ones() -> None:
    with pytest.raises(ValueError, match="LlamaForCausalLM.*Qwen2ForCausalLM"):
        get_model_class(["GPT2LMHeadModel"])


def test_sharded_checkpoint_loads_like_single_file(tiny_llama_dir: str, tmp_path) -> None:
    from transformers import AutoModelForCausalLM

    sharded = str(tmp_path / "sharded")
    AutoModelForCausalLM.from_pretrained(tiny_llama_dir).save_pretrained(
        sharded, max_shard_size="2MB")
    assert os.path.exists(os.path.join(sharded, "model.safetensors.index.json"))
    a, _ = load_model(tiny_llama_dir, dtype="float32")
    b, _ = load_model(sharded, dtype="float32")
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(pa, pb), name


def test_load_weights_rejects_missing_and_unknown(tiny_llama_dir: str) -> None:
    from sglang.srt.utils.checkpoint_files import iter_safetensors

    model, _ = load_model(tiny_llama_dir, dtype="float32")
    weights = dict(iter_safetensors(tiny_llama_dir))
    partial = {k: v for k, v in weights.items() if "layers.1.self_attn.k_proj" not in k}
    with pytest.raises(ValueError, match="layers.1.self_attn.qkv_proj"):
        model.load_weights(partial.items())
    with pytest.raises(KeyError, match="no place"):
        model.load_weights([*weights.items(), ("model.layers.0.mlp.extra.weight", torch.zeros(1))])


def test_bfloat16_load(tiny_qwen2_dir: str) -> None:
    model, _ = load_model(tiny_qwen2_dir, dtype="bfloat16")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied survives meta init


def test_gguf_tokenizer_is_cached(smollm2_path: str, tmp_path) -> None:
    first = load_tokenizer(smollm2_path, cache_dir=str(tmp_path))
    assert len(os.listdir(tmp_path)) == 1  # converted once, saved
    second = load_tokenizer(smollm2_path, cache_dir=str(tmp_path))
    text = "The capital of France is"
    assert first(text).input_ids == second(text).input_ids == [504, 3575, 282, 4649, 314]
    msgs = [{"role": "user", "content": "hi"}]
    assert second.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == \
        first.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert second.eos_token == "<|im_end|>"
