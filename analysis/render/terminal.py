"""The terminal summary of a Report: plain text, fixed-width tables, no colors.

Units, one per quantity in every terminal section: times in ms; memory in MiB (2^20 bytes, as the caching
allocator counts it); message sizes in KiB/MiB/GiB (2^10.. bytes, as NCCL's buffers); bandwidth in GB/s
(10^9 bytes/s, as nccl-tests); file sizes in MB (10^6 bytes, as `merge --budget-mb`). Counts are whole numbers
when they are (a per-step mean of 74.0 reads "74").
"""

from __future__ import annotations

from fleetscope.analysis.cross_rank.matching import METHOD_ORDER, METHOD_SEQUENCE, CollectiveMatching
from fleetscope.analysis.per_rank.collectives import step_label
from fleetscope.analysis.render.capture_text import capture_sections
from fleetscope.analysis.render.evidence_text import evidence_sections, profiling_cost_headline
from fleetscope.analysis.render.cause_terminal import cause_lines, critical_path_lines
from fleetscope.analysis.render.pipeline_section import pipeline_text
from fleetscope.analysis.render.moe_text import moe_section
from fleetscope.analysis.render.whole_run_text import whole_run_text
from fleetscope.analysis.quantities import profiled_excess_pct, step_ranges
from fleetscope.analysis.report.model import Report, WindowReport

MAX_RANK_ROWS = 32
"""Beyond this many ranks the table shows the slowest and fastest ones."""
WORST_COLLECTIVES_SHOWN = 3


def render_terminal(report: Report) -> str:
    """A summary of the report for a terminal (ends with a newline)."""
    sections = [
        _header(report),
        _rank_table(report),
        _stragglers(report),
        cause_lines(report),
        critical_path_lines(report),
        pipeline_text(report),
        *evidence_sections(report),
        *capture_sections(report),
        moe_section(report.moe),
        whole_run_text(report.whole_run),
        _clock_lines(report),
        _hta_lines(report),
        _problems(report),
        _listed("Notes", report.notes + [f"window {_w(w.window)}: {n}" for w in report.windows for n in w.notes]),
    ]
    return "\n\n".join(s for s in sections if s) + "\n"


def _w(window: int | None) -> str:
    return "-" if window is None else str(window)


