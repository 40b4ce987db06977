"""SamplingParams: SGLang's per-request sampling options, with upstream's names and defaults.

Importable without torch. `verify()` raises ValueError with a message a user can act on;
the HTTP layer turns it into a 400.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Dict, List, Optional, Union

_GREEDY_EPS = 1e-6


@dataclasses.dataclass
class SamplingParams:
    max_new_tokens: Optional[int] = 128
    min_new_tokens: int = 0
    n: int = 1
    stop: Optional[Union[str, List[str]]] = None
    stop_token_ids: Optional[List[int]] = None
    stop_regex: Optional[Union[str, List[str]]] = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    json_schema: Optional[str] = None
    regex: Optional[str] = None
    ebnf: Optional[str] = None
    structural_tag: Optional[str] = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    custom_params: Optional[Dict[str, Any]] = None
    stream_interval: Optional[int] = None
    logit_bias: Optional[Dict[str, float]] = None
    sampling_seed: Optional[int] = None

    @classmethod
    def from_dict(cls, d: Optional[Dict[str, Any]]) -> "SamplingParams":
        d = dict(d or {})
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"Unknown sampling parameter(s) {unknown}; known: {sorted(names)}")
        # Clients send explicit nulls for "unset" (SGLang's frontend does): keep defaults.
        defaults = {f.name: f.default for f in dataclasses.fields(cls)}
        for key in list(d):
            if d[key] is None and defaults[key] is not None:
                d[key] = defaults[key]
        params = cls(**d)
        params.normalize()
        return params

    def normalize(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in (self.stop or []) if s]
        if isinstance(self.stop_regex, str):
            self.stop_regex = [self.stop_regex]
        self.stop_regex = list(self.stop_regex or [])
        self.stop_token_ids = list(self.stop_token_ids or [])

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS or self.top_k == 1

    def verify(self, vocab_size: Optional[int] = None) -> None:
        def bad(msg: str) -> None:
            raise ValueError(msg)

        def is_num(x: Any) -> bool:
            return isinstance(x, (int, float)) and not isinstance(x, bool)

        for name in ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty",
                     "repetition_penalty"):
            if not is_num(getattr(self, name)):
                bad(f"{name} must be a number, got {getattr(self, name)!r}")
        for name in ("top_k", "min_new_tokens", "n"):
            if not isinstance(getattr(self, name), int) or isinstance(getattr(self, name), bool):
                bad(f"{name} must be an integer, got {getattr(self, name)!r}")
        if self.max_new_tokens is not None and (
            not isinstance(self.max_new_tokens, int) or isinstance(self.max_new_tokens, bool)
        ):
            bad(f"max_new_tokens must be an integer, got {self.max_new_tokens!r}")
        for name in ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty",
                     "repetition_penalty"):
            if not math.isfinite(getattr(self, name)):
                bad(f"{name} must be a finite number, got {getattr(self, name)}")
        if not all(isinstance(s, str) for s in self.stop or []):
            bad(f"stop must be a string or a list of strings, got {self.stop!r}")
        if not all(isinstance(s, str) for s in self.stop_regex or []):
            bad(f"stop_regex must be a string or a list of strings, got {self.stop_regex!r}")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                bad("logit_bias must be an object mapping token ids to numbers")
            for key, value in self.logit_bias.items():
                if not is_num(value) or not math.isfinite(value):
                    bad(f"logit_bias[{key!r}] must be a finite number, got {value!r}")
        if self.temperature < 0.0:
            bad(f"temperature must be non-negative, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            bad(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            bad(f"min_p must be in [0, 1], got {self.min_p}")
        if self.top_k < 1 and self.top_k != -1:
            bad(f"top_k must be -1 (disable) or at least 1, got {self.top_k}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            bad(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            bad(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not 0.0 < self.repetition_penalty <= 2.0:
            bad(f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}")
        if self.max_new_tokens is not None and self.max_new_tokens < 0:
            bad(f"max_new_tokens must be at least 0, got {self.max_new_tokens}")
        if self.min_new_tokens < 0:
            bad(f"min_new_tokens must be at least 0, got {self.min_new_tokens}")
        if self.max_new_tokens is not None and self.min_new_tokens > self.max_new_tokens:
            bad(f"min_new_tokens ({self.min_new_tokens}) must not exceed max_new_tokens "
                f"({self.max_new_tokens})")
        if self.n < 1:
            bad(f"n must be at least 1, got {self.n}")
        if sum(x is not None for x in (self.regex, self.json_schema, self.ebnf)) > 1:
            bad("Only one of regex, json_schema and ebnf can be set")
        if vocab_size is not None:
            for t in self.stop_token_ids or []:
                if not isinstance(t, int) or not 0 <= t < vocab_size:
                    bad(f"stop_token_ids entry {t!r} is not a token id of this model "
                        f"(vocab size {vocab_size})")
            for key in (self.logit_bias or {}):
                if not str(key).lstrip("-").isdigit() or not 0 <= int(key) < vocab_size:
                    bad(f"logit_bias key {key!r} is not a token id of this model")
