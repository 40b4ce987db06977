"""Batched sampling: logit adjustments -> processed distribution -> one token per row.

`logits_to_probs` is the single definition of "the distribution a request samples from":
plain sampling draws from it, and speculative rejection sampling must use it as the target p,
so sampled output stays exactly the target's distribution.

Reproducibility: each sampled row draws with its own request's generator, one row at a time,
and every filter is defined by values only (never by the order of tied tokens), so a seeded
request produces the same tokens whatever else is in the batch.
"""

from __future__ import annotations

import dataclasses
from typing import List, Optional, Sequence, Tuple

import torch

from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo
from sglang.srt.utils import host_sync


@dataclasses.dataclass
class SampleOutput:
    next_token_ids: torch.Tensor  # [bs] int64
    # [bs, vocab] f32: log_softmax(adjusted_logits / temperature); temperature 0 -> no scaling.
    logprobs: Optional[torch.Tensor] = None


# Vocab block of greedy_ids: torch's argmax over a row is a scalar loop (1.3 ms for 10 rows of
# a 152K vocab on 2 cores, a tenth of a verify's non-kernel time) while amax is vectorised.
_ARGMAX_BLOCK = 256


def greedy_ids(logits: torch.Tensor) -> torch.Tensor:
    """torch.argmax(logits, dim=-1) for [bs, vocab], the same index (the first maximum; a NaN
    counts as the maximum): the first block of _ARGMAX_BLOCK logits holding the row's max,
    found by a blocked amax, then the argmax inside that block."""
    bs, vocab = logits.shape
    c = _ARGMAX_BLOCK
    if vocab <= 4 * c or not logits.is_cpu:
        return torch.argmax(logits, dim=-1)
    nb = vocab // c
    block_max = logits[:, :nb * c].reshape(bs, nb, c).amax(dim=-1)  # [bs, nb]
    if nb * c < vocab:
        block_max = torch.cat([block_max, logits[:, nb * c:].amax(dim=-1, keepdim=True)], 1)
    start = torch.argmax(block_max, dim=-1) * c  # [bs]: the first block with the max
    # the last block may be short: its clamped copies of the last logit come after it
    cols = (start.unsqueeze(1) + torch.arange(c)).clamp_(max=vocab - 1)
    return start + torch.argmax(logits.gather(1, cols), dim=-1)