def _num(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _header(report: Report) -> str:
    state = report.state
    steps = report.step_time
    lines = [
        f"fleetscope analysis of {report.source_path} ({report.source_kind.replace('_', ' ')}): {state}",
        f"world size {report.world_size or '?'} | {len(report.windows)} window(s) | "
        f"{len(report.ranks)} rank(s) analyzed"
        + (f" | {step_time_text(report)}" if steps or report.run_step_time_ms is not None else ""),
        f"verdict: {report.verdict}",
    ]
    run_wide = whole_run_headline(report)
    if run_wide:
        lines.append(f"whole run: {run_wide}")
    for index, finding in enumerate(report.advice, 1):
        lines.append(f"advice {index}: {finding.title} [{finding.rule}; confidence {finding.confidence}; {finding.gain}]"
                     + (f" (overlaps {', '.join(finding.overlaps)}: not additive)" if finding.overlaps else ""))
        lines.append(f"  change: {finding.change}")
    if report.advice:
        lines.append("  (fleetscope advise RUN: the evidence; fleetscope tune RUN --apply RULE: try it)")
        cut = advice_cut_short(report)
        if cut:
            lines.append(f"  ({cut})")
    return "\n".join(lines)


def whole_run_headline(report: Report) -> str:
    """The whole run's slow-rank verdict, beside the profiled steps' verdict at the top, where the timelines
    found slow-rank episodes: the profiled steps may be a few, and a long run's story lies in every step
    ("" where there is none)."""
    section = report.whole_run
    return section.verdict if section is not None and section.slow_ranks else ""


def advice_cut_short(report: Report) -> str:
    """What the advice rests on when the job did not complete ("" when it did)."""
    outcome = report.outcome
    if outcome is None or outcome.completed:
        return ""
    return f"this advice rests on the profiled steps before the job {report.state}: its gains are theirs"


def step_time_text(report: Report) -> str:
    """The run's steady step time first (step metrics), then the profiled steps' with how much slower they are."""
    steps = report.step_time
    profiled = (f"profiled steps median {steps.median_ms:.2f} ms, mean {steps.mean_ms:.2f} ms over {steps.count} "
                f"steps ({report.step_time_basis or 'trace'})" if steps else "")
    if report.run_step_time_ms is None:
        return "step time " + profiled.replace("profiled steps ", "", 1)
    run = f"step time {report.run_step_time_ms:.2f} ms ({report.run_step_time_basis})"
    beside = profiled_beside_run(report)
    return run + (f"; {profiled}" + (f", {beside}" if beside else "") if profiled else "")


def profiled_beside_run(report: Report) -> str:
    """How the profiled steps' median compares with the run's steady step, and the measured profiling cost,
    said beside the profiled steps ("" where neither is known)."""
    steps = report.step_time
    excess = profiled_excess_pct(steps.median_ms if steps else None, report.run_step_time_ms)
    parts = [] if excess is None else [f"{excess:+.0f}% over the run's" if excess >= 0 else
                                       f"{-excess:.0f}% under the run's"]
    cost = profiling_cost_headline(report)
    return "; ".join(parts + ([cost] if cost else []))


_COLUMNS = ("rank", "host", "steps", "mean ms", "median ms", "max ms", "busy %", "idle %", "comm %",
            "overlap %", "basis")


def _rank_table(report: Report) -> str:
    if not report.ranks:
        return ""
    ranks = _shown_ranks(report)
    rows = [_COLUMNS] + [_rank_row(s) for s in ranks]
    widths = [max(len(row[i]) for row in rows) for i in range(len(_COLUMNS))]
    lines = ["  ".join(cell.rjust(w) if i != 1 else cell.ljust(w) for i, (cell, w) in enumerate(zip(row, widths)))
             for row in rows]
    if len(ranks) < len(report.ranks):
        lines.append(f"... {len(report.ranks) - len(ranks)} more ranks in the JSON/HTML report")
    return "Per rank (all windows; each rank's own profiled steps, trace)\n" + "\n".join(lines)


def _shown_ranks(report: Report):
    if len(report.ranks) <= MAX_RANK_ROWS:
        return report.ranks
    by_mean = sorted(report.ranks, key=lambda s: -(s.step_time.mean_ms if s.step_time else 0.0))
    half = MAX_RANK_ROWS // 2
    return sorted(by_mean[:half] + by_mean[-half:], key=lambda s: s.rank)


def _rank_row(summary) -> tuple[str, ...]:
    steps = summary.step_time
    return (
        str(summary.rank), summary.host[:20], str(steps.count if steps else 0),
        _num(steps.mean_ms if steps else None, 2), _num(steps.median_ms if steps else None, 2),
        _num(steps.max_ms if steps else None, 2), _num(summary.busy_pct), _num(summary.idle_pct),
        _num(summary.comm_pct), _num(summary.overlap_pct), summary.basis or "-",
    )


def _stragglers(report: Report) -> str:
    lines = []
    for window in report.windows:
        lines.append(f"window {_w(window.window)}: {window.stragglers.verdict}")
        matching = matching_sentence(window.collective_matching)
        lines += [f"  {matching}"] if matching else []
        lines += _worst_collectives(window)
    return "Stragglers\n" + "\n".join(f"  {line}" for line in lines) if lines else ""


MATCHING_GROUPS_NAMED = 3


def matching_sentence(matching: CollectiveMatching) -> str:
    """How the window's collectives were matched across ranks, in one line ("" without collectives)."""
    if matching.method is None:
        return ""
    by_sequence = [g for g in matching.groups if g.method == METHOD_SEQUENCE]
    by_order = [g for g in matching.groups if g.method == METHOD_ORDER]
    parts = [f"by {METHOD_SEQUENCE} ({_group_names(by_sequence)})"] if by_sequence else []
    if by_order:
        first = by_order[0]
        why = f"{first.group}: {first.reason}" if first.group else first.reason
        more = f"; {len(by_order) - 1} more group(s)" if len(by_order) > 1 else ""
        parts.append(f"by {METHOD_ORDER} ({why}{more})")
    return "collectives matched across ranks " + "; ".join(parts)


def _group_names(groups) -> str:
    names = [g.group for g in groups[:MATCHING_GROUPS_NAMED]]
    return ", ".join(names) + (f" and {len(groups) - len(names)} more" if len(groups) > len(names) else "")


def _worst_collectives(window: WindowReport) -> list[str]:
    """The worst instances of the rank the window's verdict names first: the examples under a headline show it."""
    threshold = window.stragglers.min_lateness_us
    named = window.stragglers.waited_for_rank
    late = [i for i in window.stragglers.worst_instances if i.lateness_us >= threshold]
    worst = sorted(late, key=lambda i: (i.last_rank != named, -i.lateness_us))[:WORST_COLLECTIVES_SHOWN]
    return [f"  {step_label(i.step, prefix='step ')} {i.name} #{i.ordinal}: rank {i.last_rank} arrived {i.lateness_us / 1000:.2f} ms "
            f"after the others ({i.participants} ranks; {_extra_compute(i.extra_compute_us)})" for i in worst]


def _extra_compute(extra_us: float) -> str:
    """The late rank's computation since the previous collective, against the others' median."""
    if abs(extra_us) < 5.0:
        return "it computed as much as the others"
    return f"it computed {abs(extra_us) / 1000:.2f} ms {'more' if extra_us > 0 else 'less'} than the others"


def _clock_lines(report: Report) -> str:
    lines = []
    for window in report.windows:
        others = [h for h in window.clock.hosts if h.host != window.clock.reference_host]
        for host in others:
            bound = (f" +/- {host.measured_uncertainty_us / 1000:.3f} ms" if host.source == "measured"
                     else f", spread {host.collective_spread_us / 1000:.3f} ms" if host.source == "collectives" else "")
            lines.append(f"window {_w(window.window)}: {host.host} (ranks {_ranks(host.ranks)}) "
                         f"{host.offset_us / 1000:+.3f} ms vs {window.clock.reference_host} ({host.source}{bound})")
    return "Clocks (offset to the reference host, removed before matching collectives)\n" + "\n".join(
        f"  {line}" for line in lines) if lines else ""


def _ranks(ranks: list[int]) -> str:
    return ",".join(map(str, ranks)) if len(ranks) <= 8 else f"{ranks[0]}..{ranks[-1]} ({len(ranks)})"


def _hta_lines(report: Report) -> str:
    lines = []
    for window in report.windows:
        hta = window.hta
        detail = hta.reason or ", ".join(sorted(hta.tables))
        lines.append(f"window {_w(window.window)}: HTA {hta.status}: {detail}")
        lines += [f"  {name} failed: {error}" for name, error in sorted(hta.errors.items())]
        if hta.oracle:  # only with --hta-oracle
            lines.append(f"  {_oracle_line(hta.oracle)}")
    return "HTA\n" + "\n".join(f"  {line}" for line in lines) if lines else ""


def _oracle_line(oracle: dict[str, dict]) -> str:
    """How fleetscope's HTA tables compare with stock HTA's: tables stock HTA did not compute (its loader
    failed on the trace, say) are named as such, not counted as differences."""
    not_computed = sorted(name for name, entry in oracle.items() if entry.get("oracle_failed"))
    compared = {name: entry for name, entry in oracle.items() if name not in not_computed}
    off = sorted(name for name, entry in compared.items() if not entry.get("within_tolerance"))
    parts = [f"{len(compared) - len(off)} of {len(compared)} within 1e-9" if compared else "nothing compared"]
    if off:
        parts.append(f"differs: {', '.join(off)}")
    if not_computed:
        reason = next((oracle[name]["error"].partition("; HTA: ")[2] for name in not_computed
                       if "; HTA: " in oracle[name].get("error", "")), "")
        parts.append(f"stock HTA did not compute {', '.join(not_computed)}" + (f" ({reason})" if reason else ""))
    return "stock HTA beside it: " + "; ".join(parts)


def _problems(report: Report) -> str:
    lines = [f"{p.label}: {p.reason}" for p in report.problems]
    lines += _missing_lines(report)
    return _listed("Problems (the analysis is partial)", lines)


def _missing_lines(report: Report) -> list[str]:
    """Missing rank traces as one line per window, the ranks as ranges; those beyond the listed ones counted."""
    by_window: dict = {}
    for m in report.missing:
        by_window.setdefault(m.window, []).append(m.rank)
    lines = []
    for window, ranks in by_window.items():
        where = "" if window is None else f" in window {window}"
        lines.append(f"no trace{where} for {len(ranks)} rank(s): {step_ranges(ranks)}")
    unlisted = report.missing_total - len(report.missing)
    if unlisted > 0:
        lines.append(f"and {unlisted} more rank trace(s) missing, not listed ({report.missing_total} in all)")
    return lines


def _listed(title: str, lines: list[str]) -> str:
    return f"{title}\n" + "\n".join(f"  {line}" for line in lines) if lines else ""


def render_comparison(comparison) -> str:
    """A `compare` result as a terminal table (ends with a newline)."""
    rows = [("metric", "base", "new", "change", "gated")]
    for m in comparison.metrics:
        mark = "REGRESSION" if m.regression else ("yes" if m.gated else "no")
        change = ("-" if m.delta_pct is None and getattr(m, "delta_points", None) is None else
                  f"{m.delta_points:+.1f} pt" if getattr(m, "delta_points", None) is not None else f"{m.delta_pct:+.1f}%")
        rows.append((m.name, _num(m.base, 2), _num(m.new, 2), change, mark))
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    table = "\n".join("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
                      for r in rows)
    lines = [f"compare {comparison.base_path} -> {comparison.new_path}", table, f"verdict: {comparison.verdict}"]
    slower = [r for r in comparison.ranks if r.delta_pct is not None and r.delta_pct >= comparison.threshold_pct]
    if slower:
        lines.append("ranks with slower steps: " + ", ".join(f"{r.rank} ({r.delta_pct:+.1f}%)" for r in slower[:16]))
    lines += [f"note: {n}" for n in comparison.notes]
    return "\n".join(lines) + "\n"
