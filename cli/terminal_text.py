"""Text from run files, made safe to print on a terminal.

A run file (a Flight Recorder dump's profiling_name, a fan-out record's errors, a log line) is written by
whoever can write the run directory. Printed raw, its control characters would clear the screen, set colors
or the window title, or move the cursor to forge lines. `escape_controls` writes every control character
(C0, DEL and C1, plus the Unicode line separators) as a visible escape; newlines and tabs of the text
fleetscope itself lays out are kept.
"""

from __future__ import annotations

import re

_CONTROLS = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u2028\u2029\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def _escape(match: re.Match) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def escape_controls(text: str, *, keep_newlines: bool = True) -> str:
    """`text` with control characters escaped (`\\x1b`, `\\u202e`); newlines kept unless keep_newlines=False."""
    escaped = _CONTROLS.sub(_escape, text)
    return escaped if keep_newlines else escaped.replace("\n", "\\n")
