"""What the scheduler reports about itself (/server_info, /metrics, tests' invariants) and
its start-up calibration: a mixin of Scheduler."""

from __future__ import annotations

from typing import Dict

from sglang.srt.mem_cache.mla_pool import kv_bytes_per_token


class SchedulerStateMixin:
    def calibrate(self) -> None:
        """Before serving: time plain and speculative steps per batch size for the cost
        model (--speculative-calibrate-seconds; managers/spec_calibration.py)."""
        from sglang.srt.managers.spec_calibration import calibrate

        self.spec_calibration = calibrate(self, self.server_args.speculative_calibrate_seconds)

    # ------------------------------------------------------------------ introspection
    def spec_state(self) -> Dict[str, object]:
        """Speculative figures for /server_info (avg_spec_accept_length as upstream)."""
        if self.spec is None:
            return {"avg_spec_accept_length": None}
        per_token = kv_bytes_per_token(self.runner.config, self.runner.kv_dtype,
                                       self.runner.tp_size)
        calibration = self.spec_calibration
        return {
            "spec_calibration": calibration.to_dict() if calibration is not None else None,
            "avg_spec_accept_length": self.spec.avg_accept_length(),
            "speculative_num_steps": self.spec.num_steps,
            "speculative_eagle_topk": self.spec.topk,
            "speculative_num_draft_tokens": self.spec.num_draft_tokens,
            # A verify step adds KV for its tree only: tree tokens x layers x KV per token.
            "spec_verify_kv_bytes_per_request": self.spec.max_tree_nodes * per_token,
        }

    def moe_state(self) -> Dict[str, object]:
        """Expert store and prefetch figures for /server_info and /metrics (MoE + store)."""
        store = self.runner.expert_store
        if store is None:
            return {}
        out: Dict[str, object] = {"moe_expert_store": store.stats().to_dict()}
        if self.prefetcher is not None:
            out["moe_prefetch"] = self.prefetcher.figures()
            if self.tree_budget is not None:
                out["moe_prefetch"]["tree_budget"] = self.tree_budget.to_dict()
        return out

    def check_all_free(self) -> None:
        """Invariant for tests: idle + flushed => every slot and row is free."""
        assert self.is_idle(), "requests are still running"
        self.tree_cache.check_integrity()
        self.tree_cache.reset()
        self.allocator.check()
        assert self.allocator.available_size() == self.allocator.size, (
            f"KV slots leaked: {self.allocator.size - self.allocator.available_size()}")
        assert self.req_to_token_pool.available_size() == self.req_to_token_pool.size
        if self.spec is not None:
            self.spec.check_all_free()
            assert not self.spec.controllers, "speculation state left for finished requests"
        store = self.runner.expert_store
        if store is not None:  # MoE experts served from a slow tier: nothing pinned or loading
            store.check_idle()
