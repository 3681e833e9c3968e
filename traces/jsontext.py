"""JSON as every reader can parse it: no NaN or Infinity (not JSON; many readers refuse them).

`strict_dumps` writes a non-finite float as null (the value is not known) and then dumps with
allow_nan=False, so a non-finite number that slipped through is an error here, never a file that other
tools cannot read.
"""

from __future__ import annotations

import json
from typing import Any

from .validate import finite


def json_safe(value: Any) -> Any:
    """`value` with every float that is not finite (at any depth of dicts, lists and tuples) replaced by None."""
    if isinstance(value, float):
        return value if finite(value) is not None else None
    if isinstance(value, dict):
        return {key: json_safe(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(item) for item in value]
    return value


def strict_dumps(value: Any, **options: Any) -> str:
    """json.dumps of `value` after `json_safe`, with allow_nan=False."""
    return json.dumps(json_safe(value), allow_nan=False, **options)
