"""Messages between the scheduler step and expert offload."""

from __future__ import annotations

import dataclasses
from typing import List, Optional


@dataclasses.dataclass
class StepContext:
    """The requests of one forward and the tokens each feeds it, in batch order."""

    rids: List[str]
    tokens: List[List[int]]  # per request: its rows' token ids (root + draft nodes for a tree)
    is_tree: List[bool]  # the request's rows are a draft tree (row 0 = its last token)
    starts: Optional[List[int]] = None  # per request: the token index of its first row
