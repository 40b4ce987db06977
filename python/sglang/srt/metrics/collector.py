"""Prometheus collectors with SGLang's `sglang:` names and the `model_name` label.

Fed from the tokenizer manager (one call per request update) and, at scrape time, from the
scheduler's internal state (running / queued requests, KV usage). Everything lives in one
process, so a private CollectorRegistry suffices (no multiprocess mode).
"""

from __future__ import annotations

import collections
import time
from typing import Any, Deque, Dict, Tuple

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                 2.5, 5.0, 7.5, 10.0, 15.0, 20.0, 25.0, 30.0, 60.0, 120.0, 300.0)
_ITL_BUCKETS = (0.002, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.035, 0.04, 0.05, 0.06, 0.075,
                0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.0, 5.0)
_E2E_BUCKETS = (0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                50.0, 60.0, 90.0, 120.0, 300.0, 600.0, 1200.0)

_MOE_GAUGES = {
    "expert_hit_rate": "Expert uses that found the expert resident.",
    "expert_stall_seconds": "Time layers waited for expert loads.",
    "expert_bytes_loaded": "Bytes of experts loaded into the fast tier.",
    "prefetch_recall": "Needed experts resident when their layer ran.",
    "prefetch_precision": "Prefetched experts that the layer then used.",
    "prefetch_bytes_fetched": "Bytes of experts the prefetcher fetched.",
    "prefetch_bytes_fetched_used": "Bytes of prefetched experts that were used.",
    "prefetch_predicted_recall": "Needed experts the predictor named (loaded in time or not).",
    "prefetch_recall_ceiling": "Needed experts the fast tier's slots could hold at best.",
    "prefetch_gate_steps_on": "Decode steps the prefetch gate ran with prefetch (layer all).",
    "prefetch_gate_steps_off": "Decode steps the prefetch gate ran on-demand (layer all).",
    "tree_nodes_pruned": "Draft nodes budget-aware trees dropped for their expert loads (layer all).",
    "tree_loads_saved": "Expert loads the dropped draft nodes would have caused (layer all).",
}

# Generation throughput is averaged over this many recent seconds.
_THROUGHPUT_WINDOW_S = 10.0


