"""EAGLE3 drafter: an EAGLE-3 head (models/llama_eagle3.py) drafts from the target's own
hidden states.

Rows as upstream's: the head's row i reads token i + 1 beside the target's features at
token i (three target layers' outputs, projected by the head's `fc`), at position i. A
request of n tokens therefore has n - 1 rows, and the last one (the root's token beside
the features of the token before it) drafts the token after the root. A tree level feeds
back the head's own output at each node's parent row. Everything else (the head's KV
beside the target's in the radix tree, the views of a long context, trees, catch-up, the
cost model's prices) is the STANDALONE drafter's: this class is one, and changes only what
a row reads.

The target's features arrive after each of its forwards (`on_target_hidden`: prompt
chunks, plain decodes, a verify's accepted path), projected at once (H numbers a token,
not 3H) and kept until the head has read them. A row whose features the target never
computed (a prefix whose target KV came from the radix cache while the head's KV for it
had been evicted) reads zeros: its drafts get worse, the output does not (the verify
decides); `missing_features` counts them. A radix hit's target prefill is plain's (the
same tokens recomputed, so bf16 rounds alike); the head's row at the hit's last token reads
zeros (`adopt`, `boundary_rows`).
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Tuple

import torch

from sglang.srt.models.llama_eagle3 import LlamaForCausalLMEagle3, aux_hidden_layers
from sglang.srt.speculative.drafters.standalone import StandaloneDrafter
from sglang.srt.speculative.tree import DraftTree


@dataclasses.dataclass
class FeatureLog:
    """One request's projected target features not yet read: (first token index, [n, H])."""

    segments: List[Tuple[int, torch.Tensor]] = dataclasses.field(default_factory=list)

    def add(self, start: int, rows: torch.Tensor) -> None:
        self.segments.append((start, rows))  # a later segment wins where two overlap

    def gather(self, start: int, n: int, out: torch.Tensor) -> int:
        """Write the features of tokens [start, start + n) into out[:n]; returns how many
        of them were never captured (left as they are: zeros)."""
        covered = torch.zeros(n, dtype=torch.bool)
        for s, rows in self.segments:
            lo, hi = max(start, s), min(start + n, s + len(rows))
            if lo < hi:
                out[lo - start: hi - start] = rows[lo - s: hi - s]
                covered[lo - start: hi - start] = True
        return int(n - covered.sum())

    def trim(self, before: int) -> None:
        """Forget the features of tokens below `before` (the head has read them)."""
        kept = []
        for s, rows in self.segments:
            if s + len(rows) > before:
                cut = max(0, before - s)
                kept.append((s + cut, rows[cut:]))
        self.segments = kept


