"""Request bodies as JSON: a body the parser cannot take is the client's error (400), never
a 500 (a body nested 100,000 levels deep raised RecursionError in the parser)."""

from __future__ import annotations

import json
from typing import Any


def loads_body(raw: bytes) -> Any:
    """The parsed body; ValueError with a message that says what to change."""
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"The request body is not valid JSON: {e}") from None
    except RecursionError:
        raise ValueError("The request body is nested too deeply to parse: send a flatter "
                         "JSON object (requests need a few levels of nesting).") from None
