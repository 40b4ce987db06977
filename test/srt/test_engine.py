"""The offline sglang.Engine: real subprocesses, SGLang's result shapes."""

from __future__ import annotations

import pytest

import sglang

pytestmark = pytest.mark.slow  # server / engine processes, or a long scenario: not in make test-fast


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    with sglang.Engine(model_path=tiny_llama_dir, dtype="float32", max_total_tokens=4096) as e:
        yield e


def greedy(n=8, **kw):
    return {"max_new_tokens": n, "temperature": 0, **kw}


def test_single_prompt_shape(engine):
    out = engine.generate("The contract shall", greedy())
    assert set(out) == {"text", "output_ids", "meta_info"}
    meta = out["meta_info"]
    for key in ("id", "finish_reason", "prompt_tokens", "completion_tokens", "cached_tokens",
                "e2e_latency"):
        assert key in meta
    assert meta["completion_tokens"] == len(out["output_ids"]) == 8
    assert meta["finish_reason"] == {"type": "length", "length": 8}
    assert isinstance(out["text"], str) and out["text"]


def test_batch_matches_single(engine):
    prompts = ["Clause 1. The Supplier", "Payment terms are", "Either party may terminate"]
    batch = engine.generate(prompts, greedy())
    assert isinstance(batch, list) and len(batch) == 3
    for p, b in zip(prompts, batch):
        assert engine.generate(p, greedy())["output_ids"] == b["output_ids"]


def test_stream_is_cumulative_and_ends_with_final(engine):
    chunks = list(engine.generate("Stream this", greedy(6), stream=True))
    texts = [c["text"] for c in chunks]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"
    assert chunks[-1]["output_ids"] == engine.generate("Stream this", greedy(6))["output_ids"]


def test_prefix_cache_hit_reported(engine):
    doc = "This Agreement is made between the parties named below. " * 20
    engine.generate(doc, {"max_new_tokens": 0})
    out = engine.generate(doc + "Question: who?", greedy(4))
    assert out["meta_info"]["cached_tokens"] >= out["meta_info"]["prompt_tokens"] - 8


def test_max_new_tokens_zero(engine):
    out = engine.generate("Warm me", {"max_new_tokens": 0})
    assert out["text"] == "" and out["output_ids"] == []
    assert out["meta_info"]["completion_tokens"] == 0
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 0}


def test_sampling_seed_same_output(engine):
    params = {"max_new_tokens": 10, "temperature": 1.0, "sampling_seed": 7}
    a = engine.generate("Seeded", params)["output_ids"]
    b = engine.generate(["Other prompt", "Seeded"], [{"max_new_tokens": 5, "temperature": 0.8}, params])[1]
    assert a == b["output_ids"]


def test_stop_token_ids_and_stop_strings(engine):
    base = engine.generate("Stop test", greedy(12))
    ids = base["output_ids"]
    stop_id = ids[3]
    out = engine.generate("Stop test", greedy(12, stop_token_ids=[stop_id]))
    assert out["output_ids"] == ids[: ids.index(stop_id) + 1]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_id}
    # A stop string taken from the middle of the greedy text ends generation there.
    text = base["text"]
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    if stop.strip():
        s = engine.generate("Stop test", greedy(12, stop=stop))
        assert s["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
        assert stop not in s["text"] and text.startswith(s["text"])


def test_logprobs_shapes(engine):
    out = engine.generate("Log probs here please", greedy(4), return_logprob=True,
                          logprob_start_len=1, top_logprobs_num=3)
    meta = out["meta_info"]
    assert meta["prompt_tokens"] == 1 + len(meta["input_token_logprobs"])
    assert meta["input_token_logprobs"][0][0] is None
    assert all(isinstance(e[0], float) for e in meta["input_token_logprobs"][1:])
    assert len(meta["output_token_logprobs"]) == 4
    assert [e[1] for e in meta["output_token_logprobs"]] == out["output_ids"]
    assert all(len(top) == 3 for top in meta["output_top_logprobs"])
    # Greedy: the chosen token is the best of the top list.
    assert all(top[0][1] == e[1] for top, e in zip(meta["output_top_logprobs"],
                                                   meta["output_token_logprobs"]))


def test_bad_sampling_params_raise_value_error(engine):
    with pytest.raises(ValueError, match="top_p"):
        engine.generate("x", {"top_p": 0})
    assert engine.generate("still alive", greedy(2))["meta_info"]["completion_tokens"] == 2


def test_all_slots_free_after_flush(engine):
    assert engine.flush_cache()
    info = engine.get_server_info()
    assert info["available_kv_tokens"] == info["max_total_num_tokens"]


def test_shutdown_leaves_no_pending_task(tiny_llama_dir):
    """Shutting down after a stream ends the receive loop's task: one left cancelled but never
    run again is destroyed pending, and asyncio logged "Task was destroyed but it is pending!"
    at every Engine shutdown (at garbage collection, so the task's state is what we check)."""
    with sglang.Engine(model_path=tiny_llama_dir, dtype="float32", max_total_tokens=1024) as e:
        list(e.generate(prompt="Hello", stream=True, sampling_params={"max_new_tokens": 2}))
        task = e.tokenizer_manager._loop_task
        assert task is not None and not task.done()
    assert task.done()


def test_speculative_engine_starts_calibrated_with_every_slot_free(tiny_llama_dir):
    """A speculative server times its steps per batch size before it reports ready (the
    cost model's start-up calibration), shows what it measured in its server info, and
    starts with every KV slot free."""
    with sglang.Engine(model_path=tiny_llama_dir, dtype="float32", max_total_tokens=4096,
                       speculative_algorithm="STANDALONE",
                       speculative_draft_model_path=tiny_llama_dir,
                       max_running_requests=4) as e:
        info = e.get_server_info()
        cal = info["spec_calibration"]
        assert cal["batch_sizes"][0] == 1 and cal["stopped"]
        assert cal["step_seconds"]["1/1"] > 0
        assert info["available_kv_tokens"] == info["max_total_num_tokens"]
        assert e.generate("The contract shall", greedy(6))["meta_info"]["completion_tokens"] == 6
