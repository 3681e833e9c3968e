"""Defaults of the command line's flags that more than one command offers, defined once.

The CLI imports no analysis for `--help`, so the analysis' own defaults are repeated here as plain numbers;
tests/test_cli_help.py holds each equal to the one it stands for.
"""

from __future__ import annotations

from ..launcher.spec import SlurmOptions

THRESHOLD_DEFAULT_PCT = 5.0
"""analysis/gate.py DEFAULT_THRESHOLD_PCT: `--threshold` of compare, tune and history."""

DEFAULT_BUDGET_MB = 400
"""analysis/merge/focus.py DEFAULT_BUDGET_BYTES in MB: `--budget-mb` of merge and postprocess."""

SLURM_JOB_NAME = SlurmOptions().job_name
"""`--job-name` of launch and of postprocess --slurm (launcher/spec.py SlurmOptions, launcher/fanout.py)."""

SLURM_TIME_MINUTES = SlurmOptions().time_minutes
"""`--time` of launch and of postprocess --slurm, in minutes."""

HTA_RANKS_DEFAULT = "auto"
"""analysis/report/build.py HTA_RANKS_AUTO: `--hta-ranks` of analyze and postprocess."""
