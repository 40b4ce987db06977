"""The suffix automaton behind NGRAM: the longest earlier match of the text's suffix, kept up
to date token by token (checked against a brute-force search on random texts)."""

from __future__ import annotations

import random
import types

from sglang.srt.speculative.drafters.ngram import NgramDrafter
from sglang.srt.speculative.drafters.suffix_index import SuffixAutomaton


def _longest_earlier_match(hist):
    """max m such that hist[n-m:n] also ends at some p < n (brute force)."""
    n, best = len(hist), 0
    for p in range(1, n):
        m = 0
        while m < p and hist[p - 1 - m] == hist[n - 1 - m]:
            m += 1
        best = max(best, m)
    return best


def test_longest_match_equals_brute_force_as_the_text_grows():
    for trial in range(200):
        rng = random.Random(trial)
        alphabet = rng.choice([2, 3, 6, 50])
        sam, hist = SuffixAutomaton(), []
        for _ in range(80):
            new = [rng.randrange(alphabet) for _ in range(rng.choice([1, 1, 2, 5]))]
            hist += new
            sam.extend(new)  # incremental: only the new tokens
            best = _longest_earlier_match(hist)
            found = sam.matches()
            if best == 0:
                assert found == [], (trial, hist)
                continue
            length, end = found[0]
            assert length == best, (trial, hist, found)
            assert 0 < end < len(hist) and hist[end - length : end] == hist[-length:]
            # every further candidate is a shorter suffix that really occurred earlier
            assert [m for m, _ in found] == sorted({m for m, _ in found}, reverse=True)
            for m, e in found:
                assert e < len(hist) and hist[e - m : e] == hist[len(hist) - m :]


def test_the_first_candidate_is_the_most_recent_occurrence_of_the_longest_match():
    sam = SuffixAutomaton()
    text = [1, 2, 3, 9, 1, 2, 3, 8, 1, 2, 3]
    sam.extend(text)
    length, end = sam.matches()[0]
    assert (length, end) == (3, 7)  # "1 2 3" ended before 8, the latest earlier one


def test_ngram_drafts_a_quote_whose_bigram_is_everywhere():
    """A long match far back is found even where its last two tokens occur hundreds of
    times since (more than the bigram index looks at)."""
    quote = list(range(500, 510)) + [7, 8] + list(range(600, 606))
    history = quote + [1]
    for k in range(300):  # "7 8" again and again, with other continuations
        history += [7, 8, 2000 + k]
    history += quote[:12]  # the output quotes the passage again, up to "7 8"
    drafter = NgramDrafter(max_depth=6)
    req = types.SimpleNamespace(rid="q", fill_ids=history, cached_tokens=0)
    tree = drafter.propose([req], [7])[0]
    chain, node = [], 0
    while True:
        kids = [i for i, p in enumerate(tree.parents) if p == node]
        if not kids:
            break
        node = max(kids, key=lambda i: tree.scores[i])
        chain.append(tree.tokens[node])
    assert chain == quote[12:18]
    drafter.release(req)
    drafter.check_all_free()
