"""Trace analysis (idle, overlap, stragglers, HTA) and the merged Perfetto trace.

`analyze(path)` is the entry point: it returns a `Report`; `render_terminal` turns one into terminal text,
`render_html` into a self-contained HTML page. `compare(base, new)` checks a run against a baseline.
"""

from .analyze import analyze, load_report_json, write_report_json
from .compare import Comparison, compare
from .render_html import render_html
from .render_terminal import render_terminal
from .report import SCHEMA_VERSION, Report

__all__ = ["analyze", "load_report_json", "write_report_json", "render_html", "render_terminal", "Report",
           "SCHEMA_VERSION", "compare", "Comparison"]
