"""Expert distribution recording: the messages, the scheduler-side handler, the HTTP routes.

Upstream's endpoints, each POST (GET accepted too) and admin-only like /flush_cache:
    /start_expert_distribution_record   start a fresh recording
    /stop_expert_distribution_record    stop recording (records are kept)
    /dump_expert_distribution_record    write the records to a .pt file (see
                                        layers/moe/recorder.py for its layout); the JSON
                                        answer gives the path and per-layer expert counts
The recorder lives in the scheduler process (the MoE layers run there), so the HTTP process
sends an `ExpertDistributionReq` and waits for the `ExpertDistributionReqOutput`.

Wiring (done by the owners of those files):
- io_struct.py: re-export `ExpertDistributionReq`, `ExpertDistributionReqOutput`.
- scheduler_process.handle_message: `if isinstance(msg, ExpertDistributionReq):
  return handle_expert_distribution_req(msg)`.
- tokenizer_manager: `ExpertDistributionReqOutput` among the control replies that resolve
  `_control_future`, and `async def expert_distribution(self, action)` ->
  `await self._control(ExpertDistributionReq(action))`.
- http_server: `register_expert_record_routes(app, lambda action:
  state.tokenizer_manager.expert_distribution(action))`; add the three paths to
  `_ADMIN_PATHS`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Awaitable, Callable, Dict, Optional

ACTIONS = ("start", "stop", "dump")
PATHS = {action: f"/{action}_expert_distribution_record" for action in ACTIONS}


@dataclasses.dataclass
class ExpertDistributionReq:
    action: str  # "start" | "stop" | "dump"
    output_dir: Optional[str] = None  # dump only; default: the recorder's default_dump_dir()


@dataclasses.dataclass
class ExpertDistributionReqOutput:
    success: bool
    message: str = ""
    path: Optional[str] = None  # the dump's file
    summary: Dict[str, Any] = dataclasses.field(default_factory=dict)


def handle_expert_distribution_req(req: ExpertDistributionReq, recorder=None) -> ExpertDistributionReqOutput:
    """Scheduler side: act on the process's recorder (or `recorder`)."""
    from sglang.srt.layers.moe.recorder import get_expert_recorder

    recorder = recorder or get_expert_recorder()
    if req.action == "start":
        recorder.start()
        return ExpertDistributionReqOutput(True, "Expert distribution recording started.")
    if req.action == "stop":
        recorder.stop()
        return ExpertDistributionReqOutput(True, "Expert distribution recording stopped.")
    if req.action == "dump":
        try:
            path = recorder.dump(req.output_dir)
        except OSError as exc:
            return ExpertDistributionReqOutput(False, f"Could not write the dump: {exc}")
        snap = recorder.snapshot()
        summary = {"num_layers": snap["num_layers"], "num_experts": snap["num_experts"],
                   "top_k": snap["top_k"], "num_steps": len(snap["steps"]),
                   "counts": snap["counts"].tolist()}
        return ExpertDistributionReqOutput(True, f"Dumped to {path}.", path, summary)
    return ExpertDistributionReqOutput(False, f"unknown action {req.action!r}; one of {ACTIONS}")


def register_expert_record_routes(
        app, send: Callable[[str], Awaitable[ExpertDistributionReqOutput]]) -> None:
    """Add the three endpoints to a FastAPI `app`; `send(action)` forwards the request to
    the scheduler and returns its reply."""
    from fastapi.responses import JSONResponse

    def route(action: str):
        async def endpoint():
            out = await send(action)
            body = {"success": out.success, "message": out.message}
            if out.path is not None:
                body.update(path=out.path, **out.summary)
            return JSONResponse(body, status_code=200 if out.success else 400)

        endpoint.__name__ = f"{action}_expert_distribution_record"
        return endpoint

    for action in ACTIONS:
        app.add_api_route(PATHS[action], route(action), methods=["POST", "GET"])