def apply_logit_adjustments(logits: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
    """Penalties, logit_bias, min_new_tokens and the grammar mask. Returns a float32 tensor
    [bs, vocab]; the input is never modified."""
    if info.penalties is None and info.vocab_mask is None:
        return logits.float()
    logits = logits.to(torch.float32, copy=True)
    if info.penalties is not None:
        info.penalties.apply(logits)
    if info.vocab_mask is not None:
        logits.masked_fill_(info.vocab_mask, float("-inf"))
    return logits


def logits_to_probs(logits: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
    """The distribution each row samples from, [bs, vocab] f32, rows summing to 1.

    `logits` must already be adjusted (`apply_logit_adjustments`). Sampled rows: softmax of
    logits / temperature, then top-k, top-p, min-p, renormalised after each filter (HF order).
    Greedy rows: one-hot at argmax (lowest index on ties). Top-k and top-p keep every token tied
    with the last one kept, so which of equal tokens survives never depends on the batch.
    """
    scaled = logits.float() / info.temperatures  # [bs, vocab]
    if info.need_top_k:
        scaled = _mask_top_k(scaled, info.top_ks, info.top_ks_host, info.vocab_size)
    probs = torch.softmax(scaled, dim=-1)
    if info.need_top_p:
        # the head's cap: the largest top-k of the sampled rows, known on the host
        k_cap = max(k for k, g in zip(info.top_ks_host, info.greedy_host) if not g)
        probs = _mask_top_p(probs, info.top_ps, info.top_ps_host, k_cap, info.vocab_size)
    if info.need_min_p:
        max_probs = probs.max(dim=-1, keepdim=True).values  # [bs, 1]
        probs = probs.masked_fill(probs < max_probs * info.min_ps.unsqueeze(1), 0.0)
    if info.need_top_p or info.need_min_p:
        probs = probs / probs.sum(dim=-1, keepdim=True)
    if any(info.greedy_host):
        # Argmax of the unscaled logits: division could merge two close values into a tie.
        one_hot = torch.zeros_like(probs).scatter_(
            1, torch.argmax(logits, dim=-1, keepdim=True), 1.0)
        probs = torch.where(info.is_greedy.unsqueeze(1), one_hot, probs)
    return probs


def _host_rows(flags: Sequence[bool], device) -> torch.Tensor:
    """The rows whose flag is set, from host flags (a nonzero() on a GPU waits for it)."""
    return torch.tensor([i for i, f in enumerate(flags) if f], dtype=torch.int64, device=device)


def _mask_top_k(scaled: torch.Tensor, top_ks: torch.Tensor, top_ks_host: Sequence[int],
                vocab_size: int) -> torch.Tensor:
    """Set logits below each row's k-th largest value to -inf (rows with k == vocab: untouched)."""
    rows = _host_rows([k < vocab_size for k in top_ks_host], scaled.device)
    sub = scaled[rows]  # [n, vocab]
    k_rows = top_ks[rows]  # [n]
    k_max = max(k for k in top_ks_host if k < vocab_size)
    top_vals = torch.topk(sub, k_max, dim=-1).values  # [n, k_max], descending
    kth = top_vals.gather(1, (k_rows - 1).unsqueeze(1))  # [n, 1]
    scaled = scaled.clone()
    scaled[rows] = sub.masked_fill(sub < kth, float("-inf"))
    return scaled


def _mask_top_p(probs: torch.Tensor, top_ps: torch.Tensor, top_ps_host: Sequence[float],
                k_cap: int, vocab_size: int) -> torch.Tensor:
    """Keep, per row with top_p < 1, the smallest head of the sorted distribution whose mass
    reaches top_p (plus ties with its last token); zero the rest (not renormalised)."""
    rows = _host_rows([p < 1.0 for p in top_ps_host], probs.device)
    sub = probs[rows]  # [n, vocab]
    p = top_ps[rows].unsqueeze(1)  # [n, 1]
    sorted_vals = _sorted_head(sub, p, k_cap, vocab_size)  # [n, h]
    mass_before = torch.cumsum(sorted_vals, dim=-1) - sorted_vals  # exclusive prefix sums
    n_keep = (mass_before < p).sum(dim=-1).clamp(min=1)  # [n]
    cutoff = sorted_vals.gather(1, (n_keep - 1).unsqueeze(1))  # [n, 1]
    probs = probs.clone()
    probs[rows] = sub.masked_fill(sub < cutoff, 0.0)
    return probs


def _sorted_head(sub: torch.Tensor, p: torch.Tensor, k_cap: int, vocab_size: int) -> torch.Tensor:
    """The largest values of each row, descending: enough of them that every row's head holds
    mass >= p, or all that can be non-zero (k_cap, the largest top-k of the rows).

    Sorting a 150K vocabulary costs ~15 ms a row on CPU, while a top-256 costs ~0.4 ms and
    usually already holds the top-p mass of a language model's distribution; grow only when
    not. Cutting the head early changes nothing: positions past it only see prefix mass >= what
    the head already reaches, so they would be dropped anyway."""
    k = min(256, k_cap)
    while True:
        if k >= vocab_size:
            return torch.sort(sub, dim=-1, descending=True).values
        head = torch.topk(sub, k, dim=-1).values  # [n, k]
        if k >= k_cap or host_sync.to_bool((torch.cumsum(head, dim=-1)[:, -1:] >= p).all(),
                                           "top_p_head"):
            return head
        k = min(k * 8, k_cap)


def draw_from_probs(probs: torch.Tensor,
                    generators: Sequence[Optional[torch.Generator]]) -> torch.Tensor:
    """One draw per row of `probs` [n, vocab] (rows need not be normalised); returns [n] int64.

    Inverse CDF with one float64 uniform from the row's own generator (None: torch's global
    RNG), row by row so a seeded request never depends on its neighbours. Exact, and ~25x
    cheaper on CPU than torch.multinomial, which draws one exponential per vocab entry."""
    n, vocab = probs.shape
    cdf = torch.cumsum(probs, dim=-1, dtype=torch.float64)  # [n, vocab]
    uniforms = torch.empty(n, dtype=torch.float64)
    for i, gen in enumerate(generators):
        # Drawn on the generator's device: a CPU generator keeps seeds portable across devices.
        uniforms[i] = torch.rand((), dtype=torch.float64, generator=gen,
                                 device=gen.device if gen is not None else "cpu").item()
    targets = (uniforms.to(cdf.device) * cdf[:, -1]).unsqueeze(1)  # [n, 1], in [0, total)
    # First index whose cdf exceeds the target: never a zero-probability token.
    ids = torch.searchsorted(cdf, targets, right=True).squeeze(1)  # [n]
    # the target rounded up to the total: take the last non-zero token (no device read)
    last_nonzero = vocab - 1 - torch.argmax((probs.flip(-1) > 0).to(torch.int8), dim=-1)
    return torch.where(ids >= vocab, last_nonzero, ids)


def sample(logits: torch.Tensor, info: SamplingBatchInfo,
           return_logprobs: bool = False) -> SampleOutput:
    """Next token per row of `logits` [bs, vocab]. Greedy rows: argmax of the adjusted logits
    (no RNG consumed). Other rows: a draw from `logits_to_probs`."""
    adjusted = apply_logit_adjustments(logits, info)  # [bs, vocab] f32
    next_ids = greedy_ids(adjusted)  # [bs]
    if not info.is_all_greedy:
        probs = logits_to_probs(adjusted, info)
        sampled = [i for i, g in enumerate(info.greedy_host) if not g]
        sampled_rows = torch.tensor(sampled, dtype=torch.int64, device=logits.device)
        gens = [info.generators[i] for i in sampled]
        next_ids[sampled_rows] = draw_from_probs(probs[sampled_rows], gens)
    logprobs = adjusted_logprobs(adjusted, info) if return_logprobs else None
    return SampleOutput(next_token_ids=next_ids, logprobs=logprobs)


def adjusted_logprobs(adjusted: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
    """The logprobs SGLang reports: log_softmax(adjusted logits / temperature) [bs, vocab]."""
    logprobs = torch.log_softmax(adjusted / info.temperatures, dim=-1)
    # -inf (masked tokens) is not valid JSON; clamp like upstream does.
    return logprobs.clamp(min=torch.finfo(torch.float32).min)


def top_logprobs(logprobs_row: torch.Tensor, k: int) -> List[Tuple[float, int]]:
    """The k most likely (logprob, token_id) pairs of one row [vocab], best first."""
    k = min(k, logprobs_row.shape[-1])
    if k <= 0:
        return []
    vals, ids = torch.topk(logprobs_row, k)
    return list(zip(host_sync.to_list(vals, "top_logprobs"),
                    host_sync.to_list(ids, "top_logprobs")))


def token_logprob(logprobs_row: torch.Tensor, token_id: int) -> float:
    return host_sync.to_float(logprobs_row[token_id], "token_logprob")
