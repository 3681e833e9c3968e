"""fleetscope: launch, profile and explain distributed training jobs.

The Python API for notebooks and scripts (analysis/api.py, analysis/diff.py):

    import fleetscope
    run = fleetscope.open_run("runs/r1")     # the report, advice, step times, event tables, whole-run series
    fleetscope.diff("runs/r1", "runs/r2")    # where the step's time moved

The command line is `fleetscope` (cli/main.py). The subpackages are fleetscope.launcher, .trainer, .traces,
.analysis and .cli. These names load their modules when first used, so `import fleetscope` imports nothing heavy.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "open_run": "fleetscope.analysis.api",
    "Run": "fleetscope.analysis.api",
    "diff": "fleetscope.analysis.diff",
    "analyze": "fleetscope.analysis.analyze",
    "compare": "fleetscope.analysis.compare",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'fleetscope' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
