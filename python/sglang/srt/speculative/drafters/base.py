"""The drafter contracts: what the SpecWorker and the scheduler may ask of a drafter.

- `Drafter`: proposes a tree per request, hears which nodes were accepted, and drops a
  request's state when it ends. `draft_kv` is its KV seam with the radix cache.
- `DraftKVOwner`: a drafter whose KV hangs off the radix tree beside the target's (a draft model).
  `NO_DRAFT_KV` is the null one (n-grams keep no KV): every call is a no-op.
- `DraftObserver`: what a drafter tells a listener while it drafts (the target's expert
  prefetch); the base hears nothing and asks for nothing.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Callable, Dict, List, Optional, Set

import torch

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.mem_cache.memory_pool import TokenSlotAllocator
    from sglang.srt.speculative.tree import DraftTree


@dataclasses.dataclass
class CatchUpRecord:
    """What the latest proposal's catch-up read: the draft's backlog and its time."""

    backlog_tokens: int = 0  # tokens the draft was behind on, over the requests it read
    requests: int = 0  # requests it read them for
    computed_tokens: int = 0  # tokens the catch-up sent through the draft
    seconds: float = 0.0


class DraftObserver:
    """Hears a drafter's progress. Residual streams are captured only when asked for."""

    def on_level(self, reqs: List["Req"], trees: List["DraftTree"]) -> None:
        """A tree level was drafted (all but the last): its tokens are known."""

    def wants_hidden(self) -> bool:
        """Capture each draft forward's residual stream for `on_hidden`?"""
        return False

    def on_hidden(self, rids: List[str], tokens: List[int],
                  hidden: Dict[int, torch.Tensor]) -> None:
        """{draft layer: residual [rows, H]} of the rows a proposal's forward computed."""

    def catch_up_rows(self) -> int:
        """Catch-up tokens at indices below this are handed to `on_catch_up` (0: none)."""
        return 0

    def on_catch_up(self, rids: List[str], indices: List[int],
                    hidden: Dict[int, torch.Tensor]) -> None:
        """{draft layer: residual [rows, H]} of catch-up tokens (rid, token index per row)."""


NO_OBSERVER = DraftObserver()


class DraftKVOwner:
    """The null draft KV (n-grams): nothing to adopt, share, warm or free."""

    allocator: Optional["TokenSlotAllocator"] = None
    num_params: int = 0  # the draft model's parameters (prices a draft token)
    model_config = None  # the draft model's Hugging Face config

    @property
    def enabled(self) -> bool:
        return self.allocator is not None

    def set_evictor(self, evict: Callable[[int], int]) -> None:
        """Short of draft slots, call evict(n) (the cache's unlocked draft KV goes first)."""

    def adopt(self, req: "Req", slots: torch.Tensor) -> int:
        """Start from the cache's draft slots for the request's prefix; returns the count."""
        return 0

    def shareable_prefix(self, req: "Req", limit: int) -> Optional[torch.Tensor]:
        """Draft slots of a prefix (at most `limit` tokens) the cache may take over."""
        return None

    def on_cached(self, req: "Req", canonical: torch.Tensor, passed: int) -> None:
        """The cache now owns the first `passed` draft slots (and may have swapped them)."""

    def warm_many(self, reqs: List["Req"], ends: List[int]) -> List[bool]:
        """Catch the draft up on fill_ids[:ends[i]] without proposing."""
        return [False] * len(reqs)

    def release_kv(self, req: "Req", keep: int) -> Optional[torch.Tensor]:
        """Drop the request's draft KV; returns slots of its prefix [0, <= keep) for the
        cache (ownership passes with them); frees the rest."""
        return None

    def backlog(self, req: "Req") -> int:
        """Tokens the draft is behind on for `req` (what its next catch-up reads)."""
        return 0

    def begin_proposal(self) -> None:
        """A proposal starts: the backlog it reads is counted afresh."""

    def last_read(self) -> CatchUpRecord:
        """The latest proposal's backlog, and what the latest catch-up computed and cost."""
        return CatchUpRecord()


NO_DRAFT_KV = DraftKVOwner()


class Drafter(ABC):
    name = "drafter"
    draft_kv: DraftKVOwner = NO_DRAFT_KV
    # drafting costs next to nothing (n-grams): speculation is judged by tokens per verify
    # against the verify's own cost, and each request sizes its draft
    costs_nothing = False
    # part of its drafts needs no draft KV (HYBRID's n-grams): a request the draft model is
    # too far behind on is still drafted, by that part alone (`hold_back`)
    drafts_without_model = False
    # cached draft rows of a radix hit's last tokens not to adopt: a head's row i read token
    # i + 1, which for the last matched row may be another request's
    match_lag = 0

    @abstractmethod
    def propose(self, reqs: List["Req"], budgets: List[int],
                depth: Optional[int] = None) -> List[Optional["DraftTree"]]:
        """One tree per request (root = the request's last token) of at most budgets[i]
        nodes and at most `depth` levels, or None when this drafter has nothing to offer
        for it this step."""

    def hold_back(self, rids: Set[str], alone: Optional[Dict[str, int]] = None) -> None:
        """This step, the draft model sits out for the requests `rids` (their draft KV is
        not worth catching up); `alone`: per request, the nodes its drafts without the
        model may fill (their own draft length). Set before each proposal."""

    def model_ran_for(self, req: "Req") -> bool:
        """Did the latest proposal run a draft model's forwards for `req`? (its price)"""
        return not self.costs_nothing

    def target_layers(self) -> Optional[List[int]]:
        """Target layers whose hidden states the drafter reads (an EAGLE-3 head), else None."""
        return None

    def bind_target(self, model, config) -> None:
        """The target model is built: a head takes its embedding and checks its width."""

    def on_target_hidden(self, req: "Req", start: int, hidden: torch.Tensor) -> None:
        """The target computed tokens [start, start + len(hidden)) of `req`; `hidden`:
        their `target_layers` concatenated (only asked of drafters that name layers)."""

    def observe(self, observer: DraftObserver) -> None:
        """Tell `observer` about each proposal as it is drafted (drafters with a model)."""

    def on_verified(self, req: "Req", path: List[int]) -> None:
        """The verify accepted `path` (tree node indices, root first) of the last tree."""

    def weights_of(self, req: "Req") -> Optional[Dict[str, float]]:
        """How much each member drafter is trusted for `req` now (HYBRID), else None."""
        return None

    def release(self, req: "Req") -> None:
        """The request finished or was retracted: drop its state (KV goes via draft_kv)."""

    def check_all_free(self) -> None:
        """Invariant for tests: no per-request state or KV left."""
