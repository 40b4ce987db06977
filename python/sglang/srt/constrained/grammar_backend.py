"""Constrained generation with xgrammar: regex, JSON schema and EBNF grammars.

xgrammar's import and tokenizer analysis take seconds, and compiling a grammar can too,
so both run on a background thread: a request whose grammar is not ready yet waits in the
queue while others run. Each running constrained request owns a GrammarMatcher; the sampler
receives a per-row mask of forbidden tokens, and the speculative verifier walks the draft
tree with the matcher so drafted tokens that break the grammar are rejected.
"""

from __future__ import annotations

import concurrent.futures
import logging
from typing import Dict, List, Optional, Tuple

import torch

logger = logging.getLogger(__name__)


def grammar_key(sampling_params) -> Optional[Tuple[str, str]]:
    sp = sampling_params
    if sp.json_schema is not None:
        return ("json", sp.json_schema if isinstance(sp.json_schema, str) else str(sp.json_schema))
    if sp.regex is not None:
        return ("regex", sp.regex)
    if sp.ebnf is not None:
        return ("ebnf", sp.ebnf)
    return None


class GrammarBackend:
    def __init__(self, tokenizer, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="grammar")
        self._compiler = None
        self._cache: Dict[Tuple[str, str], concurrent.futures.Future] = {}

    def request(self, key: Tuple[str, str]) -> concurrent.futures.Future:
        """A future of the compiled grammar (cached per key); raises ValueError when used if
        the grammar is invalid."""
        fut = self._cache.get(key)
        if fut is None or (fut.done() and fut.exception() is not None):
            fut = self._cache[key] = self._pool.submit(self._compile, key)
        return fut

    def _compile(self, key: Tuple[str, str]):
        import xgrammar as xgr

        if self._compiler is None:
            info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size)
            self._compiler = xgr.GrammarCompiler(info)
        kind, spec = key
        try:
            if kind == "json":
                # Compact JSON: with free whitespace small models can pad until the limit.
                return self._compiler.compile_json_schema(spec, any_whitespace=False)
            if kind == "regex":
                return self._compiler.compile_regex(spec)
            return self._compiler.compile_grammar(spec)
        except Exception as e:  # xgrammar raises RuntimeError on bad input
            raise ValueError(f"Invalid {kind} constraint: {e}") from e

    @staticmethod
    def new_matcher(compiled):
        import xgrammar as xgr

        return xgr.GrammarMatcher(compiled)

    def forbidden_mask(self, matchers: List[Optional[object]]) -> torch.Tensor:
        """[bs, vocab] bool, True where a row's grammar forbids the token."""
        import xgrammar as xgr

        bitmask = xgr.allocate_token_bitmask(len(matchers), self.vocab_size)
        for i, m in enumerate(matchers):
            if m is not None:
                m.fill_next_token_bitmask(bitmask, i)
        scores = torch.zeros((len(matchers), self.vocab_size), dtype=torch.float32)
        xgr.apply_token_bitmask_inplace(scores, bitmask)
        return torch.isinf(scores)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
