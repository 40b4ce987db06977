"""Load generator for any SGLang-compatible server: `python -m sglang.bench_serving`.

Sends a prompt set at a request rate (Poisson arrivals) and/or a concurrency cap, streams
every response, and reports throughput and TTFT / inter-token / per-token / end-to-end
latency percentiles; `--output-file` appends the result as one JSON line.

Backends: `sglang` (native /generate), `sglang-oai` (/v1/completions), `sglang-oai-chat`
(/v1/chat/completions). Prompt sets: `random` (random token ids decoded to text),
`random-ids` (token ids, native backend), `sharegpt` (a local ShareGPT JSON file), and
`generated-shared-prefix` (groups of questions sharing one long document).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import random
import sys
import time
from typing import Any, Dict, List, Optional

import numpy as np


@dataclasses.dataclass
class Request:
    prompt: Any  # str, or list of token ids
    prompt_len: int
    output_len: int


@dataclasses.dataclass
class Outcome:
    ok: bool = False
    error: str = ""
    prompt_len: int = 0
    output_len: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: List[float] = dataclasses.field(default_factory=list)


# ---------------------------------------------------------------------- prompt sets
def load_tokenizer(args: argparse.Namespace):
    from transformers import AutoTokenizer

    path = args.tokenizer
    if path is None:
        import requests

        path = requests.get(args.base_url + "/get_model_info", headers=_headers(args),
                            timeout=30).json()["model_path"]
    return AutoTokenizer.from_pretrained(path)


def build_requests(args: argparse.Namespace, tokenizer) -> List[Request]:
    rng = random.Random(args.seed)
    n, name = args.num_prompts, args.dataset_name

    def lens(target: int) -> List[int]:
        lo = max(1, int(target * args.random_range_ratio))
        return [rng.randint(lo, target) for _ in range(n)]

    if name in ("random", "random-ids"):
        special = set(tokenizer.all_special_ids)
        vocab = [t for t in range(min(len(tokenizer), 1 << 20)) if t not in special]
        out = []
        for il, ol in zip(lens(args.random_input_len), lens(args.random_output_len)):
            ids = [rng.choice(vocab) for _ in range(il)]
            prompt = ids if name == "random-ids" else tokenizer.decode(ids)
            plen = il if name == "random-ids" else len(tokenizer(prompt)["input_ids"])
            out.append(Request(prompt, plen, ol))
        return out
    if name == "sharegpt":
        if not args.dataset_path:
            raise SystemExit("--dataset-name sharegpt needs --dataset-path (a local JSON file)")
        with open(args.dataset_path) as f:
            convs = [c["conversations"] for c in json.load(f) if len(c.get("conversations", [])) >= 2]
        rng.shuffle(convs)
        out = []
        for conv in convs:
            prompt, answer = conv[0]["value"], conv[1]["value"]
            plen = len(tokenizer(prompt)["input_ids"])
            olen = args.sharegpt_output_len or len(tokenizer(answer)["input_ids"])
            if plen < 4 or olen < 4:
                continue
            out.append(Request(prompt, plen, olen))
            if len(out) == n:
                break
        return out
    if name == "generated-shared-prefix":
        words = [tokenizer.decode([t]) for t in rng.sample(range(1000, 20000), 500)]
        out = []
        for g in range(args.gsp_num_groups):
            doc = "".join(rng.choice(words) for _ in range(args.gsp_system_prompt_len))
            for q in range(max(1, n // args.gsp_num_groups)):
                question = "".join(rng.choice(words) for _ in range(args.gsp_question_len))
                prompt = f"{doc}\nQuestion {g}.{q}: {question}\nAnswer:"
                out.append(Request(prompt, len(tokenizer(prompt)["input_ids"]), args.gsp_output_len))
        rng.shuffle(out)
        return out
    raise SystemExit(f"unknown --dataset-name {name!r}")


# ---------------------------------------------------------------------- one request
def _headers(args) -> Dict[str, str]:
    return {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}


def _payload(args, req: Request) -> tuple:
    stream = not args.disable_stream
    extra = json.loads(args.extra_request_body) if args.extra_request_body else {}
    if args.backend == "sglang":
        key = "input_ids" if isinstance(req.prompt, list) else "text"
        sp = {"max_new_tokens": req.output_len, "temperature": 0.0,
              "ignore_eos": not args.disable_ignore_eos}
        return "/generate", {key: req.prompt, "sampling_params": sp, "stream": stream, **extra}
    body = {"model": args.model or "default", "max_tokens": req.output_len, "temperature": 0.0,
            "stream": stream, "ignore_eos": not args.disable_ignore_eos, **extra}
    if stream:
        body["stream_options"] = {"include_usage": True}
    if args.backend == "sglang-oai":
        return "/v1/completions", {"prompt": req.prompt, **body}
    return "/v1/chat/completions", {"messages": [{"role": "user", "content": req.prompt}], **body}


async def send_one(session, args, req: Request) -> Outcome:
    import aiohttp

    path, body = _payload(args, req)
    out = Outcome(prompt_len=req.prompt_len)
    start = last = time.perf_counter()
    try:
        async with session.post(args.base_url + path, json=body, headers=_headers(args)) as resp:
            if resp.status != 200:
                out.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return out
            if args.disable_stream:
                data = await resp.json()
                out.ttft = out.latency = time.perf_counter() - start
                out.output_len = _count(args, data, req)
                out.ok = True
                return out
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:") or line == b"data: [DONE]":
                    continue
                data = json.loads(line[5:])
                if "error" in data:
                    out.error = str(data["error"])
                    return out
                now = time.perf_counter()
                if _has_output(args, data):
                    if out.ttft == 0.0:
                        out.ttft = now - start
                    else:
                        out.itl.append(now - last)
                    last = now
                out.output_len = _count(args, data, req) or out.output_len
            out.latency = time.perf_counter() - start
            out.ok = True
    except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError) as e:
        out.error = f"{type(e).__name__}: {e}"
    return out


def _has_output(args, data: Dict[str, Any]) -> bool:
    if args.backend == "sglang":
        return bool(data.get("output_ids"))
    for ch in data.get("choices", []):
        if ch.get("text") or (ch.get("delta") or {}).get("content"):
            return True
    return False


def _count(args, data, req: Request) -> int:
    """Output tokens as the server counted them (0 if this chunk does not say)."""
    if isinstance(data, list):
        data = data[0]
    if args.backend == "sglang":
        return data.get("meta_info", {}).get("completion_tokens", 0)
    return (data.get("usage") or {}).get("completion_tokens", 0)


# ---------------------------------------------------------------------- the run
async def run_requests(args, reqs: List[Request]) -> tuple:
    import aiohttp

    sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    rng = np.random.default_rng(args.seed)
    timeout = aiohttp.ClientTimeout(total=args.request_timeout)

    async def limited(session, req):
        if sem is None:
            return await send_one(session, args, req)
        async with sem:
            return await send_one(session, args, req)

    async with aiohttp.ClientSession(timeout=timeout) as session:
        for req in reqs[: args.warmup_requests]:
            await send_one(session, args, dataclasses.replace(req, output_len=min(req.output_len, 8)))
        start = time.perf_counter()
        tasks = []
        for req in reqs:
            tasks.append(asyncio.ensure_future(limited(session, req)))
            if args.request_rate != float("inf"):
                await asyncio.sleep(float(rng.exponential(1.0 / args.request_rate)))
        outcomes = await asyncio.gather(*tasks)
        return outcomes, time.perf_counter() - start


def summarize(args, outcomes: List[Outcome], duration: float) -> Dict[str, Any]:
    ok = [o for o in outcomes if o.ok]
    ms = lambda xs: np.asarray(xs, dtype=float) * 1000.0  # noqa: E731
    ttft, e2e = ms([o.ttft for o in ok]), ms([o.latency for o in ok])
    itl = ms([x for o in ok for x in o.itl])
    tpot = ms([(o.latency - o.ttft) / (o.output_len - 1) for o in ok if o.output_len > 1])
    n_in, n_out = sum(o.prompt_len for o in ok), sum(o.output_len for o in ok)
    res: Dict[str, Any] = {
        "backend": args.backend, "dataset_name": args.dataset_name,
        "request_rate": args.request_rate if args.request_rate != float("inf") else "inf",
        "max_concurrency": args.max_concurrency, "num_prompts": len(outcomes),
        "completed": len(ok), "failed": len(outcomes) - len(ok), "duration": duration,
        "total_input_tokens": n_in, "total_output_tokens": n_out,
        "request_throughput": len(ok) / duration, "input_throughput": n_in / duration,
        "output_throughput": n_out / duration, "total_throughput": (n_in + n_out) / duration,
        "concurrency": float(e2e.sum() / 1000.0 / duration) if len(e2e) else 0.0,
        "errors": sorted({o.error for o in outcomes if not o.ok})[:5],
    }
    for name, xs in (("ttft", ttft), ("itl", itl), ("tpot", tpot), ("e2e_latency", e2e)):
        empty = len(xs) == 0
        res[f"mean_{name}_ms"] = 0.0 if empty else float(xs.mean())
        res[f"median_{name}_ms"] = 0.0 if empty else float(np.median(xs))
        res[f"std_{name}_ms"] = 0.0 if empty else float(xs.std())
        for p in (90, 95, 99):
            res[f"p{p}_{name}_ms"] = 0.0 if empty else float(np.percentile(xs, p))
        res[f"max_{name}_ms"] = 0.0 if empty else float(xs.max())
    return res


def print_summary(res: Dict[str, Any]) -> None:
    print("{s:{c}^60}".format(s=" Serving Benchmark Result ", c="="))
    rows = [("Backend", res["backend"]), ("Traffic request rate", res["request_rate"]),
            ("Max request concurrency", res["max_concurrency"] or "not set"),
            ("Successful requests", res["completed"]), ("Failed requests", res["failed"]),
            ("Benchmark duration (s)", f"{res['duration']:.2f}"),
            ("Total input tokens", res["total_input_tokens"]),
            ("Total generated tokens", res["total_output_tokens"]),
            ("Request throughput (req/s)", f"{res['request_throughput']:.2f}"),
            ("Input token throughput (tok/s)", f"{res['input_throughput']:.2f}"),
            ("Output token throughput (tok/s)", f"{res['output_throughput']:.2f}"),
            ("Concurrency", f"{res['concurrency']:.2f}")]
    for name, label in (("e2e_latency", "E2E Latency"), ("ttft", "TTFT"), ("tpot", "TPOT"),
                        ("itl", "ITL")):
        rows += [(f"Mean {label} (ms)", f"{res[f'mean_{name}_ms']:.2f}"),
                 (f"Median {label} (ms)", f"{res[f'median_{name}_ms']:.2f}"),
                 (f"P99 {label} (ms)", f"{res[f'p99_{name}_ms']:.2f}")]
    for k, v in rows:
        print(f"{k:<40}{v!s:>20}")
    for err in res["errors"]:
        print(f"error: {err}")
    print("=" * 60)


def run_benchmark(args: argparse.Namespace) -> Dict[str, Any]:
    if args.base_url is None:
        args.base_url = f"http://{args.host}:{args.port}"
    random.seed(args.seed)
    tokenizer = load_tokenizer(args)
    reqs = build_requests(args, tokenizer)
    outcomes, duration = asyncio.run(run_requests(args, reqs))
    res = summarize(args, outcomes, duration)
    if args.output_file:
        with open(args.output_file, "a") as f:
            f.write(json.dumps(res) + "\n")
    return res


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m sglang.bench_serving", description=__doc__.split("\n")[0])
    p.add_argument("--backend", default="sglang", choices=["sglang", "sglang-oai", "sglang-oai-chat"])
    p.add_argument("--base-url", default=None)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--api-key", default=None)
    p.add_argument("--model", default=None, help="model name sent to the OpenAI endpoints")
    p.add_argument("--tokenizer", default=None, help="default: the server's model_path")
    p.add_argument("--dataset-name", default="random",
                   choices=["random", "random-ids", "sharegpt", "generated-shared-prefix"])
    p.add_argument("--dataset-path", default=None)
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--random-input-len", type=int, default=256)
    p.add_argument("--random-output-len", type=int, default=64)
    p.add_argument("--random-range-ratio", type=float, default=0.0)
    p.add_argument("--sharegpt-output-len", type=int, default=None)
    p.add_argument("--gsp-num-groups", type=int, default=4)
    p.add_argument("--gsp-system-prompt-len", type=int, default=512)
    p.add_argument("--gsp-question-len", type=int, default=32)
    p.add_argument("--gsp-output-len", type=int, default=64)
    p.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s (Poisson)")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--warmup-requests", type=int, default=1)
    p.add_argument("--disable-stream", action="store_true")
    p.add_argument("--disable-ignore-eos", action="store_true")
    p.add_argument("--extra-request-body", default=None, help="JSON merged into every request")
    p.add_argument("--request-timeout", type=float, default=6 * 3600)
    p.add_argument("--output-file", default=None, help="append the result as a JSON line")
    p.add_argument("--seed", type=int, default=1)
    return p.parse_args(argv)


def main(argv: Optional[List[str]] = None) -> None:
    res = run_benchmark(parse_args(argv))
    print_summary(res)
    if res["completed"] == 0:
        sys.exit(1)


if __name__ == "__main__":
    main()
