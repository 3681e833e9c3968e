"""The self-contained HTML report: one file, inline CSS and SVG, nothing fetched when opened."""

from __future__ import annotations

import re
from collections import defaultdict
from html import escape, unescape
from typing import Any

from fleetscope.analysis.render import open_in_perfetto as perfetto
from fleetscope.analysis.render.open_in_perfetto import StepRanges
from fleetscope.analysis.per_rank.collectives import step_label
from fleetscope.analysis.per_rank.utilization import Utilization
from fleetscope.analysis.render import html_table, svg
from fleetscope.analysis.render.html_table import table as _table
from fleetscope.analysis.render.capture_html import capture_html
from fleetscope.analysis.render.evidence_html import evidence_sections
from fleetscope.analysis.render.cause_html import cause_section, critical_path_section
from fleetscope.analysis.render.pipeline_section import pipeline_html
from fleetscope.analysis.render.moe_html import moe_section
from fleetscope.analysis.render.whole_run_html import whole_run_html
from fleetscope.analysis.render.terminal import (advice_cut_short, matching_sentence, profiled_beside_run,
                                                  whole_run_headline)
from fleetscope.analysis.report.model import RankSummary, Report, WindowReport

HTA_ROWS_SHOWN = 20
PROBLEMS_ID = "problems"
"""The anchor with_anchors gives the Problems section (its title, lowered)."""
_HEADING = re.compile(r"<h2>(.*?)</h2>", re.S)

_CSS = """
body{font-family:system-ui,sans-serif;margin:24px;color:#222;max-width:1100px}
h1{font-size:20px}h2{font-size:16px;margin-top:28px;border-bottom:1px solid #ddd}h3{font-size:14px}
table{border-collapse:collapse;font-size:12px;margin:8px 0}
td,th{border:1px solid #ddd;padding:3px 6px;text-align:right}th{background:#f4f4f4}
td.l,th.l{text-align:left}
td.l{max-width:640px;overflow:hidden;text-overflow:ellipsis;white-space:nowrap}
td.l:hover{white-space:normal;overflow-wrap:anywhere}.bad{color:#b00020;font-weight:600}.ok{color:#1b7f3b;font-weight:600}
.note{color:#555;font-size:12px}.scroll{overflow-x:auto}
"""

BREAKDOWN_COLORS = {
    "compute": svg.PALETTE[0],
    "comm hidden": svg.PALETTE[3],
    "comm exposed": svg.PALETTE[2],
    "memory only": svg.PALETTE[5],
    "idle in comm": svg.PALETTE[6],
    "idle": "#cccccc",
}


def render_html(report: Report, *, trace_ranges: StepRanges | None = None) -> str:
    """The whole report as one HTML document, read top-down: the verdict and the advice, a table of contents,
    the sections from the ranks' numbers to the evidence, problems and notes last. Its 'Open in Perfetto'
    buttons open the merged trace next to it, scrolled to each finding's steps when `trace_ranges` (the
    merge's `step_ranges_ns()`) is given."""
    ended_badly = report.outcome is not None and not report.outcome.completed
    sections, contents = with_anchors([
        capture_html(report) if ended_badly else "",   # a hang's diagnosis is the story: first
        _rank_table(report.ranks),
        _breakdown_section(report),
        _overlap_section(report),
        _step_heatmap(report),
        _kernel_section(report),
        _straggler_section(report, trace_ranges),
        cause_section(report),
        critical_path_section(report),
        pipeline_html(report),
        evidence_sections(report),
        "" if ended_badly else capture_html(report),
        moe_section(report.moe),
        whole_run_html(report.whole_run),
        _clock_section(report),
        _hta_section(report),
        _problems(report),
        _notes(report),
    ])
    body = [_header(report), _contents(contents), perfetto.help_box() if report.windows else "", sections,
            perfetto.script() if report.windows else ""]
    title = escape(f"fleetscope report: {report.source_path}")
    return (f"<!DOCTYPE html><html><head><meta charset=\"utf-8\"><title>{title}</title>"
            f"<style>{_CSS}{html_table.CSS}{perfetto.CSS}</style></head><body>{''.join(body)}</body></html>\n")


