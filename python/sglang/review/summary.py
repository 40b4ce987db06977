"""The end-of-job summary, over every record in the results file."""

from __future__ import annotations

from typing import Any, Dict, List


def _percentile(values: List[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def summarize(records: List[Dict[str, Any]], expected: int, this_run: int, failed: int,
              wall_s: float, warm_s: float, docs: int) -> Dict[str, Any]:
    prompt = sum(r.get("prompt_tokens", 0) for r in records)
    cached = sum(r.get("cached_tokens", 0) for r in records)
    completion = sum(r.get("completion_tokens", 0) for r in records)
    latencies = [r.get("latency_s", 0.0) for r in records]
    spec = [r["acceptance"] for r in records if r.get("acceptance")]
    accepted = sum(a["accepted_tokens"] for a in spec)
    drafted = sum(a["draft_tokens"] for a in spec)
    verify = sum(a["verify_ct"] for a in spec)
    spec_completion = sum(r.get("completion_tokens", 0) for r in records if r.get("acceptance"))
    new = records[-this_run:] if this_run else []
    new_completion = sum(r.get("completion_tokens", 0) for r in new)
    return {
        "records": len(records), "expected": expected, "complete": len(records) == expected,
        "this_run": this_run, "resumed": len(records) - this_run, "failed": failed,
        "documents": docs, "prompt_tokens": prompt, "cached_tokens": cached,
        "cache_hit_rate": cached / prompt if prompt else 0.0,
        "completion_tokens": completion,
        "latency_mean_s": sum(latencies) / len(latencies) if latencies else 0.0,
        "latency_p50_s": _percentile(latencies, 0.5),
        "latency_p95_s": _percentile(latencies, 0.95),
        "wall_s": wall_s, "warm_s": warm_s,
        "output_tokens_per_s": new_completion / wall_s if wall_s > 0 else 0.0,
        "spec_records": len(spec),
        "accept_rate": accepted / drafted if drafted else None,
        "accept_length": spec_completion / verify if verify else None,
        "fallback_events": sum(r.get("fallback_events") or 0 for r in records),
    }


def format_summary(s: Dict[str, Any]) -> str:
    lines = [
        f"review: {s['records']}/{s['expected']} records over {s['documents']} documents "
        f"({s['resumed']} from earlier runs, {s['this_run']} this run, {s['failed']} failed)",
        f"tokens: prompt {s['prompt_tokens']} (cached {s['cached_tokens']}, "
        f"{100 * s['cache_hit_rate']:.0f}%), completion {s['completion_tokens']}",
        f"latency per record: mean {s['latency_mean_s']:.2f} s, p50 {s['latency_p50_s']:.2f} s, "
        f"p95 {s['latency_p95_s']:.2f} s; this run {s['wall_s']:.1f} s wall "
        f"({s['warm_s']:.1f} s warming documents), {s['output_tokens_per_s']:.1f} output tok/s",
    ]
    if s["accept_rate"] is not None:
        lines.append(f"speculation: acceptance rate {s['accept_rate']:.2f}, accept length "
                     f"{s['accept_length']:.2f}, fallback events {s['fallback_events']}")
    else:
        lines.append("speculation: none reported by the server")
    if not s["complete"]:
        lines.append("incomplete: run the same command again to finish")
    return "\n".join(lines)
