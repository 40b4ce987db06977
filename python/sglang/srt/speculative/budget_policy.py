"""How many tree nodes a speculative step drafts per request (1 = decode plainly).

`CostModelBudget` asks the cost model for the budget with the most expected tokens per
second (or always the full tree without one); `FixedBudget` runs one budget for every
eligible request, fallback and cost aside (the start-up calibration times each budget so).
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

from sglang.srt.speculative.cost_model import CostModel


class BudgetPolicy:
    forced = False  # True: every eligible request runs the budget, fallback aside

    def choose(self, rates: Sequence[float], depth_of: Callable[[int], int]) -> int:
        raise NotImplementedError


class CostModelBudget(BudgetPolicy):
    def __init__(self, cost_model: Optional[CostModel], full: int) -> None:
        self.cost_model, self.full = cost_model, full

    def choose(self, rates: Sequence[float], depth_of: Callable[[int], int]) -> int:
        if self.cost_model is None:
            return self.full
        return self.cost_model.choose(rates, depth_of)


class FixedBudget(BudgetPolicy):
    forced = True

    def __init__(self, budget: int) -> None:
        self.budget = budget

    def choose(self, rates: Sequence[float], depth_of: Callable[[int], int]) -> int:
        return self.budget