def _header(report: Report) -> str:
    state = ('<span class="ok">complete</span>' if report.complete else
             f'<span class="bad">{escape(report.state.lower())}</span>')
    steps = report.step_time
    step_line = (f"step time: median {steps.median_ms:.2f} ms, mean {steps.mean_ms:.2f} ms, "
                 f"max {steps.max_ms:.2f} ms over {steps.count} steps ({report.step_time_basis or 'trace'})"
                 if steps else "no step annotations")
    if report.run_step_time_ms is not None:
        beside = profiled_beside_run(report)
        step_line = (f"step time {report.run_step_time_ms:.2f} ms ({report.run_step_time_basis}); profiled "
                     + step_line.replace("step time: ", "steps ", 1) + (f", {beside}" if beside else ""))
    run_wide = whole_run_headline(report)
    run_line = f"<p><b>Whole run:</b> {escape(run_wide)}</p>" if run_wide else ""
    return (f"<h1>fleetscope report</h1><p id=\"verdict\"><b>Verdict:</b> {escape(report.verdict)}</p>{run_line}"
            f"{_advice(report)}<p>{escape(step_line)}</p>"
            f"<p class=\"note\">{escape(report.source_path)} ({escape(report.source_kind)}), {state}; world size "
            f"{report.world_size or '?'}, {len(report.ranks)} rank(s), {len(report.windows)} window(s); created "
            f"{escape(report.created_at)}</p>{_problem_pointer(report)}")


def _advice(report: Report) -> str:
    """The advisor's top findings, next to the verdict (Report.advice)."""
    if not report.advice:
        return ""
    items = "".join(
        f"<li><b>{escape(f.title)}</b> [{escape(f.rule)}; confidence {escape(f.confidence)}; {escape(f.gain)}]"
        + (f" (overlaps {escape(', '.join(f.overlaps))}: not additive)" if f.overlaps else "")
        + f"<br>change: <code>{escape(f.change)}</code></li>" for f in report.advice)
    cut = advice_cut_short(report)
    note = f'<p class="note">{escape(cut[0].upper() + cut[1:])}.</p>' if cut else ""
    return f"<p><b>Advice</b> (fleetscope advise RUN gives the evidence):</p><ol id=\"advice\">{items}</ol>{note}"


def _problem_pointer(report: Report) -> str:
    """Problems are listed last; a partial report says so at the top."""
    job = [p for p in report.problems if p.label == "job"]
    count = len(report.problems) - len(job) + len(report.missing)
    ended = f"the job {report.outcome.state}" if job and report.outcome is not None else ""
    parts = [part for part in (ended, f"{count} trace problem(s)" if count else "") if part]
    if not parts:
        return ""
    return f'<p class="bad">{"; ".join(parts)}: see <a href="#{PROBLEMS_ID}">Problems</a>.</p>'


def _contents(entries: list[tuple[str, str]]) -> str:
    links = " &middot; ".join(f'<a href="#{anchor}">{title}</a>' for anchor, title in entries)
    return f'<nav id="contents"><b>Contents:</b> {links}</nav>' if entries else ""


def with_anchors(sections: list[str]) -> tuple[str, list[tuple[str, str]]]:
    """The sections joined, an anchor named from its title before each <h2> (the heading itself is left as its
    section wrote it); and (anchor, title) of each, in page order, for the table of contents. The titles are
    the sections' own markup (already escaped)."""
    entries: list[tuple[str, str]] = []

    def anchored(match: re.Match) -> str:
        title = match.group(1)
        anchor = _anchor_name(title, {a for a, _ in entries})
        entries.append((anchor, title))
        return f'<a id="{anchor}"></a>{match.group(0)}'

    return _HEADING.sub(anchored, "".join(sections)), entries


def _anchor_name(title: str, taken: set[str]) -> str:
    """"Memory, input and compilation" -> "memory-input-and-compilation"; a second one gets "-2"."""
    text = unescape(re.sub(r"<[^>]+>", "", title)).lower()
    anchor = re.sub(r"[^a-z0-9]+", "-", text).strip("-") or "section"
    candidate, n = anchor, 1
    while candidate in taken:
        n += 1
        candidate = f"{anchor}-{n}"
    return candidate


def _problems(report: Report) -> str:
    rows = [[p.label, _opt(p.rank), _opt(p.window), p.reason] for p in report.problems]
    rows += [["(no trace)", str(m.rank), _opt(m.window), "missing"] for m in report.missing]
    if not rows:
        return ""
    return "<h2>Problems</h2>" + _table(["file", "rank", "window", "reason"], rows, left=(0, 3))


def _notes(report: Report) -> str:
    notes = report.notes + [f"window {_opt(w.window)}: {n}" for w in report.windows for n in w.notes]
    if not notes:
        return ""
    return "<h2>Notes</h2><ul>" + "".join(f"<li>{escape(n)}</li>" for n in notes) + "</ul>"


def _rank_table(ranks: list[RankSummary]) -> str:
    header = ["rank", "host", "steps", "mean ms", "median ms", "max ms", "busy %", "idle %", "comm %",
              "overlap %", "basis"]
    rows = [[str(s.rank), s.host, str(s.step_time.count if s.step_time else 0),
             _f(s.step_time.mean_ms if s.step_time else None, 2), _f(s.step_time.median_ms if s.step_time else None, 2),
             _f(s.step_time.max_ms if s.step_time else None, 2), _f(s.busy_pct), _f(s.idle_pct), _f(s.comm_pct),
             _f(s.overlap_pct), s.basis or "-"] for s in ranks]
    return ("<h2>Ranks</h2><p class=\"note\">Definitions: busy/idle/comm are shares of the profiled steps' "
            "span; overlap is the share of communication time hidden behind computation; step times are each rank's own "
            "profiled steps (trace).</p>"
            + _table(header, rows, left=(1,), labels=2))


