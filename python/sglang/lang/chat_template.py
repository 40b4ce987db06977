"""Chat templates for `sgl.system` / `sgl.user` / `sgl.assistant`.

A template wraps each role's text in a prefix and a suffix. The frontend picks one from the
model path the backend reports (as upstream: regexes over `/get_model_info`'s
`model_path`). When no regex matches and the path is a local folder the client can read
(a server on the same machine, the in-process Engine), the folder's own chat template is
recognised by its markers, so a local checkpoint gets its real template on both backends.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import Callable, Dict, List, Optional, Tuple


@dataclasses.dataclass(frozen=True)
class ChatTemplate:
    name: str
    role_prefix_and_suffix: Dict[str, Tuple[str, str]]
    default_system_prompt: Optional[str] = None
    # Appended to every gen's stop list while this template is in use.
    stop_str: Tuple[str, ...] = ()

    def get_prefix_and_suffix(self, role: str,
                              hist_messages: List[Dict[str, str]]) -> Tuple[str, str]:
        """Text before and after a `role` message, given the messages already sent. The
        default system prompt is put before the first message when that is not a system
        message."""
        if role not in self.role_prefix_and_suffix:
            raise ValueError(f"chat template {self.name!r} has no role {role!r}")
        prefix, suffix = self.role_prefix_and_suffix[role]
        if role != "system" and not hist_messages and self.default_system_prompt is not None:
            sys_prefix, sys_suffix = self.role_prefix_and_suffix["system"]
            prefix = sys_prefix + self.default_system_prompt + sys_suffix + prefix
        return prefix, suffix

    def get_prompt(self, messages: List[Dict[str, str]]) -> str:
        """The text of whole messages, then the assistant prefix (a generation prompt)."""
        out, hist = "", []
        for m in messages:
            prefix, suffix = self.get_prefix_and_suffix(m["role"], hist)
            out += prefix + m["content"] + suffix
            hist.append(m)
        return out + self.get_prefix_and_suffix("assistant", hist)[0]


_TEMPLATES: Dict[str, ChatTemplate] = {}
_MATCHERS: List[Callable[[str], Optional[str]]] = []


def register_chat_template(template: ChatTemplate) -> None:
    _TEMPLATES[template.name] = template


def get_chat_template(name: str) -> ChatTemplate:
    if name not in _TEMPLATES:
        raise ValueError(f"unknown chat template {name!r}; known: {sorted(_TEMPLATES)}")
    return _TEMPLATES[name]


def register_chat_template_matching_function(fn: Callable[[str], Optional[str]]):
    """`fn(model_path)` returns a template name or None; later registrations win."""
    _MATCHERS.insert(0, fn)
    return fn


def _chatml(name: str, system: Optional[str] = None) -> ChatTemplate:
    roles = {r: (f"<|im_start|>{r}\n", "<|im_end|>\n") for r in ("system", "user", "assistant")}
    return ChatTemplate(name, roles, system, ("<|im_end|>",))


def _headers(role: str) -> Tuple[str, str]:
    return f"<|start_header_id|>{role}<|end_header_id|>\n\n", "<|eot_id|>"


for _t in (
    ChatTemplate("default", {"system": ("SYSTEM:", "\n"), "user": ("USER:", "\n"),
                             "assistant": ("ASSISTANT:", "\n")}),
    _chatml("chatml"),
    _chatml("qwen", "You are a helpful assistant."),
    ChatTemplate("llama-3-instruct", {r: _headers(r) for r in ("system", "user", "assistant")},
                 stop_str=("<|eot_id|>",)),
    ChatTemplate("mistral", {"system": ("[SYSTEM_PROMPT] ", " [/SYSTEM_PROMPT]"),
                             "user": ("[INST] ", " [/INST]"), "assistant": ("", " </s>")},
                 stop_str=("</s>",)),
    ChatTemplate("gemma-it", {"system": ("", ""),
                              "user": ("<start_of_turn>user\n", "<end_of_turn>\n"),
                              "assistant": ("<start_of_turn>model\n", "<end_of_turn>\n")},
                 stop_str=("<end_of_turn>",)),
):
    register_chat_template(_t)

# Checked in order; the first match wins (as upstream, on the lower-cased path).
_PATH_RULES = [
    (re.compile(r"llama-?3.*instruct"), "llama-3-instruct"),
    (re.compile(r"(mistral|mixtral).*instruct"), "mistral"),
    (re.compile(r"gemma.*-it"), "gemma-it"),
    (re.compile(r"qwen.*(chat|instruct)"), "qwen"),
    (re.compile(r"smollm.*instruct"), "chatml"),
]


def get_chat_template_by_model_path(model_path: str) -> ChatTemplate:
    for fn in _MATCHERS:
        name = fn(model_path)
        if name is not None:
            return get_chat_template(name)
    lowered = model_path.lower()
    for pattern, name in _PATH_RULES:
        if pattern.search(lowered):
            return get_chat_template(name)
    sniffed = template_from_local_folder(model_path)
    return sniffed if sniffed is not None else get_chat_template("default")


def _read_jinja(folder: str) -> Optional[str]:
    path = os.path.join(folder, "chat_template.jinja")
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            return f.read()
    path = os.path.join(folder, "tokenizer_config.json")
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            value = json.load(f).get("chat_template")
        if isinstance(value, list):  # named templates: take "default"
            value = next((v.get("template") for v in value if v.get("name") == "default"), None)
        return value if isinstance(value, str) else None
    return None


# A default system message written literally inside the jinja, e.g. SmolLM2's
# `'<|im_start|>system\nYou are a helpful AI assistant ...<|im_end|>\n'`.
_CHATML_DEFAULT_SYSTEM = re.compile(r"<\|im_start\|>system(?:\n|\\n)([^{}'\"<]+?)<\|im_end\|>")


def template_from_local_folder(path: str) -> Optional[ChatTemplate]:
    """The template of a readable local model folder, recognised by its markers."""
    if not os.path.isdir(path):
        return None
    try:
        jinja = _read_jinja(path)
    except (OSError, ValueError):
        return None
    if not jinja:
        return None
    if "<|im_start|>" in jinja:
        m = _CHATML_DEFAULT_SYSTEM.search(jinja)
        return _chatml("chatml", m.group(1)) if m else get_chat_template("chatml")
    if "<|start_header_id|>" in jinja:
        return get_chat_template("llama-3-instruct")
    if "<start_of_turn>" in jinja:
        return get_chat_template("gemma-it")
    if "[INST]" in jinja:
        return get_chat_template("mistral")
    return None
