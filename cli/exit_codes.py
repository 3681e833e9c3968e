"""Exit codes scripts can trust (defined once, in traces/exit_status.py):

  0  success (analysis: every expected rank analyzed)
  1  the job or the command failed
  2  bad usage or configuration (nothing was started)
  3  partial result: some ranks or traces were missing or unreadable (the rest was processed)
"""

from __future__ import annotations

from ..launcher.scheduler import Verdict
from ..traces.exit_status import (EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, EXIT_PARTIAL, EXIT_REFUSED,
                                  EXIT_REGRESSION, EXIT_USAGE)

__all__ = ["EXIT_FAILED", "EXIT_INTERRUPTED", "EXIT_OK", "EXIT_PARTIAL", "EXIT_REFUSED", "EXIT_REGRESSION",
           "EXIT_USAGE", "exit_code"]

_BY_VERDICT = {Verdict.OK: EXIT_OK, Verdict.FAILED: EXIT_FAILED, Verdict.PARTIAL: EXIT_PARTIAL}


def exit_code(verdict: Verdict) -> int:
    return _BY_VERDICT[verdict]
