"""scripts/build_adversarial_docs.py: the documents have the promised structure, the same
seed rebuilds them byte for byte, and the tables' figures really are unpredictable."""

from __future__ import annotations

import json
import re

from sglang.test.fixtures import load_script


def load_builder():
    return load_script("build_adversarial_docs")


def test_structure_and_determinism(tmp_path) -> None:
    b = load_builder()
    index = b.build(str(tmp_path / "a"), seed=3, table_rows=20)
    again = b.build(str(tmp_path / "b"), seed=3, table_rows=20)
    other = b.build(str(tmp_path / "c"), seed=4, table_rows=20)
    assert index == again and json.load(open(tmp_path / "a" / "index.json")) == index
    for name in ("table_contract", "shifting_register"):
        text = (tmp_path / "a" / f"{name}.txt").read_text()
        assert text == (tmp_path / "b" / f"{name}.txt").read_text()
        assert text != (tmp_path / "c" / f"{name}.txt").read_text()
        spans = index[name]["spans"]
        assert spans[0]["start"] == 0 and spans[-1]["end"] == len(text) == index[name]["chars"]
        tables = [text[s["start"] : s["end"]] for s in spans if s["kind"] == "table"]
        # table text is dense with figures; no invoice reference repeats
        for t in tables:
            assert len(re.findall(r"\d", t)) > 0.3 * len(t.replace(" ", ""))
        refs = re.findall(r"INV-\d{8}", "".join(tables))
        assert len(refs) == len(set(refs)) > 10
    assert [s["kind"] for s in index["shifting_register"]["spans"]] == \
        ["prose", "table", "prose", "table", "prose"]
    assert [s["kind"] for s in index["table_contract"]["spans"]][1:] == ["table"] * 3
    assert other["table_contract"]["seed"] == 4