class Eagle3Drafter(StandaloneDrafter):
    """An EAGLE-3 head as the draft model (--speculative-draft-model-path of a head)."""

    name = "eagle3"
    algorithm, kind, head_class = "EAGLE3", "EAGLE-3", LlamaForCausalLMEagle3
    match_lag = 1  # a hit's last cached row read the token after the match: not ours

    def __init__(self, server_args, *args, **kwargs) -> None:
        if server_args.speculative_draft_kv_policy == "retrieval":
            raise ValueError(f"--speculative-algorithm {self.algorithm} reads the draft context "
                             "in full or streaming (--speculative-draft-kv-policy "
                             "full|streaming): retrieved chunks would need every token's "
                             "target features kept")
        super().__init__(server_args, *args, **kwargs)
        head = self.runner.model
        if not isinstance(head, self.head_class):
            raise ValueError(f"--speculative-algorithm {self.algorithm} needs an {self.kind} "
                             f"head (architectures [{self.head_class.__name__}]) as "
                             "--speculative-draft-model-path, got "
                             f"{type(head).__name__} from {server_args.speculative_draft_model_path}")
        self.head = head
        self.layers: Optional[List[int]] = None  # set by bind_target
        self.features: Dict[str, FeatureLog] = {}
        self.missing_features = 0  # rows read without the target's features (zeros)
        self.boundary_rows = 0  # radix hits' last matched rows, read with zero features
        self._out: Dict[Tuple[str, int], torch.Tensor] = {}  # (rid, node) -> head output

    def _use_token_map(self, path: str) -> None:
        raise ValueError("--speculative-token-map: an EAGLE-3 head drafts over its own reduced "
                         "vocabulary (its d2t map, chosen when it was trained); drop the flag")

    @property
    def num_params(self) -> int:
        """What a draft step computes with (the cost model's prior): the head without the
        target's embedding, which is a lookup."""
        return sum(p.numel() for n, p in self.head.named_parameters()
                   if not n.startswith("embed_tokens."))

    # ------------------------------------------------------------------ the target's side
    def bind_target(self, model, config) -> None:
        """The head reads the target's embedding and three of its layers."""
        embed = getattr(getattr(model, "model", None), "embed_tokens", None)
        if embed is None:
            raise ValueError(f"EAGLE3: the target {type(model).__name__} has no "
                             "model.embed_tokens for the head to share")
        width = self.head.fc.weight.shape[1]
        if width != 3 * config.hidden_size:
            raise ValueError(f"EAGLE3: the head's fc reads {width} features, the target gives "
                             f"3 x {config.hidden_size}: the head was trained for another target")
        self.head.set_embed(embed)
        self.layers = aux_hidden_layers(self.head.config, config.num_hidden_layers)

    def target_layers(self) -> Optional[List[int]]:
        return self.layers

    @torch.inference_mode()
    def on_target_hidden(self, req, start: int, hidden: torch.Tensor) -> None:
        """The target computed tokens [start, start + len(hidden)) of `req`: keep their
        features, projected by the head's fc."""
        if len(hidden):
            fc = self.head.fc
            log = self.features.setdefault(req.rid, FeatureLog())
            log.add(start, fc(hidden.to(fc.weight.dtype)))

    def adopt(self, req, slots: torch.Tensor) -> int:
        """A radix hit of k tokens: the target computes from token k as plain decoding
        does (same rows, same rounding); the head's row k - 1 needs the features of token
        k - 1, which only the request that cached it computed. It reads zeros (one row
        among the context's: its drafts barely change, the output not at all)."""
        n = super().adopt(req, slots)
        if n and n == req.kv_len - 1:
            zero = torch.zeros((1, self.head.config.hidden_size), dtype=self.runner.dtype,
                               device=self.runner.device)
            self.features.setdefault(req.rid, FeatureLog()).add(n, zero)
            self.boundary_rows += 1
        return n

    # ------------------------------------------------------------------ rows
    def _sequence(self, req) -> List[int]:
        return req.fill_ids[1:]  # row i reads token i + 1

    def _end(self, req) -> int:
        return req.fill_len - 1

    def _target_ids(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head.to_target_ids(ids.to(self.head.d2t.device))

    def warm_many(self, reqs, ends: List[int]) -> List[bool]:
        # a row needs the next token: the prompt's last token gets its row once sampled
        return super().warm_many(reqs, [min(e, r.fill_len - 1) for r, e in zip(reqs, ends)])

    def propose(self, reqs, budgets, depth=None) -> List[Optional[DraftTree]]:
        self._out.clear()
        try:
            return super().propose(reqs, budgets, depth)
        finally:
            self._out.clear()

    def _catch_up(self, reqs, ends, want_logits):
        out = super()._catch_up(reqs, ends, want_logits)
        for r in reqs:
            log = self.features.get(r.rid)
            if log is not None:  # the last row may be read again (propose re-reads it)
                log.trim(self.contexts[r.rid].computed - 1)
        return out

    def _forward_telling(self, fb, rids, tokens, rows, read=None, nodes=None) -> torch.Tensor:
        """The head's forward over the rows' features: the target's for a catch-up (`read`:
        (rid, token index) per row), each parent's head output for a tree level (`nodes`)."""
        h = self.head.config.hidden_size
        if nodes is None:
            feats = torch.zeros((fb.num_tokens, h), dtype=self.runner.dtype,
                                device=self.runner.device)
            k = 0
            while k < len(read[0]):  # runs of one request's consecutive tokens
                rid, first = read[0][k], read[1][k]
                n = 1
                while (k + n < len(read[0]) and read[0][k + n] == rid
                       and read[1][k + n] == first + n):
                    n += 1
                log = self.features.get(rid)
                self.missing_features += (log.gather(first, n, feats[k: k + n])
                                          if log is not None else n)
                k += n
        else:
            feats = torch.stack([self._out[(rid, tree.parents[node])]
                                 for rid, (tree, node) in zip(rids, nodes)])
        logits, out = self.runner.forward(fb, hidden=feats, from_target=False)
        if nodes is None:
            for rid, row in zip(rids, rows):  # the roots' rows: their children read these
                self._out[(rid, 0)] = out[row]
        else:
            for j, (rid, (_, node)) in enumerate(zip(rids, nodes)):
                self._out[(rid, node)] = out[j]
        return logits

    # ------------------------------------------------------------------ memory
    def release_kv(self, req, keep: int) -> Optional[torch.Tensor]:
        self.features.pop(req.rid, None)
        return super().release_kv(req, keep)

    def check_all_free(self) -> None:
        super().check_all_free()
        assert not self.features, f"target features still held for {list(self.features)}"


def build_head_drafter(cls, cfg, server_args, max_running: int, context_len: int,
                       max_total_tokens: int, chunk_size: int):
    """A head drafter of class `cls` (--speculative-draft-model-path: a head folder)."""
    if not cfg.draft_model_path:
        raise ValueError(f"--speculative-algorithm {cls.algorithm} needs "
                         f"--speculative-draft-model-path (a folder with an {cls.kind} head)")
    return cls(server_args, max_running, context_len, max_total_tokens, cfg.num_steps,
               cfg.topk, chunk_size)


def build(cfg, server_args, max_running: int, context_len: int, max_total_tokens: int,
          chunk_size: int) -> Eagle3Drafter:
    """EAGLE3: a head (--speculative-draft-model-path) reading the target's features."""
    return build_head_drafter(Eagle3Drafter, cfg, server_args, max_running, context_len,
                              max_total_tokens, chunk_size)
