"""HTTP server: SGLang's native API on FastAPI + uvicorn (OpenAI routes in openai/)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
from typing import Any, Dict, Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from sglang.srt.managers.io_struct import GenerateReqInput
from sglang.srt.server_args import ServerArgs
from sglang.version import __version__

logger = logging.getLogger(__name__)


class AppState:
    tokenizer_manager = None
    server_args: Optional[ServerArgs] = None
    scheduler_info: Dict[str, Any] = {}
    ready: bool = False


state = AppState()
app = FastAPI()


def error_response(message: str, status: int = 400) -> JSONResponse:
    return JSONResponse({"error": {"message": message}}, status_code=status)


@app.middleware("http")
async def api_key_auth(request: Request, call_next):
    key = state.server_args.api_key if state.server_args else None
    path = request.url.path
    if key and request.method != "OPTIONS" and not path.startswith(("/health", "/metrics")):
        if request.headers.get("Authorization", "") != f"Bearer {key}":
            return JSONResponse({"error": "Unauthorized"}, status_code=401)
    return await call_next(request)


async def read_json(request: Request) -> Any:
    try:
        return await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"The request body is not valid JSON: {e}")


@app.api_route("/generate", methods=["POST", "PUT"])
async def generate(request: Request):
    try:
        obj = GenerateReqInput.from_json(await read_json(request))
        agen = state.tokenizer_manager.generate_request(obj)
        if obj.stream:
            first = await agen.__anext__()  # surfaces validation errors as a 400
            return StreamingResponse(_sse(first, agen, request), media_type="text/event-stream")
        return JSONResponse(await agen.__anext__())
    except (ValueError, TypeError) as e:
        return error_response(str(e))
    except RuntimeError as e:
        return error_response(str(e), 503)


async def _sse(first, agen, request: Request):
    try:
        yield b"data: " + json.dumps(first).encode() + b"\n\n"
        async for chunk in agen:
            yield b"data: " + json.dumps(chunk).encode() + b"\n\n"
    except (ValueError, RuntimeError) as e:
        yield b"data: " + json.dumps({"error": {"message": str(e)}}).encode() + b"\n\n"
    finally:
        await agen.aclose()  # aborts the request if the client went away
    yield b"data: [DONE]\n\n"


@app.get("/health")
@app.get("/health_generate")
async def health():
    if not state.ready or state.tokenizer_manager.dead_message:
        return Response(status_code=503)
    obj = GenerateReqInput(input_ids=[0], sampling_params={"max_new_tokens": 1, "temperature": 0},
                           rid=f"HEALTH_CHECK_{os.urandom(4).hex()}")
    try:
        agen = state.tokenizer_manager.generate_request(obj)
        await asyncio.wait_for(agen.__anext__(), timeout=20)
        await agen.aclose()
        return Response(status_code=200)
    except Exception:
        return Response(status_code=503)


@app.get("/get_model_info")
@app.get("/model_info")
async def model_info():
    args = state.server_args
    return {"model_path": args.model_path, "tokenizer_path": args.tokenizer_path,
            "is_generation": True, "preferred_sampling_params": None,
            "weight_version": "default", "has_image_understanding": False,
            "has_audio_understanding": False, "model_type": state.scheduler_info.get("model_type"),
            "architectures": state.scheduler_info.get("architectures")}


@app.get("/get_server_info")
@app.get("/server_info")
async def server_info():
    internal = await state.tokenizer_manager.get_internal_state()
    args = {k: v for k, v in vars(state.server_args).items()}
    internal_state = {**args, **internal}
    internal_state.setdefault("avg_spec_accept_length", None)
    return {**args, "status": "ready", **{k: internal[k] for k in (
        "max_total_num_tokens", "max_req_input_len")},
        "internal_states": [internal_state], "version": __version__}


@app.api_route("/flush_cache", methods=["GET", "POST"])
async def flush_cache():
    out = await state.tokenizer_manager.flush_cache()
    if out.success:
        return PlainTextResponse("Cache flushed.\nPlease check backend logs for more details.")
    return PlainTextResponse(out.message, status_code=400)


@app.post("/abort_request")
async def abort_request(request: Request):
    try:
        body = await read_json(request)
    except ValueError as e:
        return error_response(str(e))
    rid = body.get("rid", "") if isinstance(body, dict) else ""
    state.tokenizer_manager.abort_request(rid if not body.get("abort_all") else "")
    return Response(status_code=200)


def launch_server(server_args: ServerArgs) -> None:
    import uvicorn

    from sglang.srt.entrypoints.launch import launch_subprocesses, watch_children
    from sglang.srt.utils.process import kill_process_tree

    logging.basicConfig(level=getattr(logging, server_args.log_level.upper()),
                        format="[%(asctime)s] %(levelname)s %(message)s")
    tm, procs, info, _ = launch_subprocesses(server_args)
    state.tokenizer_manager, state.server_args, state.scheduler_info = tm, server_args, info
    state.ready = True

    def on_death(message: str) -> None:
        logger.error("%s Shutting the server down.", message)
        kill_process_tree(procs)
        os._exit(1)

    watch_children(procs, on_death)
    try:
        uvicorn.run(app, host=server_args.host, port=server_args.port,
                    log_level=server_args.log_level_http or "warning", loop="uvloop",
                    timeout_keep_alive=5)
    finally:
        kill_process_tree(procs)
