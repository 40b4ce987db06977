"""OutputProcessor: what happens to logits after a forward, per request.

Owns the logprob conventions of SGLang's API (input logprobs cover prompt positions
logprob_start_len .. len-1, the first entry is null), sampling, stop conditions and the
updates sent to the detokenizer. Keeps scheduler.py about batching and memory only.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable, Dict, List, Optional, Set

import torch

from sglang.srt.managers.io_struct import ReqUpdate
from sglang.srt.managers.schedule_batch import Req
from sglang.srt.sampling.sampler import (adjusted_logprobs, apply_logit_adjustments, sample,
                                         token_logprob, top_logprobs)
from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo
from sglang.srt.utils import host_sync


@dataclasses.dataclass
class LogitRows:
    """Rows of this step's logits one request needs, as absolute row indices."""

    input_rows: List[int]  # positions whose next token is a prompt token (input logprobs)
    input_first_pos: int  # prompt position predicted by input_rows[0]
    sample_row: Optional[int]  # the row that samples the next token

    def all_rows(self) -> List[int]:
        return self.input_rows + ([self.sample_row] if self.sample_row is not None else [])


class OutputProcessor:
    def __init__(self, vocab_size: int, tokenizer, eos_token_ids: Set[int],
                 extra_meta: Optional[Callable[[Req], Dict[str, Any]]] = None,
                 grammar_backend=None) -> None:
        self.vocab_size = vocab_size
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.extra_meta = extra_meta
        self.grammar_backend = grammar_backend

    def init_req(self, req: Req) -> None:
        sp = req.sampling_params
        req.eos_token_ids = set() if sp.ignore_eos else set(self.eos_token_ids)
        req.stop_token_ids_all = req.eos_token_ids | set(sp.stop_token_ids or [])

    # ------------------------------------------------------------------ logits rows
    def logit_rows(self, req: Req, kv_len: int, n: int, start: int) -> LogitRows:
        prompt_len = len(req.origin_input_ids)
        rows: List[int] = []
        first = -1
        if req.wants_input_logprobs and not req.input_logprobs_done:
            # Row at position q predicts token q + 1; we need q in [start_len, prompt_len - 2].
            lo = max(kv_len, req.logprob_start_len)
            hi = min(kv_len + n, prompt_len - 1)
            rows = [start + q - kv_len for q in range(lo, hi)]
            first = lo + 1
        sample_row = start + n - 1 if kv_len + n == req.fill_len else None
        return LogitRows(rows, first, sample_row)

    def collect_input_logprobs(self, req: Req, rows: LogitRows, req_logits: torch.Tensor) -> None:
        if not req.wants_input_logprobs or req.input_logprobs_done:
            return
        if not req.input_logprob_pending:
            req.input_logprob_pending.append(None)  # the first prompt position has no context
            req.input_top_pending.append(None)
            req.input_ids_lp_pending.append(None)
        k = len(rows.input_rows)
        if k:
            logprobs = torch.log_softmax(req_logits[:k].float(), dim=-1)
            targets = req.origin_input_ids[rows.input_first_pos : rows.input_first_pos + k]
            picked = logprobs[torch.arange(k), torch.tensor(targets)]
            req.input_logprob_pending.extend(host_sync.to_list(picked, "input_logprobs"))
            for i in range(k):
                if req.top_logprobs_num:
                    req.input_top_pending.append(top_logprobs(logprobs[i], req.top_logprobs_num))
                if req.token_ids_logprob:
                    req.input_ids_lp_pending.append(
                        [[token_logprob(logprobs[i], t), t] for t in req.token_ids_logprob])
        if req.kv_len >= len(req.origin_input_ids):
            req.input_logprobs_done = True

    # ------------------------------------------------------------------ sampling
    def sample_and_append(self, reqs: List[Req], logits: torch.Tensor) -> None:
        info = SamplingBatchInfo.from_reqs(reqs, self.vocab_size, device=logits.device)
        if any(r.grammar is not None for r in reqs):
            info.vocab_mask = self.grammar_backend.forbidden_mask(
                [r.grammar for r in reqs]).to(logits.device)
        out = sample(logits, info, return_logprobs=any(r.return_logprob for r in reqs))
        # the step's one device-to-host copy of tokens
        next_ids = host_sync.to_list(out.next_token_ids, "next_token_ids")
        for i, (req, tok) in enumerate(zip(reqs, next_ids)):
            req.output_ids.append(tok)
            if req.grammar is not None:
                req.grammar.accept_token(tok)
            if req.return_logprob:
                self._record_output_logprob(req, out.logprobs[i], tok)
            self.check_finished(req)

    def append_verified(self, req: Req, tokens: List[int],
                        logits: Optional[torch.Tensor]) -> int:
        """Append a verified run token by token, stopping at the first finish condition
        (EOS, stop string, max_new_tokens inside the run). logits[j] predicted tokens[j]
        (needed only when the request returns logprobs). Returns how many tokens were
        appended."""
        logprobs = None
        if req.return_logprob:
            assert logits is not None, "a request returning logprobs needs its path's logits"
            info = SamplingBatchInfo.from_reqs([req], self.vocab_size, device=logits.device
                                               ).expand_rows([len(tokens)])
            adjusted = apply_logit_adjustments(logits[: len(tokens)].float(), info)
            logprobs = adjusted_logprobs(adjusted, info)
        for j, tok in enumerate(tokens):
            req.output_ids.append(tok)
            if logprobs is not None:
                self._record_output_logprob(req, logprobs[j], tok)
            self.check_finished(req)
            if req.finished:
                return j + 1
        return len(tokens)

    def _record_output_logprob(self, req: Req, lp: torch.Tensor, tok: int) -> None:
        req.out_logprobs_pending.append([token_logprob(lp, tok), tok])
        if req.top_logprobs_num:
            req.out_top_pending.append(top_logprobs(lp, req.top_logprobs_num))
        if req.token_ids_logprob:
            req.out_ids_lp_pending.append([[token_logprob(lp, t), t] for t in req.token_ids_logprob])

    def check_finished(self, req: Req) -> None:
        if req.finished:
            return
        sp = req.sampling_params
        last = req.output_ids[-1]
        if last in req.stop_token_ids_all and len(req.output_ids) >= sp.min_new_tokens:
            req.finished_reason = {"type": "stop", "matched": last}
            req.trim_tokens = 0 if sp.no_stop_trim else 1
            return
        if len(req.output_ids) >= req.max_new_tokens:
            req.finished_reason = {"type": "length", "length": req.max_new_tokens}
            return
        if (sp.stop or sp.stop_regex) and self.tokenizer is not None \
                and len(req.output_ids) >= sp.min_new_tokens:
            self._check_stop_strings(req)

    def _check_stop_strings(self, req: Req) -> None:
        sp = req.sampling_params
        longest = max([len(s) for s in sp.stop] + [0])
        tail_tokens = req.output_ids[-(longest + 2):] if not sp.stop_regex else req.output_ids[-64:]
        tail = self.tokenizer.decode(tail_tokens, skip_special_tokens=False)
        for stop in sp.stop:
            if stop in tail:
                req.finished_reason = {"type": "stop", "matched": stop}
                req.matched_stop_str = stop
                return
        for pattern in sp.stop_regex:
            m = re.search(pattern, tail)
            if m:
                req.finished_reason = {"type": "stop", "matched": pattern}
                req.matched_stop_str = m.group(0)
                return

    # ------------------------------------------------------------------ updates
    def maybe_update(self, req: Req) -> Optional[ReqUpdate]:
        new = len(req.output_ids) - req.sent_output_len
        if req.finished:
            return self.make_update(req)
        if not req.stream or new == 0:
            return None
        interval = req.sampling_params.stream_interval or 1
        if req.sent_output_len == 0 or new >= interval:
            return self.make_update(req)
        return None

    def make_update(self, req: Req) -> ReqUpdate:
        sp = req.sampling_params
        upd = ReqUpdate(
            rid=req.rid, new_output_ids=req.output_ids[req.sent_output_len:],
            finished_reason=req.finished_reason, prompt_tokens=len(req.origin_input_ids),
            cached_tokens=req.cached_tokens, completion_tokens=len(req.output_ids),
            total_retractions=req.total_retractions,
            trim_tokens=req.trim_tokens if req.finished else 0,
            matched_stop_str=req.matched_stop_str,
            skip_special_tokens=sp.skip_special_tokens,
            spaces_between_special_tokens=sp.spaces_between_special_tokens,
            no_stop_trim=sp.no_stop_trim,
        )
        req.sent_output_len = len(req.output_ids)
        if self.extra_meta is not None and req.finished:
            upd.extra_meta = self.extra_meta(req)
        if req.return_logprob:
            upd.output_token_logprobs, req.out_logprobs_pending = req.out_logprobs_pending, []
            if req.top_logprobs_num:
                upd.output_top_logprobs, req.out_top_pending = req.out_top_pending, []
            if req.token_ids_logprob:
                upd.output_token_ids_logprobs, req.out_ids_lp_pending = req.out_ids_lp_pending, []
            if req.input_logprobs_done and not req.input_logprobs_sent or \
                    (req.finished and not req.input_logprobs_sent):
                req.input_logprobs_sent = True
                upd.input_token_logprobs = _pairs(req.input_logprob_pending,
                                                  req.origin_input_ids, req.logprob_start_len)
                if req.top_logprobs_num:
                    upd.input_top_logprobs = req.input_top_pending
                if req.token_ids_logprob:
                    upd.input_token_ids_logprobs = req.input_ids_lp_pending
        return upd


def _pairs(logprobs: List[Optional[float]], prompt: List[int], start: int) -> List[List[Any]]:
    if start < 0:
        return []
    return [[lp, prompt[start + i]] for i, lp in enumerate(logprobs)]
