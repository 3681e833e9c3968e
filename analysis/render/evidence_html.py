"""HTML sections of the evidence: collective bandwidth (and the sections after it in the report)."""

from __future__ import annotations

from html import escape

from fleetscope.analysis.report.model import Report

_LEFT = ' class="l"'


def evidence_sections(report: Report) -> str:
    """The evidence sections of the HTML report, concatenated."""
    return "".join((_bandwidth(report),))


def table(header: list[str], rows: list[list[str]], *, left: tuple[int, ...] = ()) -> str:
    def cells(tag: str, values: list[str]) -> str:
        return "".join(f"<{tag}{_LEFT if i in left else ''}>{escape(v)}</{tag}>" for i, v in enumerate(values))

    return ("<table><tr>" + cells("th", header) + "</tr>"
            + "".join("<tr>" + cells("td", row) + "</tr>" for row in rows) + "</table>")


def _f(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


_BANDWIDTH_HEADER = ["collective", "group", "size", "scope", "ranks", "instances", "GB moved", "moving ms",
                     "wait %", "algbw GB/s", "busbw GB/s", "peak GB/s", "% of peak"]


def _bandwidth(report: Report) -> str:
    parts = []
    for window in report.windows:
        bandwidth = window.bandwidth
        if bandwidth is None:
            continue
        title = f"<h3>window {'-' if window.window is None else window.window}</h3>"
        if bandwidth.status != "ok":
            parts.append(f"{title}<p>{escape(bandwidth.status)}: {escape(bandwidth.reason)}</p>")
            continue
        rows = [[r.collective, r.group or "-", r.size_bucket, r.scope, str(r.members), str(r.instances),
                 _f(r.total_bytes / 1e9, 3), _f(r.moving_us / 1000, 2), _f(r.wait_pct), _f(r.algbw_gbps),
                 _f(r.busbw_gbps), _f(r.peak_busbw_gbps, 0), _f(r.peak_pct)] for r in bandwidth.rows]
        verdicts = "".join(f"<li>{escape(r.verdict)}</li>" for r in bandwidth.rows[:5])
        parts.append(f"{title}<ul>{verdicts}</ul>" + table(_BANDWIDTH_HEADER, rows, left=(0, 1, 2, 3))
                     + f"<p class=\"note\">Peaks: {escape(bandwidth.peak_source)}.</p>")
    if not parts:
        return ""
    return ("<h2>Collective bandwidth</h2><p class=\"note\">Data movement = own end minus the last rank's "
            "arrival; waiting = last arrival minus own arrival. busbw = algbw x the nccl-tests factor "
            "(all-reduce 2(n-1)/n; all-gather, reduce-scatter, all-to-all (n-1)/n; others 1).</p>"
            + "".join(parts))