class TokenizerMetrics:
    def __init__(self, model_name: str) -> None:
        import prometheus_client as pc

        # SGLang's multiprocess collectors emit no *_created series; match that.
        pc.disable_created_metrics()
        self.registry = pc.CollectorRegistry(auto_describe=True)
        self.model_name = model_name
        reg, labels = self.registry, ["model_name"]

        def counter(name: str, doc: str):
            return pc.Counter(name, doc, labels, registry=reg).labels(model_name)

        def gauge(name: str, doc: str):
            return pc.Gauge(name, doc, labels, registry=reg).labels(model_name)

        def histogram(name: str, doc: str, buckets):
            return pc.Histogram(name, doc, labels, buckets=buckets, registry=reg).labels(model_name)

        self.prompt_tokens = counter("sglang:prompt_tokens", "Prefill tokens processed.")
        self.generation_tokens = counter("sglang:generation_tokens", "Tokens generated.")
        self.cached_tokens = counter("sglang:cached_tokens", "Prompt tokens from the prefix cache.")
        self.num_requests = counter("sglang:num_requests", "Finished requests.")
        self.num_aborted = counter("sglang:num_aborted_requests", "Aborted requests.")
        self.ttft = histogram("sglang:time_to_first_token_seconds",
                              "Time to first token (streaming requests).", _TTFT_BUCKETS)
        self.itl = histogram("sglang:inter_token_latency_seconds",
                             "Latency between output tokens.", _ITL_BUCKETS)
        self.tpot = histogram("sglang:time_per_output_token_seconds",
                              "Mean time per output token of a request.", _ITL_BUCKETS)
        self.e2e = histogram("sglang:e2e_request_latency_seconds",
                             "End-to-end request latency.", _E2E_BUCKETS)
        self.num_running = gauge("sglang:num_running_reqs", "Running requests.")
        self.num_queue = gauge("sglang:num_queue_reqs", "Requests waiting in the queue.")
        self.token_usage = gauge("sglang:token_usage", "Fraction of KV slots in use.")
        self.gen_throughput = gauge("sglang:gen_throughput", "Generation throughput (tokens/s).")
        self.cache_hit_rate = gauge("sglang:cache_hit_rate", "Cached / prompt tokens so far.")
        self.max_total_tokens = gauge("sglang:max_total_num_tokens", "KV pool size in tokens.")
        # Speculative decoding (present when --speculative-algorithm is set)
        self.spec_verify = counter("sglang:spec_verify_steps", "Decode steps of speculating requests.")
        self.spec_accepted = counter("sglang:spec_accepted_tokens", "Draft tokens accepted.")
        self.spec_drafted = counter("sglang:spec_draft_tokens", "Draft token slots offered.")
        self.spec_fallbacks = counter("sglang:spec_fallbacks", "Switches to plain decoding.")
        self.spec_accept_length = gauge("sglang:spec_accept_length",
                                        "Average tokens per decode step (speculation).")
        self.spec_accept_rate = gauge("sglang:spec_accept_rate", "Accepted / drafted tokens.")
        # MoE expert store and prefetch (present with --moe-expert-cache-slots), per layer
        # ("all" = every MoE layer together) and labelled with the predictor in use.
        moe_labels = ["model_name", "layer", "predictor"]
        self._moe = {key: pc.Gauge(f"sglang:moe_{key}", doc, moe_labels, registry=reg)
                     for key, doc in _MOE_GAUGES.items()}
        self._func_latency = pc.Histogram("sglang:func_latency_seconds", "Latency of HTTP handlers.",
                                          ["name"], buckets=_E2E_BUCKETS, registry=reg)
        self._recent: Deque[Tuple[float, int]] = collections.deque()  # (time, new tokens)
        self._prompt_total = 0
        self._cached_total = 0
        self._spec_totals = [0, 0]  # accepted, drafted

    # ------------------------------------------------------------------ per request
    def on_update(self, state: Any, upd: Any, now: float) -> None:
        """Called for every update of a request, before its token times are advanced."""
        new = len(upd.new_output_ids)
        if new:
            self.generation_tokens.inc(new)
            self._recent.append((now, new))
            if state.first_token_time is None:
                if state.stream:  # a non-streaming request is only heard of at its end
                    self.ttft.observe(now - state.created)
            elif state.last_token_time is not None:
                self.itl.observe((now - state.last_token_time) / new)
        if upd.finished_reason is None:
            return
        self.prompt_tokens.inc(upd.prompt_tokens)
        self.cached_tokens.inc(upd.cached_tokens)
        self._prompt_total += upd.prompt_tokens
        self._cached_total += upd.cached_tokens
        self.num_requests.inc()
        self.e2e.observe(now - state.created)
        if upd.finished_reason.get("type") == "abort":
            self.num_aborted.inc()
        meta = getattr(upd, "extra_meta", None) or {}
        if "spec_verify_ct" in meta:
            self.spec_verify.inc(meta["spec_verify_ct"])
            self.spec_accepted.inc(meta["spec_accept_token_num"])
            self.spec_drafted.inc(meta["spec_draft_token_num"])
            self.spec_fallbacks.inc(meta.get("spec_fallback_count", 0))
            self._spec_totals[0] += meta["spec_accept_token_num"]
            self._spec_totals[1] += meta["spec_draft_token_num"]
            if self._spec_totals[1]:
                self.spec_accept_rate.set(self._spec_totals[0] / self._spec_totals[1])
        first = state.first_token_time or (now if new else None)
        if first is not None and upd.completion_tokens > 1 and state.stream:
            self.tpot.observe((now - first) / (upd.completion_tokens - 1))

    def observe_handler(self, name: str, seconds: float) -> None:
        self._func_latency.labels(name).observe(seconds)

    # ------------------------------------------------------------------ scrape
    def refresh(self, scheduler_state: Dict[str, Any]) -> None:
        """Update the gauges that describe the scheduler right before a scrape."""
        total = scheduler_state.get("max_total_num_tokens") or 0
        self.max_total_tokens.set(total)
        self.num_running.set(scheduler_state.get("num_running_reqs", 0))
        self.num_queue.set(scheduler_state.get("num_waiting_reqs", 0))
        if total:
            free = scheduler_state.get("available_kv_tokens", total) + \
                scheduler_state.get("cache_evictable_tokens", 0)
            self.token_usage.set(max(0.0, (total - free) / total))
        if self._prompt_total:
            self.cache_hit_rate.set(self._cached_total / self._prompt_total)
        self.gen_throughput.set(self.throughput())
        if scheduler_state.get("avg_spec_accept_length") is not None:
            self.spec_accept_length.set(scheduler_state["avg_spec_accept_length"])
        self._refresh_moe(scheduler_state)

    def _refresh_moe(self, state: Dict[str, Any]) -> None:
        store = state.get("moe_expert_store")
        if not store:
            return
        prefetch = state.get("moe_prefetch") or {}
        predictor = prefetch.get("predictor", "none")
        layers = {"all": (store["total"], prefetch.get("total", {}))}
        for key, figs in store["layers"].items():
            layers[key] = (figs, prefetch.get("layers", {}).get(key, {}))
        for layer, (s, p) in layers.items():
            values = {"expert_hit_rate": s["hit_rate"], "expert_stall_seconds": s["stall_seconds"],
                      "expert_bytes_loaded": s["bytes_loaded"],
                      "prefetch_recall": p.get("recall"), "prefetch_precision": p.get("precision"),
                      "prefetch_bytes_fetched": p.get("bytes_fetched"),
                      "prefetch_bytes_fetched_used": p.get("bytes_fetched_used"),
                      "prefetch_predicted_recall": p.get("predicted_recall"),
                      "prefetch_recall_ceiling": p.get("recall_ceiling")}
            if layer == "all" and "gate" in prefetch:
                values["prefetch_gate_steps_on"] = prefetch["gate"]["steps_on"]
                values["prefetch_gate_steps_off"] = prefetch["gate"]["steps_off"]
            if layer == "all" and "tree_budget" in prefetch:
                values["tree_nodes_pruned"] = prefetch["tree_budget"]["nodes_removed"]
                values["tree_loads_saved"] = prefetch["tree_budget"]["loads_saved"]
            for key, value in values.items():
                if value is not None:
                    self._moe[key].labels(self.model_name, layer, predictor).set(value)

    def throughput(self) -> float:
        """Generated tokens per second over the last few seconds."""
        now = time.time()
        while self._recent and self._recent[0][0] < now - _THROUGHPUT_WINDOW_S:
            self._recent.popleft()
        return sum(n for _, n in self._recent) / _THROUGHPUT_WINDOW_S

    def render(self) -> Tuple[bytes, str]:
        """The exposition text and its content type."""
        import prometheus_client as pc

        return pc.generate_latest(self.registry), pc.CONTENT_TYPE_LATEST
