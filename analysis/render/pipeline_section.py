"""The pipeline-parallel section of the report: bubble and compute per stage, in text and HTML."""

from __future__ import annotations

from html import escape

from fleetscope.analysis.report.model import Report

HEADER = ["rank", "stages", "step ms", "bubble ms", "bubble %", "wait fwd ms", "wait bwd ms",
          "compute/mb ms", "sends", "recvs"]


def pipeline_rows(report: Report) -> list[tuple[int | None, list[list[str]]]]:
    """(window, table rows) of every window with pipeline traffic."""
    tables = []
    for window in report.windows:
        if window.pipeline is None:
            continue
        rows = [[str(s.rank), ",".join(map(str, s.stages)) or "?", f"{s.step_ms:.2f}", f"{s.bubble_ms:.2f}",
                 f"{s.bubble_pct:.1f}", f"{s.forward_wait_ms:.2f}", f"{s.backward_wait_ms:.2f}",
                 "-" if s.compute_per_microbatch_ms is None else f"{s.compute_per_microbatch_ms:.2f}",
                 str(s.sends), str(s.recvs)] for s in window.pipeline.ranks]
        tables.append((window.window, rows))
    return tables


def _summary(pipeline) -> str:
    schedule = (f"{pipeline.schedule}, {pipeline.stages} stages, {pipeline.microbatches} micro-batches"
                if pipeline.schedule else "schedule not recorded")
    return (f"{schedule}; {pipeline.transfers} sends paired with their receive, {pipeline.unpaired} unpaired "
            f"({pipeline.p2p_source})")


def pipeline_text(report: Report) -> str:
    """The terminal section ('' without pipeline traffic)."""
    lines = []
    for window, rows in pipeline_rows(report):
        pipeline = next(w.pipeline for w in report.windows if w.window == window)
        label = "-" if window is None else str(window)
        lines += [f"  window {label}: {_summary(pipeline)}", f"    {pipeline.verdict}"]
        widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(HEADER)]
        for row in [HEADER, *rows]:
            lines.append("    " + "  ".join(cell.rjust(width) for cell, width in zip(row, widths)))
    return "Pipeline (point-to-point; not counted as collectives)\n" + "\n".join(lines) if lines else ""


def pipeline_html(report: Report) -> str:
    """The HTML section ('' without pipeline traffic)."""
    parts = []
    for window, rows in pipeline_rows(report):
        pipeline = next(w.pipeline for w in report.windows if w.window == window)
        head = "".join(f"<th>{escape(h)}</th>" for h in HEADER)
        body = "".join("<tr>" + "".join(f"<td>{escape(c)}</td>" for c in row) + "</tr>" for row in rows)
        parts.append(f"<p>window {escape(str(window))}: {escape(_summary(pipeline))}</p>"
                     f"<p>{escape(pipeline.verdict)}</p><table><tr>{head}</tr>{body}</table>")
    return "<h2>Pipeline</h2>" + "".join(parts) if parts else ""
