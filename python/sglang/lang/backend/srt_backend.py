"""The /generate protocol shared by the HTTP endpoint and the in-process Engine backend.

Both build the same request bodies (those upstream's RuntimeEndpoint sends) and differ only
in how a body reaches the engine, so a program gives the same greedy result either way.
"""

from __future__ import annotations

import abc
from typing import Any, Dict, Iterator, List, Tuple

from sglang.lang.backend.base_backend import BaseBackend
from sglang.lang.choices import ChoicesDecision, ChoicesSamplingMethod, mean_logprob
from sglang.lang.global_config import global_config
from sglang.lang.ir import SglSamplingParams


class SrtBackend(BaseBackend, abc.ABC):
    @abc.abstractmethod
    def _post(self, body: Dict[str, Any]) -> Any:
        """POST /generate `body`; the decoded response (a dict, or a list for a batch)."""

    @abc.abstractmethod
    def _post_stream(self, body: Dict[str, Any]) -> Iterator[Dict[str, Any]]:
        """POST /generate `body` with stream=true; each chunk (cumulative text)."""

    # ------------------------------------------------------------------ bodies
    @staticmethod
    def generate_body(text: str, params: SglSamplingParams) -> Dict[str, Any]:
        body: Dict[str, Any] = {"text": text, "sampling_params": {
            "skip_special_tokens": global_config.skip_special_tokens_in_output,
            "spaces_between_special_tokens": global_config.spaces_between_special_tokens_in_out,
            **params.to_srt_kwargs()}}
        body.update(params.top_level_kwargs())
        return body

    def cache_prefix(self, prefix_str: str) -> None:
        self._post({"text": prefix_str, "sampling_params": {"max_new_tokens": 0}})

    def generate(self, s: Any, sampling_params: SglSamplingParams) -> Tuple[Any, Any]:
        out = self._post(self.generate_body(s.text_, sampling_params))
        if isinstance(out, list):  # n > 1
            return [o["text"] for o in out], [o["meta_info"] for o in out]
        return out["text"], out["meta_info"]

    def generate_stream(self, s: Any, sampling_params: SglSamplingParams
                        ) -> Iterator[Tuple[str, Dict[str, Any]]]:
        body = self.generate_body(s.text_, sampling_params)
        body["stream"] = True
        pos = 0
        for chunk in self._post_stream(body):
            if "error" in chunk:
                raise RuntimeError(chunk["error"])
            text = chunk["text"]  # cumulative: the new piece is what follows `pos`
            yield text[pos:], chunk["meta_info"]
            pos = len(text)

    def select(self, s: Any, choices: List[str], temperature: float,
               choices_method: ChoicesSamplingMethod) -> ChoicesDecision:
        """Score each choice by the logprobs of prefix + choice, in three requests: cache
        the prefix (and learn its length), score all choices in one batch starting two
        tokens early (the choice may merge with the prefix's last token), and, for methods
        that need it, score the choice tokens alone."""
        if temperature > 1e-5:
            raise ValueError("select on this backend is greedy: use temperature=0")
        prefix = s.text_
        first = self._post({"text": prefix, "sampling_params": {"max_new_tokens": 0}})
        start = max(first["meta_info"]["prompt_tokens"] - 2, 0)
        outs = self._post({"text": [prefix + c for c in choices],
                           "sampling_params": {"max_new_tokens": 0, "temperature": 0},
                           "return_logprob": True, "return_text_in_logprobs": True,
                           "logprob_start_len": start})
        inputs, outputs, normalized = [], [], []
        for out in outs:
            # Entry 0 (position start) only gives context: its logprob is always null.
            entries = out["meta_info"]["input_token_logprobs"][1:]
            inputs.append(entries)
            outputs.append(out["meta_info"].get("output_token_logprobs", []))
            normalized.append(mean_logprob(entries))
        unconditional = None
        if choices_method.requires_unconditional_logprobs:
            # Upstream sends no logprob_start_len here, and then no server returns input
            # logprobs (-1 means output only): ask for them from the first token.
            res = self._post({"input_ids": [[e[1] for e in entries] for entries in inputs],
                              "sampling_params": {"max_new_tokens": 0},
                              "return_logprob": True, "logprob_start_len": 0})
            unconditional = [r["meta_info"]["input_token_logprobs"] for r in res]
        return choices_method(choices=choices, normalized_prompt_logprobs=normalized,
                              input_token_logprobs=inputs, output_token_logprobs=outputs,
                              unconditional_token_logprobs=unconditional)
