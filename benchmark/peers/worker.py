"""One engine configuration in its own process, decoding in turns with the others.

    python worker.py ENGINE JOB_JSON OUT_JSON

Runs in the engine's own environment (ours and transformers: this repo's venv; vLLM and
llama.cpp: theirs), so it imports nothing from sglang itself: only `engines/<ENGINE>.py`,
whose `load(job)` returns a function `run(ids, new_tokens) -> (start, stamps, output_ids)`.
JOB_JSON: {"config": {...}, "model": ..., "prompts": [{"name", "ids"}], "rounds",
"new_tokens", "threads"}. Each round decodes every prompt once (turns.py: the parent says
when); the records (raw event streams) are written to OUT_JSON after every round.
"""

import importlib
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # benchmark/: spec_eval.turns has no sglang imports
sys.path.insert(0, os.path.join(HERE, "engines"))
from spec_eval.turns import done_turn, ready, wait_turn  # noqa: E402


def main() -> None:
    engine, job_file, out_file = sys.argv[1:4]
    with open(job_file) as f:
        job = json.load(f)
    t = time.perf_counter()
    run = importlib.import_module(engine).load(job)
    print(f"[{job['name']}] loaded in {time.perf_counter() - t:.1f} s", flush=True)
    ready()
    records = []
    for r in range(job["rounds"]):
        wait_turn(r)
        for p in job["prompts"]:
            start, stamps, ids = run(p["ids"], job["new_tokens"])
            records.append({"prompt": p["name"], "round": r, "start": start,
                            "stamps": stamps, "output_ids": ids})
            span = stamps[-1][0] - stamps[0][0] if len(stamps) > 1 else 0
            rate = (sum(n for _, n in stamps) - stamps[0][1]) / span if span > 0 else None
            print(f"[{job['name']}] round {r + 1} {p['name']}: ttft "
                  f"{stamps[0][0] - start:.2f} s, decode {rate and round(rate, 2)} tok/s, "
                  f"{len(ids)} tokens", flush=True)
        with open(out_file, "w") as f:
            json.dump(records, f)
        done_turn(r)


if __name__ == "__main__":  # vLLM's CPU worker re-imports the main module
    main()
