"""Trace analysis (idle, overlap, stragglers, HTA) and the merged Perfetto trace.

`analyze(path)` is the entry point: it returns a `Report`; `render_terminal` turns one into terminal text,
`render_html` into a self-contained HTML page. `compare(base, new)` checks a run against a baseline.
"""

from fleetscope.analysis.analyze import analyze, load_report_json, write_report_json
from fleetscope.analysis.compare import Comparison, compare
from fleetscope.analysis.render.html import render_html
from fleetscope.analysis.render.terminal import render_terminal
from fleetscope.analysis.report.model import SCHEMA_VERSION, Report

__all__ = ["analyze", "load_report_json", "write_report_json", "render_html", "render_terminal", "Report",
           "SCHEMA_VERSION", "compare", "Comparison"]
