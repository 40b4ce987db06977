"""How `select` picks one of its choices from per-token logprobs.

Every method is called with keyword arguments only (the backend's contract):
`choices`, `normalized_prompt_logprobs` (one mean logprob per choice),
`input_token_logprobs` / `output_token_logprobs` (per choice, a list of
`[logprob, token_id, token_text]` entries covering the choice's tokens) and, when the
method asks for it, `unconditional_token_logprobs` (the same tokens scored without the
prompt). Ties go to the earliest choice.
"""

from __future__ import annotations

import abc
import dataclasses
import math
from typing import Any, Dict, List, Optional, Sequence

Entry = Sequence[Any]  # [logprob or None, token_id, token_text or None]


@dataclasses.dataclass
class ChoicesDecision:
    decision: str
    meta_info: Optional[Dict[str, Any]] = None


def _first_argmax(scores: Sequence[float]) -> int:
    if not scores:
        raise ValueError("select needs at least one choice")
    best = 0
    for i, v in enumerate(scores):
        # NaN never wins (a choice with no scored token).
        if not math.isnan(v) and (math.isnan(scores[best]) or v > scores[best]):
            best = i
    return best


def _logprobs(entries: Sequence[Entry]) -> List[float]:
    return [float(e[0]) for e in entries if e[0] is not None]


def mean_logprob(entries: Sequence[Entry]) -> float:
    """Mean of the non-null logprobs; NaN when there is none."""
    values = _logprobs(entries)
    return sum(values) / len(values) if values else float("nan")


class ChoicesSamplingMethod(abc.ABC):
    @property
    def requires_unconditional_logprobs(self) -> bool:
        return False

    @abc.abstractmethod
    def __call__(self, *, choices: List[str], normalized_prompt_logprobs: List[float],
                 input_token_logprobs: List[List[Entry]],
                 output_token_logprobs: List[List[Entry]],
                 unconditional_token_logprobs: Optional[List[List[Entry]]] = None,
                 ) -> ChoicesDecision:
        ...

    def __repr__(self) -> str:
        return type(self).__name__


def _meta(normalized, inputs, outputs, **extra: Any) -> Dict[str, Any]:
    return {"normalized_prompt_logprobs": normalized, "input_token_logprobs": inputs,
            "output_token_logprobs": outputs, **extra}


class TokenLengthNormalized(ChoicesSamplingMethod):
    """The choice whose tokens have the highest mean logprob."""

    def __call__(self, *, choices, normalized_prompt_logprobs, input_token_logprobs,
                 output_token_logprobs, unconditional_token_logprobs=None) -> ChoicesDecision:
        best = _first_argmax(normalized_prompt_logprobs)
        return ChoicesDecision(choices[best], _meta(normalized_prompt_logprobs,
                                                    input_token_logprobs,
                                                    output_token_logprobs))


class GreedyTokenSelection(ChoicesSamplingMethod):
    """Compare choices token by token, keeping those with the best logprob at each
    position. A shorter choice is padded with its own mean, so a prefix of a longer
    choice competes on how well it did on average."""

    def __call__(self, *, choices, normalized_prompt_logprobs, input_token_logprobs,
                 output_token_logprobs, unconditional_token_logprobs=None) -> ChoicesDecision:
        rows = [_logprobs(entries) for entries in input_token_logprobs]
        width = max((len(r) for r in rows), default=0)
        matrix = []
        for r in rows:
            pad = sum(r) / len(r) if r else float("-inf")
            matrix.append(r + [pad] * (width - len(r)))
        alive = list(range(len(choices)))
        for col in range(width):
            top = max(matrix[i][col] for i in alive)
            alive = [i for i in alive if matrix[i][col] == top]
            if len(alive) == 1:
                break
        return ChoicesDecision(choices[alive[0]], _meta(
            normalized_prompt_logprobs, input_token_logprobs, output_token_logprobs,
            greedy_logprob_matrix=matrix))


class UnconditionalLikelihoodNormalized(ChoicesSamplingMethod):
    """The choice with the highest mean of (logprob given the prompt - logprob without
    it): penalises choices that are likely whatever was asked. The unconditional score
    of a choice's first token is unknown (it starts the sequence) and counts as 0."""

    @property
    def requires_unconditional_logprobs(self) -> bool:
        return True

    def __call__(self, *, choices, normalized_prompt_logprobs, input_token_logprobs,
                 output_token_logprobs, unconditional_token_logprobs=None) -> ChoicesDecision:
        if unconditional_token_logprobs is None:
            raise ValueError("unconditional_likelihood_normalized needs unconditional logprobs")
        scores = []
        for cond, uncond in zip(input_token_logprobs, unconditional_token_logprobs):
            if len(cond) != len(uncond):
                raise ValueError("conditional and unconditional logprobs differ in length")
            diffs = [(c[0] or 0.0) - (u[0] or 0.0) for c, u in zip(cond, uncond)]
            scores.append(sum(diffs) / len(diffs) if diffs else float("nan"))
        best = _first_argmax(scores)
        return ChoicesDecision(choices[best], _meta(
            normalized_prompt_logprobs, input_token_logprobs, output_token_logprobs,
            unconditional_token_logprobs=unconditional_token_logprobs,
            normalized_unconditional_prompt_logprobs=scores))


token_length_normalized = TokenLengthNormalized()
greedy_token_selection = GreedyTokenSelection()
unconditional_likelihood_normalized = UnconditionalLikelihoodNormalized()
