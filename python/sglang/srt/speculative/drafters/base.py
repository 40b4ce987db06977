"""The drafter interface: propose a tree per request; forget a request when it ends."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, List, Optional

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.speculative.tree import DraftTree


class Drafter(ABC):
    @abstractmethod
    def propose(self, reqs: List["Req"], budgets: List[int],
                depth: Optional[int] = None) -> List[Optional["DraftTree"]]:
        """One tree per request (root = the request's last token) of at most budgets[i]
        nodes and at most `depth` levels, or None when this drafter has nothing to offer
        for it this step."""

    def release(self, req: "Req") -> None:
        """The request finished or was retracted: drop its state (and KV)."""

    def check_all_free(self) -> None:
        """Invariant for tests: no per-request state or KV left."""
