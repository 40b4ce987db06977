"""Documents that defeat drafters, for the adaptive-speculation work (issue 8).

Two kinds, built from real legal prose (the fetched corpus, else built-in clauses) and
seeded random figures:
- `table_contract`: a short contract preamble, then long payment schedules and price lists
  whose cells are random amounts, dates and reference numbers: a draft cannot guess them,
  and the n-grams of one row say nothing about the next.
- `shifting_register`: prose, then a table, then prose again (and once more), so a request
  moves between predictable and unpredictable text mid-document.
Each document is written as `<name>.txt` in the output folder with `index.json` listing the
kind, seed, characters and the character spans of its table and prose parts.

    python scripts/build_adversarial_docs.py --out /tmp/adversarial --seed 7
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
from typing import Dict, List, Tuple

FALLBACK_PROSE = (
    "The Supplier shall deliver the Goods in accordance with the Specifications and the "
    "delivery schedule agreed in writing between the Parties. Title to the Goods shall pass "
    "to the Purchaser upon payment in full of the Price. Each Party shall keep confidential "
    "all information disclosed by the other Party in connection with this Agreement and shall "
    "not use such information for any purpose other than the performance of its obligations "
    "under this Agreement. Neither Party shall be liable for any failure or delay in "
    "performing its obligations where such failure or delay results from circumstances "
    "beyond its reasonable control. This Agreement shall be governed by and construed in "
    "accordance with the laws of the jurisdiction stated in the Particulars. ")

ITEMS = ("Licence fee", "Support services", "Hosting", "Implementation", "Training",
         "Data migration", "Maintenance", "Consulting", "Hardware", "Travel expenses")
CURRENCIES = ("EUR", "USD", "GBP", "CHF")


def real_prose(min_chars: int, rng: random.Random) -> str:
    """A run of real legal text (from the fetched corpus when present) of >= min_chars."""
    text = ""
    try:
        from sglang.test.real_assets import legal_docs, legal_text

        names = legal_docs()
        if names:
            text = legal_text(rng.choice(names)) or ""
    except Exception:  # the corpus is optional: fall back to built-in clauses
        text = ""
    if len(text) < min_chars:
        text = FALLBACK_PROSE * (min_chars // len(FALLBACK_PROSE) + 1)
        return text[:min_chars]
    start = rng.randrange(0, max(1, len(text) - min_chars))
    return text[start : start + min_chars]


def random_date(rng: random.Random) -> str:
    day = datetime.date(2024, 1, 1) + datetime.timedelta(days=rng.randrange(0, 1200))
    return day.isoformat()


def payment_table(rng: random.Random, rows: int) -> str:
    """A markdown payment schedule of random figures."""
    lines = ["| No. | Due date | Reference | Item | Amount | Currency | VAT % | Total |",
             "|---|---|---|---|---|---|---|---|"]
    for i in range(1, rows + 1):
        amount = rng.randrange(100, 9_999_999) / 100
        vat = rng.choice((0, 5, 7, 10, 19, 20, 21))
        lines.append(f"| {i} | {random_date(rng)} | INV-{rng.randrange(10**7, 10**8)} | "
                     f"{rng.choice(ITEMS)} | {amount:,.2f} | {rng.choice(CURRENCIES)} | {vat} | "
                     f"{amount * (1 + vat / 100):,.2f} |")
    return "\n".join(lines) + "\n"


def price_list(rng: random.Random, rows: int) -> str:
    lines = ["SKU        Unit price   Qty   Discount   Net"]
    for _ in range(rows):
        price = rng.randrange(50, 500_000) / 100
        qty = rng.randrange(1, 400)
        disc = rng.randrange(0, 35)
        lines.append(f"{rng.randrange(10**9, 10**10):<10d} {price:>10.2f} {qty:>5d} {disc:>8d}% "
                     f"{price * qty * (1 - disc / 100):>12.2f}")
    return "\n".join(lines) + "\n"


def build_table_contract(rng: random.Random, table_rows: int) -> Tuple[str, List[Dict]]:
    parts = [("prose", "MASTER SUPPLY AGREEMENT\n\n" + real_prose(800, rng) + "\n\n"),
             ("table", "Schedule 1: Payment schedule\n\n" + payment_table(rng, table_rows) + "\n"),
             ("table", "Schedule 2: Price list\n\n" + price_list(rng, table_rows) + "\n"),
             ("table", "Schedule 3: Milestone payments\n\n" + payment_table(rng, table_rows // 2))]
    return _join(parts)


def build_shifting_register(rng: random.Random, table_rows: int) -> Tuple[str, List[Dict]]:
    parts = [("prose", real_prose(2000, rng) + "\n\n"),
             ("table", "Annex A: Fees\n\n" + payment_table(rng, table_rows) + "\n"),
             ("prose", real_prose(2000, rng) + "\n\n"),
             ("table", "Annex B: Unit prices\n\n" + price_list(rng, table_rows) + "\n"),
             ("prose", real_prose(1500, rng))]
    return _join(parts)


def _join(parts: List[Tuple[str, str]]) -> Tuple[str, List[Dict]]:
    text, spans = "", []
    for kind, chunk in parts:
        spans.append({"kind": kind, "start": len(text), "end": len(text) + len(chunk)})
        text += chunk
    return text, spans


def build(out: str, seed: int = 7, table_rows: int = 40) -> Dict[str, Dict]:
    """Write both documents to `out`; return their index entries."""
    os.makedirs(out, exist_ok=True)
    index = {}
    for name, builder in (("table_contract", build_table_contract),
                          ("shifting_register", build_shifting_register)):
        rng = random.Random(f"{seed}:{name}")
        text, spans = builder(rng, table_rows)
        with open(os.path.join(out, name + ".txt"), "w") as f:
            f.write(text)
        index[name] = {"kind": name, "seed": seed, "chars": len(text), "spans": spans}
    with open(os.path.join(out, "index.json"), "w") as f:
        json.dump(index, f, indent=2)
    return index


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--table-rows", type=int, default=40)
    args = ap.parse_args()
    for name, entry in build(args.out, args.seed, args.table_rows).items():
        kinds = [s["kind"] for s in entry["spans"]]
        print(f"{name}: {entry['chars']} chars, parts {kinds}")


if __name__ == "__main__":
    main()
