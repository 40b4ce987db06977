"""Typed messages between the tokenizer manager, the scheduler and the detokenizer.

They cross process boundaries over ZMQ as pickles, so they hold only plain data
(lists, ints, strings, SamplingParams) and never tensors. Importable without torch.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional

from sglang.srt.managers.expert_record_handler import (  # noqa: F401  (re-exported)
    ExpertDistributionReq, ExpertDistributionReqOutput)
from sglang.srt.sampling.sampling_params import SamplingParams


@dataclasses.dataclass
class TokenizedGenerateReqInput:
    rid: str
    input_ids: List[int]
    sampling_params: SamplingParams
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    token_ids_logprob: Optional[List[int]] = None
    stream: bool = False
    input_text: Optional[str] = None


@dataclasses.dataclass
class AbortReq:
    rid: str  # "" aborts every request
    message: str = "Aborted by the client."


@dataclasses.dataclass
class FlushCacheReq:
    pass


@dataclasses.dataclass
class FlushCacheOutput:
    success: bool
    message: str = ""


@dataclasses.dataclass
class GetInternalStateReq:
    pass


@dataclasses.dataclass
class GetInternalStateOutput:
    state: Dict[str, Any]


@dataclasses.dataclass
class ReqUpdate:
    """What one request produced in one scheduler step (new tokens only)."""

    rid: str
    new_output_ids: List[int]
    finished_reason: Optional[Dict[str, Any]]  # SGLang's finish_reason dict, None while running
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    total_retractions: int = 0
    # Logprob entries for the new tokens: (logprob, token_id) pairs, top lists per position.
    output_token_logprobs: Optional[List[List[Any]]] = None
    output_top_logprobs: Optional[List[List[List[Any]]]] = None
    output_token_ids_logprobs: Optional[List[List[List[Any]]]] = None
    # Sent once, with the first update after the prompt is done.
    input_token_logprobs: Optional[List[List[Any]]] = None
    input_top_logprobs: Optional[List[Any]] = None
    input_token_ids_logprobs: Optional[List[Any]] = None
    # Tokens at the end of new_output_ids that must not appear in text (a matched stop token).
    trim_tokens: int = 0
    matched_stop_str: Optional[str] = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    extra_meta: Dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class BatchTokenIDOut:
    updates: List[ReqUpdate]


@dataclasses.dataclass
class ReqStrUpdate:
    """ReqUpdate after detokenization: text is the whole output so far."""

    update: ReqUpdate
    text: str
    # token texts for logprob entries (filled when the request asked for text in logprobs)
    token_texts: Optional[Dict[int, str]] = None


@dataclasses.dataclass
class BatchStrOut:
    updates: List[ReqStrUpdate]


@dataclasses.dataclass
class GenerateReqInput:
    """The body of POST /generate (and Engine.generate), as SGLang clients send it."""

    text: Optional[Any] = None  # str | list[str]
    input_ids: Optional[Any] = None  # list[int] | list[list[int]]
    input_embeds: Optional[Any] = None
    sampling_params: Optional[Any] = None  # dict | list[dict]
    rid: Optional[Any] = None
    stream: bool = False
    return_logprob: Optional[Any] = False
    logprob_start_len: Optional[Any] = None
    top_logprobs_num: Optional[Any] = None
    token_ids_logprob: Optional[Any] = None
    return_text_in_logprobs: bool = False
    # Accepted for compatibility; not used by this engine.
    image_data: Optional[Any] = None
    video_data: Optional[Any] = None
    audio_data: Optional[Any] = None
    modalities: Optional[Any] = None
    lora_path: Optional[Any] = None
    custom_logit_processor: Optional[Any] = None
    session_params: Optional[Any] = None
    priority: Optional[int] = None
    extra_key: Optional[Any] = None
    routing_key: Optional[Any] = None
    return_hidden_states: bool = False
    log_metrics: bool = True
    bootstrap_host: Optional[Any] = None
    bootstrap_port: Optional[Any] = None
    bootstrap_room: Optional[Any] = None
    data_parallel_rank: Optional[int] = None
    no_logs: bool = False
    background: bool = False
    custom_labels: Optional[Any] = None

    @classmethod
    def from_json(cls, body: Any) -> "GenerateReqInput":
        if not isinstance(body, dict):
            raise ValueError("The request body must be a JSON object.")
        names = {f.name for f in dataclasses.fields(cls)}
        # Upstream ignores fields it does not know (clients of newer versions send more).
        return cls(**{k: v for k, v in body.items() if k in names})

    def is_batch(self) -> bool:
        if self.text is not None:
            return isinstance(self.text, list)
        return bool(self.input_ids) and isinstance(self.input_ids[0], list)

    def split(self) -> List["SingleReq"]:
        """One SingleReq per (prompt, sample), in the order the response lists them."""
        given = [x is not None for x in (self.text, self.input_ids, self.input_embeds)]
        if sum(given) != 1:
            raise ValueError("Exactly one of text, input_ids and input_embeds must be given.")
        if self.input_embeds is not None:
            raise ValueError("input_embeds is not supported by this server; send text or input_ids.")
        prompts = self.text if self.text is not None else self.input_ids
        if self.text is not None:
            if not isinstance(prompts, (str, list)) or (
                    isinstance(prompts, list) and not all(isinstance(p, str) for p in prompts)):
                raise ValueError("text must be a string or a list of strings.")
        else:
            if not isinstance(prompts, list):
                raise ValueError("input_ids must be a list of integers or a list of lists.")
            if prompts and isinstance(prompts[0], list):
                if not all(isinstance(p, list) and all(_is_int(t) for t in p) for p in prompts):
                    raise ValueError("input_ids must be a list of integers or a list of lists of integers.")
            elif not all(_is_int(t) for t in prompts):
                raise ValueError("input_ids must be a list of integers or a list of lists of integers.")
        batch = self.is_batch()
        plist = prompts if batch else [prompts]
        if batch and len(plist) == 0:
            raise ValueError("The batch is empty.")
        count = len(plist)

        def per_item(value: Any, default: Any, name: str) -> List[Any]:
            if isinstance(value, list) and batch and name != "token_ids_logprob":
                if len(value) != count:
                    raise ValueError(f"{name} has {len(value)} entries for a batch of {count}.")
                return value
            if name == "token_ids_logprob" and batch and value and isinstance(value[0], list):
                return value
            return [default if value is None else value] * count

        sps = per_item(self.sampling_params, {}, "sampling_params")
        for sp in sps:
            if not isinstance(sp, dict):
                raise ValueError("sampling_params must be an object (or a list of objects for a batch).")
        ns = {int(sp.get("n", 1) or 1) for sp in sps}
        if len(ns) > 1:
            raise ValueError("All entries of a batch must use the same n.")
        n = ns.pop()
        rids = self.rid if isinstance(self.rid, list) else None
        if rids is not None and len(rids) != count:
            raise ValueError(f"rid has {len(rids)} entries for a batch of {count}.")
        lps = per_item(self.return_logprob, False, "return_logprob")
        starts = per_item(self.logprob_start_len, -1, "logprob_start_len")
        tops = per_item(self.top_logprobs_num, 0, "top_logprobs_num")
        tids = per_item(self.token_ids_logprob, None, "token_ids_logprob")
        out = []
        for i, prompt in enumerate(plist):
            for k in range(n):
                base_rid = rids[i] if rids else (self.rid if isinstance(self.rid, str) and count == 1 else None)
                rid = base_rid if n == 1 else (f"{base_rid}-{k}" if base_rid else None)
                sp = {key: v for key, v in sps[i].items() if key != "n"}
                out.append(SingleReq(
                    text=prompt if isinstance(prompt, str) else None,
                    input_ids=None if isinstance(prompt, str) else list(prompt),
                    sampling_params=sp, rid=rid, return_logprob=bool(lps[i]),
                    logprob_start_len=-1 if starts[i] is None else starts[i],
                    top_logprobs_num=tops[i] or 0, token_ids_logprob=tids[i],
                    return_text_in_logprobs=self.return_text_in_logprobs,
                    index=len(out), prompt_index=i))
        return out


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclasses.dataclass
class SingleReq:
    text: Optional[str]
    input_ids: Optional[List[int]]
    sampling_params: Dict[str, Any]
    rid: Optional[str]
    return_logprob: bool
    logprob_start_len: int
    top_logprobs_num: int
    token_ids_logprob: Optional[List[int]]
    return_text_in_logprobs: bool
    index: int
    prompt_index: int
