"""sglang.Engine: the offline entry point, same parts as the server without HTTP."""

from __future__ import annotations

import asyncio
import logging
import shutil
from typing import Any, Dict, Iterator, List, Optional, Union

from sglang.srt.managers.io_struct import GenerateReqInput
from sglang.srt.server_args import ServerArgs

logger = logging.getLogger(__name__)


class Engine:
    def __init__(self, server_args: Optional[ServerArgs] = None, **kwargs: Any) -> None:
        from sglang.srt.entrypoints.launch import launch_subprocesses, watch_children
        from sglang.srt.utils.flag_checks import check_one_replica

        if server_args is None:
            kwargs.setdefault("log_level", "error")
            server_args = ServerArgs(**kwargs)
        check_one_replica(server_args)
        self.server_args = server_args
        logging.basicConfig(level=getattr(logging, server_args.log_level.upper()))
        self.loop = asyncio.new_event_loop()
        self._closed = False
        self.tokenizer_manager, self.procs, self.scheduler_info, self._ipc = launch_subprocesses(
            server_args)
        watch_children(self.procs, self._on_child_death)

    def _on_child_death(self, message: str) -> None:
        if self._closed:
            return
        logger.error("%s The engine cannot serve any more requests.", message)
        self.loop.call_soon_threadsafe(self.tokenizer_manager.fail_all, message)

    # ------------------------------------------------------------------ generate
    def generate(self, prompt: Optional[Union[str, List[str]]] = None,
                 sampling_params: Optional[Union[Dict, List[Dict]]] = None,
                 input_ids: Optional[Union[List[int], List[List[int]]]] = None,
                 return_logprob: Union[bool, List[bool]] = False,
                 logprob_start_len: Optional[Union[int, List[int]]] = None,
                 top_logprobs_num: Optional[Union[int, List[int]]] = None,
                 token_ids_logprob: Optional[List] = None, stream: bool = False,
                 rid: Optional[Union[str, List[str]]] = None, return_text_in_logprobs: bool = False,
                 **_ignored: Any):
        obj = GenerateReqInput(text=prompt, input_ids=input_ids, sampling_params=sampling_params,
                               return_logprob=return_logprob, logprob_start_len=logprob_start_len,
                               top_logprobs_num=top_logprobs_num,
                               token_ids_logprob=token_ids_logprob, stream=stream, rid=rid,
                               return_text_in_logprobs=return_text_in_logprobs)
        agen = self.tokenizer_manager.generate_request(obj)
        if stream:
            return self._iterate(agen)
        return self.loop.run_until_complete(agen.__anext__())

    def _iterate(self, agen) -> Iterator[Dict[str, Any]]:
        try:
            while True:
                try:
                    yield self.loop.run_until_complete(agen.__anext__())
                except StopAsyncIteration:
                    return
        finally:
            self.loop.run_until_complete(agen.aclose())

    async def async_generate(self, prompt=None, sampling_params=None, input_ids=None,
                             stream: bool = False, **kwargs: Any):
        obj = GenerateReqInput(text=prompt, input_ids=input_ids, sampling_params=sampling_params,
                               stream=stream, **kwargs)
        agen = self.tokenizer_manager.generate_request(obj)
        if stream:
            return agen
        return await agen.__anext__()

    # ------------------------------------------------------------------ control
    def flush_cache(self) -> bool:
        return self.loop.run_until_complete(self.tokenizer_manager.flush_cache()).success

    def get_server_info(self) -> Dict[str, Any]:
        state = self.loop.run_until_complete(self.tokenizer_manager.get_internal_state())
        return {**vars(self.server_args), **state}

    def shutdown(self) -> None:
        from sglang.srt.utils.process import kill_process_tree

        if self._closed:
            return
        self._closed = True
        kill_process_tree(self.procs)
        try:
            if not self.loop.is_running():
                self.loop.run_until_complete(self.tokenizer_manager.stop())
            self.tokenizer_manager.close()
        finally:
            self.loop.close()
            shutil.rmtree(self._ipc, ignore_errors=True)

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    def __del__(self) -> None:  # pragma: no cover
        try:
            self.shutdown()
        except Exception:
            pass
