"""TokenizerManager: validates and tokenizes requests, tracks them, builds SGLang's responses.

Runs on the asyncio loop of the HTTP server (or of the offline Engine). Requests go to the
scheduler process over ZMQ; text comes back from the detokenizer process.

Errors a client caused raise ValueError (HTTP 400); a request the engine refused for
load or health reasons raises RequestRefused with its HTTP status (503, 500).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from typing import Any, AsyncIterator, Callable, Dict, List, Optional

import zmq
import zmq.asyncio

from sglang.srt.managers.bos_guard import encode_with_bos_guard, guard_bos, tokenizer_adds_bos
from sglang.srt.managers.io_struct import (AbortReq, BatchStrOut, ExpertDistributionReq,
                                           ExpertDistributionReqOutput, FlushCacheOutput,
                                           FlushCacheReq,
                                           GenerateReqInput, GetInternalStateOutput,
                                           GetInternalStateReq, ReqStrUpdate, SingleReq,
                                           TokenizedGenerateReqInput)
from sglang.srt.managers.request_checks import (RequestRefused, check_request_types,
                                               raise_if_refused)
from sglang.srt.sampling.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

_LOAD_TOKENIZER = object()  # sentinel: "no tokenizer handed in, load it here"
HEALTH_CHECK_PREFIX = "HEALTH_CHECK"  # rid prefix of /health probes (as upstream)


@dataclasses.dataclass
class ReqState:
    single: SingleReq
    rid: str
    queue: "asyncio.Queue[ReqStrUpdate]"
    created: float
    prompt_ids: List[int]
    sampling_params: Optional[SamplingParams] = None
    logprob_start_len: int = -1
    stream: bool = False
    output_ids: List[int] = dataclasses.field(default_factory=list)
    text: str = ""
    finished: bool = False
    meta_logprobs: Dict[str, list] = dataclasses.field(default_factory=dict)
    first_token_time: Optional[float] = None  # for TTFT / inter-token latency metrics
    last_token_time: Optional[float] = None


class TokenizerManager:
    def __init__(self, server_args, addrs, scheduler_info: Dict[str, Any],
                 tokenizer: Any = _LOAD_TOKENIZER) -> None:
        self.server_args = server_args
        self.scheduler_info = scheduler_info
        self.context_len = scheduler_info["context_len"]
        self.vocab_size = scheduler_info["vocab_size"]
        if server_args.skip_tokenizer_init:
            tokenizer = None
        elif tokenizer is _LOAD_TOKENIZER or tokenizer is None:
            from sglang.srt.model_loader.loader import load_tokenizer

            tokenizer = load_tokenizer(server_args.tokenizer_path)
        self.tokenizer = tokenizer
        self.bos_id = tokenizer_adds_bos(self.tokenizer) if self.tokenizer is not None else None
        self.addrs = addrs
        self.rid_to_state: Dict[str, ReqState] = {}
        self.dead_message: Optional[str] = None
        self.metrics = None  # a metrics.collector.TokenizerMetrics when --enable-metrics
        self._ctx = zmq.asyncio.Context()
        self._send = self._ctx.socket(zmq.PUSH)
        self._send.connect(addrs.scheduler)
        self._recv = self._ctx.socket(zmq.PULL)
        self._recv.bind(addrs.tokenizer)
        self._loop_task: Optional[asyncio.Task] = None
        self._control_lock: Optional[asyncio.Lock] = None
        self._control_future: Optional[asyncio.Future] = None
        self.on_finish: List[Callable[[ReqState, Dict[str, Any]], None]] = []

    # ------------------------------------------------------------------ plumbing
    def _ensure_loop(self) -> None:
        if self._loop_task is None or self._loop_task.done():
            self._control_lock = asyncio.Lock()
            self._loop_task = asyncio.get_running_loop().create_task(self._handle_loop())

    async def _handle_loop(self) -> None:
        while True:
            msg = await self._recv.recv_pyobj()
            if isinstance(msg, BatchStrOut):
                for upd in msg.updates:
                    state = self.rid_to_state.get(upd.update.rid)
                    if state is not None:
                        state.queue.put_nowait(upd)
            elif isinstance(msg, (FlushCacheOutput, GetInternalStateOutput,
                                  ExpertDistributionReqOutput)):
                if self._control_future is not None and not self._control_future.done():
                    self._control_future.set_result(msg)

    def fail_all(self, message: str) -> None:
        """A child process died: fail every waiting request with the reason."""
        self.dead_message = message
        for state in self.rid_to_state.values():
            state.queue.put_nowait(None)  # type: ignore[arg-type]

    @property
    def num_unfinished(self) -> int:
        return len(self.rid_to_state)

    # ------------------------------------------------------------------ tokenization
    def tokenize(self, single: SingleReq) -> List[int]:
        if single.text is not None:
            if self.tokenizer is None:
                raise ValueError("This server runs with --skip-tokenizer-init: send input_ids, not text.")
            ids = encode_with_bos_guard(self.tokenizer, single.text, self.bos_id)
        else:
            ids = guard_bos(list(single.input_ids), self.bos_id)
        if not ids:
            raise ValueError("The input is empty: send at least one token.")
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ValueError(f"input_ids contain {bad}, which is not a token id of this model "
                             f"(vocab size {self.vocab_size}).")
        return ids

    def _check_length(self, ids: List[int], sp: SamplingParams) -> List[int]:
        """SGLang's rules: the prompt must be shorter than the context, and prompt +
        max_new_tokens must stay below it; --allow-auto-truncate trims instead of refusing."""
        ctx = self.context_len
        if len(ids) >= ctx:
            if not self.server_args.allow_auto_truncate:
                raise ValueError(f"The input ({len(ids)} tokens) is longer than the model's "
                                 f"context length ({ctx} tokens).")
            logger.warning("The input (%d tokens) is longer than the context length (%d tokens); "
                           "truncating it.", len(ids), ctx)
            ids = ids[: ctx - 1]
        mnt = sp.max_new_tokens
        if mnt is None:  # an explicit null: generate up to the end of the context
            sp.max_new_tokens = ctx - len(ids)
        elif len(ids) + mnt >= ctx:
            if not self.server_args.allow_auto_truncate:
                raise ValueError(
                    f"Requested token count exceeds the model's maximum context length of {ctx} "
                    f"tokens. You requested a total of {len(ids) + mnt} tokens: {len(ids)} tokens "
                    f"from the input messages and {mnt} tokens for the completion. Please reduce "
                    f"the number of tokens in the input messages or the completion to fit within "
                    f"the limit.")
            sp.max_new_tokens = max(0, ctx - len(ids))
        return ids

    @staticmethod
    def _logprob_start(single: SingleReq, n_ids: int, sp: SamplingParams) -> int:
        """-1 means output logprobs only: then the input list is just the last prompt token
        (null logprob), or empty for a prefill-only request, as upstream reports it."""
        start = single.logprob_start_len
        prefill_only = sp.max_new_tokens == 0
        if not single.return_logprob:
            return -1
        if not isinstance(start, int) or isinstance(start, bool) or start < -1:
            raise ValueError(f"logprob_start_len must be an integer >= -1, got {start!r}")
        if start == -1:
            return n_ids if prefill_only else n_ids - 1
        if start >= n_ids and not prefill_only:
            raise ValueError(f"logprob_start_len ({start}) must be smaller than the number of "
                             f"input tokens ({n_ids}). Please use a smaller logprob_start_len.")
        return start

    def prepare(self, obj: GenerateReqInput) -> List[ReqState]:
        """Validate, tokenize and register every sub-request; raises ValueError on bad input."""
        check_request_types(obj)
        singles = obj.split()
        states = []
        for single in singles:
            sp = SamplingParams.from_dict(single.sampling_params)
            if single.sampling_params.get("max_new_tokens", 0) is None:
                sp.max_new_tokens = None  # upstream: null means "no limit but the context"
            sp.verify(self.vocab_size)
            if sp.stream_interval is None:
                sp.stream_interval = self.server_args.stream_interval
            ids = self._check_length(self.tokenize(single), sp)
            start = self._logprob_start(single, len(ids), sp)
            if single.top_logprobs_num > self.vocab_size:
                raise ValueError(f"top_logprobs_num ({single.top_logprobs_num}) must not exceed "
                                 f"the vocabulary size ({self.vocab_size}).")
            rid = single.rid or uuid.uuid4().hex
            if rid in self.rid_to_state or any(s.rid == rid for s in states):
                raise ValueError(f"Duplicate request id {rid!r}.")
            states.append(ReqState(single, rid, asyncio.Queue(), time.time(), ids, sp, start,
                                   bool(obj.stream)))
        return states

    def _send_req(self, state: ReqState) -> None:
        s = state.single
        self.rid_to_state[state.rid] = state
        self._send.send_pyobj(TokenizedGenerateReqInput(
            rid=state.rid, input_ids=state.prompt_ids, sampling_params=state.sampling_params,
            return_logprob=s.return_logprob, logprob_start_len=state.logprob_start_len,
            top_logprobs_num=s.top_logprobs_num, token_ids_logprob=s.token_ids_logprob,
            stream=state.stream, input_text=s.text))

    # ------------------------------------------------------------------ generate
    async def generate_request(self, obj: GenerateReqInput) -> AsyncIterator[Any]:
        """Yield response dicts: one final (dict or list) unless obj.stream, then chunks.

        Cancelling or closing the iterator aborts every unfinished sub-request (this is
        how a client that went away frees its KV slots)."""
        self._ensure_loop()
        if self.dead_message:
            raise RequestRefused(self.dead_message, 503)
        states = self.prepare(obj)
        if not states[0].rid.startswith(HEALTH_CHECK_PREFIX):  # health probes skip the queue cap
            self._check_queue_room(len(states))
        batch = obj.is_batch() or len(states) > 1
        try:
            if len(states) > 1 and len({s.single.prompt_index for s in states}) < len(states):
                await self._warm_prefixes(states)
            for st in states:
                self._send_req(st)
            if obj.stream:
                async for chunk in self._stream(states, batch):
                    yield chunk
            else:
                results = await asyncio.gather(*[self._wait_final(st) for st in states])
                yield results if batch else results[0]
        finally:
            for st in states:
                if not st.finished and st.rid in self.rid_to_state:
                    self.abort_request(st.rid)
                self.rid_to_state.pop(st.rid, None)

    def _check_queue_room(self, count: int) -> None:
        """Refuse at once when the queue must be full: with more unfinished requests than
        max running + max queued, the waiting queue holds at least --max-queued-requests.
        (The scheduler makes the exact check for every request it receives.)"""
        limit = self.server_args.max_queued_requests
        if limit is None:
            return
        cap = self.scheduler_info.get("max_running_requests", 0) + limit
        if self.num_unfinished + count > cap:
            from sglang.srt.managers.scheduler_process import queue_full_message

            raise RequestRefused(queue_full_message(limit), 503)

    async def _warm_prefixes(self, states: List[ReqState]) -> None:
        """n > 1: run each prompt once with max_new_tokens 0 so the samples share its KV."""
        seen: Dict[int, ReqState] = {}
        for st in states:
            seen.setdefault(st.single.prompt_index, st)
        warmers = []
        for st in seen.values():
            w = ReqState(dataclasses.replace(st.single, return_logprob=False), uuid.uuid4().hex,
                         asyncio.Queue(), time.time(), st.prompt_ids,
                         SamplingParams.from_dict({"max_new_tokens": 0}))
            self._send_req(w)
            warmers.append(w)
        try:
            await asyncio.gather(*[self._wait_final(w) for w in warmers])
        finally:
            for w in warmers:
                if not w.finished:
                    self.abort_request(w.rid)
                self.rid_to_state.pop(w.rid, None)

    async def _next(self, state: ReqState) -> Dict[str, Any]:
        upd = await state.queue.get()
        if upd is None:
            raise RequestRefused(self.dead_message or "The scheduler stopped.", 503)
        return self._apply(state, upd)

    async def _wait_final(self, state: ReqState) -> Dict[str, Any]:
        while True:
            out = await self._next(state)
            if state.finished:
                raise_if_refused(out)
                return out

    async def _stream(self, states: List[ReqState], batch: bool) -> AsyncIterator[Dict[str, Any]]:
        pending = {asyncio.ensure_future(self._next(st)): st for st in states}
        try:
            while pending:
                done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for fut in done:
                    st = pending.pop(fut)
                    out = fut.result()
                    if batch:
                        out["index"] = st.single.index
                    yield out
                    if not st.finished:
                        pending[asyncio.ensure_future(self._next(st))] = st
        finally:
            for fut in pending:
                fut.cancel()

    def _apply(self, state: ReqState, su: ReqStrUpdate) -> Dict[str, Any]:
        upd = su.update
        now = time.time()
        state.output_ids.extend(upd.new_output_ids)
        state.text = su.text
        state.finished = upd.finished_reason is not None
        meta: Dict[str, Any] = {
            "id": state.rid,
            "finish_reason": upd.finished_reason,
            "prompt_tokens": upd.prompt_tokens,
            "completion_tokens": upd.completion_tokens,
            "cached_tokens": upd.cached_tokens,
            "reasoning_tokens": 0,
            "weight_version": "default",
            "total_retractions": upd.total_retractions,
        }
        meta.update(upd.extra_meta)
        if state.single.return_logprob:
            self._merge_logprobs(state, upd)
            meta.update(state.meta_logprobs)
            meta["output_token_logprobs_length"] = len(state.meta_logprobs["output_token_logprobs"])
        if state.finished:
            meta["e2e_latency"] = now - state.created
        out: Dict[str, Any] = {"output_ids": list(state.output_ids), "meta_info": meta}
        if self.tokenizer is not None:
            out = {"text": state.text, **out}
        if self.metrics is not None:
            self.metrics.on_update(state, upd, now)
        if upd.new_output_ids:
            state.first_token_time = state.first_token_time or now
            state.last_token_time = now
        if state.finished:
            for hook in self.on_finish:
                hook(state, out)
        return out

    def _merge_logprobs(self, state: ReqState, upd) -> None:
        m = state.meta_logprobs
        with_text = state.single.return_text_in_logprobs
        m.setdefault("input_token_logprobs", [])
        m.setdefault("output_token_logprobs", [])
        if upd.input_token_logprobs is not None:
            m["input_token_logprobs"] = [self._entry(e, with_text) for e in upd.input_token_logprobs]
            if upd.input_top_logprobs is not None:
                m["input_top_logprobs"] = [None if p is None else [self._entry(e, with_text) for e in p]
                                           for p in upd.input_top_logprobs]
            if upd.input_token_ids_logprobs is not None:
                m["input_token_ids_logprobs"] = [None if p is None else [self._entry(e, with_text) for e in p]
                                                 for p in upd.input_token_ids_logprobs]
        m["output_token_logprobs"] += [self._entry(e, with_text) for e in upd.output_token_logprobs or []]
        if state.single.top_logprobs_num:
            m.setdefault("input_top_logprobs", [])
            m.setdefault("output_top_logprobs", [])
            m["output_top_logprobs"] += [[self._entry(e, with_text) for e in p]
                                         for p in upd.output_top_logprobs or []]
        if state.single.token_ids_logprob:
            m.setdefault("input_token_ids_logprobs", [])
            m.setdefault("output_token_ids_logprobs", [])
            m["output_token_ids_logprobs"] += [[self._entry(e, with_text) for e in p]
                                               for p in upd.output_token_ids_logprobs or []]

    def _entry(self, e: List[Any], with_text: bool) -> List[Any]:
        lp, tok = e[0], e[1]
        text = self.tokenizer.decode([tok]) if with_text and self.tokenizer is not None else None
        return [lp, tok, text]

    # ------------------------------------------------------------------ control
    def abort_request(self, rid: str = "", message: str = "Aborted by the client.") -> None:
        self._send.send_pyobj(AbortReq(rid, message))

    async def _control(self, msg):
        self._ensure_loop()
        async with self._control_lock:
            self._control_future = asyncio.get_running_loop().create_future()
            self._send.send_pyobj(msg)
            return await asyncio.wait_for(self._control_future, timeout=60)

    async def flush_cache(self) -> FlushCacheOutput:
        return await self._control(FlushCacheReq())

    async def expert_distribution(self, action: str) -> ExpertDistributionReqOutput:
        """start / stop / dump the expert distribution recorder in the scheduler."""
        return await self._control(ExpertDistributionReq(action))

    async def get_internal_state(self) -> Dict[str, Any]:
        out = await self._control(GetInternalStateReq())
        return out.state

    async def stop(self) -> None:
        """Cancel the receive loop and wait for it to end (run on the loop that started it):
        a task cancelled but never run again is destroyed pending, which asyncio logs as an
        error at shutdown."""
        task, self._loop_task = self._loop_task, None
        if task is not None and not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    def close(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
        self._send.close(linger=0)
        self._recv.close(linger=0)
        self._ctx.term()
