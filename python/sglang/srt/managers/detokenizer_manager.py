"""DetokenizerManager: token ids -> text, incrementally, in its own process.

Keeps, per request, the ids so far and two offsets so each update decodes only a short
tail (a whole-sequence decode per step would cost O(n^2) over a long output). Text is
cumulative, as SGLang's /generate streams it. Non-token messages pass straight through.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Dict, List

from sglang.srt.managers.io_struct import BatchStrOut, BatchTokenIDOut, ReqStrUpdate, ReqUpdate

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class DecodeState:
    ids: List[int]
    text: str = ""
    prefix_offset: int = 0  # ids[prefix_offset:read_offset] is context already emitted
    read_offset: int = 0


class IncrementalDetokenizer:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.states: Dict[str, DecodeState] = {}

    def _decode(self, ids: List[int], upd: ReqUpdate) -> str:
        return self.tokenizer.decode(
            ids, skip_special_tokens=upd.skip_special_tokens,
            spaces_between_special_tokens=upd.spaces_between_special_tokens)

    def process(self, upd: ReqUpdate) -> ReqStrUpdate:
        st = self.states.setdefault(upd.rid, DecodeState(ids=[]))
        st.ids.extend(upd.new_output_ids)
        if upd.finished_reason is not None:
            self.states.pop(upd.rid, None)
            return ReqStrUpdate(upd, self._final_text(st, upd))
        # Decode the tail with a little context so merges across tokens render right.
        prefix = self._decode(st.ids[st.prefix_offset : st.read_offset], upd)
        full = self._decode(st.ids[st.prefix_offset :], upd)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            st.text += full[len(prefix):]
            st.prefix_offset = st.read_offset
            st.read_offset = len(st.ids)
        return ReqStrUpdate(upd, st.text)

    def _final_text(self, st: DecodeState, upd: ReqUpdate) -> str:
        ids = st.ids[: len(st.ids) - upd.trim_tokens] if upd.trim_tokens else st.ids
        text = self._decode(ids, upd)
        if upd.matched_stop_str and not upd.no_stop_trim:
            pos = text.find(upd.matched_stop_str)
            if pos >= 0:
                text = text[:pos]
        return text


def run_detokenizer_process(server_args, addrs, ready_pipe, tokenizer_pipe=None) -> None:
    """Process entry: pull BatchTokenIDOut from the scheduler, push text to the tokenizer side.

    The tokenizer normally arrives over `tokenizer_pipe` (loaded once, by the scheduler);
    it is loaded here only when none arrives (no pipe, or it could not be pickled).
    """
    import zmq

    from sglang.srt.utils.process import configure_child_logging, watch_parent

    configure_child_logging(server_args.log_level, "detokenizer")
    watch_parent()
    ctx = zmq.Context()
    recv = ctx.socket(zmq.PULL)
    recv.bind(addrs.detokenizer)
    send = ctx.socket(zmq.PUSH)
    send.connect(addrs.tokenizer)
    tokenizer = None
    if not server_args.skip_tokenizer_init:
        if tokenizer_pipe is not None:
            _preimport_tokenizer_modules()
            tokenizer = tokenizer_pipe.recv()
        if tokenizer is None:
            from sglang.srt.model_loader.loader import load_tokenizer

            tokenizer = load_tokenizer(server_args.tokenizer_path)
    detok = IncrementalDetokenizer(tokenizer)
    ready_pipe.send("ready")
    while True:
        msg = recv.recv_pyobj()
        if isinstance(msg, BatchTokenIDOut) and detok.tokenizer is not None:
            msg = BatchStrOut([detok.process(u) for u in msg.updates])
        elif isinstance(msg, BatchTokenIDOut):
            msg = BatchStrOut([ReqStrUpdate(u, "") for u in msg.updates])
        send.send_pyobj(msg)


def _preimport_tokenizer_modules() -> None:
    """Import transformers' tokenizer classes while the scheduler loads the tokenizer, so
    unpickling it is quick. Only a speed-up: failures are ignored."""
    try:
        import transformers  # noqa: F401
        from transformers import PreTrainedTokenizerFast  # noqa: F401
    except Exception:  # pragma: no cover
        pass
