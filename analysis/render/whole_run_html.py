"""HTML of the report's `whole_run` section, with its rank x step heatmaps as inline SVG."""

from __future__ import annotations

from html import escape

from fleetscope.analysis.cross_rank.whole_run import STATUS_OK, Heatmap, WholeRun
from fleetscope.analysis.render import svg
from fleetscope.analysis.render.html_table import table
from fleetscope.analysis.render.whole_run_text import whole_run_text


def whole_run_html(section: WholeRun | None) -> str:
    """Empty when the report has no whole_run section."""
    if section is None:
        return ""
    if section.status != STATUS_OK:
        return f"<h2>Whole run</h2><pre>{escape(whole_run_text(section))}</pre>"
    parts = [
        "<h2>Whole run</h2>",
        f"<p>{escape(section.verdict)}</p>",
        f"<p>{section.ranks} ranks, steps {section.first_step}-{section.last_step}, {section.steady_steps:,} steady "
        f"steps. Step time: {escape(section.basis)}. Lateness: {escape(section.lateness_basis)}.</p>",
        _slow_table(section),
        _window_table(section),
        f"<p>Drift: {escape(section.drift)}</p><p>Representative: {escape(section.representative)}</p>",
        _heatmap(section.step_time_map),
        _heatmap(section.lateness_map),
    ]
    if section.notes:
        parts.append("<ul>" + "".join(f"<li>{escape(n)}</li>" for n in section.notes) + "</ul>")
    return "".join(parts)


def _slow_table(section: WholeRun) -> str:
    rows = [[str(s.rank), f"{s.from_step:,}", "end" if s.to_the_end else f"{s.to_step:,}", s.signal,
             f"{s.excess_ms:+.1f}", f"{s.excess_pct:+.1f}", _f(s.job_step_change_ms, 1), _pct(s.last_pct),
             _pct(s.first_collective_last_pct), _f(s.median_lateness_ms), s.sentence]
            for s in section.slow_ranks]
    if not rows:
        return ""
    return table(["rank", "from step", "to step", "what it does that its peers don't", "excess over peers ms",
                  "excess % of the step before", "median rank's step change ms", "last to end %",
                  "last at first collective %", "median lateness ms", "finding"], rows, left=(3, 10))


def _window_table(section: WholeRun) -> str:
    rows = [[w.label, _f(w.median_ms), _f(w.between_median_ms),
             _f(w.percentile_pct, 0)] for w in section.windows]
    if not rows:
        return ""
    return table(["profiled window", "median ms (profiled)", "steady steps before it, median ms",
                  "percentile in the run"], rows)


def _heatmap(heatmap: Heatmap | None) -> str:
    if heatmap is None:
        return ""
    rows = [f"ranks {a}-{b}" if a != b else f"rank {a}" for a, b in heatmap.rank_bins]
    columns = [f"steps {a}-{b}" if a != b else f"step {a}" for a, b in heatmap.step_bins]
    return (f"<h3>{escape(heatmap.quantity)}</h3><p>{escape(heatmap.binning)}</p>"
            + svg.heatmap(rows, columns, heatmap.values, unit=heatmap.unit))


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def _f(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"
