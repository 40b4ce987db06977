"""What the interpreter asks of a backend."""

from __future__ import annotations

from typing import Any, Dict, Iterator, List, Tuple

from sglang.lang.chat_template import ChatTemplate, get_chat_template
from sglang.lang.choices import ChoicesDecision, ChoicesSamplingMethod
from sglang.lang.ir import SglSamplingParams


class BaseBackend:
    """`s` below is the program's StreamExecutor; backends read `s.text_` (the whole text
    so far) and must not change it."""

    chat_template: ChatTemplate = get_chat_template("default")

    def get_model_name(self) -> str:
        raise NotImplementedError()

    def get_chat_template(self) -> ChatTemplate:
        return self.chat_template

    def cache_prefix(self, prefix_str: str) -> None:
        """Make the backend keep `prefix_str`'s KV (a hint; may be a no-op)."""

    def generate(self, s: Any, sampling_params: SglSamplingParams) -> Tuple[Any, Any]:
        """(completion text, meta_info); lists of both when sampling_params.n > 1."""
        raise NotImplementedError()

    def generate_stream(self, s: Any, sampling_params: SglSamplingParams
                        ) -> Iterator[Tuple[str, Dict[str, Any]]]:
        """(new text piece, meta_info so far) until the generation ends."""
        raise NotImplementedError()

    def select(self, s: Any, choices: List[str], temperature: float,
               choices_method: ChoicesSamplingMethod) -> ChoicesDecision:
        raise NotImplementedError()

    def flush_cache(self) -> Any:
        raise NotImplementedError()

    def get_server_info(self) -> Dict[str, Any]:
        raise NotImplementedError()

    def shutdown(self) -> None:
        pass
