"""HTTP server: SGLang's native API and the OpenAI API on FastAPI + uvicorn (uvloop).

Native errors are `{"error": {"message": ...}}` (400 for bad input, 503 when refused);
OpenAI routes answer with OpenAI's flat error object. Lifecycle: /health answers 503 until
the warm-up request finished and while draining, else 200 at once (/health_generate also
generates one token); SIGTERM stops admitting, lets running
requests finish, then exits 0; a dead child process logs why and exits 1.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import sys
import time
from typing import Optional

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from sglang.srt.entrypoints.app_state import native_error, read_json, refused, state
from sglang.srt.entrypoints.body_limit import bounded_receive, declared_length, too_large_message
from sglang.srt.entrypoints.openai.protocol import ModelCard, ModelList
from sglang.srt.entrypoints.openai.serving_base import (ClientDisconnected, SafeJSONResponse,
                                                        json_bytes, until_disconnect)
from sglang.srt.entrypoints.server_routes import router as server_router
from sglang.srt.managers.expert_record_handler import PATHS, register_expert_record_routes
from sglang.srt.managers.io_struct import GenerateReqInput
from sglang.srt.managers.request_checks import RequestRefused, raise_if_refused
from sglang.srt.server_args import ServerArgs

logger = logging.getLogger(__name__)

_ADMIN_PATHS = ("/flush_cache", *PATHS.values())


@contextlib.asynccontextmanager
async def lifespan(_app: FastAPI):
    state.loop = asyncio.get_running_loop()
    task = asyncio.ensure_future(_warm_up())
    yield
    task.cancel()


app = FastAPI(lifespan=lifespan)


# ---------------------------------------------------------------------- auth and draining
class GateMiddleware:
    """Bearer auth (all but /health*, /metrics and OPTIONS), refusal while draining, and
    bodies over --max-request-body-bytes (413). Plain ASGI, so streaming responses still
    see client disconnects."""

    def __init__(self, asgi_app) -> None:
        self.app = asgi_app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            refusal = _refusal(scope)
            if refusal is None and state.server_args is not None and scope["method"] != "GET":
                limit = state.server_args.max_request_body_bytes
                declared = declared_length(scope)
                bounded = None if declared is not None and declared > limit else (
                    await bounded_receive(receive, limit))
                if bounded is None:
                    refusal = refused(scope["path"], too_large_message(limit), 413)
                else:
                    receive = bounded
            if refusal is not None:
                await refusal(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _refusal(scope) -> Optional[Response]:
    args, path = state.server_args, scope["path"]
    if args is None or scope["method"] == "OPTIONS":
        return None
    if not path.startswith(("/health", "/metrics")):
        headers = dict(scope["headers"])
        given = headers.get(b"authorization", b"").decode("latin-1")
        allowed = {f"Bearer {k}" for k in (args.api_key, args.admin_api_key) if k}
        if path in _ADMIN_PATHS and args.admin_api_key:
            allowed = {f"Bearer {args.admin_api_key}"}
        if allowed and given not in allowed:
            return SafeJSONResponse({"error": "Unauthorized"}, status_code=401)
    if state.draining and not path.startswith(("/health", "/metrics")):
        return refused(path, "The server is shutting down; no new requests are accepted.", 503)
    return None


app.add_middleware(GateMiddleware)


def error_response(exc: BaseException) -> Response:
    if isinstance(exc, (ValueError, TypeError)):
        return native_error(str(exc), 400)
    if isinstance(exc, RequestRefused):
        return native_error(str(exc), exc.status_code)
    logger.exception("Internal error while serving a request")
    return native_error(f"Internal server error: {exc}", 500)


# ---------------------------------------------------------------------- native API
@app.api_route("/generate", methods=["POST", "PUT"])
async def generate(request: Request):
    t0 = time.perf_counter()
    try:
        obj = GenerateReqInput.from_json(await read_json(request))
    except (ValueError, TypeError) as e:
        return native_error(str(e))
    agen = state.tokenizer_manager.generate_request(obj)
    try:
        first = await until_disconnect(request, agen.__anext__())
        if obj.stream and "index" not in first and first["meta_info"]["finish_reason"]:
            raise_if_refused(first)  # e.g. the queue is full: a status, not a stream
    except ClientDisconnected:
        return Response(status_code=499)
    except Exception as e:
        await agen.aclose()
        return error_response(e)
    if not obj.stream:
        await agen.aclose()
        _observe("generate_request", t0)
        return SafeJSONResponse(first)
    return StreamingResponse(_sse(first, agen), media_type="text/event-stream")


async def _sse(first, agen):
    """Chunks carry the cumulative text (SGLang's /generate contract), then [DONE]."""
    try:
        yield b"data: " + json_bytes(first) + b"\n\n"
        async for chunk in agen:
            yield b"data: " + json_bytes(chunk) + b"\n\n"
    except (ValueError, RequestRefused) as e:
        yield b"data: " + json_bytes({"error": {"message": str(e)}}) + b"\n\n"
    finally:
        await agen.aclose()  # aborts the request if the client went away
    yield b"data: [DONE]\n\n"


def _observe(name: str, t0: float) -> None:
    metrics = state.tokenizer_manager.metrics
    if metrics is not None:
        metrics.observe_handler(name, time.perf_counter() - t0)


app.include_router(server_router)
register_expert_record_routes(app, lambda action: state.tokenizer_manager.expert_distribution(action))


# ---------------------------------------------------------------------- OpenAI API
def _model_card() -> ModelCard:
    name = state.server_args.served_model_name
    return ModelCard(id=name, root=name, max_model_len=state.tokenizer_manager.context_len)


@app.get("/v1/models")
async def list_models():
    return SafeJSONResponse(ModelList(data=[_model_card()]).model_dump())


@app.get("/v1/models/{model:path}")
async def retrieve_model(model: str):
    if model != state.server_args.served_model_name:
        err = {"message": f"The model '{model}' does not exist",
               "type": "invalid_request_error", "param": "model", "code": "model_not_found"}
        return SafeJSONResponse({"error": err}, status_code=404)
    return SafeJSONResponse(_model_card().model_dump())


@app.post("/v1/completions")
async def openai_completions(request: Request):
    return await state.completions.handle(request)


@app.post("/v1/chat/completions")
async def openai_chat_completions(request: Request):
    return await state.chat.handle(request)


# ---------------------------------------------------------------------- lifecycle
async def _warm_up() -> None:
    """One short request before /health turns 200 (skipped with --skip-server-warmup)."""
    tm = state.tokenizer_manager
    if not state.server_args.skip_server_warmup:
        obj = GenerateReqInput(sampling_params={"max_new_tokens": 4, "temperature": 0},
                               rid=f"WARMUP_{os.urandom(8).hex()}",
                               **({"input_ids": [10, 11, 12]} if tm.tokenizer is None
                                  else {"text": "The capital city of France is"}))
        try:
            agen = tm.generate_request(obj)
            await agen.__anext__()
            await agen.aclose()
        except Exception as e:  # the server still serves; health shows the real state
            logger.error("The warm-up request failed: %s", e)
    state.ready = True
    logger.info("The server is fired up and ready to roll!")


class _Server:
    """uvicorn.Server whose SIGTERM drains instead of cutting requests off."""

    @staticmethod
    def make(config):
        import uvicorn

        class Server(uvicorn.Server):
            def handle_exit(self, sig, frame) -> None:
                if sig == signal.SIGTERM and not state.draining and state.loop is not None:
                    state.draining = True
                    state.loop.call_soon_threadsafe(lambda: asyncio.ensure_future(_drain(self)))
                    return
                super().handle_exit(sig, frame)  # SIGINT, or a second SIGTERM: stop now

        return Server(config)


async def _drain(server) -> None:
    tm = state.tokenizer_manager
    logger.info("SIGTERM received: finishing %d running request(s), then exiting.", tm.num_unfinished)
    while tm.num_unfinished > 0 and not tm.dead_message:
        await asyncio.sleep(0.05)
    server.should_exit = True


def launch_server(server_args: ServerArgs) -> None:
    import uvicorn

    from sglang.srt.entrypoints.launch import launch_subprocesses, watch_children
    from sglang.srt.entrypoints.openai.serving_chat import OpenAIServingChat
    from sglang.srt.entrypoints.openai.serving_completions import OpenAIServingCompletion
    from sglang.srt.utils.process import kill_process_tree

    logging.basicConfig(level=getattr(logging, server_args.log_level.upper()),
                        format="[%(asctime)s] %(levelname)s %(message)s")
    if server_args.node_rank > 0:  # TP ranks only; node 0 serves
        from sglang.srt.entrypoints.launch import run_follower_node

        sys.exit(run_follower_node(server_args))
    tm, procs, info, ipc_folder = launch_subprocesses(server_args)

    def on_death(message: str) -> None:
        if state.shutting_down:
            return
        logger.error("%s Shutting the server down.", message)
        kill_process_tree(procs)
        os._exit(1)

    try:
        if server_args.enable_metrics:
            from sglang.srt.metrics.collector import TokenizerMetrics

            tm.metrics = TokenizerMetrics(server_args.served_model_name)
        state.tokenizer_manager, state.server_args, state.scheduler_info = tm, server_args, info
        state.chat, state.completions = OpenAIServingChat(tm), OpenAIServingCompletion(tm)
        watch_children(procs, on_death)
        config = uvicorn.Config(app, host=server_args.host, port=server_args.port,
                                log_level=server_args.log_level_http or "warning",
                                loop="uvloop", timeout_keep_alive=5)
        _Server.make(config).run()
    finally:
        state.shutting_down = True
        kill_process_tree(procs)
        shutil.rmtree(ipc_folder, ignore_errors=True)
    logger.info("The server has shut down.")
