"""The commands' exit code of a launch's verdict; the numbers themselves are defined once, in
traces/exit_status.py."""

from __future__ import annotations

from ..launcher.scheduler import Verdict
from ..traces.exit_status import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, EXIT_PARTIAL, EXIT_USAGE

__all__ = ["EXIT_FAILED", "EXIT_INTERRUPTED", "EXIT_OK", "EXIT_PARTIAL", "EXIT_USAGE", "exit_code"]

_BY_VERDICT = {Verdict.OK: EXIT_OK, Verdict.FAILED: EXIT_FAILED, Verdict.PARTIAL: EXIT_PARTIAL}


def exit_code(verdict: Verdict) -> int:
    return _BY_VERDICT[verdict]
