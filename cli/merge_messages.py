"""What `merge` and `postprocess` print about a merge: the files, the size budget, which ranks are drawn in
full and why, and what was left out (counts and short rank ranges, never a thousand numbers)."""

from __future__ import annotations

from collections import defaultdict

from ..analysis.merge.focus import FocusPlan
from ..analysis.quantities import step_ranges

_PEER_PREFIX = "process-group peer of rank "
_HOST_PREFIX = "first rank of host "


def describe_merge(result) -> list[str]:
    """Lines for a MergeResult (analysis/merge/run.py)."""
    if not result.ranks:
        return ["nothing merged: no trace could be read (the problems below say why); no file written"]
    others = sum(not summary.profiler_trace for summary in result.per_rank)
    drawn = [f"{len(result.ranks) - others} rank(s) in full"] if len(result.ranks) > others else []
    drawn += [f"{others} trace(s) of another tool (no torch.profiler events: drawn as they are)"] if others else []
    lines = [f"merged {' and '.join(drawn)} into {len(result.outputs)} file(s):"]
    lines += [f"  {path} ({path.stat().st_size / 1e6:.1f} MB)" for path in result.outputs if path.is_file()]
    if result.summary:
        lines.append(f"  summary tracks of all {len(result.summary)} ranks (process 'fleetscope summary (every rank)')"
                     + ("" if not result.shards else f" in {result.output.name}"))
    if result.whole_run_samples:
        lines.append(f"  the whole run: every rank's step time and lateness over every step, {result.whole_run_samples:,} "
                     "counter samples (process 'fleetscope whole run (every rank, every step)')"
                     + ("" if not result.shards else f" in {result.output.name}"))
    if result.focus is not None:
        lines += describe_focus(result.focus)
    lines += describe_notes(getattr(result, "notes", []))
    return lines


def describe_notes(notes) -> list[str]:
    """The events a merge repaired or left out of usable traces (MergeResult.notes: "N events: reason" per
    file), one line per reason: the events summed over the files, the ranks as ranges."""
    by_reason: dict[str, tuple[int | None, set[int]]] = {}
    for note in notes:
        reason = str(getattr(note, "reason", note))
        count, separator, what = reason.partition(" events: ")
        counted = bool(separator) and count.isdigit()
        key = what if counted else reason
        total, ranks = by_reason.get(key, (0 if counted else None, set()))
        by_reason[key] = (total + int(count) if counted and total is not None else total, ranks)
        if getattr(note, "rank", None) is not None:
            ranks.add(note.rank)
    lines = []
    for reason, (total, ranks) in by_reason.items():
        where = f" ({len(ranks)} rank(s): {step_ranges(sorted(ranks))})" if ranks else ""
        lines.append(f"  note: {total:,} events: {reason}{where}" if total is not None else f"  note: {reason}{where}")
    return lines


def describe_focus(plan: FocusPlan) -> list[str]:
    total = len(plan.chosen) + len(plan.left_out)
    if not plan.left_out:
        return [f"size budget {megabytes(plan.budget_bytes)}: every rank fits (estimated "
                f"{megabytes(plan.estimated_bytes - plan.summary_bytes)}): all {total} in full, nothing left out"]
    lines = [f"size budget {megabytes(plan.budget_bytes)}: {len(plan.chosen)} of {total} ranks in full "
             f"(estimated {megabytes(plan.estimated_bytes)} with the summary of every rank)"]
    for reason, ranks in _by_reason(plan).items():
        lines.append(f"  in full, {reason}: {step_ranges(ranks)}")
    lines.append(f"  left out (summary only): {len(plan.left_out)} ranks: {step_ranges(plan.left_out)}")
    if plan.over_budget:
        lines.append(f"  over the budget: {len(plan.over_budget)} more candidates "
                     f"({_kinds(c.reasons for c in plan.over_budget)})")
    lines.append("  everything in full: --ranks all, or --shard-ranks N (N ranks per file, plus the summary file)")
    return lines


def megabytes(count: int) -> str:
    return f"{count / 1e6:.0f} MB" if count >= 10e6 else f"{count / 1e6:.3g} MB"


def _by_reason(plan: FocusPlan) -> dict[str, list[int]]:
    """Reason -> ranks; peers and host leaders are grouped into one line each."""
    grouped: dict[str, list[int]] = defaultdict(list)
    for choice in plan.chosen:
        for reason in choice.reasons:
            grouped[_kind(reason)].append(choice.rank)
    return dict(grouped)


def _kind(reason: str) -> str:
    if reason.startswith(_PEER_PREFIX):
        return "process-group peers of the ranks above"
    if reason.startswith(_HOST_PREFIX):
        return "one rank per host"
    return reason


def _kinds(reason_lists) -> str:
    counts: dict[str, int] = defaultdict(int)
    for reasons in reason_lists:
        counts[_kind(reasons[0])] += 1
    return ", ".join(f"{kind}: {count}" for kind, count in counts.items())


def describe_problems(problems) -> list[str]:
    """One line per merge problem as words (rank, file, reason), never a Python repr; problems that share a
    reason and differ only by rank are one line with their count and rank ranges."""
    by_reason: dict[str, list[int]] = {}
    lines = []
    for problem in problems:
        if getattr(problem, "path", None) is None and getattr(problem, "rank", None) is not None:
            by_reason.setdefault(str(problem.reason), []).append(problem.rank)
            continue
        where = ": ".join(str(part) for part in (
            f"rank {problem.rank}" if getattr(problem, "rank", None) is not None else None,
            getattr(problem, "path", None)) if part)
        lines.append(f"problem: {where + ': ' if where else ''}{getattr(problem, 'reason', problem)}")
    for reason, ranks in by_reason.items():
        lines.append(f"problem: {reason}: {len(ranks)} rank(s) ({step_ranges(sorted(ranks))})")
    return lines
