"""CUPTI teardown after each profiling window: the variables the launcher sets for every rank, and the
rank's own check of its CUDA version. Launcher (launcher/spec.py) and profiler (trainer/profiling.py)
both import the names from here.

Kineto keeps CUPTI subscribed after a profiler stops unless `TEARDOWN_CUPTI=1` is set
(pytorch/pytorch#144455): every kernel launch after the first window then pays CUPTI's callbacks
(10-20% slower eager steps, bench/results/h200/README.md). fleetscope sets it for every rank, where it is
safe:
  * windows at least one step apart (kineto PR #1554: a race when two profiler starts come in quick
    succession); the launcher checks the schedule, on-demand and triggered windows keep a step free;
  * CUDA >= 12.6: teardown with CUDA graphs crashed on older CUDA (torch/_inductor and
    torch/profiler/profiler.py force `TEARDOWN_CUPTI=0` there themselves); each rank checks its own
    CUDA build before its first window and turns the default off below 12.6.
The setting `profiler.cupti_teardown=false` turns it off; a `TEARDOWN_CUPTI` the user sets (in the
launching shell or with `--env`) is passed through unchanged and never overridden.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, MutableMapping

TEARDOWN_VAR = "TEARDOWN_CUPTI"
"""Kineto's own variable: "1" unsubscribes CUPTI when a profiler stops."""
DEFAULT_MARK_VAR = "FLEETSCOPE_CUPTI_TEARDOWN"
"""Set next to TEARDOWN_VAR when fleetscope's default (not the user) chose the value: the rank may turn it off."""
MIN_CUDA = (12, 6)
"""CUDA versions below this keep CUPTI subscribed (CUDA graph crashes after a teardown)."""


def launcher_environment(*, enabled: bool, windows_apart: bool, user_env: Mapping[str, str]) -> dict[str, str]:
    """What the launcher adds for every rank (pure): the teardown default, unless turned off, unsafe for the
    schedule, or the user set TEARDOWN_CUPTI themselves."""
    if not enabled or not windows_apart or TEARDOWN_VAR in user_env:
        return {}
    return {TEARDOWN_VAR: "1", DEFAULT_MARK_VAR: "1"}


def inherited_setting(environ: Mapping[str, str]) -> dict[str, str]:
    """The user's own TEARDOWN_CUPTI from the launching shell (it wins over the default), or nothing."""
    return {TEARDOWN_VAR: environ[TEARDOWN_VAR]} if TEARDOWN_VAR in environ else {}


def cuda_supports_teardown(cuda_version: str | None) -> bool:
    """CUDA >= 12.6; a build without CUDA (None) has no CUPTI to keep."""
    if not cuda_version:
        return True
    try:
        version = tuple(int(part) for part in cuda_version.split(".")[:2])
    except ValueError:
        return False
    return version >= MIN_CUDA


def guard_rank_environment(cuda_version: str | None, environ: MutableMapping[str, str] | None = None) -> str | None:
    """Before a rank's first window: turn fleetscope's default teardown off on CUDA < 12.6 (a user's own value
    is left alone). Returns the TEARDOWN_CUPTI value now in effect (None: unset)."""
    environ = os.environ if environ is None else environ
    if environ.get(DEFAULT_MARK_VAR) == "1" and not cuda_supports_teardown(cuda_version):
        environ[TEARDOWN_VAR] = "0"
    return environ.get(TEARDOWN_VAR)
