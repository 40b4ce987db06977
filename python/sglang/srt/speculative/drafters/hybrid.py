"""HYBRID drafter: n-gram and draft-model candidates merged into one tree per request.

Both drafters propose under the step's token budget; their trees are merged as tries (a
token path both propose is one node), and the merged tree keeps the best nodes, as many as
the n-grams alone may fill (their own draft length) plus the draft model's where it ran, by

    score(node) = log( w_ngram * p_ngram(node) + w_model * p_model(node) )

where p_d is drafter d's cumulative probability of the path (0 if d did not propose it) and
w_d is the request's recent acceptance weight of drafter d. Each p_d is non-increasing along
a path, so the score is too and `select_best` keeps ancestors before descendants.

Weights: after each verify, a drafter is credited with the accepted draft nodes it had
proposed; w_d follows an exponential moving average of that credit, so a request whose text
is copied from its document leans on n-grams and prose on the draft model. Verification is
the same as for any tree (verify.py), so the merge never changes the output distribution.

Skipping the draft model: its forwards are the step's only drafting cost, so it sits out
while it adds nothing the n-grams did not propose: the EMA of accepted nodes only it
proposed is under `min_unique` tokens a verify (0 where none of its nodes made the tree;
also where the n-grams found nothing). Shared credit alone cannot tell that: while
a passage is quoted both drafters propose the same tokens. And it sits out while the n-grams
are plainly quoting (a long backward match, a deep likely path), before its EMA could show
it. While it sits out it is probed after a few steps, a wait that doubles after each probe
that does not bring it back (a probe costs a draft-model step).
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Dict, List, Optional, Set, Tuple

from sglang.srt.speculative.drafters.base import Drafter
from sglang.srt.speculative.drafters.ngram import NgramDrafter
from sglang.srt.speculative.tree import DraftTree, select_best
from sglang.srt.utils.checkpoint_files import folder_architectures

NAMES = ("ngram", "model")


@dataclasses.dataclass
class DrafterWeights:
    """Per-request EMA of accepted draft tokens credited to each drafter per step."""

    ema: Dict[str, float] = dataclasses.field(default_factory=lambda: {n: 1.0 for n in NAMES})
    alpha: float = 0.3
    floor: float = 0.05  # a drafter out of favour still gets a few nodes: it can come back
    skipped: int = 0  # steps the draft model sat out in a row
    probe_wait: int = 0  # steps between its probes now (0: the drafter's probe_every)
    # accepted nodes a verify that only the draft model proposed (what it adds to n-grams)
    model_unique: float = 1.0

    def update(self, credit: Dict[str, int]) -> None:
        for name in NAMES:
            self.ema[name] = (1 - self.alpha) * self.ema[name] + self.alpha * credit.get(name, 0)

    def weights(self) -> Dict[str, float]:
        total = sum(self.ema.values())
        if total <= 0:
            return {n: 1.0 / len(NAMES) for n in NAMES}
        raw = {n: max(self.ema[n] / total, self.floor) for n in NAMES}
        norm = sum(raw.values())
        return {n: v / norm for n, v in raw.items()}


def merge_trees(root: int, trees: Dict[str, Optional[DraftTree]], weights: Dict[str, float],
                budget: int) -> Tuple[DraftTree, List[frozenset]]:
    """(merged tree of at most `budget` nodes, per node the set of drafters that proposed it)."""
    prob: Dict[Tuple[int, ...], Dict[str, float]] = {(): {n: 1.0 for n in NAMES}}
    for name, tree in trees.items():
        if tree is None:
            continue
        assert tree.tokens[0] == root, "drafters disagree on the root token"
        paths: List[Tuple[int, ...]] = [()]
        for i in range(1, len(tree)):
            path = paths[tree.parents[i]] + (tree.tokens[i],)
            paths.append(path)
            prob.setdefault(path, {})[name] = math.exp(tree.scores[i])
    merged = DraftTree.root_only(root)
    origins: List[frozenset] = [frozenset(NAMES)]
    node_of = {(): 0}
    for path in sorted(prob, key=len):  # parents first
        if not path:
            continue
        p = prob[path]
        mass = sum(weights[n] * p.get(n, 0.0) for n in NAMES)
        node_of[path] = merged.add(path[-1], node_of[path[:-1]], math.log(max(mass, 1e-30)))
        origins.append(frozenset(p))
    kept = select_best(merged, budget)
    if kept is merged:
        return merged, origins
    # select_best keeps nodes in order; map its nodes back to their paths' origins
    index = {}
    paths_of = [()]
    for i in range(1, len(kept)):
        paths_of.append(paths_of[kept.parents[i]] + (kept.tokens[i],))
        index[i] = node_of[paths_of[i]]
    return kept, [origins[0]] + [origins[index[i]] for i in range(1, len(kept))]


class HybridDrafter(Drafter):
    name = "hybrid"
    drafts_without_model = True

    # The n-grams are quoting: their best candidate matches at least `sure_match` tokens
    # back and their tree holds a path past the draft model's 3 steps with probability >=
    # `sure_prob`. The draft model sits out while they do, from the first such step, instead
    # of running until its EMA shows it adds nothing: on a quoting question with a short
    # answer those steps were a third of the request's (cra/quote/1K: 0.72x NGRAM).
    sure_match = 8
    sure_depth = 4
    sure_prob = 0.5

    def __init__(self, ngram: NgramDrafter, model: Drafter, probe_every: int = 8,
                 min_unique: float = 0.5) -> None:
        self.ngram, self.model = ngram, model
        self.min_unique = min_unique  # tokens a verify the draft model must add to be asked
        self.draft_kv = model.draft_kv  # the draft model's KV hangs off the radix cache
        self.probe_every = probe_every  # steps to the first draft-model probe while skipped
        self.max_probe_wait = 8 * probe_every  # doubling after each probe that found nothing
        self.weights: Dict[str, DrafterWeights] = {}
        self.origins: Dict[str, List[frozenset]] = {}  # rid -> origins of its last tree
        self.last_weights: Dict[str, DrafterWeights] = {}  # of released requests (bounded)
        self.held: Set[str] = set()  # requests the draft model sits out for this step
        self.alone: Dict[str, int] = {}  # rid -> nodes its n-grams alone may fill this step
        self.asked: Set[str] = set()  # requests the draft model drafted for, latest proposal

    def hold_back(self, rids: Set[str], alone: Optional[Dict[str, int]] = None) -> None:
        self.held = set(rids)
        self.alone = dict(alone or {})

    def propose(self, reqs, budgets, depth=None) -> List[Optional[DraftTree]]:
        # n-grams are cheap and can see further than the draft's steps: their own depth
        ngram_trees = self.ngram.propose(reqs, budgets, None)
        # The draft model costs forwards: skip it for a request whose text the n-grams have
        # been carrying (its weight at the floor), except for a probe every few steps. Its
        # KV catches up on the skipped tokens at the next call (one extend, not decodes).
        ask = [i for i, (r, nt) in enumerate(zip(reqs, ngram_trees)) if self._wants_model(r, nt)]
        self.asked = {reqs[i].rid for i in ask}
        model_trees: List[Optional[DraftTree]] = [None] * len(reqs)
        if ask:
            got = self.model.propose([reqs[i] for i in ask], [budgets[i] for i in ask], depth)
            for i, tree in zip(ask, got):
                model_trees[i] = tree
        out: List[Optional[DraftTree]] = []
        for req, budget, mt, nt in zip(reqs, budgets, model_trees, ngram_trees):
            if mt is None and nt is None:
                out.append(None)
                continue
            if req.rid not in self.weights:  # new, or resumed after a retraction
                self.weights[req.rid] = self.last_weights.pop(req.rid, None) or DrafterWeights()
            w = self.weights[req.rid].weights()
            # the rows NGRAM would verify, plus the draft model's own nodes where it ran: a
            # tree at the step's whole budget made each draft-model step a 10-row verify
            alone = min(budget, self.alone.get(req.rid, budget))
            cap = alone if mt is None else min(budget, alone + len(mt) - 1)
            tree, origins = merge_trees(req.fill_ids[-1], {"model": mt, "ngram": nt}, w, cap)
            self.origins[req.rid] = origins
            out.append(tree)
        return out

    def _wants_model(self, req, ngram_tree: Optional[DraftTree]) -> bool:
        if req.rid in self.held:
            return False
        found = ngram_tree is not None and len(ngram_tree) > 1
        if found and self._ngrams_quoting(req, ngram_tree):
            return False  # no probe: what it would learn is moot
        # Where the n-grams found nothing the model's own record decides as well: asked at
        # every such step, a head that brought nothing cost 2-3 plain steps a verify there.
        w = self.weights.get(req.rid)
        if w is None:
            return True
        if w.weights()["model"] > 2 * w.floor and w.model_unique >= self.min_unique:
            w.skipped, w.probe_wait = 0, self.probe_every
            return True
        w.skipped += 1
        wait = w.probe_wait or self.probe_every
        if w.skipped >= wait:
            # a probe that does not bring the model back doubles the wait to the next one
            w.skipped, w.probe_wait = 0, min(2 * wait, self.max_probe_wait)
            return True
        return False

    def _ngrams_quoting(self, req, tree: DraftTree) -> bool:
        if self.ngram.match_len.get(req.rid, 0) < self.sure_match:
            return False
        floor = math.log(self.sure_prob)
        return any(d >= self.sure_depth and sc >= floor
                   for d, sc in zip(tree.depths, tree.scores))

    def on_verified(self, req, path: List[int]) -> None:
        """Credit each drafter with the accepted draft nodes (path[1:]) it proposed."""
        origins = self.origins.pop(req.rid, None)
        if origins is None:
            return
        credit = {n: sum(n in origins[i] for i in path[1:]) for n in NAMES}
        w = self.weights.setdefault(req.rid, DrafterWeights())
        w.update(credit)
        # the draft model ran: what it added, 0 if its nodes lost their place in the tree
        # to the n-grams' (it had kept being asked for nothing, its record never updated)
        if req.rid in self.asked:
            unique = sum(origins[i] == {"model"} for i in path[1:])
            w.model_unique = (1 - w.alpha) * w.model_unique + w.alpha * unique

    def model_ran_for(self, req) -> bool:
        return req.rid in self.asked

    def observe(self, observer) -> None:
        self.model.observe(observer)

    # an EAGLE head as the model side: the target's features pass through to it
    @property
    def match_lag(self) -> int:
        return self.model.match_lag

    def target_layers(self):
        return self.model.target_layers()

    def bind_target(self, model, config) -> None:
        self.model.bind_target(model, config)

    def on_target_hidden(self, req, start: int, hidden) -> None:
        self.model.on_target_hidden(req, start, hidden)

    def weights_of(self, req) -> Dict[str, float]:
        """The request's weights now (read-only: the final update comes after release)."""
        w = self.weights.get(req.rid)
        if w is None:
            w = self.last_weights.get(req.rid, DrafterWeights())
        return w.weights()

    def release(self, req) -> None:
        """Drop the n-gram index and the weights. The draft model's KV is not touched here:
        the SpecWorker releases it (into the radix cache) through `draft_kv`."""
        self.ngram.release(req)
        w = self.weights.pop(req.rid, None)
        if w is not None:  # the finished request's meta_info still reports them
            self.last_weights[req.rid] = w
            while len(self.last_weights) > 1024:
                self.last_weights.pop(next(iter(self.last_weights)))
        self.origins.pop(req.rid, None)
        self.asked.discard(req.rid)

    def check_all_free(self) -> None:
        self.ngram.check_all_free()
        self.model.check_all_free()
        assert not self.weights and not self.origins, "hybrid state left for finished requests"


def build(cfg, server_args, max_running: int, context_len: int, max_total_tokens: int,
          chunk_size: int) -> HybridDrafter:
    """HYBRID: n-gram and draft-model candidates in one tree, weighted per request; the
    draft model may be an EAGLE or EAGLE-3 head (by its config's architectures), or the
    target's own MTP layer (NEXTN: a DeepSeek-V3 target as its own draft path)."""
    from sglang.srt.speculative.drafters import eagle, eagle3, ngram, nextn, standalone

    kind = {"LlamaForCausalLMEagle": eagle, "LlamaForCausalLMEagle3": eagle3,
            "DeepseekV3ForCausalLMNextN": nextn}
    archs = folder_architectures(cfg.draft_model_path)
    model = next((kind[a] for a in archs if a in kind), standalone)
    if (model is standalone and nextn.is_mtp_checkpoint(cfg.draft_model_path)
            and os.path.abspath(cfg.draft_model_path) == os.path.abspath(server_args.model_path)):
        model = nextn
    return HybridDrafter(ngram.build(cfg, server_args, max_running, context_len,
                                     max_total_tokens, chunk_size),
                         model.build(cfg, server_args, max_running, context_len,
                                     max_total_tokens, chunk_size))
