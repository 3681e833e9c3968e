"""Terminal tables of the regression gate (analysis/gate.py) and of a runs' history (analysis/history.py)."""

from __future__ import annotations

# duck-typed: a render module does not import the top-level gate.py / history.py (tests/test_docs_layering.py)


def _table(rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
                     for r in rows)


def _num(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def render_gate(result) -> str:
    """The gate's metrics, interval and verdict (ends with a newline)."""
    lines = [f"gate: base {', '.join(result.base_runs)} -> new {', '.join(result.new_runs)}"]
    if result.metrics:
        rows = [("metric", "base", "new", "change", "95% interval", "each new run", "steps", "")]
        for m in result.metrics:
            interval = "-" if m.interval_pct is None else f"{m.interval_pct[0]:+.1f}..{m.interval_pct[1]:+.1f}%"
            per_run = ",".join(f"{c:+.1f}%" for c in m.new_run_changes_pct) or "-"
            change = "-" if m.change_pct is None else f"{m.change_pct:+.1f}%"
            if m.change_pct is not None and getattr(m, "step_cost_pct", None) is not None:
                # a part of the step is judged by what its change costs the step: say both
                change += f" ({m.step_cost_pct:+.1f}% of the step time)"
            mark = "REGRESSION" if m.regression else (m.reason if m.gated else "not gated")
            rows.append((m.name, _num(m.base_median), _num(m.new_median), change, interval, per_run,
                         f"{m.base_steps}/{m.new_steps}", mark))
        lines.append(_table(rows))
    lines.append(f"verdict: {result.verdict}")
    lines += [f"note: {n}" for n in result.notes]
    return "\n".join(lines) + "\n"


def render_directions(result, directions: dict[str, str]) -> str:
    """One line per gated metric: which way it moved and whether that is a gain (`directions`: name ->
    gate.direction of it). Ends with a newline; empty when nothing was gated."""
    lines = []
    for m in result.metrics:
        if not m.gated or m.change_pct is None:
            continue
        better = "higher" if m.higher_is_better else "lower"
        verdict = {"gain": "a GAIN beyond the noise", "loss": "a LOSS beyond the noise",
                   "unclear": "within the noise"}[directions.get(m.name, "unclear")]
        lines.append(f"  {m.name}: {_num(m.base_median)} -> {_num(m.new_median)} ({m.change_pct:+.1f}%; "
                     f"{better} is better): {verdict}")
    return "".join(line + "\n" for line in lines)


def render_history(result) -> str:
    """One row per run, oldest first; a '!' marks a metric the run regresses (ends with a newline)."""
    names = result.metrics
    rows = [("date", "run", *names)]
    for run in result.runs:
        cells = [(_num(run.medians.get(n)) + ("!" if n in run.regressions else "")) for n in names]
        rows.append((run.date, run.path, *cells))
    regressed = sum(1 for r in result.runs if r.regressions)
    summary = (f"{len(result.runs)} run(s) under {result.root}; {regressed} with a regression "
               f"(each gated against the runs of the same job before it, threshold {result.threshold_pct:g}%; "
               "'!' marks it; values: medians over steady steps, step metrics, slowest rank per step)")
    jobs = [f"note: {r.path}: {r.job_note}" for r in result.runs if getattr(r, "job_note", "")]
    return (_table(rows) + "\n" if result.runs else "") + "".join(j + "\n" for j in jobs) + summary + "\n"
