"""An online suffix automaton over token ids: where the text's longest repeated suffix
occurred before.

`extend` adds tokens in O(1) amortized each (the automaton's usual construction; one flat
dict holds every transition). `matches()` walks the suffix links of the longest suffix that
occurred earlier: each state on the way is a shorter suffix, with the end of an earlier
occurrence (the most recent one for the `RECENT_DEPTH` longest, an older one beyond), so a
drafter gets the longest match first and shorter, usually more frequent ones after it.
"""

from __future__ import annotations

from typing import Dict, List, Tuple

# States whose latest occurrence is kept up to date at each extension (the longest suffixes;
# beyond them an occurrence is still true, only not the most recent).
RECENT_DEPTH = 16


class SuffixAutomaton:
    def __init__(self) -> None:
        self.length: List[int] = [0]  # longest string of each state
        self.link: List[int] = [-1]  # suffix link
        self.next: List[Dict[int, int]] = [{}]  # transitions
        self.end: List[int] = [-1]  # end (exclusive) of the latest occurrence known
        self.prev_end: List[int] = [-1]  # end of the occurrence before it
        self.last = 0  # the state of the whole text
        self.size = 0  # tokens added

    def fork(self) -> "SuffixAutomaton":
        """An independent copy (a flat copy of the state lists: far cheaper than rebuilding)."""
        other = SuffixAutomaton.__new__(SuffixAutomaton)
        other.length, other.link = list(self.length), list(self.link)
        other.next = [dict(d) for d in self.next]
        other.end, other.prev_end = list(self.end), list(self.prev_end)
        other.last, other.size = self.last, self.size
        return other

    def extend(self, tokens: List[int]) -> None:
        for tok in tokens:
            self._add(int(tok))

    def _new_state(self, length: int, link: int, nxt: Dict[int, int], end: int,
                   prev_end: int) -> int:
        self.length.append(length)
        self.link.append(link)
        self.next.append(nxt)
        self.end.append(end)
        self.prev_end.append(prev_end)
        return len(self.length) - 1

    def _add(self, tok: int) -> None:
        self.size += 1
        n = self.size
        cur = self._new_state(self.length[self.last] + 1, 0, {}, n, -1)
        p = self.last
        while p != -1 and tok not in self.next[p]:
            self.next[p][tok] = cur
            p = self.link[p]
        if p != -1:
            q = self.next[p][tok]
            if self.length[p] + 1 == self.length[q]:
                self.link[cur] = q
            else:
                clone = self._new_state(self.length[p] + 1, self.link[q], dict(self.next[q]),
                                        self.end[q], self.prev_end[q])
                while p != -1 and self.next[p].get(tok) == q:
                    self.next[p][tok] = clone
                    p = self.link[p]
                self.link[q] = self.link[cur] = clone
        self.last = cur
        # the text's suffixes (the states on cur's suffix links) now also end at n
        s, depth = self.link[cur], 0
        while s > 0 and depth < RECENT_DEPTH:
            if self.end[s] != n:
                self.prev_end[s], self.end[s] = self.end[s], n
            s, depth = self.link[s], depth + 1

    def matches(self, limit: int = 8) -> List[Tuple[int, int]]:
        """(match length, end of an earlier occurrence) for up to `limit` suffixes of the
        text that occurred before its end, longest first. The length is a lower bound: the
        occurrence may match further back."""
        out: List[Tuple[int, int]] = []
        s = self.link[self.last] if self.size else -1
        while s > 0 and len(out) < limit:
            end = self.prev_end[s] if self.end[s] == self.size else self.end[s]
            if 0 < end < self.size:
                out.append((self.length[s], end))
            s = self.link[s]
        return out
