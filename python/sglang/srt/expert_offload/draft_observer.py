"""The target's expert prefetch as a listener of the draft model (speculative.drafters'
DraftObserver contract): drafted tokens, the draft's residual streams, catch-up pairs."""

from __future__ import annotations

from typing import Dict, List

import torch

from sglang.srt.expert_offload.messages import StepContext
from sglang.srt.expert_offload.prefetcher import ExpertPrefetcher
from sglang.srt.expert_offload.routing.route_map import MAX_ROWS


class PrefetchDraftObserver:
    def __init__(self, prefetcher: ExpertPrefetcher, draft_hidden_size: int,
                 draft_num_layers: int) -> None:
        self.prefetcher = prefetcher
        # a draft of the target's width: its residuals route as they are
        self.hidden = prefetcher.use_draft_hidden(draft_hidden_size, draft_num_layers)
        # a draft of another width: the routing map learns from its catch-up residuals
        self.learning = prefetcher.predictor.wants_catch_up()

    def on_level(self, reqs, trees) -> None:
        self.prefetcher.on_draft_level(StepContext([r.rid for r in reqs],
                                                   [list(t.tokens) for t in trees],
                                                   [True] * len(reqs)))

    def wants_hidden(self) -> bool:
        return self.hidden

    def on_hidden(self, rids: List[str], tokens: List[int],
                  hidden: Dict[int, torch.Tensor]) -> None:
        self.prefetcher.on_draft_hidden(rids, tokens, hidden)

    def catch_up_rows(self) -> int:
        return MAX_ROWS if self.learning else 0

    def on_catch_up(self, rids: List[str], indices: List[int],
                    hidden: Dict[int, torch.Tensor]) -> None:
        self.learning = self.prefetcher.predictor.on_draft_catch_up(rids, indices, hidden)
