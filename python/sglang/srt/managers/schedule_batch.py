"""Req: the scheduler's view of one request.

Token arithmetic (the one rule every step follows): `fill_ids = origin_input_ids +
output_ids`; KV exists for `fill_ids[:kv_len]`; a step computes some of the tokens
`fill_ids[kv_len:]` and, when it reaches the end, samples one more token. Prefill, chunked
prefill, decode, prefix-cache hits and resumption after retraction are all this rule.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Set

import torch

from sglang.srt.sampling.sampling_params import SamplingParams

if TYPE_CHECKING:
    from sglang.srt.mem_cache.base_prefix_cache import CacheHandle


@dataclasses.dataclass
class Req:
    rid: str
    origin_input_ids: List[int]
    sampling_params: SamplingParams
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    token_ids_logprob: Optional[List[int]] = None
    stream: bool = False
    output_ids: List[int] = dataclasses.field(default_factory=list)
    generator: Optional[torch.Generator] = None
    stop_token_ids_all: Set[int] = dataclasses.field(default_factory=set)
    eos_token_ids: Set[int] = dataclasses.field(default_factory=set)

    # Constrained generation: the compiled grammar arrives asynchronously, then a matcher.
    grammar_future: Optional[Any] = None
    grammar: Optional[Any] = None

    # Memory state
    req_pool_idx: Optional[int] = None
    kv_len: int = 0
    cache_handle: Optional["CacheHandle"] = None
    cache_protected_len: int = 0  # leading tokens whose slots the prefix cache owns

    # Reporting
    cached_tokens: int = 0
    total_retractions: int = 0
    finished_reason: Optional[Dict[str, Any]] = None
    trim_tokens: int = 0
    matched_stop_str: Optional[str] = None
    admitted_step: int = -1

    # Logprobs accumulated while running; flushed to the client with each update
    input_logprob_pending: List[Optional[float]] = dataclasses.field(default_factory=list)
    input_top_pending: List[Any] = dataclasses.field(default_factory=list)
    input_ids_lp_pending: List[Any] = dataclasses.field(default_factory=list)
    input_logprobs_done: bool = False
    input_logprobs_sent: bool = False
    out_logprobs_pending: List[List[Any]] = dataclasses.field(default_factory=list)
    out_top_pending: List[Any] = dataclasses.field(default_factory=list)
    out_ids_lp_pending: List[Any] = dataclasses.field(default_factory=list)
    sent_output_len: int = 0

    # Speculative decoding statistics (SGLang's meta_info names)
    spec_verify_ct: int = 0
    spec_accept_token_num: int = 0
    spec_accept_histogram: List[int] = dataclasses.field(default_factory=list)

    @property
    def fill_ids(self) -> List[int]:
        return self.origin_input_ids + self.output_ids

    @property
    def fill_len(self) -> int:
        return len(self.origin_input_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.finished_reason is not None

    @property
    def wants_input_logprobs(self) -> bool:
        return self.return_logprob and 0 <= self.logprob_start_len < len(self.origin_input_ids)

    @property
    def max_new_tokens(self) -> int:
        mnt = self.sampling_params.max_new_tokens
        return 1 << 30 if mnt is None else mnt
