"""The server's own routes, beside the generation APIs: health (shallow and deep), load,
model and server info, cache flush, aborts, metrics. Upstream's paths and shapes, which the
sglang-router and monitoring read."""

from __future__ import annotations

import asyncio
import os

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse, Response

from sglang.srt.entrypoints.app_state import native_error, read_json, serving, state
from sglang.srt.entrypoints.openai.serving_base import SafeJSONResponse
from sglang.srt.managers.io_struct import GenerateReqInput
from sglang.srt.managers.tokenizer_manager import HEALTH_CHECK_PREFIX
from sglang.version import __version__

router = APIRouter()


@router.get("/health")
async def health():
    """Up, warmed and its processes alive (they are watched): answered at once, never queued
    behind a long prefill, which had a router mark a busy worker unhealthy. The deep check,
    one generated token, is /health_generate (upstream's pair)."""
    return Response(status_code=200 if serving() else 503)


@router.get("/health_generate")
async def health_generate():
    tm = state.tokenizer_manager
    if not serving():
        return Response(status_code=503)
    obj = GenerateReqInput(input_ids=[0], sampling_params={"max_new_tokens": 1, "temperature": 0},
                           rid=f"{HEALTH_CHECK_PREFIX}_{os.urandom(8).hex()}")
    agen = tm.generate_request(obj)
    try:
        await asyncio.wait_for(agen.__anext__(), timeout=20)
        return Response(status_code=200)
    except Exception:
        return Response(status_code=503)
    finally:
        await agen.aclose()


@router.get("/get_model_info")
@router.get("/model_info")
async def model_info():
    args = state.server_args
    return {"model_path": args.model_path, "tokenizer_path": args.tokenizer_path,
            "is_generation": True, "preferred_sampling_params": None,
            "weight_version": "default", "has_image_understanding": False,
            "has_audio_understanding": False, "model_type": state.scheduler_info.get("model_type"),
            "architectures": state.scheduler_info.get("architectures")}


@router.get("/get_load")
async def get_load():
    """Upstream's load shape, one entry per data-parallel rank (one here), for the
    sglang-router's load monitor and power-of-two policy: requests running and waiting,
    and the KV tokens they hold (the pool less its free and evictable cached tokens)."""
    s = await state.tokenizer_manager.get_internal_state()
    used = s["max_total_num_tokens"] - s["available_kv_tokens"] - s["cache_evictable_tokens"]
    return [{"dp_rank": 0, "num_reqs": s["num_running_reqs"] + s["num_waiting_reqs"],
             "num_waiting_reqs": s["num_waiting_reqs"], "num_tokens": max(used, 0)}]


@router.get("/get_server_info")
@router.get("/server_info")
async def server_info():
    internal = await state.tokenizer_manager.get_internal_state()
    args = dict(vars(state.server_args))
    internal_state = {**args, **internal, "last_gen_throughput": _throughput()}
    internal_state.setdefault("avg_spec_accept_length", None)
    return SafeJSONResponse({
        **args, "dp_size": 1, "status": "ready" if state.ready else "starting",
        "max_total_num_tokens": internal["max_total_num_tokens"],
        "max_req_input_len": internal["max_req_input_len"],
        "internal_states": [internal_state], "version": __version__})


def _throughput() -> float:
    metrics = state.tokenizer_manager.metrics
    return metrics.throughput() if metrics is not None else 0.0


@router.api_route("/flush_cache", methods=["GET", "POST"])
async def flush_cache():
    out = await state.tokenizer_manager.flush_cache()
    if out.success:
        return PlainTextResponse("Cache flushed.\nPlease check backend logs for more details. "
                                 "(When there are running or waiting requests, the operation "
                                 "will not be performed.)\n")
    return PlainTextResponse(out.message, status_code=400)


@router.post("/abort_request")
async def abort_request(request: Request):
    try:
        body = await read_json(request)
        if not isinstance(body, dict):
            raise ValueError("The request body must be a JSON object.")
        rid, abort_all = body.get("rid", ""), bool(body.get("abort_all", False))
        if not abort_all and (not isinstance(rid, str) or not rid):
            raise ValueError("Give the rid (a string) of the request to abort, or abort_all: true.")
    except ValueError as e:
        return native_error(str(e))
    state.tokenizer_manager.abort_request("" if abort_all else rid)
    return Response(status_code=200)


@router.get("/metrics")
async def metrics():
    collector = state.tokenizer_manager.metrics
    if collector is None:
        return native_error("Metrics are off; start the server with --enable-metrics.", 404)
    collector.refresh(await state.tokenizer_manager.get_internal_state())
    body, content_type = collector.render()
    return Response(body, media_type=content_type)
