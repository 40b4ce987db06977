"""Self-distilled chat data: the target's own answers to review questions over excerpts of
the corpus documents, saved as chat-template text the trainer reads like any document.

Why: a head trained on raw documents alone drafts raw text; served, it drafts the target's
answers in the chat template, which it never saw (the Qwen 0.5B head accepted 1.26 tokens
per verify continuing a held-out law's text, 1.00-1.05 answering questions on it). EAGLE's
own recipe trains on the target's regenerated responses for the same reason. The questions
here are worded unlike the held-out evaluation's (benchmark/spec_eval/eval_set.py).
"""

from __future__ import annotations

import os
from typing import Dict, List, Sequence

# three styles (quote, summarise, list), worded unlike the evaluation's questions
QUESTIONS = (
    "Copy out verbatim the passage above that imposes a duty on someone. Add nothing else.",
    "In a few sentences, explain what the passage above obliges its parties to do.",
    "Name each defined term, body or party mentioned above, one per line, with a short "
    "description of each.",
)


def chat_samples(tokenizer, documents: Sequence[str], excerpt_tokens: int,
                 excerpts_per_doc: int) -> List[Dict]:
    """[{name, ids}]: chat prompts of one excerpt and one question each (questions in turn)."""
    out = []
    for path in documents:
        ids = tokenizer(open(path, encoding="utf-8", errors="replace").read(),
                        add_special_tokens=False).input_ids
        stem = os.path.splitext(os.path.basename(path))[0]
        for k in range(excerpts_per_doc):
            start = k * len(ids) // max(excerpts_per_doc, 1)
            piece = ids[start: start + excerpt_tokens]
            if len(piece) < 64:
                continue
            q = QUESTIONS[(len(out)) % len(QUESTIONS)]
            msgs = [{"role": "user", "content": tokenizer.decode(piece) + "\n\n" + q}]
            chat = tokenizer.apply_chat_template(msgs, add_generation_prompt=True,
                                                 tokenize=False)
            out.append({"name": f"{stem}_{k}",
                        "ids": tokenizer(chat, add_special_tokens=False).input_ids})
    return out


def generate_answers(target_path: str, documents: Sequence[str], out_dir: str,
                     excerpt_tokens: int = 384, excerpts_per_doc: int = 3,
                     new_tokens: int = 160, dtype: str = "bfloat16",
                     device: str = "cpu") -> List[str]:
    """Write `<doc>_<k>.txt` (the prompt and the target's greedy answer, as text) into
    `out_dir` for every sample not already there (a rerun resumes); returns the files."""
    from sglang.srt.managers.io_struct import TokenizedGenerateReqInput
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.model_loader.loader import load_tokenizer
    from sglang.srt.sampling.sampling_params import SamplingParams
    from sglang.srt.server_args import ServerArgs

    tokenizer = load_tokenizer(target_path)
    samples = chat_samples(tokenizer, documents, excerpt_tokens, excerpts_per_doc)
    os.makedirs(out_dir, exist_ok=True)
    todo = [s for s in samples if not os.path.isfile(os.path.join(out_dir, s["name"] + ".txt"))]
    if todo:
        longest = max(len(s["ids"]) for s in todo) + new_tokens + 16
        sched = Scheduler(ServerArgs(model_path=target_path, dtype=dtype, context_length=longest,
                                     max_total_tokens=16 * longest, max_running_requests=16,
                                     device=device))
        for s in todo:
            params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0)
            params.normalize()
            sched.add_request(TokenizedGenerateReqInput(rid=s["name"], input_ids=s["ids"],
                                                        sampling_params=params))
        answers: Dict[str, List[int]] = {s["name"]: [] for s in todo}
        by_name = {s["name"]: s for s in todo}
        done = 0
        while not sched.is_idle():
            for u in sched.step():
                answers[u.rid] += u.new_output_ids
                if u.finished_reason is not None:
                    text = tokenizer.decode(by_name[u.rid]["ids"] + answers[u.rid])
                    tmp = os.path.join(out_dir, u.rid + ".tmp")
                    with open(tmp, "w", encoding="utf-8") as f:
                        f.write(text)
                    os.replace(tmp, os.path.join(out_dir, u.rid + ".txt"))  # whole or absent
                    done += 1
                    print(f"answers {done}/{len(todo)}", flush=True)
        sched.flush_cache()
        sched.check_all_free()
    return [os.path.join(out_dir, s["name"] + ".txt") for s in samples]
