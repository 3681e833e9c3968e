"""Trace analysis (idle, overlap, stragglers, HTA) and the merged Perfetto trace.

`analyze(path)` is the entry point: it returns a `Report`; `render_terminal` turns one into terminal text,
`render_html` into a self-contained HTML page. `compare(base, new)` checks a run against a baseline.
`open_run(path)` gives a run's report, advice, event tables and whole-run series as objects (api.py);
`diff(a, b)` where the step's time moved between two (diff.py).

These names load their modules when first used: importing one small part of the package (as HTA's worker
server and the merge's spawned workers do) no longer imports the whole analysis (a sixth of a second).
"""

from __future__ import annotations

import importlib
import sys
import types

_EXPORTS = {
    "analyze": "fleetscope.analysis.analyze",
    "AnalyzeOptions": "fleetscope.analysis.options",
    "load_report_json": "fleetscope.analysis.analyze",
    "write_report_json": "fleetscope.analysis.analyze",
    "render_html": "fleetscope.analysis.render.html",
    "render_terminal": "fleetscope.analysis.render.terminal",
    "Report": "fleetscope.analysis.report.model",
    "SCHEMA_VERSION": "fleetscope.analysis.report.model",
    "compare": "fleetscope.analysis.compare",
    "Comparison": "fleetscope.analysis.compare",
    "open_run": "fleetscope.analysis.api",
    "Run": "fleetscope.analysis.api",
    "diff": "fleetscope.analysis.diff",
    "TraceDiff": "fleetscope.analysis.diff",
}
__all__ = list(_EXPORTS)


class _LazyExports(types.ModuleType):
    def __getattr__(self, name: str):
        module = _EXPORTS.get(name)
        if module is None:
            raise AttributeError(f"module {self.__name__!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        setattr(self, name, value)
        return value

    def __setattr__(self, name: str, value) -> None:
        # importing the submodule `analyze` (or `compare`) binds it here under the name of the function it
        # holds: the package keeps exporting the function, as an eager `from .analyze import analyze` did
        if isinstance(value, types.ModuleType) and _EXPORTS.get(name) == value.__name__:
            value = getattr(value, name)
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _LazyExports
