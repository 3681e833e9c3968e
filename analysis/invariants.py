"""Rules every report, advice and merged trace must keep, whatever the input: a checker, not a test fixture.

`fleetscope analyze --check` runs it for users; the test suite runs it on every report and advice
fleetscope writes (FLEETSCOPE_INVARIANTS_LOG: each writer appends what broke, tests/conftest.py fails the
test). Each rule returns human-readable violations ("windows[0].causes.findings[1].what_if[2]: ..."):

  no negative time        every *_us / *_ms / *_pct field is >= 0, except the signed differences
                          (SIGNED: against peers, offsets, starts; fields inside a `*_vs_*` comparison);
  shares                  percentages within [0, 100]; busy + idle = 100 per rank and window; critical-path
                          segment shares sum to 1 per step, and a window's by-rank shares to 1; the ranks'
                          shares of the waiting sum to 1;
  what-if                 0 <= caused wait <= step - floor; floor <= projected <= step (a what-if is never below
                          the step's own compute nor above the step), and projected = step - caused wait on the
                          arithmetic basis (quantities.py "what-if");
  waiting                 a rank's waiting per step is the union of its waits that the instance details place
                          (quantities.py "waiting": concurrent collectives count once, never their sum); the
                          waiting a rank caused, and each what-if's, at most the union of its lateness
                          stretches; no what-if below another rank's step less its waiting (its own work);
  step time               the report's step_time is quantities.trace_step_times' StepStats;
  verdict                 the rank the verdict names is quantities.job_straggler's; a verdict (the report's and
                          each window's) names one rank, whatever the sentence (straggler, most waited for,
                          slowest steps, compared with); a window names a straggler only when its significance
                          stands out (stragglers.py);
  idle by cause           a rank's idle time by cause sums to no more than its idle time; on the GPU basis,
                          idle by cause + GPU busy inside the steps = the steps' span (the partition every
                          idle finding's gain is taken from);
  outcome                 a job that did not complete (cross_rank/outcome.py) makes no complete report: its
                          verdict starts with the outcome's sentence and its first problem is the job's;
  advice                  every gain in [0, its denominator], its percentage that share of the printed
                          denominator, the combined gain at most the step, overlaps named both ways, the
                          straggler finding's rank the verdict's (the whole run's episode that stands out and
                          cost the most, where the finding rests on the whole run), its confidence no higher
                          than its significance allows, and no node remedy (--exclude, nvidia-smi) for a CPU
                          rank, nor --exclude for a rank whose host runs other ranks; no advice to rebalance the router unless the MoE
                          section names a hot expert;
  whole run               every change point printed moved its rank's level by MIN_CHANGE_LEVEL or more.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any, Iterator

import numpy as np
from fleetscope.analysis.quantities import (WHAT_IF_ARITHMETIC, WHAT_IF_REPLAYED, job_straggler, trace_step_times,
                                           union_by_step_us)
from fleetscope.analysis.cross_rank.whole_run import EVIDENCE_SOURCE, run_straggler
from fleetscope.analysis.report.model import Report
from fleetscope.traces.validate import finite

LOG_ENV = "FLEETSCOPE_INVARIANTS_LOG"
"""A directory: when set, every report and advice fleetscope writes is checked, and violations are appended
to a file in it (the test suite sets it)."""
SIGNED = ("extra", "excess", "vs_", "offset", "start", "slowdown", "carried", "delta", "change", "growth",
          "interval", "skew")
"""Fields that hold a signed difference (against peers, a clock, a base run) or a position, not a duration."""
TOLERANCE_MS = 1e-6
SHARE_TOLERANCE = 1e-3
PCT_TOLERANCE = 0.05


def check_report(report: Report) -> list[str]:
    """Every rule of the module docstring that a report alone can break."""
    data = report.to_json()
    problems = list(_non_negative(data)) + list(_percentages(data))
    problems += _utilization_sums(report) + _path_shares(report) + _what_ifs(report)
    problems += _step_time(report) + _verdict_rank(report) + _idle_by_cause(report) + _wait_unions(report)
    problems += _verdicts_name_one_rank(report) + _named_stands_out(report) + _outcome_first(report)
    problems += _sized_changes(report)
    return problems


def _sized_changes(report: Report) -> list[str]:
    """A whole-run change point the report prints moved its rank's level by MIN_CHANGE_LEVEL or more ("rank 0 at
    step 302: 1.00 -> 1.00" is no change)."""
    from fleetscope.analysis.cross_rank.whole_run import MIN_CHANGE_LEVEL

    whole = report.whole_run
    changes = getattr(whole, "changes", None) or []
    return [f"whole_run.changes[{index}]: rank {c.rank} at step {c.step} moved {c.level_before:.3f} -> "
            f"{c.level_after:.3f}, less than {MIN_CHANGE_LEVEL}: no change"
            for index, c in enumerate(changes) if abs(c.level_after - c.level_before) < MIN_CHANGE_LEVEL - 1e-12]


