"""Exit codes scripts can trust (the one place they are defined):

  0  success (analysis: every expected rank analyzed)
  1  the job or the command failed
  2  bad usage or configuration (nothing was started)
  3  partial result: some ranks or traces were missing or unreadable (the rest was processed)
"""

from __future__ import annotations

from ..launcher.scheduler import Verdict

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_PARTIAL = 3
EXIT_INTERRUPTED = 130
"""128 + SIGINT, as shells report a command ended by Ctrl-C."""

_BY_VERDICT = {Verdict.OK: EXIT_OK, Verdict.FAILED: EXIT_FAILED, Verdict.PARTIAL: EXIT_PARTIAL}


def exit_code(verdict: Verdict) -> int:
    return _BY_VERDICT[verdict]
