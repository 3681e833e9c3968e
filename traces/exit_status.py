"""Every exit status fleetscope gives or reads, defined once: the command line's, the comparison gate's and the
trainer's. Scripts, schedulers and the analysis of a finished job all read these numbers, so they live in the
run-directory contract layer that every stage may import.

Commands (cli/):
  0  success (analysis: every expected rank analyzed)
  1  the job or the command failed
  2  bad usage or configuration (nothing was started)
  3  partial result: some ranks or traces were missing or unreadable (the rest was processed)
130  interrupted (Ctrl-C)
Comparisons (analysis/gate.py, compare, history): 0 no regression, 1 a regression, 2 refused (different jobs or
environments): the same numbers as the commands' 0 / 1 / 2.
Trainer ranks (trainer/): 75 stopped on request after saving a checkpoint, 86 stopped by the hang watchdog.
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_PARTIAL = 3
EXIT_INTERRUPTED = 130
"""128 + SIGINT, as shells report a command ended by Ctrl-C."""

EXIT_REGRESSION = EXIT_FAILED
EXIT_REFUSED = EXIT_USAGE
"""A comparison's: a regression; refused (the runs cannot be compared)."""

EXIT_PREEMPTED = 75
"""A rank that stopped on request after saving a checkpoint (EX_TEMPFAIL: the scheduler may run it again)."""
EXIT_HUNG = 86
"""A rank stopped by the hang watchdog (no step finished for observability.hang_timeout_s)."""
