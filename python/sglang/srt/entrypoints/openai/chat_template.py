"""Chat templates: the tokenizer's own, or `--chat-template` (a .jinja file, or a name).

The template renders OpenAI messages to prompt text; the text is then tokenized without
adding special tokens (the template writes them), and the BOS guard of the tokenizer
manager makes sure the prompt has exactly one BOS where the model expects one.
"""

from __future__ import annotations

import json
import os
from typing import Any, Dict, List, Optional

# A few well-known formats, written out here so they work for models whose tokenizer has
# no template. Names follow SGLang's (`--chat-template chatml`, ...).
_NAMED_TEMPLATES: Dict[str, str] = {
    "chatml": (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    ),
    "llama-3-instruct": (
        "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}"
        "<|end_header_id|>\n\n{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
        "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
    ),
    "llama-2-chat": (
        "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'system' %}<<SYS>>\n"
        "{{ m['content'] }}\n<</SYS>>\n\n{% elif m['role'] == 'user' %}[INST] {{ m['content'] }} "
        "[/INST]{% else %} {{ m['content'] }} {{ eos_token }}{% endif %}{% endfor %}"
    ),
    "mistral": (
        "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST] "
        "{{ m['content'] }} [/INST]{% elif m['role'] == 'assistant' %}{{ m['content'] }}"
        "{{ eos_token }}{% endif %}{% endfor %}"
    ),
}


def resolve_chat_template(arg: Optional[str]) -> Optional[str]:
    """The Jinja source `--chat-template` names: a file (.jinja, or .json holding a
    "chat_template" key), or one of the built-in names. None keeps the tokenizer's."""
    if arg is None:
        return None
    if os.path.isfile(arg):
        with open(arg, encoding="utf-8") as f:
            text = f.read()
        if arg.endswith(".json"):
            data = json.loads(text)
            if not isinstance(data, dict) or "chat_template" not in data:
                raise ValueError(f"--chat-template {arg}: a .json template must hold a "
                                 f"\"chat_template\" string")
            return data["chat_template"]
        return text
    if arg in _NAMED_TEMPLATES:
        return _NAMED_TEMPLATES[arg]
    raise ValueError(f"--chat-template {arg!r} is neither a file nor a known template name "
                     f"({', '.join(sorted(_NAMED_TEMPLATES))})")


def message_dicts(messages: List[Any]) -> List[Dict[str, Any]]:
    """Pydantic messages -> the plain dicts chat templates expect; text parts of a list
    content are joined, other parts (images, audio) are refused."""
    out = []
    for m in messages:
        d = m.model_dump(exclude_none=True)
        if isinstance(m.content, list):
            texts = []
            for part in m.content:
                if part.type != "text" or part.text is None:
                    raise ValueError(f"Message content of type {part.type!r} is not supported "
                                     f"by this server; send text.")
                texts.append(part.text)
            d["content"] = "\n".join(texts)
        elif m.content is None:
            d["content"] = ""
        out.append(d)
    return out


class ChatRenderer:
    def __init__(self, tokenizer, template_arg: Optional[str]) -> None:
        self.tokenizer = tokenizer
        self.template = resolve_chat_template(template_arg)

    @property
    def available(self) -> bool:
        return self.template is not None or getattr(self.tokenizer, "chat_template", None) is not None

    def render(self, messages: List[Any], continue_final_message: bool = False,
               tools: Optional[List[Dict[str, Any]]] = None,
               template_kwargs: Optional[Dict[str, Any]] = None) -> str:
        if self.tokenizer is None:
            raise ValueError("Chat completions need a tokenizer; this server runs with "
                             "--skip-tokenizer-init.")
        if not self.available:
            raise ValueError("This model's tokenizer has no chat template; start the server "
                             "with --chat-template <file or name>.")
        dicts = message_dicts(messages)
        if not dicts:
            raise ValueError("messages must not be empty.")
        if continue_final_message and dicts[-1]["role"] != "assistant":
            raise ValueError("continue_final_message needs the last message to be an "
                             "assistant message.")
        try:
            return self.tokenizer.apply_chat_template(
                dicts, chat_template=self.template, tokenize=False,
                add_generation_prompt=not continue_final_message,
                continue_final_message=continue_final_message, tools=tools,
                **(template_kwargs or {}))
        except ValueError:
            raise
        except Exception as e:  # a template error is the request's fault (e.g. bad roles)
            raise ValueError(f"The chat template failed on these messages: {e}") from e

    def encode(self, text: str) -> List[int]:
        # The template wrote the special tokens; adding them again would double BOS.
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]
