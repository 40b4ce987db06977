"""NGRAM drafter: continuations of the current suffix found earlier in prompt + output.

Long legal documents quote themselves, so the tokens that followed an earlier occurrence
of the last few tokens are strong guesses. Per request, two indexes grow with the text (a
few operations per new token): a map of each `key_len`-gram to the positions after its
occurrences (frequent short matches), and a suffix automaton (suffix_index.py) that names
the longest earlier match however far back it lies. A lookup ranks the candidates by how far
each matches backwards, gathers their continuations into a trie weighted by frequency and
match length, and keeps the heaviest nodes.

Many questions on one document: a request whose prompt starts with a prefix the radix cache
held (`cached_tokens`, a document an earlier request read) starts from a copy of the index
of that prefix (`DocumentIndexes`, a few documents, least recently used out) instead of
indexing the document again; the copy is a flat copy of lists, the rebuild a loop in Python
per token.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from typing import Dict, List, Optional, Tuple

import numpy as np

from sglang.srt.speculative.drafters.base import Drafter
from sglang.srt.speculative.drafters.suffix_index import SuffixAutomaton
from sglang.srt.speculative.tree import DraftTree


@dataclasses.dataclass
class SuffixIndex:
    key_len: int
    tokens: np.ndarray  # int64 history, grown geometrically
    length: int = 0
    positions: Dict[Tuple[int, ...], List[int]] = dataclasses.field(default_factory=dict)
    automaton: SuffixAutomaton = dataclasses.field(default_factory=SuffixAutomaton)

    @classmethod
    def new(cls, key_len: int) -> "SuffixIndex":
        return cls(key_len, np.zeros(1024, dtype=np.int64))

    def fork(self) -> "SuffixIndex":
        return SuffixIndex(self.key_len, self.tokens.copy(), self.length,
                           {k: list(v) for k, v in self.positions.items()},
                           self.automaton.fork())

    def extend(self, ids: List[int]) -> None:
        """Index ids[self.length:] (ids is the whole history so far)."""
        new = ids[self.length:]
        if not new:
            return
        need = len(ids)
        if need > len(self.tokens):
            grown = np.zeros(max(need, 2 * len(self.tokens)), dtype=np.int64)
            grown[: self.length] = self.tokens[: self.length]
            self.tokens = grown
        self.tokens[self.length : need] = new
        self.automaton.extend(new)
        k = self.key_len
        for end in range(max(self.length, k), need):
            # The k-gram ending just before `end` is followed by tokens[end].
            key = tuple(int(t) for t in self.tokens[end - k : end])
            self.positions.setdefault(key, []).append(end)
        self.length = need


class DocumentIndexes:
    """Indexes of prompt prefixes that the radix cache shares between requests, by length."""

    def __init__(self, capacity: int = 4, min_tokens: int = 256) -> None:
        self.capacity, self.min_tokens = capacity, min_tokens
        self.saved: "collections.OrderedDict[int, SuffixIndex]" = collections.OrderedDict()
        self.forks = 0  # requests that started from a saved index (for tests and stats)
        self.saves = 0

    def start(self, ids: List[int], shared: int, key_len: int) -> SuffixIndex:
        """An index of a prefix of `ids`: the longest saved one it starts with, else empty.
        The first `shared` tokens (its radix-cached prefix) are saved for the next request."""
        best = None
        for key, index in self.saved.items():
            n = index.length
            if n <= len(ids) and (best is None or n > best.length) and \
                    np.array_equal(index.tokens[:n], np.asarray(ids[:n], dtype=np.int64)):
                best, best_key = index, key
        if best is not None:
            self.saved.move_to_end(best_key)
            self.forks += 1
        index = best.fork() if best is not None else SuffixIndex.new(key_len)
        if shared >= self.min_tokens and shared > index.length:
            index.extend(ids[:shared])
            self.saves += 1
            self.saved[self.saves] = index.fork()
            while len(self.saved) > self.capacity:
                self.saved.popitem(last=False)
        return index


class NgramDrafter(Drafter):
    name = "ngram"
    costs_nothing = True

    def __init__(self, max_depth: int = 8, key_len: int = 2, max_match: int = 18,
                 max_candidates: int = 32) -> None:
        self.max_depth = max_depth
        self.key_len = key_len
        self.max_match = max_match
        self.max_candidates = max_candidates
        self.indexes: Dict[str, SuffixIndex] = {}
        self.documents = DocumentIndexes()
        # rid -> how far back its last proposal's best candidate matched (0: no match); a
        # long match means the request is quoting its context (HYBRID reads it)
        self.match_len: Dict[str, int] = {}

    def propose(self, reqs, budgets, depth=None) -> List[Optional[DraftTree]]:
        return [self._propose_one(r, b, depth or self.max_depth) for r, b in zip(reqs, budgets)]

    def _propose_one(self, req, budget: int, depth: int) -> Optional[DraftTree]:
        ids = req.fill_ids
        index = self.indexes.get(req.rid)
        if index is None:
            index = self.indexes[req.rid] = self.documents.start(
                ids, req.cached_tokens, self.key_len)
        index.extend(ids)
        n = index.length
        self.match_len[req.rid] = 0
        if budget < 2 or n <= self.key_len:
            return None
        key = tuple(ids[n - self.key_len :])
        starts = [p for p in index.positions.get(key, []) if p < n][-256:]
        # the longest earlier matches, however far back (longer than the k-gram, or not)
        found = index.automaton.matches()
        starts += [p for m, p in found if m > self.key_len]
        if not starts:  # no k-gram occurred before: a shorter suffix (one token) still may
            starts = [p for _, p in found]
        if not starts:
            return None
        hist = index.tokens[:n]
        # Rank occurrences by how far the match extends backwards, then by recency.
        scored = sorted(((_match_len(hist, p, n, self.max_match), p) for p in set(starts)),
                        key=lambda mp: (-mp[0], -mp[1]))
        self.match_len[req.rid] = scored[0][0]
        trie: Dict[Tuple[int, ...], float] = {}
        for m, p in scored[: self.max_candidates]:
            # A candidate's vote grows with its match length: a passage being quoted
            # matches far back and should outweigh the many short matches of a common
            # phrase (equal votes let ", the ..." outvote the quote).
            vote = float(_MATCH_WEIGHT ** min(m, 12))
            cont = hist[p : min(p + min(depth, self.max_depth), n)].tolist()
            for d in range(1, len(cont) + 1):
                trie[tuple(cont[:d])] = trie.get(tuple(cont[:d]), 0.0) + vote
        return _trie_to_tree(ids[-1], trie, budget)

    def release(self, req) -> None:
        self.indexes.pop(req.rid, None)
        self.match_len.pop(req.rid, None)

    def check_all_free(self) -> None:
        assert not self.indexes and not self.match_len, \
            f"n-gram state left for {list(self.indexes) or list(self.match_len)}"


_MATCH_WEIGHT = 2.0  # vote of a candidate = _MATCH_WEIGHT ** (backward match length, <= 12)


def _match_len(hist: np.ndarray, p: int, n: int, cap: int) -> int:
    """Length of the common suffix of hist[:p] and hist[:n] (up to cap)."""
    m = 0
    while m < cap and p - 1 - m >= 0 and hist[p - 1 - m] == hist[n - 1 - m]:
        m += 1
    return m


def _trie_to_tree(root_token: int, trie: Dict[Tuple[int, ...], float], budget: int) -> DraftTree:
    tree = DraftTree.root_only(root_token)
    total = sum(c for k, c in trie.items() if len(k) == 1)
    # Most frequent first, shallow first; parents are always added before children.
    order = sorted(trie.items(), key=lambda kv: (len(kv[0]), -kv[1]))
    node_of: Dict[Tuple[int, ...], int] = {(): 0}
    count_of: Dict[Tuple[int, ...], float] = {(): total}
    best = sorted(order, key=lambda kv: (-kv[1], len(kv[0])))[: budget - 1]
    chosen = {k for k, _ in best}
    for key, count in order:
        if key not in chosen or key[:-1] not in node_of:
            continue
        parent = node_of[key[:-1]]
        score = tree.scores[parent] + math.log(count / max(count_of[key[:-1]], 1e-30))
        node_of[key] = tree.add(key[-1], parent, score)
        count_of[key] = count
    return tree


def build(cfg, server_args, max_running: int, context_len: int, max_total_tokens: int,
          chunk_size: int) -> NgramDrafter:
    """NGRAM: suffix matches over prompt + output, as deep as the tree budget allows."""
    return NgramDrafter(max_depth=cfg.ngram_depth)
