"""JSON as every reader can parse it: no NaN or Infinity (not JSON; many readers refuse them).

`strict_dumps` writes a non-finite float as null (the value is not known) and then dumps with
allow_nan=False, so a non-finite number that slipped through is an error here, never a file that other
tools cannot read.
"""

from __future__ import annotations

import json
import math
from typing import Any


def without_nonfinite(value: Any) -> Any:
    """`value` with every non-finite float (at any depth of dicts, lists and tuples) replaced by None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: without_nonfinite(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [without_nonfinite(item) for item in value]
    return value


def strict_dumps(value: Any, **options: Any) -> str:
    """json.dumps of `value` after `finite`, with allow_nan=False."""
    return json.dumps(without_nonfinite(value), allow_nan=False, **options)
