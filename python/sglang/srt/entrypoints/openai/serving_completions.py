"""POST /v1/completions: OpenAI text completions on top of the tokenizer manager.

Choices are ordered prompt by prompt, n samples each (index = prompt * n + sample);
streaming sends text deltas per choice, the finish reason on a choice's last chunk, then
(with stream_options.include_usage) a usage chunk with no choices, then [DONE].
"""

from __future__ import annotations

import time
import uuid
from typing import Any, AsyncIterator, Dict, List

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from sglang.srt.entrypoints.openai.protocol import (CompletionRequest, CompletionResponse,
                                                    CompletionResponseChoice,
                                                    CompletionResponseStreamChoice,
                                                    CompletionStreamResponse)
from sglang.srt.entrypoints.openai.serving_base import (ClientDisconnected, error_for,
                                                        finish_fields, openai_error,
                                                        openai_logprobs, parse_body,
                                                        sampling_params, streaming_error,
                                                        until_disconnect, usage)
from sglang.srt.managers.io_struct import GenerateReqInput
from sglang.srt.managers.request_checks import RequestRefused, raise_if_refused


class OpenAIServingCompletion:
    def __init__(self, tokenizer_manager) -> None:
        self.tm = tokenizer_manager

    async def handle(self, raw: Request) -> Response:
        try:
            req = await parse_body(raw, CompletionRequest)
            _validate(req)
            rid = req.rid or f"cmpl-{uuid.uuid4().hex}"
            obj = self._to_generate(req, rid)
        except ValueError as e:
            return openai_error(str(e))
        agen = self.tm.generate_request(obj)
        try:
            first = await until_disconnect(raw, agen.__anext__())
            if req.stream and first["meta_info"]["finish_reason"] is not None:
                raise_if_refused(first)
        except ClientDisconnected:
            return Response(status_code=499)
        except Exception as e:
            await agen.aclose()
            return error_for(e)
        if not req.stream:
            await agen.aclose()
            results = first if isinstance(first, list) else [first]
            return JSONResponse(self._response(req, rid, results).model_dump())
        return StreamingResponse(self._stream(req, rid, first, agen), media_type="text/event-stream")

    def _to_generate(self, req: CompletionRequest, rid: str) -> GenerateReqInput:
        prompt = req.prompt
        is_text = isinstance(prompt, str) or (bool(prompt) and isinstance(prompt[0], str))
        return GenerateReqInput(
            text=prompt if is_text else None, input_ids=None if is_text else prompt,
            sampling_params=sampling_params(req, req.max_tokens, req.stop),
            return_logprob=req.logprobs is not None, top_logprobs_num=req.logprobs or 0,
            logprob_start_len=0 if req.echo and req.logprobs else -1,
            return_text_in_logprobs=True, stream=req.stream, rid=rid)

    def _echo_texts(self, req: CompletionRequest) -> List[str]:
        """The prompt text each choice echoes, one per prompt."""
        p = req.prompt
        if isinstance(p, str):
            return [p]
        if p and isinstance(p[0], str):
            return list(p)
        decode = lambda ids: self.tm.tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
        if p and isinstance(p[0], list):
            return [decode(ids) for ids in p]
        return [decode(p)]

    def _logprobs(self, req: CompletionRequest, meta: Dict[str, Any], with_input: bool,
                  start: int = 0):
        return openai_logprobs(
            token_logprobs=meta["output_token_logprobs"][start:],
            top_logprobs=meta.get("output_top_logprobs", [])[start:],
            input_token_logprobs=meta.get("input_token_logprobs") if with_input else None,
            input_top_logprobs=meta.get("input_top_logprobs") if with_input else None)

    def _response(self, req: CompletionRequest, rid: str, results: List[Dict[str, Any]]):
        echo = self._echo_texts(req) if req.echo else None
        choices = []
        for idx, r in enumerate(results):
            text = r.get("text", "")
            if echo is not None:
                text = echo[idx // req.n] + text
            lp = self._logprobs(req, r["meta_info"], req.echo) if req.logprobs is not None else None
            choices.append(CompletionResponseChoice(index=idx, text=text, logprobs=lp,
                                                    **finish_fields(r["meta_info"])))
        return CompletionResponse(id=rid, model=req.model, choices=choices,
                                  usage=usage(results, req.n, self.tm.server_args.enable_cache_report))

    async def _stream(self, req: CompletionRequest, rid: str, first: Dict[str, Any],
                      agen: AsyncIterator[Dict[str, Any]]) -> AsyncIterator[str]:
        created = int(time.time())
        texts: Dict[int, str] = {}
        sent_lps: Dict[int, int] = {}
        finals: Dict[int, Dict[str, Any]] = {}
        echo = self._echo_texts(req) if req.echo else None
        try:
            content = first
            while True:
                index = content.get("index", 0)
                meta = content["meta_info"]
                started = index in texts
                prev = texts.get(index, "")
                delta = content.get("text", "")[len(prev):]
                texts[index] = content.get("text", "")
                if echo is not None and not started:
                    delta = echo[index // req.n] + delta
                lp = None
                if req.logprobs is not None:
                    lp = self._logprobs(req, meta, req.echo and not started, sent_lps.get(index, 0))
                    sent_lps[index] = len(meta["output_token_logprobs"])
                if meta["finish_reason"] is not None:
                    finals[index] = content
                choice = CompletionResponseStreamChoice(index=index, text=delta, logprobs=lp,
                                                        **finish_fields(meta))
                chunk = CompletionStreamResponse(id=rid, created=created, model=req.model,
                                                 choices=[choice])
                yield f"data: {chunk.model_dump_json()}\n\n"
                try:
                    content = await agen.__anext__()
                except StopAsyncIteration:
                    break
            if req.stream_options and req.stream_options.include_usage:
                results = [finals[i] for i in sorted(finals)]
                chunk = CompletionStreamResponse(
                    id=rid, created=created, model=req.model, choices=[],
                    usage=usage(results, req.n, self.tm.server_args.enable_cache_report))
                yield f"data: {chunk.model_dump_json(exclude_none=True)}\n\n"
        except (ValueError, RequestRefused) as e:
            yield streaming_error(str(e), getattr(e, "status_code", 400))
        finally:
            await agen.aclose()
        yield "data: [DONE]\n\n"


def _validate(req: CompletionRequest) -> None:
    p = req.prompt
    if isinstance(p, str):
        if not p.strip():
            raise ValueError("Prompt cannot be empty or whitespace only")
    elif not p:
        raise ValueError("Prompt list cannot be empty")
    elif isinstance(p[0], list) and any(len(x) == 0 for x in p):
        raise ValueError("Token sequences in the prompt cannot be empty")
    if req.logprobs is not None and req.logprobs < 0:
        raise ValueError(f"logprobs must be non-negative, got {req.logprobs}")
    if req.n < 1:
        raise ValueError(f"n must be at least 1, got {req.n}")
