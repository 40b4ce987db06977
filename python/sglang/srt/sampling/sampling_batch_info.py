"""SamplingBatchInfo: the per-row sampling parameters of one batch, as tensors.

Built fresh each step from the running requests (`from_reqs`); row i belongs to reqs[i].
Invariants: `temperatures` are all positive (1.0 where temperature < 1e-6, so division is
safe and logprobs of such rows are a plain log_softmax); greedy rows (temperature < 1e-6 or
top_k == 1) hold neutral top-k/top-p/min-p and never set the `need_*` flags.
Disabled top-k is stored as `vocab_size`; disabled top-p as 1.0; disabled min-p as 0.0.
"""

from __future__ import annotations

import dataclasses
from typing import List, Optional, Protocol, Sequence, Set

import torch

from sglang.srt.sampling.penalties import PenaltyState
from sglang.srt.sampling.sampling_params import _GREEDY_EPS, SamplingParams


class SamplingView(Protocol):
    """What the sampler reads from a request (the scheduler's Req satisfies it)."""

    sampling_params: SamplingParams
    origin_input_ids: List[int]
    output_ids: List[int]
    generator: Optional[torch.Generator]  # per-request RNG, seeded by the scheduler
    stop_token_ids_all: Set[int]  # model EOS ids + request stop_token_ids (for min_new_tokens)


@dataclasses.dataclass
class SamplingBatchInfo:
    temperatures: torch.Tensor  # [bs, 1] f32, > 0
    top_ps: torch.Tensor  # [bs] f32
    top_ks: torch.Tensor  # [bs] int64, in [1, vocab_size]
    min_ps: torch.Tensor  # [bs] f32
    is_greedy: torch.Tensor  # [bs] bool
    generators: List[Optional[torch.Generator]]  # [bs]; None -> torch's global RNG
    vocab_size: int
    is_all_greedy: bool
    need_top_p: bool
    need_top_k: bool
    need_min_p: bool
    # the same flags and top-k on the host: the sampler picks rows and sizes without reading
    # the device (no sync; utils/host_sync.py)
    greedy_host: List[bool] = dataclasses.field(default_factory=list)
    top_ks_host: List[int] = dataclasses.field(default_factory=list)
    top_ps_host: List[float] = dataclasses.field(default_factory=list)
    penalties: Optional[PenaltyState] = None
    # [bs, vocab] bool, True = token forbidden (grammar-constrained decoding fills it).
    vocab_mask: Optional[torch.Tensor] = None

    @property
    def batch_size(self) -> int:
        return self.temperatures.shape[0]

    @property
    def device(self) -> torch.device:
        return self.temperatures.device

    @classmethod
    def from_reqs(cls, reqs: Sequence[SamplingView], vocab_size: int,
                  device: torch.device | str = "cpu") -> "SamplingBatchInfo":
        temps, top_ps, top_ks, min_ps, greedy = [], [], [], [], []
        for req in reqs:
            sp = req.sampling_params
            greedy.append(sp.is_greedy)
            temps.append(1.0 if sp.temperature < _GREEDY_EPS else float(sp.temperature))
            if sp.is_greedy:
                # Neutral filters: sampling never reads this row.
                top_ps.append(1.0)
                top_ks.append(vocab_size)
                min_ps.append(0.0)
                continue
            top_ps.append(float(sp.top_p))
            top_ks.append(vocab_size if sp.top_k < 1 else min(int(sp.top_k), vocab_size))
            min_ps.append(float(sp.min_p))
        return cls(
            temperatures=torch.tensor(temps, dtype=torch.float32, device=device).view(-1, 1),
            top_ps=torch.tensor(top_ps, dtype=torch.float32, device=device),
            top_ks=torch.tensor(top_ks, dtype=torch.int64, device=device),
            min_ps=torch.tensor(min_ps, dtype=torch.float32, device=device),
            is_greedy=torch.tensor(greedy, dtype=torch.bool, device=device),
            generators=[req.generator for req in reqs],
            vocab_size=vocab_size,
            is_all_greedy=all(greedy),
            need_top_p=any(p < 1.0 for p in top_ps),
            need_top_k=any(k < vocab_size for k in top_ks),
            need_min_p=any(p > 0.0 for p in min_ps),
            greedy_host=greedy, top_ks_host=top_ks, top_ps_host=top_ps,
            penalties=PenaltyState.build(reqs, vocab_size, device),
        )

    def expand_rows(self, repeats: Sequence[int]) -> "SamplingBatchInfo":
        """Repeat row r `repeats[r]` times (consecutively), e.g. for a verify pass that scores
        several positions per request. Penalties are those of the step start: tokens accepted
        inside the step do not update them. Repeated rows share their request's generator."""
        rep = torch.tensor(list(repeats), dtype=torch.int64, device=self.device)
        generators = [g for g, n in zip(self.generators, repeats) for _ in range(n)]

        def expand(t: torch.Tensor) -> torch.Tensor:
            return torch.repeat_interleave(t, rep, dim=0)

        return dataclasses.replace(
            self,
            temperatures=expand(self.temperatures),
            top_ps=expand(self.top_ps),
            top_ks=expand(self.top_ks),
            min_ps=expand(self.min_ps),
            is_greedy=expand(self.is_greedy),
            generators=generators,
            greedy_host=[g for g, n in zip(self.greedy_host, repeats) for _ in range(n)],
            top_ks_host=[k for k, n in zip(self.top_ks_host, repeats) for _ in range(n)],
            top_ps_host=[p for p, n in zip(self.top_ps_host, repeats) for _ in range(n)],
            penalties=None if self.penalties is None else self.penalties.repeat_rows(rep),
            vocab_mask=None if self.vocab_mask is None else expand(self.vocab_mask),
        )
