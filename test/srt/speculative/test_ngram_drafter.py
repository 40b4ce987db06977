"""NGRAM drafter: what it proposes from the request's own history."""

from __future__ import annotations

import types

from sglang.srt.speculative.drafters.ngram import NgramDrafter


def _req(ids, rid="r"):
    return types.SimpleNamespace(rid=rid, fill_ids=list(ids))


def test_a_long_quoted_match_outweighs_many_short_ones():
    """A passage being quoted matches far back once; a common bigram occurs many times
    with other continuations. The chain proposed is the quote's continuation."""
    quote = [500, 501, 502, 503, 504, 505, 506, 507, 508, 509]
    history = []
    for k in range(12):  # "7 8" followed by a different token each time
        history += [7, 8, 900 + k, 1]
    history += quote + [2, 3]
    # Now the output quotes the passage again and has reached "... 503 7 8" inside it?
    # No: it has reached the quote's first six tokens, whose last two are the bigram key.
    quote_with_key = [500, 501, 502, 503, 7, 8, 600, 601, 602, 603]
    history += quote_with_key + [4, 5] + quote_with_key[:6]
    drafter = NgramDrafter(max_depth=4)
    tree = drafter.propose([_req(history)], [5])[0]
    chain, node = [], 0
    while True:
        kids = [i for i, p in enumerate(tree.parents) if p == node]
        if not kids:
            break
        node = max(kids, key=lambda i: tree.scores[i])
        chain.append(tree.tokens[node])
    assert chain == [600, 601, 602, 603]
    drafter.release(_req(history))
    drafter.check_all_free()


def test_equal_matches_rank_by_frequency():
    history = [1, 2, 10, 0, 1, 2, 10, 0, 1, 2, 11, 0, 5, 1, 2]
    drafter = NgramDrafter(max_depth=2)
    tree = drafter.propose([_req(history)], [3])[0]
    first = [tree.tokens[i] for i, p in enumerate(tree.parents) if p == 0]
    assert first[0] == 10 and set(first) <= {10, 11}
    drafter.release(_req(history))
