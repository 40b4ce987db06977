"""NGRAM drafter: what it proposes from the request's own history."""

from __future__ import annotations

import types

from sglang.srt.speculative.drafters.ngram import NgramDrafter


def _req(ids, rid="r"):
    return types.SimpleNamespace(rid=rid, fill_ids=list(ids), cached_tokens=0)


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


def test_questions_on_a_cached_document_share_its_index():
    """The second question on a document (its prefix radix-cached) saves the document's
    index; later ones start from a copy of it. Every proposal equals a fresh index's, and a
    copy grown by one request never changes what the next one starts from."""
    import random
    from types import SimpleNamespace

    rng = random.Random(3)
    phrase = [rng.randrange(50) for _ in range(40)]
    doc = []
    while len(doc) < 600:  # text that quotes itself, as documents do
        doc += phrase[rng.randrange(20):] if rng.random() < 0.3 else [rng.randrange(50)]
    shared = NgramDrafter(max_depth=4)
    for q in range(4):
        question = [rng.randrange(50, 60) for _ in range(5)]
        req = SimpleNamespace(rid=f"q{q}", fill_ids=doc + question,
                              cached_tokens=0 if q == 0 else len(doc))
        fresh = NgramDrafter(max_depth=4)
        alone = SimpleNamespace(rid="a", fill_ids=None, cached_tokens=0)
        for step in range(30):
            alone.fill_ids = req.fill_ids
            got, want = shared.propose([req], [6])[0], fresh.propose([alone], [6])[0]
            assert (got is None) == (want is None)
            if got is not None:
                assert (got.tokens, got.parents) == (want.tokens, want.parents)
            req.fill_ids = req.fill_ids + [rng.choice(doc + question)]
        shared.release(req)
        fresh.release(alone)
    assert shared.documents.saves == 1 and shared.documents.forks == 2
    shared.check_all_free()


def test_a_one_token_match_drafts_where_no_key_gram_occurred():
    """The answer's first word after the chat template ("\\n Article") pairs with a token
    the document never put before it; the word alone occurred, and what followed it is the
    draft (vLLM's ngram takes such one-token matches too). Before: no draft at all."""
    doc = [10, 11, 12, 40, 41, 42, 43, 44, 13, 14]  # 40 = "Article", after 12 ("\\n\\n")
    history = doc + [90, 91, 99, 40]  # the answer starts "Article" after 99 ("\\n")
    drafter = NgramDrafter(max_depth=4)
    tree = drafter.propose([_req(history)], [5])[0]
    assert tree is not None
    chain = [tree.tokens[i] for i in range(1, len(tree))]
    assert chain[:4] == [41, 42, 43, 44]
    drafter.release(_req(history))
    drafter.check_all_free()
