"""The one check of untrusted text: every string of a job that reaches a shell, a batch script, a TorchX
AppDef, an environment variable or a path.

Quoting (shlex.quote, done where each command is built) makes a value one word; it cannot make a line
break safe: a newline ends an `#SBATCH` line or a comment in a batch script, and the rest of the value
runs as a command. So no such text may hold a control character (below 0x20, 0x7f, the C1 range) or a
Unicode line separator (U+0085, U+2028, U+2029): it is refused, naming the field.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from ..trainer.config import ConfigError

_LINE_BREAKING = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def require_plain_text(value: str, field_name: str) -> str:
    """`value` unchanged, or a ConfigError naming `field_name` if it holds a control character."""
    found = _LINE_BREAKING.search(value)
    if found is not None:
        raise ConfigError(f"{field_name}: must not contain control characters (newline, tab, ...; found "
                          f"{found.group()!r}): {value!r}")
    return value


def require_plain_fields(config: Any, prefix: str = "") -> None:
    """Check every string of a config dataclass, recursively (tuples, lists and dicts included);
    fields are named by their dotted path (`data.path`), as `--set` names them."""
    for field in dataclasses.fields(config):
        require_plain_value(getattr(config, field.name), f"{prefix}{field.name}")


def require_plain_value(value: Any, field_name: str) -> None:
    if isinstance(value, str):
        require_plain_text(value, field_name)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        require_plain_fields(value, prefix=f"{field_name}.")
    elif isinstance(value, (tuple, list)):
        for item in value:
            require_plain_value(item, field_name)
    elif isinstance(value, dict):
        for key, item in value.items():
            require_plain_value(key, field_name)
            require_plain_value(item, f"{field_name} {key}")
