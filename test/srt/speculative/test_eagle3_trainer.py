"""The EAGLE-3 trainer (scripts/train_eagle3.py): its training forward is the engine's head
forward (step 0 and an unrolled step), its checkpoint is upstream's format and loads back
with the same drafts, a rerun resumes, and a head trained for seconds on a repetitive
corpus accepts far more than an untrained one."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors import safe_open

from sglang.eagle_train.trainer import TrainConfig, resolve_device, train
from sglang.eagle_train.ttt import unroll
from sglang.srt.model_executor.forward_batch import ForwardMode
from sglang.srt.models.llama_eagle3 import load_eagle3_head
from sglang.test.eagle_fixtures import build_tiny_eagle3_head
from sglang.test.harness import TinyRunner
from sglang.test.scheduler_driver import greedy, make_scheduler, run

UPSTREAM_TENSORS = {
    "fc.weight", "midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight",
    "midlayer.post_attention_layernorm.weight", "midlayer.self_attn.q_proj.weight",
    "midlayer.self_attn.k_proj.weight", "midlayer.self_attn.v_proj.weight",
    "midlayer.self_attn.o_proj.weight", "midlayer.mlp.gate_proj.weight",
    "midlayer.mlp.up_proj.weight", "midlayer.mlp.down_proj.weight", "norm.weight",
    "lm_head.weight", "d2t", "t2d"}


def _corpus(path, lines: int = 200) -> str:
    g = torch.Generator().manual_seed(0)
    words = ("the licensee shall not sublicense software without prior written consent of "
             "licensor agreement term party").split()
    sents = [" ".join(words[int(i)] for i in torch.randint(0, len(words), (12,), generator=g))
             + "." for _ in range(6)]
    text = "\n".join(sents[int(i)] for i in torch.randint(0, 6, (lines,), generator=g))
    path.write_text(text)
    return str(path)


def _engine_logits(head, embed, ids, aux, k_rows):
    """Step 0 over every row, then for each row i one draft step (token i + 2, the row's
    own output), as the engine drafts: per-row logits of both steps."""
    head.set_embed(embed)
    r = TinyRunner(None, model=head, config=head.config)
    r.rows, r.lens = [r.req_pool.alloc()], [0]
    rows = len(ids) - 1
    step0, out = r._forward(ForwardMode.EXTEND, [ids[1:].tolist()], True, hidden=aux[:rows])
    r.release()
    step1 = []
    for i in range(k_rows):
        r.rows, r.lens = [r.req_pool.alloc()], [0]
        _, o = r._forward(ForwardMode.EXTEND, [ids[1: i + 2].tolist()], True, hidden=aux[: i + 1])
        logit, _ = r._forward(ForwardMode.DECODE, [[int(ids[i + 2])]], False,
                              hidden=o[-1:], from_target=False)
        step1.append(logit[0])
        r.release()
    return step0, torch.stack(step1)


def test_the_training_forward_is_the_engines_forward(tiny_llama_dir, tmp_path):
    head = load_eagle3_head(build_tiny_eagle3_head(tiny_llama_dir, str(tmp_path / "h"),
                                                   draft_ids=range(0, 49152, 5)))
    embed = torch.nn.Embedding(49152, 64)
    torch.nn.init.normal_(embed.weight, std=0.5)
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 49152, (9,), generator=g)
    aux = torch.randn(9, 3 * 64, generator=g)
    target_p = torch.softmax(torch.randn(9, head.draft_vocab_size, generator=g) * 3, -1)
    with torch.no_grad():
        got = unroll(head, embed.weight, ids, aux, target_p, steps=2)
        step0, step1 = _engine_logits(head, embed, ids, aux, k_rows=7)

    def ce(logits, labels):
        return float(-(labels * torch.log_softmax(logits, -1)).sum(-1).mean())

    assert got.step_losses[0] == pytest.approx(ce(step0, target_p[1:9]), rel=1e-5)
    assert got.step_losses[1] == pytest.approx(ce(step1, target_p[2:9]), rel=1e-5)


def test_checkpoint_format_round_trip_and_resume(tiny_llama_dir, tmp_path):
    corpus = _corpus(tmp_path / "c.txt", lines=60)
    out = str(tmp_path / "head")
    cfg = TrainConfig(tiny_llama_dir, corpus, out, max_steps=3, seq_len=64,
                      draft_vocab_size=128, aux_layers=[0, 1, 2], progress=False)
    first = train(cfg)
    assert first["steps"] == 3
    assert first["device"] == ("cuda" if torch.cuda.is_available() else "cpu")  # "auto"
    with safe_open(os.path.join(out, "model.safetensors"), framework="pt") as f:
        assert set(f.keys()) == UPSTREAM_TENSORS
        d2t, t2d = f.get_tensor("d2t"), f.get_tensor("t2d")
    config = json.load(open(os.path.join(out, "config.json")))
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["draft_vocab_size"] == 128 and int(t2d.sum()) == 128
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]
    assert torch.equal(torch.arange(128) + d2t, torch.nonzero(t2d).flatten())
    # the saved head drafts as the trained one (rounded to the checkpoint's bfloat16)
    state = torch.load(os.path.join(out, "trainer_state.pt"), weights_only=False)
    loaded = load_eagle3_head(out, dtype=torch.bfloat16)
    mem = load_eagle3_head(out, dtype=torch.bfloat16)
    mem.load_state_dict({k: v.bfloat16() if v.is_floating_point() else v
                         for k, v in state["head"].items()})
    for a, b in zip(loaded.state_dict().values(), mem.state_dict().values()):
        assert torch.equal(a, b)
    shard = os.path.join(out, "features", "shard_00000.safetensors")
    stamp = os.path.getmtime(shard)
    again = train(TrainConfig(**{**cfg.__dict__, "max_steps": 5}))
    assert again["steps"] == 5  # went on from step 3
    assert os.path.getmtime(shard) == stamp  # the features were not dumped again


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: cuda is valid")
def test_asking_for_a_gpu_where_there_is_none_says_what_to_change(tiny_llama_dir, tmp_path):
    with pytest.raises(ValueError, match="--device cpu"):
        resolve_device("cuda")
    cfg = TrainConfig(tiny_llama_dir, _corpus(tmp_path / "c.txt", lines=20), str(tmp_path / "h"),
                      max_steps=1, seq_len=64, draft_vocab_size=64, aux_layers=[0, 1, 2],
                      progress=False, device="cuda:0")
    with pytest.raises(ValueError, match="no CUDA device"):
        train(cfg)
    assert not os.path.exists(str(tmp_path / "h" / "features"))  # failed before any work


@pytest.mark.slow
def test_a_head_trained_for_seconds_accepts_far_more(tmp_path):
    """SmolLM2-135M (the embedded default model) on a repetitive corpus: an untrained head
    (0 steps) accepts almost nothing; 150 training steps (~15 s here) several tokens."""
    from sglang.srt.model_loader.loader import load_tokenizer
    from sglang.test.fixtures import smollm2_gguf_path

    target = smollm2_gguf_path()
    corpus = _corpus(tmp_path / "c.txt", lines=300)
    common = dict(seq_len=128, draft_vocab_size=512, progress=False)
    untrained = str(tmp_path / "h0")
    train(TrainConfig(target, corpus, untrained, max_steps=0, **common))
    trained = str(tmp_path / "h1")
    summary = train(TrainConfig(target, corpus, trained, max_steps=150, **common))
    assert summary["recent_step0_accuracy"] > 0.3
    tok = load_tokenizer(target)
    lines = open(corpus).read().split("\n")
    ps = [tok("\n".join(lines[i: i + 6])).input_ids for i in (100, 200)]
    accept = {}
    for name, head in (("untrained", untrained), ("trained", trained)):
        sched = make_scheduler(target, speculative_algorithm="EAGLE3",
                               speculative_draft_model_path=head, speculative_num_steps=4,
                               speculative_eagle_topk=1)
        got = run(sched, ps, [greedy(48)] * len(ps))
        accept[name] = sum(u.extra_meta["spec_accept_length"] for _, u in got.values()) / len(ps)
        sched.check_all_free()
    assert accept["untrained"] < 1.3
    assert accept["trained"] > 1.8, accept