def _breakdown_section(report: Report) -> str:
    parts = ["<h2>Where the time went</h2>"]
    for window in report.windows:
        rows = [(f"rank {r.rank}", breakdown_segments(r.utilization)) for r in window.ranks if r.utilization]
        if rows:
            parts.append(f"<h3>window {_opt(window.window)} (ms)</h3>")
            parts.append(svg.stacked_bars(rows, unit="ms", colors=BREAKDOWN_COLORS))
    return "".join(parts) if len(parts) > 1 else ""


def breakdown_segments(u: Utilization) -> list[svg.Segment]:
    """Disjoint parts of the span (ms) that add up to it (sets of utilization.py):
    compute alone, comm hidden behind compute, comm on the resource alone, memory alone, idle while a
    collective was in flight, other idle."""
    comm_busy_us = u.comm_us - u.idle_comm_us
    values_us = {
        "compute": u.compute_us - u.overlap_us,
        "comm hidden": u.overlap_us,
        "comm exposed": comm_busy_us - u.overlap_us,
        "memory only": max(u.busy_us - (u.compute_us + comm_busy_us - u.overlap_us), 0.0),
        "idle in comm": u.idle_comm_us,
        "idle": u.idle_us - u.idle_comm_us,
    }
    return [svg.Segment(name, value / 1000.0) for name, value in values_us.items()]


def _overlap_section(report: Report) -> str:
    ranks = [s for s in report.ranks if s.overlap_pct is not None]
    if not ranks:
        return ""
    return ("<h2>Communication hidden behind computation (%)</h2>"
            + svg.bars([f"rank {s.rank}" for s in ranks], [s.overlap_pct for s in ranks], unit="%",
                        full_scale=100.0))


def _kernel_section(report: Report) -> str:
    parts = []
    for window in report.windows:
        if window.top_kernels:
            kernels = window.top_kernels
            parts.append(f"<h3>window {_opt(window.window)}: total ms in the window, {len(window.ranks)} rank(s) summed</h3>")
            parts.append(svg.bars([_short(k.name) for k in kernels], [k.total_us / 1000 for k in kernels],
                                  unit="ms", label_width=320))
            rows = [[k.name, str(k.count), _f(k.total_us / 1000, 3), _f(k.total_us / k.count, 2), str(k.ranks)]
                    for k in kernels]
            parts.append(_table(["kernel", "launches", "total ms", "mean us", "ranks"], rows, left=(0,)))
    return "<h2>Top kernels</h2>" + "".join(parts) if parts else ""


def _short(name: str, limit: int = 48) -> str:
    return name if len(name) <= limit else name[: limit - 3] + "..."


def _step_heatmap(report: Report) -> str:
    columns = [(w.window, step) for w in report.windows for step in w.steps]
    if not columns:
        return ""
    times: dict[int, dict[tuple[int | None, int], float]] = defaultdict(dict)
    for window in report.windows:
        for rank in window.ranks:
            for step in rank.steps:
                times[rank.rank][(window.window, step.step)] = step.step_time_ms
    ranks = sorted(times)
    values = [[times[r].get(c) for c in columns] for r in ranks]
    labels = [f"s{s}" if w is None else f"w{w} s{s}" for w, s in columns]
    return ("<h2>Step time, rank x step (ms)</h2>"
            + svg.heatmap([f"rank {r}" for r in ranks], labels, values, unit="ms"))


def _straggler_section(report: Report, ranges: StepRanges | None) -> str:
    parts = ["<h2>Stragglers</h2>"]
    for window in report.windows:
        parts.append(_window_stragglers(window, ranges))
    return "".join(parts)


