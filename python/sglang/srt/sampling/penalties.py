"""Logit penalties for a batch: repetition, frequency/presence, logit_bias, min_new_tokens.

Everything is stored sparsely as flat (row, token, value) triples, so the cost per step is
proportional to the number of distinct tokens a batch has seen, not to `bs * vocab`.
Order of application (matches vLLM; HF applies repetition to raw logits too):
  1. repetition penalty over prompt + output tokens (HF: positive / p, negative * p),
  2. frequency and presence penalties over output tokens (OpenAI: -= f * count + p * (count > 0)),
  3. logit_bias (added),
  4. min_new_tokens: stop/EOS ids -> -inf while len(output_ids) < min_new_tokens.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, List, Optional, Sequence, Tuple

import torch

if TYPE_CHECKING:
    from sglang.srt.sampling.sampling_batch_info import SamplingView

# verify() admits repetition_penalty == 0; dividing by it would put +inf in the logits and NaN in
# softmax. Clamp so the row stays finite (the repeated tokens just get pushed very far).
_MIN_REPETITION_PENALTY = 1e-6


@dataclasses.dataclass
class _Sparse:
    """Flat (row, token, value) triples; `value` is None for pure masks."""

    rows: torch.Tensor  # [n] int64
    tokens: torch.Tensor  # [n] int64
    values: Optional[torch.Tensor] = None  # [n] f32

    def repeat_rows(self, repeats: torch.Tensor) -> "_Sparse":
        """Row r becomes rows starts[r] .. starts[r] + repeats[r] - 1 (for multi-token verify)."""
        starts = torch.cumsum(repeats, 0) - repeats
        per_entry = repeats[self.rows]
        offsets = _arange_segments(per_entry)
        src = torch.repeat_interleave(torch.arange(self.rows.numel(), device=self.rows.device),
                                      per_entry)
        return _Sparse(starts[self.rows[src]] + offsets, self.tokens[src],
                       None if self.values is None else self.values[src])


def _arange_segments(lengths: torch.Tensor) -> torch.Tensor:
    """[2, 3] -> [0, 1, 0, 1, 2]."""
    total = int(lengths.sum())
    starts = torch.repeat_interleave(torch.cumsum(lengths, 0) - lengths, lengths)
    return torch.arange(total, device=lengths.device) - starts


def _flatten(triples: List[Tuple[int, List[int], Optional[List[float]]]],
             device: torch.device | str) -> Optional[_Sparse]:
    rows: List[int] = []
    tokens: List[int] = []
    values: List[float] = []
    with_values = any(v is not None for _, _, v in triples)
    for row, toks, vals in triples:
        rows.extend([row] * len(toks))
        tokens.extend(toks)
        if with_values:
            values.extend(vals or [])
    if not tokens:
        return None
    return _Sparse(torch.tensor(rows, dtype=torch.int64, device=device),
                   torch.tensor(tokens, dtype=torch.int64, device=device),
                   torch.tensor(values, dtype=torch.float32, device=device)
                   if with_values else None)


@dataclasses.dataclass
class PenaltyState:
    """Penalty data of one batch; each part is None when no row of the batch uses it."""

    repetition: Optional[_Sparse] = None  # value = penalty, over distinct prompt+output tokens
    additive: Optional[_Sparse] = None  # value = -(f * count + p) over distinct output tokens
    logit_bias: Optional[_Sparse] = None  # value = bias
    min_tokens_mask: Optional[_Sparse] = None  # tokens to forbid

    @classmethod
    def build(cls, reqs: Sequence["SamplingView"], vocab_size: int,
              device: torch.device | str = "cpu") -> Optional["PenaltyState"]:
        """Returns None when no request of the batch uses any penalty."""
        rep, add, bias, mask = [], [], [], []
        for row, req in enumerate(reqs):
            sp = req.sampling_params
            if sp.repetition_penalty != 1.0:
                seen = torch.unique(torch.tensor(
                    list(req.origin_input_ids) + list(req.output_ids), dtype=torch.int64))
                seen = seen[(seen >= 0) & (seen < vocab_size)].tolist()
                pen = max(float(sp.repetition_penalty), _MIN_REPETITION_PENALTY)
                rep.append((row, seen, [pen] * len(seen)))
            if (sp.frequency_penalty != 0.0 or sp.presence_penalty != 0.0) and req.output_ids:
                ids = torch.tensor(req.output_ids, dtype=torch.int64)
                ids = ids[(ids >= 0) & (ids < vocab_size)]
                counts = torch.bincount(ids, minlength=0)  # [max_id + 1]
                toks = torch.nonzero(counts).flatten()
                vals = -(sp.frequency_penalty * counts[toks].float() + sp.presence_penalty)
                add.append((row, toks.tolist(), vals.tolist()))
            if sp.logit_bias:
                toks, vals = [], []
                for key, value in sp.logit_bias.items():
                    tok = int(key)
                    if 0 <= tok < vocab_size:  # padded or foreign ids are ignored
                        toks.append(tok)
                        vals.append(float(value))
                bias.append((row, toks, vals))
            if sp.min_new_tokens > 0 and len(req.output_ids) < sp.min_new_tokens:
                stops = sorted(t for t in req.stop_token_ids_all if 0 <= t < vocab_size)
                mask.append((row, stops, None))
        state = cls(_flatten(rep, device), _flatten(add, device), _flatten(bias, device),
                    _flatten(mask, device))
        return None if state.is_empty() else state

    def is_empty(self) -> bool:
        return all(p is None for p in (self.repetition, self.additive, self.logit_bias,
                                       self.min_tokens_mask))

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """Apply in place to `logits` [bs, vocab] f32 and return it."""
        if self.repetition is not None:
            r, t, pen = self.repetition.rows, self.repetition.tokens, self.repetition.values
            cur = logits[r, t]
            logits[r, t] = torch.where(cur > 0, cur / pen, cur * pen)
        if self.additive is not None:
            logits.index_put_((self.additive.rows, self.additive.tokens), self.additive.values,
                              accumulate=True)
        if self.logit_bias is not None:
            logits.index_put_((self.logit_bias.rows, self.logit_bias.tokens),
                              self.logit_bias.values, accumulate=True)
        if self.min_tokens_mask is not None:
            logits[self.min_tokens_mask.rows, self.min_tokens_mask.tokens] = float("-inf")
        return logits

    def _map(self, fn) -> "PenaltyState":
        return PenaltyState(*(None if p is None else fn(p) for p in (
            self.repetition, self.additive, self.logit_bias, self.min_tokens_mask)))

    def repeat_rows(self, repeats: torch.Tensor) -> "PenaltyState":
        return self._map(lambda p: p.repeat_rows(repeats))
