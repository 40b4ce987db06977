#!/usr/bin/env python3
"""Build a folder of real legal documents and a question set for `python -m sglang.review`.

Sources, in this order (nothing is downloaded here):
- Debian's /usr/share/common-licenses (GPL, LGPL, MPL, Apache, ...; ~237k chars), always
  present on Debian/Ubuntu; symlinks (GPL -> GPL-3) are skipped.
- ~/.cache/sglang-fork/legal/*.txt, if scripts/fetch_legal_docs.py has run: six EU laws
  (AI Act, GDPR, DORA, CRA, NIS2, CSRD) and long commercial licence agreements (Esri,
  Splunk, Qt, ...). Its copies of the common licences are skipped (already taken above).

Output:
    OUT/docs/<name>.txt    one document per file
    OUT/questions.txt      one question per line (the same for every document)
    OUT/docs.jsonl         the same documents as JSONL {id, text, source} (with --jsonl)
    OUT/index.json         name, source, chars, sha1 of every document

    python scripts/build_legal_corpus.py --out corpus [--max-chars 4000] [--max-docs 5]
        [--only common|eu|licences ...] [--jsonl]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import sys
from typing import Dict, List, Optional

COMMON_LICENSES = "/usr/share/common-licenses"
FETCHED = os.path.expanduser("~/.cache/sglang-fork/legal")
EU_LAWS = ("ai_act", "gdpr", "dora", "cra", "nis2", "csrd")

QUESTIONS = [
    "Who are the parties to this document, or to whom does it apply?",
    "What rights or permissions does it grant?",
    "What obligations or conditions does it impose?",
    "Does it disclaim warranties or limit liability? Quote the clause.",
    "How can it be terminated, and what happens on termination?",
    "Which law governs it, and where are disputes resolved?",
    "Does it set fines, penalties or damages? Give the amounts if any.",
    "Summarise the document in two sentences.",
]


def _kind(name: str) -> str:
    if name in EU_LAWS:
        return "eu"
    return "licences" if name.startswith("license_") else "common"


def collect(common_dir: str = COMMON_LICENSES, fetched_dir: str = FETCHED) -> List[Dict[str, str]]:
    """Every available document as {name, source, text}, common licences first."""
    docs: List[Dict[str, str]] = []
    if os.path.isdir(common_dir):
        for name in sorted(os.listdir(common_dir)):
            path = os.path.join(common_dir, name)
            if os.path.islink(path) or not os.path.isfile(path):
                continue
            with open(path, encoding="utf-8", errors="replace") as f:
                docs.append({"name": "common_" + name, "source": path, "text": f.read()})
    if os.path.isdir(fetched_dir):
        taken = {d["name"] for d in docs}
        for name in sorted(os.listdir(fetched_dir)):
            stem, ext = os.path.splitext(name)
            if ext != ".txt" or stem in taken or (stem.startswith("common_") and docs):
                continue
            with open(os.path.join(fetched_dir, name), encoding="utf-8", errors="replace") as f:
                docs.append({"name": stem, "source": os.path.join(fetched_dir, name),
                             "text": f.read()})
    return docs


def cut(text: str, max_chars: Optional[int]) -> str:
    """At most max_chars, ending at a paragraph (or line) break when there is one."""
    if not max_chars or len(text) <= max_chars:
        return text
    head = text[:max_chars]
    for sep in ("\n\n", "\n"):
        at = head.rfind(sep)
        if at > max_chars // 2:
            return head[:at].rstrip() + "\n"
    return head


def build(out: str, max_chars: Optional[int] = None, max_docs: Optional[int] = None,
          only: Optional[List[str]] = None, jsonl: bool = False,
          common_dir: str = COMMON_LICENSES, fetched_dir: str = FETCHED) -> List[Dict[str, str]]:
    docs = [d for d in collect(common_dir, fetched_dir) if not only or _kind(d["name"]) in only]
    docs = docs[:max_docs] if max_docs else docs
    if not docs:
        raise SystemExit("no legal documents found: is /usr/share/common-licenses there, "
                         "or has scripts/fetch_legal_docs.py run?")
    doc_dir = os.path.join(out, "docs")
    os.makedirs(doc_dir, exist_ok=True)
    index = []
    for d in docs:
        d["text"] = cut(d["text"], max_chars)
        safe = re.sub(r"[^A-Za-z0-9_.-]", "_", d["name"])
        with open(os.path.join(doc_dir, safe + ".txt"), "w", encoding="utf-8") as f:
            f.write(d["text"])
        index.append({"name": safe, "source": d["source"], "chars": len(d["text"]),
                      "sha1": hashlib.sha1(d["text"].encode()).hexdigest()})
    with open(os.path.join(out, "questions.txt"), "w", encoding="utf-8") as f:
        f.write("# One question per line; every document gets every question.\n")
        f.write("\n".join(QUESTIONS) + "\n")
    with open(os.path.join(out, "index.json"), "w", encoding="utf-8") as f:
        json.dump(index, f, indent=1)
    if jsonl:
        with open(os.path.join(out, "docs.jsonl"), "w", encoding="utf-8") as f:
            for d, entry in zip(docs, index):
                f.write(json.dumps({"id": entry["name"], "text": d["text"],
                                    "source": d["source"]}) + "\n")
    return docs


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--max-chars", type=int, help="cut each document to about this many chars")
    p.add_argument("--max-docs", type=int)
    p.add_argument("--only", nargs="+", choices=["common", "eu", "licences"])
    p.add_argument("--jsonl", action="store_true", help="also write docs.jsonl")
    args = p.parse_args(argv)
    docs = build(args.out, args.max_chars, args.max_docs, args.only, args.jsonl)
    total = sum(len(d["text"]) for d in docs)
    print(f"{len(docs)} documents ({total} chars) in {os.path.join(args.out, 'docs')}; "
          f"{len(QUESTIONS)} questions in {os.path.join(args.out, 'questions.txt')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
