"""Hugging Face transformers `generate`, greedy, a stamp per streamer call after the prompt's
(one per step: a prompt-lookup step hands back all its accepted tokens at once).

Config: {"dtype": "float32" | "bfloat16", "prompt_lookup_num_tokens": k (optional),
"max_matching_ngram_size": n (optional)}. float32 is the fair mode on a CPU whose torch bf16
matmul is slow (transformers' bf16 prefill of 4K tokens of the 0.5B takes minutes there).
`min_new_tokens` keeps EOS from ending a request early (transformers has no ignore_eos)."""

import time


def load(job):
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.generation.streamers import BaseStreamer

    cfg = dict(job["config"])
    if job.get("threads"):
        torch.set_num_threads(job["threads"])
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[cfg.pop("dtype", "float32")]
    model = AutoModelForCausalLM.from_pretrained(job["model"], dtype=dtype).eval()
    pad = model.config.eos_token_id
    pad = pad[0] if isinstance(pad, list) else pad

    class Stamps(BaseStreamer):
        def __init__(self):
            self.stamps, self.ids, self.prompt_seen = [], [], False

        def put(self, value):
            if not self.prompt_seen:  # the first call hands over the prompt
                self.prompt_seen = True
                return
            got = value.reshape(-1).tolist()
            self.stamps.append((time.perf_counter(), len(got)))
            self.ids += got

        def end(self):
            pass

    def run(ids, new_tokens):
        streamer = Stamps()
        start = time.perf_counter()
        with torch.inference_mode():
            model.generate(torch.tensor([ids]), max_new_tokens=new_tokens,
                           min_new_tokens=new_tokens, do_sample=False, pad_token_id=pad,
                           streamer=streamer, **cfg)
        return start, streamer.stamps, streamer.ids

    return run
