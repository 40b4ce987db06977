"""How the MoE layers call expert offload, without knowing it: two small protocols.

`MoEHooks` is told what each MoE layer is about to compute and what its router chose (expert
prefetch listens); `NO_HOOKS` does nothing and is the default. `ExpertSlots` is the fast tier
a store-backed `MoEExperts` computes from (expert_offload.store.ExpertStore implements it).
"""

from __future__ import annotations

from typing import Dict, Iterable, List, Optional, Protocol, Sequence, Tuple

import torch


class MoEHooks:
    """Called by every MoE decoder layer; the base does nothing."""

    def on_moe_input(self, layer: int, normed: torch.Tensor, residual: torch.Tensor) -> None:
        """Layer `layer`'s FFN input (normed) and residual stream, before its router runs."""

    def on_routed(self, layer: int, topk_ids: torch.Tensor) -> None:
        """The experts layer `layer` routed its rows to ([T, k])."""


NO_HOOKS = MoEHooks()


class ExpertLease(Protocol):
    slot_of: Dict[int, int]  # expert -> the slot it is pinned in while the lease is held


class ExpertSlots(Protocol):
    """A fast tier of `num_slots` experts per layer; a forward pins what it computes with."""

    num_slots: int

    def resident(self, layer: int) -> List[int]: ...

    def mapped(self, layer: int) -> List[int]: ...

    def acquire(self, layer: int, experts: Sequence[int]) -> ExpertLease: ...

    def release(self, lease: ExpertLease) -> None: ...

    def prefetch_experts(self, layer: int, experts: Iterable[int],
                         protect: Iterable[int] = (),
                         scores: Optional[Dict[int, float]] = None) -> List[int]: ...

    def weights(self, layer: int) -> Tuple[torch.Tensor, torch.Tensor]: ...
