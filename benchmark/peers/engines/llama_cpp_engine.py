"""llama.cpp through `llama-cpp-python` (its own environment) on the GGUF, greedy through the
binding's `Llama.generate` (which never stops at EOS by itself: the request ends after
`new_tokens`). Config: {"lookup": {"num_pred_tokens", "max_ngram_size"}} for the binding's
prompt-lookup drafting (`LlamaPromptLookupDecoding`), or {} for plain decoding.

A stamp per forward pass that gave tokens: a lookup step yields all its accepted tokens
one after another from one `eval`, so tokens from the same eval share one stamp. Every
request starts from an empty KV cache (`reset()`), as prefix caching is off for all peers.
With a draft model the binding (0.3.36) needs `logits_all=True` passed: it sizes its logits
buffer by the argument, not by the draft, and a prompt longer than `n_batch` overflows it."""

import time


def load(job):
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    cfg = dict(job["config"])
    lookup = cfg.get("lookup")
    longest = max(len(p["ids"]) for p in job["prompts"]) + job["new_tokens"] + 64
    threads = job.get("threads") or None
    llm = Llama(model_path=job["model"], n_ctx=longest, n_threads=threads,
                n_threads_batch=threads, n_batch=512, verbose=False, logits_all=bool(lookup),
                draft_model=LlamaPromptLookupDecoding(**lookup) if lookup else None)
    evals = [0]
    inner_eval = llm.eval

    def counted_eval(tokens):  # counts forward passes, to group a step's tokens
        evals[0] += 1
        return inner_eval(tokens)

    llm.eval = counted_eval

    def run(ids, new_tokens):
        llm.reset()
        stamps, out, last_eval = [], [], None
        start = time.perf_counter()
        for token in llm.generate(ids, temp=0.0, top_k=1, top_p=1.0, min_p=0.0,
                                  repeat_penalty=1.0, reset=True):
            now = time.perf_counter()
            out.append(int(token))
            if evals[0] == last_eval:
                stamps[-1] = (now, stamps[-1][1] + 1)
            else:
                stamps.append((now, 1))
                last_eval = evals[0]
            if len(out) >= new_tokens:
                break
        return start, stamps, out

    return run
