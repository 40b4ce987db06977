"""The plan of one scheduler step: one record per scheduled request (as vLLM's SchedulerOutput)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, List, Optional

if TYPE_CHECKING:
    import torch

    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.speculative.tree import DraftTree


@dataclasses.dataclass
class ScheduledReq:
    req: "Req"
    count: int  # tokens of the request's own sequence this forward computes (1 = a decode)
    tree: Optional["DraftTree"] = None  # a draft tree to verify instead (root = last token)
    # after a verify: draft positions offered (tree depth), accepted, tokens appended
    offered: int = 0
    accepted: int = 0
    emitted: int = 0
    kept: Optional[List[int]] = None  # after a verify: the tree nodes whose KV was kept

    @property
    def num_tokens(self) -> int:
        """Rows this request feeds the forward."""
        return len(self.tree) if self.tree is not None else self.count

    @property
    def is_prefill(self) -> bool:
        """A prompt chunk (a tree's nodes are not a prefill)."""
        return self.tree is None and self.count > 1

    def tokens(self) -> List[int]:
        """The rows' token ids: the tree's nodes, or the next `count` tokens to compute."""
        if self.tree is not None:
            return list(self.tree.tokens)
        req = self.req
        return req.fill_ids[req.kv_len : req.kv_len + self.count]


@dataclasses.dataclass
class StepPlan:
    items: List[ScheduledReq]  # in batch order: decodes first, then prompt chunks
    decode_only: bool  # every request decodes (no prompt chunk): a step the gates may time
    budget: int = 1  # speculation's tree budget for the step (1 = plain decoding)
    typical: bool = True  # False: the step's time says little about its budget
    # target layers whose hidden states the forward hands the drafter (EAGLE-3), and them
    capture_layers: Optional[List[int]] = None
    captured: Optional["torch.Tensor"] = None  # [rows of the forward, layers * hidden]

    @property
    def reqs(self) -> List["Req"]:
        return [it.req for it in self.items]

    @property
    def has_trees(self) -> bool:
        return any(it.tree is not None for it in self.items)

    @property
    def has_prefill(self) -> bool:
        return any(it.is_prefill for it in self.items)
