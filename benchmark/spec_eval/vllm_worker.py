"""vLLM CPU side of bench_spec_eval (runs in vLLM's own environment: no sglang imports).

    python vllm_worker.py MODEL_DIR TOKENIZER_DIR CONFIG_JSON PROMPTS_JSON ROUNDS NEW OUT_JSON

CONFIG_JSON: {} for plain decoding, else vLLM's speculative_config (method ngram, ...).
Timing as for our engine: one timestamp per engine step that emitted tokens; decode tok/s
is the tokens after the first over the time after the first.
"""

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from step_timing import decode_rate, first_token_and_total  # noqa: E402
from turns import done_turn, ready, wait_turn  # noqa: E402

if __name__ == "__main__":  # vLLM's CPU worker re-imports the main module
    model, tok, cfg, prompts_file, rounds, new, out_file = sys.argv[1:8]
    from vllm import LLM, SamplingParams

    prompts = json.load(open(prompts_file))
    spec = json.loads(cfg) or None
    longest = max(len(p["ids"]) for p in prompts) + int(new) + 64
    llm = LLM(model=model, tokenizer=tok, dtype="bfloat16", max_model_len=longest,
              speculative_config=spec, enable_prefix_caching=True)
    engine = llm.llm_engine
    params = SamplingParams(max_tokens=int(new), temperature=0.0, ignore_eos=True)
    ready()
    results = []
    for r in range(int(rounds)):
        wait_turn(r)
        for p in prompts:
            rid = f"{p['name']}#{r}"
            start = time.perf_counter()
            engine.add_request(rid, {"prompt_token_ids": p["ids"]}, params)
            stamps, ids, seen = [], [], 0
            while engine.has_unfinished_requests():
                for o in engine.step():
                    got = list(o.outputs[0].token_ids)
                    if len(got) > seen:
                        stamps.append((time.perf_counter(), len(got) - seen))
                        seen, ids = len(got), got
            rate = decode_rate(stamps)
            ttft, e2e = first_token_and_total(stamps, start)
            results.append({"name": p["name"], "round": r, "decode_tok_s": rate,
                            "ttft_s": ttft, "e2e_tok_s": e2e,
                            "steps": len(stamps), "output_ids": ids})
            print(f"[vllm {cfg}] round {r + 1} {p['name']}: "
                  f"{rate and round(rate, 2)} tok/s, {len(stamps)} steps", flush=True)
        done_turn(r)
    with open(out_file, "w") as f:
        json.dump(results, f)
