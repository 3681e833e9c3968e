"""Terminal text of the report's `whole_run` section: slow ranks, changes, the windows against the run."""

from __future__ import annotations

from fleetscope.analysis.cross_rank.whole_run import STATUS_OK, WholeRun

CHANGES_SHOWN = 8


def whole_run_text(section: WholeRun | None) -> str:
    """Empty when the report has no whole_run section."""
    if section is None:
        return ""
    if section.status != STATUS_OK:
        return "\n".join(["Whole run (every step, every rank)", f"  {section.status}: {section.reason}",
                          *[f"  note: {n}" for n in section.notes]])
    sources = "; ".join(f"{name}: {len(ranks)} rank(s)" for name, ranks in section.sources.items())
    lines = [
        "Whole run (every step, every rank)",
        f"  {section.ranks} ranks, steps {section.first_step}-{section.last_step}, {section.steady_steps:,} steady "
        f"steps; source: {sources}",
        f"  step time median {_ms(section.step_time_ms)} (median rank {_ms(section.median_rank_step_ms)}) "
        f"({section.basis})",
        f"  lateness: {section.lateness_basis}",
        f"  verdict: {section.verdict}",
    ]
    lines += [f"  slow: {slow.sentence}" for slow in section.slow_ranks]
    lines += _change_lines(section)
    lines += [f"  {w.label if w.profiled_steps else f'window ({w.label})'}: {_ms(w.median_ms)} profiled, "
              f"{_ms(w.between_median_ms)} in the steady steps before it" for w in section.windows]
    lines += [f"  drift: {section.drift}", f"  representative: {section.representative}"]
    for heatmap in (section.step_time_map, section.lateness_map):
        if heatmap is not None:
            lines.append(f"  heatmap of {heatmap.quantity} in the HTML report: {heatmap.binning}")
    lines += [f"  note: {n}" for n in section.notes]
    return "\n".join(lines)


def _change_lines(section: WholeRun) -> list[str]:
    smaller = (f" ({section.changes_below_size} smaller than 1% of the step left out)"
               if section.changes_below_size else "")
    if not section.changes_total:
        return [f"  change points: none in any rank's excess over its peers{smaller}"]
    shown = section.changes[:CHANGES_SHOWN]
    lines = [f"  change points: {section.changes_total} (largest {len(shown)} shown; excess level: 1 + the "
             "noise-weighted mean of a rank's excesses over its peers' median in step time, input wait and arrival "
             "at the first collective (each signal weighted by 1 / its step-to-step noise on that rank), over the "
             f"median step time; 1.00 = level with its peers){smaller}"]
    lines += [f"    rank {c.rank} at step {c.step:,}: {c.level_before:.3f} -> {c.level_after:.3f}{_episode(section, c)}"
              for c in shown]
    return lines


def _episode(section: WholeRun, change) -> str:
    """The slow episode a change point starts or ends, with its size in the user's terms: the level is a detection
    statistic (signals weighted by their noise), so a rank 66% late at its first collective can move it by 0.01."""
    for slow in section.slow_ranks:
        if slow.rank != change.rank:
            continue
        if slow.from_step == change.step:
            return f" (starts its slow episode: {slow.signal} +{slow.excess_ms:.1f} ms, +{slow.excess_pct:.0f}% of the step)"
        if not slow.to_the_end and slow.to_step + 1 == change.step:
            return f" (ends its slow episode: {slow.signal} +{slow.excess_ms:.1f} ms)"
    return ""


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f} ms"
