"""TokenizerManager: validates and tokenizes requests, tracks them, builds SGLang's responses.

Runs on the asyncio loop of the HTTP server (or of the offline Engine). Requests go to the
scheduler process over ZMQ; text comes back from the detokenizer process.
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
from sglang.srt.managers.io_struct import (AbortReq, BatchStrOut, FlushCacheOutput, FlushCacheReq,
                                           GenerateReqInput, GetInternalStateOutput,
                                           GetInternalStateReq, ReqStrUpdate, SingleReq,
                                           TokenizedGenerateReqInput)
from sglang.srt.sampling.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class ReqState:
    single: SingleReq
    rid: str
    queue: "asyncio.Queue[ReqStrUpdate]"
    created: float
    prompt_ids: List[int]
    output_ids: List[int] = dataclasses.field(default_factory=list)
    text: str = ""
    finished: bool = False
    meta_logprobs: Dict[str, list] = dataclasses.field(default_factory=dict)


class TokenizerManager:
    def __init__(self, server_args, addrs, scheduler_info: Dict[str, Any]) -> None:
        from sglang.srt.model_loader.loader import load_tokenizer

        self.server_args = server_args
        self.scheduler_info = scheduler_info
        self.context_len = scheduler_info["context_len"]
        self.vocab_size = scheduler_info["vocab_size"]
        self.tokenizer = None if server_args.skip_tokenizer_init else load_tokenizer(
            server_args.tokenizer_path)
        self.bos_id = tokenizer_adds_bos(self.tokenizer) if self.tokenizer is not None else None
        self.addrs = addrs
        self.rid_to_state: Dict[str, ReqState] = {}
        self.dead_message: Optional[str] = None
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
            elif isinstance(msg, (FlushCacheOutput, GetInternalStateOutput)):
                if self._control_future is not None and not self._control_future.done():
                    self._control_future.set_result(msg)

    def fail_all(self, message: str) -> None:
        """A child process died: fail every waiting request with the reason."""
        self.dead_message = message
        for state in self.rid_to_state.values():
            state.queue.put_nowait(None)  # type: ignore[arg-type]

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
        limit = self.context_len - 1
        if len(ids) > limit:
            if self.server_args.allow_auto_truncate:
                return ids[:limit]
            raise ValueError(f"The input ({len(ids)} tokens) is longer than the model's context "
                             f"length ({self.context_len} tokens). Shorten it, or start the server "
                             f"with --allow-auto-truncate.")
        if sp.max_new_tokens is not None and len(ids) + sp.max_new_tokens > self.context_len:
            # Upstream's behaviour: generation stops at the context end (not an error).
            sp.max_new_tokens = self.context_len - len(ids)
        return ids

    def prepare(self, obj: GenerateReqInput) -> List[ReqState]:
        """Validate, tokenize and register every sub-request; raises ValueError on bad input."""
        singles = obj.split()
        states = []
        for single in singles:
            sp = SamplingParams.from_dict(single.sampling_params)
            sp.verify(self.vocab_size)
            ids = self._check_length(self.tokenize(single), sp)
            if single.logprob_start_len is not None and single.logprob_start_len >= len(ids):
                raise ValueError(f"logprob_start_len ({single.logprob_start_len}) must be smaller "
                                 f"than the prompt length ({len(ids)} tokens).")
            rid = single.rid or uuid.uuid4().hex
            if rid in self.rid_to_state:
                raise ValueError(f"Duplicate request id {rid!r}.")
            state = ReqState(single, rid, asyncio.Queue(), time.time(), ids)
            state.sampling_params = sp  # type: ignore[attr-defined]
            states.append(state)
        return states

    def _send_req(self, state: ReqState, stream: bool) -> None:
        s = state.single
        self.rid_to_state[state.rid] = state
        self._send.send_pyobj(TokenizedGenerateReqInput(
            rid=state.rid, input_ids=state.prompt_ids,
            sampling_params=state.sampling_params,  # type: ignore[attr-defined]
            return_logprob=s.return_logprob, logprob_start_len=s.logprob_start_len,
            top_logprobs_num=s.top_logprobs_num, token_ids_logprob=s.token_ids_logprob,
            stream=stream, input_text=s.text))

    # ------------------------------------------------------------------ generate
    async def generate_request(self, obj: GenerateReqInput) -> AsyncIterator[Any]:
        """Yield response dicts: one final (dict or list) unless obj.stream, then chunks."""
        self._ensure_loop()
        if self.dead_message:
            raise RuntimeError(self.dead_message)
        states = self.prepare(obj)
        batch = obj.is_batch() or len(states) > 1
        if len(states) > 1 and len({s.single.prompt_index for s in states}) < len(states):
            await self._warm_prefixes(states)
        for st in states:
            self._send_req(st, obj.stream)
        try:
            if obj.stream:
                async for chunk in self._stream(states, batch):
                    yield chunk
            else:
                results = await asyncio.gather(*[self._wait_final(st) for st in states])
                yield results if batch else results[0]
        finally:
            for st in states:
                if not st.finished:
                    self.abort_request(st.rid)
                self.rid_to_state.pop(st.rid, None)

    async def _warm_prefixes(self, states: List[ReqState]) -> None:
        """n > 1: run each prompt once with max_new_tokens 0 so the samples share its KV."""
        seen = {}
        for st in states:
            seen.setdefault(st.single.prompt_index, st)
        warmers = []
        for st in seen.values():
            sp = SamplingParams.from_dict({"max_new_tokens": 0})
            w = ReqState(st.single, uuid.uuid4().hex, asyncio.Queue(), time.time(), st.prompt_ids)
            w.sampling_params = sp  # type: ignore[attr-defined]
            w.single = dataclasses.replace(st.single, return_logprob=False)
            self._send_req(w, False)
            warmers.append(w)
        try:
            await asyncio.gather(*[self._wait_final(w) for w in warmers])
        finally:
            for w in warmers:
                self.rid_to_state.pop(w.rid, None)

    async def _next(self, state: ReqState) -> Dict[str, Any]:
        upd = await state.queue.get()
        if upd is None:
            raise RuntimeError(self.dead_message or "The scheduler stopped.")
        return self._apply(state, upd)

    async def _wait_final(self, state: ReqState) -> Dict[str, Any]:
        while True:
            out = await self._next(state)
            if state.finished:
                return out

    async def _stream(self, states: List[ReqState], batch: bool) -> AsyncIterator[Dict[str, Any]]:
        pending = {asyncio.ensure_future(self._next(st)): st for st in states}
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

    def _apply(self, state: ReqState, su: ReqStrUpdate) -> Dict[str, Any]:
        upd = su.update
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
            meta["e2e_latency"] = time.time() - state.created
        out: Dict[str, Any] = {"output_ids": list(state.output_ids), "meta_info": meta}
        if self.tokenizer is not None:
            out = {"text": state.text, **out}
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

    async def get_internal_state(self) -> Dict[str, Any]:
        out = await self._control(GetInternalStateReq())
        return out.state

    def close(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
        self._send.close(linger=0)
        self._recv.close(linger=0)
        self._ctx.term()
