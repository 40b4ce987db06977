"""POST /v1/chat/completions: chat template -> token ids -> the tokenizer manager.

Streaming, per choice: a role chunk (`{"role": "assistant", "content": ""}`), content
deltas, then after generation one chunk carrying that choice's finish_reason and
matched_stop; then (with stream_options.include_usage) a usage chunk with no choices;
then [DONE]. Chunks of all choices share the request's id.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, AsyncIterator, Dict, List, Optional

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from sglang.srt.entrypoints.openai.chat_template import ChatRenderer
from sglang.srt.entrypoints.openai.protocol import (ChatCompletionRequest, ChatCompletionResponse,
                                                    ChatCompletionResponseChoice,
                                                    ChatCompletionResponseStreamChoice,
                                                    ChatCompletionStreamResponse,
                                                    ChatCompletionTokenLogprob, ChatMessage,
                                                    ChoiceLogprobs, DeltaMessage, TopLogprob)
from sglang.srt.entrypoints.openai.serving_base import (ClientDisconnected, error_for,
                                                        finish_fields, load_generation_defaults,
                                                        openai_error, parse_body,
                                                        sampling_params, streaming_error,
                                                        until_disconnect, usage)
from sglang.srt.managers.io_struct import GenerateReqInput
from sglang.srt.managers.request_checks import RequestRefused, raise_if_refused

_MAX_TOP_LOGPROBS = 20


class OpenAIServingChat:
    def __init__(self, tokenizer_manager) -> None:
        self.tm = tokenizer_manager
        args = tokenizer_manager.server_args
        self.renderer = ChatRenderer(tokenizer_manager.tokenizer, args.chat_template)
        use_model = getattr(args, "sampling_defaults", "model") == "model"
        self.defaults = load_generation_defaults(args.model_path) if use_model else {}

    async def handle(self, raw: Request) -> Response:
        try:
            req = await parse_body(raw, ChatCompletionRequest)
            _validate(req)
            rid = req.rid or f"chatcmpl-{uuid.uuid4().hex}"
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

    def _to_generate(self, req: ChatCompletionRequest, rid: str) -> GenerateReqInput:
        text = self.renderer.render(req.messages, req.continue_final_message, req.tools,
                                    req.chat_template_kwargs)
        # None max tokens: generate until a stop or the end of the context, as upstream.
        max_new = req.max_completion_tokens or req.max_tokens
        return GenerateReqInput(
            input_ids=self.renderer.encode(text),
            sampling_params=sampling_params(req, max_new, req.stop, self.defaults),
            return_logprob=req.logprobs, top_logprobs_num=req.top_logprobs or 0,
            return_text_in_logprobs=True, stream=req.stream, rid=rid)

    def _response(self, req: ChatCompletionRequest, rid: str, results: List[Dict[str, Any]]):
        choices = []
        for idx, r in enumerate(results):
            meta = r["meta_info"]
            lp = _logprobs(meta, 0) if req.logprobs else None
            message = ChatMessage(role="assistant", content=r.get("text", "") or None)
            choices.append(ChatCompletionResponseChoice(index=idx, message=message, logprobs=lp,
                                                        **finish_fields(meta)))
        return ChatCompletionResponse(
            id=rid, model=req.model, choices=choices,
            usage=usage(results, req.n, self.tm.server_args.enable_cache_report),
            metadata={"weight_version": results[0]["meta_info"]["weight_version"]})

    async def _stream(self, req: ChatCompletionRequest, rid: str, first: Dict[str, Any],
                      agen: AsyncIterator[Dict[str, Any]]) -> AsyncIterator[str]:
        texts: Dict[int, str] = {}
        sent_lps: Dict[int, int] = {}
        finals: Dict[int, Dict[str, Any]] = {}

        def chunk(index: int, delta: DeltaMessage, logprobs=None, finish: Optional[Dict] = None) -> str:
            choice = ChatCompletionResponseStreamChoice(
                index=index, delta=delta, logprobs=logprobs,
                **(finish or {"finish_reason": None, "matched_stop": None}))
            out = ChatCompletionStreamResponse(id=rid, created=int(time.time()), model=req.model,
                                               choices=[choice])
            return f"data: {out.model_dump_json()}\n\n"

        try:
            content = first
            while True:
                index = content.get("index", 0)
                meta = content["meta_info"]
                if index not in texts:
                    texts[index] = ""
                    yield chunk(index, DeltaMessage(role="assistant", content=""))
                delta = content.get("text", "")[len(texts[index]):]
                texts[index] = content.get("text", "")
                if delta:
                    lp = None
                    if req.logprobs:
                        # Logprobs of tokens whose text is still pending ride on the next delta.
                        lp = _logprobs(meta, sent_lps.get(index, 0))
                        sent_lps[index] = len(meta["output_token_logprobs"])
                    yield chunk(index, DeltaMessage(content=delta), lp)
                if meta["finish_reason"] is not None:
                    finals[index] = content
                try:
                    content = await agen.__anext__()
                except StopAsyncIteration:
                    break
            for index in sorted(finals):
                yield chunk(index, DeltaMessage(), None, finish_fields(finals[index]["meta_info"]))
            if req.stream_options and req.stream_options.include_usage:
                results = [finals[i] for i in sorted(finals)]
                out = ChatCompletionStreamResponse(
                    id=rid, created=int(time.time()), model=req.model, choices=[],
                    usage=usage(results, req.n, self.tm.server_args.enable_cache_report))
                yield f"data: {out.model_dump_json()}\n\n"
        except (ValueError, RequestRefused) as e:
            yield streaming_error(str(e), getattr(e, "status_code", 400))
        finally:
            await agen.aclose()
        yield "data: [DONE]\n\n"


def _logprobs(meta: Dict[str, Any], start: int) -> ChoiceLogprobs:
    tokens = meta["output_token_logprobs"][start:]
    tops = meta.get("output_top_logprobs", [])[start:]
    content = []
    for k, (lp, _tok, text) in enumerate(tokens):
        top: Dict[str, float] = {}
        for tlp, _t, ttext in (tops[k] if k < len(tops) and tops[k] else []):
            top.setdefault(ttext, tlp)
        content.append(ChatCompletionTokenLogprob(
            token=text, bytes=list(text.encode("utf-8")), logprob=lp,
            top_logprobs=[TopLogprob(token=t, bytes=list(t.encode("utf-8")), logprob=v)
                          for t, v in top.items()]))
    return ChoiceLogprobs(content=content)


def _validate(req: ChatCompletionRequest) -> None:
    if not req.messages:
        raise ValueError("messages must not be empty.")
    if req.top_logprobs is not None:
        if not req.logprobs:
            raise ValueError("top_logprobs needs logprobs to be true.")
        if not 0 <= req.top_logprobs <= _MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs must be between 0 and {_MAX_TOP_LOGPROBS}, "
                             f"got {req.top_logprobs}")
    for name in ("max_tokens", "max_completion_tokens"):
        value = getattr(req, name)
        if value is not None and value <= 0:
            raise ValueError(f"{name} must be positive, got {value}")
    if req.n < 1:
        raise ValueError(f"n must be at least 1, got {req.n}")
