"""The held-out evaluation set for speculation: review questions the other benchmarks never use.

Four documents of different kinds (two EU regulations, a commercial licence agreement, a
generated supply contract made of price tables) x three question styles (quote a passage
word for word, summarise, extract a list), in a Latin square over 1K / 4K / 16K tokens of
document so that every document and every style is asked at every length class:

    1K: dora/list, cra/quote, license/summary, tables/list
    4K: dora/summary, cra/list, license/quote, tables/quote
    16K: dora/quote, cra/summary, license/list, tables/summary

The legal texts come from PyPI (`scripts/fetch_legal_docs.py`); the table contract is
generated here with a fixed seed. Prompts are in the model's chat template.
"""

from __future__ import annotations

import random
from typing import Dict, List

QUESTIONS = {
    "quote": "Quote, word for word, the first two paragraphs of the text above that set out "
             "an obligation. Do not add anything.",
    "summary": "Summarise in four sentences what the text above requires of the parties.",
    "list": "List every defined term or named party in the text above, one per line, each "
            "with the sentence that introduces it.",
}
DOCS = {"dora": "dora", "cra": "cra", "license": "license_esri", "tables": None}
# (document, style) -> tokens of document
SQUARE = {
    ("dora", "list"): 1024, ("cra", "quote"): 1024, ("license", "summary"): 1024,
    ("tables", "list"): 1024,
    ("dora", "summary"): 4096, ("cra", "list"): 4096, ("license", "quote"): 4096,
    ("tables", "quote"): 4096,
    ("dora", "quote"): 16384, ("cra", "summary"): 16384, ("license", "list"): 16384,
    ("tables", "summary"): 16384,
}


def table_contract(schedules: int = 16, rows: int = 40, seed: int = 7) -> str:
    """A supply contract that is mostly price and payment tables (what breaks drafting)."""
    rng = random.Random(seed)
    parts = ["MASTER SUPPLY AGREEMENT\n\nSchedule 1. Unit prices (EUR, excluding VAT)\n"]
    for s in range(1, schedules + 1):
        parts.append(f"\nSchedule {s}.{rng.randint(1, 9)} Price table\n"
                     "| Item | Code | Qty band | Unit price | Discount | Delivery (days) |\n"
                     "|---|---|---|---|---|---|\n")
        for i in range(rows):
            parts.append(f"| Part {s}-{i:03d} | X{rng.randint(10000, 99999)} | "
                         f"{rng.choice(['1-9', '10-99', '100-999', '1000+'])} | "
                         f"{rng.randint(1, 9999)}.{rng.randint(0, 99):02d} | "
                         f"{rng.randint(0, 30)}% | {rng.randint(1, 90)} |\n")
        parts.append(f"\n{s}.2 Payment. Invoices under this Schedule are payable within "
                     f"{rng.choice([30, 45, 60])} days of receipt; late payment bears interest "
                     f"at {rng.randint(2, 9)}% above the reference rate. The Supplier shall "
                     f"deliver within the days stated in the table, failing which the Buyer "
                     f"may claim {rng.randint(1, 5)}% of the order value per week of delay.\n")
    return "".join(parts)


def document(key: str) -> str:
    from sglang.test.real_assets import legal_text

    if DOCS[key] is None:
        return table_contract()
    text = legal_text(DOCS[key])
    if text is None:
        raise SystemExit(f"document {DOCS[key]} missing: run scripts/fetch_legal_docs.py")
    return text


def eval_prompts(tokenizer) -> List[Dict]:
    """[{name, doc, style, doc_tokens, ids}] in the square's order (by length, then doc)."""
    from sglang.test.real_assets import truncate_to_tokens

    out = []
    for (doc, style), n in sorted(SQUARE.items(), key=lambda kv: (kv[1], kv[0])):
        full = document(doc)
        have = len(tokenizer(full, add_special_tokens=False)["input_ids"])
        if have < n:
            raise SystemExit(f"{doc} has {have} tokens, fewer than the {n} asked")
        text = truncate_to_tokens(full, n, tokenizer)
        msgs = [{"role": "user", "content": text + "\n\n" + QUESTIONS[style]}]
        chat = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        ids = tokenizer(chat, add_special_tokens=False)["input_ids"]
        out.append({"name": f"{doc}/{style}/{n // 1024}K", "doc": doc, "style": style,
                    "doc_tokens": n, "ids": [int(t) for t in ids]})
    return out