def _window_stragglers(window: WindowReport, ranges: StepRanges | None) -> str:
    s = window.stragglers
    open_window = perfetto.button(f"window {_opt(window.window)}", perfetto.window_range(ranges, window.window))
    html = f"<h3>window {_opt(window.window)}{open_window}</h3><p>{escape(s.verdict)}</p>"
    matching = matching_sentence(window.collective_matching)
    html += f"<p class=\"note\">{escape(matching)}</p>" if matching else ""
    if s.by_step_time:
        ordered = sorted(s.by_step_time, key=lambda r: r.rank)
        html += "<p class=\"note\">Mean step time per rank (ms); red: slowest</p>" + svg.bars(
            [f"rank {r.rank}" for r in ordered], [r.mean_step_ms for r in ordered], unit="ms",
            highlight=f"rank {s.slowest_rank}")
    if s.by_wait:
        ordered = sorted(s.by_wait, key=lambda w: w.rank)
        html += (f"<p class=\"note\">Waiting each rank caused at {s.matched_collectives} matched collectives "
                 f"({escape(s.collective_source or '')}; lateness counted from {s.min_lateness_us:.0f} us), ms</p>"
                 + svg.bars([f"rank {w.rank}" for w in ordered], [w.caused_wait_us / 1000 for w in ordered],
                            unit="ms", highlight=f"rank {s.waited_for_rank}"))
        html += _step_wait_heatmap(window)
        rows = [[step_label(i.step), i.name, str(i.ordinal), str(i.last_rank), _f(i.lateness_us / 1000, 3),
                 _f(i.extra_compute_us / 1000, 3), _f(i.arrival_spread_us / 1000, 3), _f(i.end_spread_us / 1000, 3),
                 str(i.participants)] for i in s.worst_instances]
        buttons = [perfetto.button(f"step {step_label(i.step)} {i.name} #{i.ordinal}: rank {i.last_rank} late",
                                   perfetto.step_range(ranges, window.window, i.step)) for i in s.worst_instances]
        html += ("<p class=\"note\">Latest arrivals. extra compute: the late rank's computation since the previous "
                 "collective minus the others' median (close to the lateness: more work; near 0: delayed "
                 "elsewhere)</p>" + _table(["step", "collective", "#", "last rank", "late by ms", "extra compute ms",
                                           "arrival spread ms", "end spread ms", "ranks", "trace"], rows, left=(1,),
                                          raw_last=buttons))
    return html


def _step_wait_heatmap(window: WindowReport) -> str:
    by_step = window.stragglers.by_step
    if not by_step:
        return ""
    ranks = sorted({rank for step in by_step for rank in step.wait_by_rank_us})
    values = [[step.wait_by_rank_us.get(rank, 0.0) / 1000 for step in by_step] for rank in ranks]
    return ("<p class=\"note\">Time each rank waited in collectives for later ranks, per step (ms)</p>"
            + svg.heatmap([f"rank {r}" for r in ranks], [step_label(step.step, prefix="s") for step in by_step], values,
                          unit="ms"))


def _clock_section(report: Report) -> str:
    rows = [[_opt(w.window), h.host, _ranks_text(h.ranks), h.source, _f(h.offset_us / 1000, 3),
             _f(_ms(h.measured_offset_us), 3), _f(_ms(h.measured_uncertainty_us), 3),
             _f(_ms(h.collective_offset_us), 3), _f(_ms(h.collective_spread_us), 3), str(h.collective_samples)]
            for w in report.windows for h in w.clock.hosts]
    if not rows:
        return ""
    return ("<h2>Clocks</h2><p class=\"note\">Offset of each host's clock to the reference host (the host of the "
            "lowest rank), removed before collectives are matched. Measured at startup over the process "
            "group (clock/rank&lt;R&gt;.json) and estimated from collective end times.</p>"
            + _table(["window", "host", "ranks", "source", "used ms", "measured ms", "+/- ms", "collectives ms",
                      "spread ms", "samples"], rows, left=(1, 2, 3), labels=4))


def _ms(value_us: float | None) -> float | None:
    return None if value_us is None else value_us / 1000


def _ranks_text(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks)) if len(ranks) <= 8 else f"{ranks[0]}..{ranks[-1]} ({len(ranks)} ranks)"


def _hta_section(report: Report) -> str:
    parts = ["<h2>HTA (Holistic Trace Analysis)</h2>"]
    for window in report.windows:
        hta = window.hta
        parts.append(f"<h3>window {_opt(window.window)}: {escape(hta.status)}</h3>")
        if hta.reason:
            parts.append(f"<p>{escape(hta.reason)}</p>")
        for name, error in sorted(hta.errors.items()):
            parts.append(f"<p class=\"bad\">{escape(name)}: {escape(error)}</p>")
        for name, rows in hta.tables.items():
            parts.append(f"<h3>{escape(name)}</h3>" + _records_table(rows))
    return "".join(parts)


def _records_table(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return "<p class=\"note\">(empty)</p>"
    header = list(rows[0])
    shown = rows[:HTA_ROWS_SHOWN]
    body = [[_cell(row.get(k)) for k in header] for row in shown]
    more = f"<p class=\"note\">{len(rows) - len(shown)} more rows in the JSON report</p>" if len(rows) > len(shown) else ""
    return _table(header, body, left=tuple(range(len(header)))) + more


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "" if value is None else str(value)


def _f(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _opt(value: int | None) -> str:
    return "-" if value is None else str(value)