def _outcome_first(report: Report) -> list[str]:
    """The outcome rule of the module docstring."""
    outcome = report.outcome
    if outcome is None or outcome.completed:
        return []
    broken = []
    if report.complete:
        broken.append(f"outcome: the job {outcome.state}, yet the report says complete")
    if not report.verdict.startswith(outcome.sentence):
        broken.append(f"outcome: the verdict does not start with how the job ended ({outcome.sentence!r})")
    if not report.problems or report.problems[0].label != "job":
        broken.append("outcome: the job's outcome is not the first problem")
    return broken


def _numbers(data: Any, where: str = "") -> Iterator[tuple[str, str, float]]:
    if isinstance(data, dict):
        for key, value in data.items():
            path = f"{where}.{key}" if where else str(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                yield path, str(key), float(value)
            else:
                yield from _numbers(value, path)
    elif isinstance(data, list):
        for index, value in enumerate(data):
            yield from _numbers(value, f"{where}[{index}]")


def _is_timed(key: str) -> bool:
    return key.endswith(("_us", "_ms", "_pct")) and not any(part in key for part in SIGNED)


def _is_comparison(path: str) -> bool:
    """A field inside a comparison (`after_vs_before.low_pct`): a signed difference, not a duration."""
    return "_vs_" in path.rpartition(".")[0]


def _non_negative(data: dict) -> Iterator[str]:
    for path, key, value in _numbers(data):
        if _is_timed(key) and not _is_comparison(path) and (finite(value) is None or value < -TOLERANCE_MS):
            yield f"{path}: {value!r} (a time or share cannot be negative or infinite)"


def _percentages(data: dict) -> Iterator[str]:
    for path, key, value in _numbers(data):
        if key.endswith("_pct") and _is_timed(key) and not _is_comparison(path) and key != "peak_pct" \
                and value > 100.0 + PCT_TOLERANCE:
            yield f"{path}: {value:.3f}% (over 100%)"


def _utilization_sums(report: Report) -> list[str]:
    problems = []
    for w, window in enumerate(report.windows):
        for r, rank in enumerate(window.ranks):
            u = rank.utilization
            if u is not None and u.span_us > 0 and abs(u.busy_pct + u.idle_pct - 100.0) > PCT_TOLERANCE:
                problems.append(f"windows[{w}].ranks[{r}].utilization: busy {u.busy_pct:.3f}% + idle "
                                f"{u.idle_pct:.3f}% != 100%")
    return problems


def _path_shares(report: Report) -> list[str]:
    problems = []
    for w, window in enumerate(report.windows):
        paths = window.critical_path
        for s, step in enumerate(paths.steps):
            total = sum(seg.share for seg in step.segments)
            if step.segments and step.length_us > 0 and abs(total - 1.0) > SHARE_TOLERANCE:
                problems.append(f"windows[{w}].critical_path.steps[{s}]: segment shares sum to {total:.4f}, not 1")
            if step.span_us and step.length_us > step.span_us + 1.0:   # a report from before span_us has none
                problems.append(f"windows[{w}].critical_path.steps[{s}]: the path ({step.length_us / 1000:.2f} ms) "
                                f"is longer than its step across ranks ({step.span_us / 1000:.2f} ms)")
        total = sum(share.share for share in paths.by_rank)
        if paths.by_rank and abs(total - 1.0) > SHARE_TOLERANCE:
            problems.append(f"windows[{w}].critical_path.by_rank: shares sum to {total:.4f}, not 1")
        waits = window.stragglers.by_wait
        total = sum(wait.score for wait in waits)
        if any(wait.caused_wait_us > 0 for wait in waits) and abs(total - 1.0) > SHARE_TOLERANCE:
            problems.append(f"windows[{w}].stragglers.by_wait: shares of the waiting sum to {total:.4f}, not 1")
    return problems


def _what_ifs(report: Report) -> list[str]:
    problems = []
    for w, window in enumerate(report.windows):
        for f, finding in enumerate(window.causes.findings):
            for i, step in enumerate(finding.what_if):
                where = f"windows[{w}].causes.findings[{f}].what_if[{i}] (step {step.step})"
                if step.caused_wait_ms < -TOLERANCE_MS or step.caused_wait_ms > step.step_time_ms - step.floor_ms + TOLERANCE_MS:
                    problems.append(f"{where}: caused wait {step.caused_wait_ms:.3f} ms outside [0, step "
                                    f"{step.step_time_ms:.3f} - floor {step.floor_ms:.3f}] ms")
                arithmetic = step.basis == WHAT_IF_ARITHMETIC
                if arithmetic and abs(step.projected_step_ms - (step.step_time_ms - step.caused_wait_ms)) > 1e-3:
                    problems.append(f"{where}: projected {step.projected_step_ms:.3f} ms != step - caused wait")
                if step.projected_step_ms < step.floor_ms - TOLERANCE_MS:
                    problems.append(f"{where}: projected {step.projected_step_ms:.3f} ms below its floor "
                                    f"{step.floor_ms:.3f} ms")
                if step.projected_step_ms > step.step_time_ms + TOLERANCE_MS:
                    problems.append(f"{where}: projected {step.projected_step_ms:.3f} ms above the step "
                                    f"{step.step_time_ms:.3f} ms")
                if step.basis not in (WHAT_IF_ARITHMETIC, WHAT_IF_REPLAYED):
                    problems.append(f"{where}: basis {step.basis!r} is none of {WHAT_IF_REPLAYED!r}, "
                                    f"{WHAT_IF_ARITHMETIC!r}")
    return problems


def _wait_unions(report: Report) -> list[str]:
    problems = []
    for w, window in enumerate(report.windows):
        placed = _placed_waits(window.stragglers)
        if placed is None:
            continue                # details not kept (too many cells) or a report from before they were placed
        waiting, caused = placed
        problems += _waiting_is_union(w, window.stragglers, waiting, caused)
        problems += _what_ifs_within_union(w, window, waiting, caused)
    return problems


def _placed_waits(stragglers) -> tuple[dict[int, dict[int, float]], dict[int, dict[int, float]]] | None:
    """From the instance details: step -> rank -> the union of its waits, and rank -> step -> the union of its
    lateness stretches ([the others' median arrival, its arrival]) where it was last by min_lateness_us."""
    details = stragglers.details
    if not details or any(d.first_start_us is None for d in details):
        return None
    ranks = stragglers.detail_ranks
    rows: dict[int, list[tuple[int, float, float]]] = {rank: [] for rank in ranks}
    late: dict[int, list[tuple[int, float, float]]] = {rank: [] for rank in ranks}
    for d in details:
        arrivals = np.asarray([np.nan if a is None else d.first_start_us + a for a in d.arrival_us])
        last_row = int(np.nanargmax(arrivals))
        last = float(arrivals[last_row])
        for rank, arrival in zip(ranks, arrivals):
            rows[rank].append((d.step, float(arrival), last))
        others = np.delete(arrivals, last_row)
        lateness = last - float(np.nanmedian(others)) if np.isfinite(others).any() else 0.0
        if lateness >= stragglers.min_lateness_us:
            late[ranks[last_row]].append((d.step, last - lateness, last))
    waiting: dict[int, dict[int, float]] = {}
    for rank, intervals in rows.items():
        for step, us in _unions(intervals).items():
            waiting.setdefault(step, {})[rank] = us
    return waiting, {rank: _unions(intervals) for rank, intervals in late.items()}


def _unions(intervals: list[tuple[int, float, float]]) -> dict[int, float]:
    if not intervals:
        return {}
    steps, starts, ends = zip(*intervals)
    return union_by_step_us(steps, starts, ends)


def _over(value_us: float, limit_us: float) -> bool:
    return value_us > limit_us * (1 + 1e-6) + 1.0


def _waiting_is_union(w: int, stragglers, waiting: dict, caused: dict) -> list[str]:
    problems = []
    for s, step in enumerate(stragglers.by_step):
        for rank, us in step.wait_by_rank_us.items():
            union = waiting.get(step.step, {}).get(rank, 0.0)
            if _over(us, union) or _over(union, us):
                problems.append(f"windows[{w}].stragglers.by_step[{s}] (step {step.step}): rank {rank} waits "
                                f"{us:.1f} us, the union of its waits is {union:.1f} us (concurrent collectives "
                                "count once)")
    for r, wait in enumerate(stragglers.by_wait):
        union = sum(caused.get(wait.rank, {}).values())
        if _over(wait.caused_wait_us, union):
            problems.append(f"windows[{w}].stragglers.by_wait[{r}]: rank {wait.rank} caused {wait.caused_wait_us:.1f} "
                            f"us of waiting, more than the union of its lateness {union:.1f} us")
    return problems


def _what_ifs_within_union(w: int, window, waiting: dict, caused: dict) -> list[str]:
    problems = []
    step_ms = {(rank.rank, s.step): s.step_time_ms for rank in window.ranks for s in rank.steps}
    for f, finding in enumerate(window.causes.findings):
        for i, step in enumerate(finding.what_if):
            where = f"windows[{w}].causes.findings[{f}].what_if[{i}] (step {step.step})"
            union = caused.get(finding.rank, {}).get(step.step, 0.0)
            if _over(step.caused_wait_ms * 1000, union):
                problems.append(f"{where}: caused wait {step.caused_wait_ms:.3f} ms exceeds the union of rank "
                                f"{finding.rank}'s lateness {union / 1000:.3f} ms")
            own = [step_ms[(rank, step.step)] - us / 1000 for rank, us in waiting.get(step.step, {}).items()
                   if rank != finding.rank and (rank, step.step) in step_ms]
            if own and step.projected_step_ms < max(own) - 1e-3:
                problems.append(f"{where}: projected {step.projected_step_ms:.3f} ms below another rank's own "
                                f"work in the step (its step less its waiting, {max(own):.3f} ms)")
    return problems


def _step_time(report: Report) -> list[str]:
    times = list(trace_step_times(report.windows).values())
    stats = report.step_time
    if not times:
        return [] if stats is None else ["step_time: present although no rank has a profiled step"]
    if stats is None:
        return ["step_time: missing although ranks have profiled steps"]
    expected = (len(times), float(np.median(times)), float(np.mean(times)))
    shown = (stats.count, stats.median_ms, stats.mean_ms)
    if shown[0] != expected[0] or any(abs(a - b) > 1e-6 for a, b in zip(shown[1:], expected[1:])):
        return [f"step_time: count/median/mean {shown} differ from the slowest rank per profiled step {expected}"]
    return []


_VERDICT_RANK = re.compile(r"rank (\d+) (?:is the straggler|causes the most waiting)")


def _verdict_rank(report: Report) -> list[str]:
    named = _VERDICT_RANK.search(report.verdict)
    if named is None:
        return []
    top = job_straggler(report.windows)
    if top is None or top.rank != int(named.group(1)):
        return [f"verdict names rank {named.group(1)}, the waiting points at "
                f"{'no rank' if top is None else f'rank {top.rank}'}"]
    return []


_BLAMED_RANK = re.compile(r"rank (\d+) (?:is the straggler|causes the most waiting|has the slowest steps|is the rank "
                          r"waited for most)|slowest rank: (\d+)|the others wait for rank (\d+)|the rank waited for "
                          r"most, rank (\d+)|vs rank (\d+)|rank (\d+), the fastest")
"""The ranks a verdict names in its step-time and collectives' sentences: as the one holding the others back, or
as the one compared with ("+1.2% vs rank 0, the fastest" beside "rank 1 is the straggler" named two)."""


def _verdicts_name_one_rank(report: Report) -> list[str]:
    problems = []
    verdicts = [("verdict", report.verdict)] + [(f"windows[{w}].stragglers.verdict", window.stragglers.verdict)
                                               for w, window in enumerate(report.windows)]
    for where, verdict in verdicts:
        named = sorted({int(next(g for g in m.groups() if g)) for m in _BLAMED_RANK.finditer(verdict)})
        if len(named) > 1:
            problems.append(f"{where}: names ranks {named} as the one holding the others back; a verdict names one")
    return problems


def _named_stands_out(report: Report) -> list[str]:
    problems = []
    for w, window in enumerate(report.windows):
        s = window.stragglers
        if s.consistent and (s.significance is None or not s.significance.stands_out
                             or s.significance.rank != s.waited_for_rank):
            problems.append(f"windows[{w}].stragglers: names rank {s.waited_for_rank} the straggler, but its lateness "
                            "does not stand out from the step-to-step spread")
    return problems


def _idle_by_cause(report: Report) -> list[str]:
    problems = []
    for w, window in enumerate(report.windows):
        for r, rank in enumerate(window.ranks):
            stalls, u = rank.host_stalls, rank.utilization
            if stalls is None or u is None:
                continue
            total = sum(stalls.idle_by_cause_us.values())
            if total > u.idle_us * (1 + 1e-6) + 1.0:
                problems.append(f"windows[{w}].ranks[{r}]: idle by cause {total:.1f} us exceeds its idle "
                                f"{u.idle_us:.1f} us")
            if u.basis == "gpu" and stalls.steps_span_us > 0:
                covered = total + stalls.steps_busy_us
                if abs(covered - stalls.steps_span_us) > 1e-6 * stalls.steps_span_us + 1.0:
                    problems.append(f"windows[{w}].ranks[{r}]: idle by cause {total:.1f} us + busy "
                                    f"{stalls.steps_busy_us:.1f} us is not the steps' span {stalls.steps_span_us:.1f} us")
    return problems


def check_advice(advice: Any, report: Report | None) -> list[str]:
    """The advice rules of the module docstring (duck-typed: analysis/advise/'s Advice)."""
    problems = []
    for index, f in enumerate(advice.findings, 1):
        where = f"finding {index} ({f.rule})"
        if f.expected_gain_ms is not None and f.expected_gain_ms < -TOLERANCE_MS:
            problems.append(f"{where}: negative gain {f.expected_gain_ms:.3f} ms")
        of_ms = getattr(f, "gain_of_ms", None)
        if f.expected_gain_pct is not None:
            if not of_ms or not getattr(f, "gain_basis", ""):
                problems.append(f"{where}: a percentage without its denominator and basis")
            elif abs(f.expected_gain_pct - 100.0 * f.expected_gain_ms / of_ms) > 1e-6:
                problems.append(f"{where}: {f.expected_gain_pct:.2f}% is not {f.expected_gain_ms:.3f} of {of_ms:.3f} ms")
            elif f.expected_gain_ms > of_ms + TOLERANCE_MS:
                problems.append(f"{where}: gain {f.expected_gain_ms:.3f} ms exceeds its step {of_ms:.3f} ms")
        for other in getattr(f, "overlaps", []):
            partner = next((g for g in advice.findings if g.rule == other), None)
            if partner is None or f.rule not in partner.overlaps:
                problems.append(f"{where}: overlaps {other}, which does not name it back")
    combined, of_ms = getattr(advice, "combined_gain_ms", None), getattr(advice, "combined_gain_of_ms", None)
    if combined is not None and (of_ms is None or combined > of_ms + TOLERANCE_MS or combined < 0):
        problems.append(f"combined gain {combined:.3f} ms outside [0, the step {of_ms}]")
    problems += _advice_within_moe(advice, report)
    top = job_straggler(report.windows) if report is not None else None
    for f in advice.findings:
        if report is None or f.rule != "straggler":
            continue
        if f.evidence.get("source") == EVIDENCE_SOURCE:
            problems += _whole_run_straggler(f, report)
        elif top is None or f.ranks != [top.rank]:
            problems.append(f"straggler finding names rank(s) {f.ranks}, the verdict "
                            f"{'no rank' if top is None else f'rank {top.rank}'}")
        else:
            problems += _straggler_confidence(f, report)
        problems += _straggler_remedy(f, report)
    return problems


def _whole_run_straggler(finding: Any, report: Report) -> list[str]:
    """A straggler finding resting on the whole run names the rank the whole run shows consistently late
    (whole_run.py run_straggler), with a confidence no higher than that episode's significance allows."""
    episode = run_straggler(report.whole_run)
    if episode is None or finding.ranks != [episode.rank]:
        return [f"straggler finding rests on the whole run and names rank(s) {finding.ranks}, the whole run's episode "
                f"that stands out {'none' if episode is None else f'rank {episode.rank}'}"]
    allowed = episode.significance.confidence
    if finding.confidence in CONFIDENCES and allowed in CONFIDENCES and \
            CONFIDENCES.index(finding.confidence) > CONFIDENCES.index(allowed):
        return [f"straggler finding: confidence {finding.confidence} beyond what the whole run's significance allows "
                f"({allowed})"]
    return []


CONFIDENCES = ("low", "medium", "high")


def _straggler_remedy(finding: Any, report: Report) -> list[str]:
    """No node remedy for a CPU rank (no GPU activity), no --exclude for a rank whose host runs other ranks."""
    problems = []
    summaries = {r.rank: r for r in report.ranks}
    for rank in finding.ranks:
        own = summaries.get(rank)
        if own is None:
            continue
        change = finding.change or ""
        if own.basis == "cpu" and ("--exclude" in change or "nvidia-smi" in change):
            problems.append(f"straggler finding: a GPU or node remedy for rank {rank}, a CPU rank ({change[:60]}...)")
        elif "--exclude" in change and any(r.host == own.host for r in report.ranks if r.rank != rank):
            problems.append(f"straggler finding: excludes the node of rank {rank}, whose host {own.host} also runs "
                            "other ranks")
    return problems


def _straggler_confidence(finding: Any, report: Report) -> list[str]:
    """A straggler finding's confidence at most what its significance allows (stragglers.py straggler_confidence)."""
    allowed = [c.significance.confidence for w in report.windows for c in w.causes.findings
               if c.rank in finding.ranks and c.significance is not None]
    if not allowed or finding.confidence not in CONFIDENCES:
        return []
    best = max(allowed, key=lambda c: CONFIDENCES.index(c) if c in CONFIDENCES else -1)
    if best not in CONFIDENCES or CONFIDENCES.index(finding.confidence) > CONFIDENCES.index(best):
        return [f"straggler finding: confidence {finding.confidence} beyond what its significance allows "
                f"({best or 'none: it does not stand out'})"]
    return []


MOE_BALANCE_WORDS = ("load-balancing loss", "router bias", "router_aux_loss_coef", "router_bias_update_rate")
"""What a change says when it asks to rebalance the router."""


def _advice_within_moe(advice: Any, report: Report | None) -> list[str]:
    """Advice to rebalance the router only where the MoE section names a hot expert: the demo's first advice said
    "raise the router's load-balancing loss" beside "no expert received >= 1.5x the mean tokens"."""
    if report is None:
        return []
    hot = bool(getattr(report.moe, "findings", None))
    return [f"finding {index} ({f.rule}): asks to rebalance the router, but the MoE section names no hot expert"
            for index, f in enumerate(advice.findings, 1)
            if not hot and (f.rule == "moe_load_balance" or any(word in str(f.change) for word in MOE_BALANCE_WORDS))]


def audit(kind: str, path: str | Path, problems: list[str]) -> None:
    """Append violations to LOG_ENV's directory when it is set (the test suite reads them back)."""
    directory = os.environ.get(LOG_ENV)
    if not directory or not problems:
        return
    record = json.dumps({"kind": kind, "path": str(path), "problems": problems[:50]})
    with open(Path(directory) / f"violations-{os.getpid()}.jsonl", "a", encoding="utf-8") as out:
        out.write(record + "\n")


def auditing() -> bool:
    return bool(os.environ.get(LOG_ENV))
