"""The advisor against the ground-truth corpus: planted cause x top finding, and each gain against the planted cost.

    python bench/planted/confusion.py CORPUS_DIR [--json OUT]

CORPUS_DIR holds one folder per program (bench/planted/corpus.py writes them): its trace(s) and planted.json
({"causes": [...], "planted_ms_per_step": {cause: ms}, "healthy": bool, "step_ms", "fixed_step_ms"}). Each folder
is advised as a user would (`fleetscope advise DIR`: a folder of traces, no run record), and scored:
  - one planted cause: the top finding (largest gain) is that cause's rule;
  - two planted causes: both rules are among the top three findings;
  - healthy: no finding gains more than 5% of the step;
  - gain error: |gain - planted| / planted for each planted cause its rule found (the issue's bar: 25%); for a
    two-problem program also against what the fix saves done last (the other problem fixed first), since two
    problems' costs interact and either order's saving is the cause's cost (printed beside, not instead);
  - other findings: above 5% of the step, naming no planted cause and recovering none of its time;
    the total counts every planted cause, found or not (PER_SAMPLE_CAUSES: as shares of the step).
A planted cause whose measured cost is under MEASURABLE_PCT of the step (or negative: the fix made the step no
faster) is no problem in that program: it is left out of the program's causes (the row says so), and a
program left with none is scored as healthy.
Prints the confusion matrix (planted cause -> top finding), the per-program table and the totals.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

RULE_OF_CAUSE = {
    "host_syncs": {"host_syncs"},
    "host_work": {"host_work"},
    "launch_bound": {"cuda_graphs"},
    "tiny_batch": {"cuda_graphs", "batch_size"},
    "precision": {"precision"},
    "optimizer_impl": {"optimizer_impl"},
    "allocator_churn": {"allocator_churn"},
    "recompilation": {"recompilation"},
    "checkpoint_in_step": {"checkpoint_in_step"},
    "data_loader": {"data_workers"},
    "pageable_copy": {"pinned_copies"},
    "gc_pauses": {"gc_pauses"},
    "eager_attention": {"eager_attention"},
    "activation_checkpointing": {"activation_checkpointing"},
    "ddp_unused_params": {"ddp_unused_params"},
}
"""Which finding names each planted cause (bench/planted/corpus.py's vocabulary -> the advisor's rules)."""
HEALTHY_MAX_PCT = 5.0
MEASURABLE_PCT = 5.0
GAIN_TOLERANCE = 0.25


def score(directory: Path) -> dict:
    from fleetscope.analysis.advise import advise

    planted = json.loads((directory / "planted.json").read_text())
    causes, unmeasured = measurable_causes(planted)
    try:
        advice = advise(directory)
        findings = advice.findings
    except Exception as error:  # a program the advisor cannot read is a miss, reported, not a crash
        return {"program": directory.name, "causes": causes, "error": f"{type(error).__name__}: {error}"}
    ranked = [(f.rule, f.expected_gain_ms, f.expected_gain_pct) for f in findings]
    top = [rule for rule, _, _ in ranked[:3]]
    row = {"program": directory.name, "causes": causes, "findings": ranked[:5], "top": top[0] if top else "none",
           "step_ms": planted.get("step_ms"), "healthy": bool(planted.get("healthy")), "unmeasured": unmeasured}
    if not causes:
        worst = max((pct or 0.0 for _, _, pct in ranked), default=0.0)
        row["right"] = worst <= HEALTHY_MAX_PCT
        if not row["right"]:
            row["unprofiled_idle_at_least_pct"] = _unprofiled_idle_at_least_pct(directory, planted.get("step_ms"))
        return row
    wanted = [RULE_OF_CAUSE.get(cause, {cause}) for cause in causes]
    row["spurious"] = _spurious(findings, set().union(*wanted))
    row["right"] = bool(top) and top[0] in wanted[0] if len(causes) == 1 else \
        all(any(rule in rules for rule in top) for rules in wanted)
    row["gain_errors"], row["scaled_gain_errors"] = {}, {}
    # a per-sample cause's step_ms is the time for the fixed batch's samples, not the traced step's
    steady = None if PER_SAMPLE_CAUSES.intersection(causes) else \
        _advised_at_steady_step(directory, planted.get("step_ms"), advice.combined_gain_of_ms)
    rescored = [(f.rule, f.expected_gain_ms, f.expected_gain_pct) for f in steady.findings] if steady else ranked
    for cause, rules in zip(causes, wanted):
        planted_ms = (planted.get("planted_ms_per_step") or {}).get(cause)
        gains = [gain for rule, gain, _ in ranked if rule in rules and gain is not None]
        scaled = [gain for rule, gain, _ in rescored if rule in rules and gain is not None]
        if planted_ms and planted_ms > 0 and gains:
            row["gain_errors"][cause] = _gain_error(cause, gains[0], planted_ms, findings, rules, planted)
            row["scaled_gain_errors"][cause] = _gain_error(cause, (scaled or gains)[0], planted_ms,
                                                           steady.findings if steady else findings, rules, planted)
            if (saved_last := _saved_when_fixed_last(cause, causes, planted)) is not None:
                row.setdefault("either_order_errors", {})[cause] = _range_error((scaled or gains)[0], planted_ms,
                                                                                saved_last)
    return row


def _saved_when_fixed_last(cause: str, causes: list[str], planted: dict) -> float | None:
    """What fixing `cause` saves once the other planted cause is fixed: the step with the other fixed less the step
    with both fixed. planted_ms_per_step holds what fixing it first saves; where two problems interact (a
    collection that walks the objects a pageable copy made, a save that waits for the attention's kernels) the
    two differ, and either is the cause's cost. None for a program without exactly two measured causes."""
    costs = planted.get("planted_ms_per_step") or {}
    step_ms, fixed_ms = planted.get("step_ms"), planted.get("fixed_step_ms")
    if len(causes) != 2 or len(costs) != 2 or step_ms is None or fixed_ms is None:
        return None
    other = next(c for c in causes if c != cause)
    if cause in PER_SAMPLE_CAUSES or other in PER_SAMPLE_CAUSES or costs.get(other) is None:
        return None
    saved = step_ms - costs[other] - fixed_ms
    return saved if saved > 0 else None


def _range_error(gain_ms: float, first_ms: float, last_ms: float) -> float:
    """The gain's distance from the nearest of what the fix saves first and last (0 between them), as a share of
    that nearest end."""
    low, high = sorted((first_ms, last_ms))
    if low <= gain_ms <= high:
        return 0.0
    nearest = low if gain_ms < low else high
    return abs(gain_ms - nearest) / nearest


def _spurious(findings: list, planted_rules: set) -> list[str]:
    """Findings above HEALTHY_MAX_PCT of the step that name no planted cause and recover no time a planted
    cause's finding recovers (an overlapping finding is another reading of the same idle, not another problem)."""
    return [f.rule for f in findings if (f.expected_gain_pct or 0.0) > HEALTHY_MAX_PCT and f.rule not in planted_rules
            and not planted_rules.intersection(f.overlaps)]


PER_SAMPLE_CAUSES = {"tiny_batch"}
"""Causes whose planted cost is per sample count, not per traced step (tiny_batch: the time for 256 samples, 64
batch-4 steps against one batch-256 step): their gain is compared as a share of the step, the per-sample share
the finding gives for a larger batch where it gives one (advise/host.py larger_batch_per_sample_pct)."""


def _gain_error(cause: str, gain_ms: float, planted_ms: float, findings: list, rules: set, planted: dict) -> float:
    if cause in PER_SAMPLE_CAUSES and planted.get("step_ms"):
        from fleetscope.analysis.advise.host import LARGER_BATCH_KEY
        found = next(f for f in findings if f.rule in rules and f.expected_gain_ms is not None)
        pct = found.evidence.get(LARGER_BATCH_KEY, found.expected_gain_pct)
        planted_pct = 100.0 * planted_ms / planted["step_ms"]
        return abs((pct or 0.0) - planted_pct) / planted_pct
    return abs(gain_ms - planted_ms) / planted_ms


def _advised_at_steady_step(directory: Path, steady_ms: float | None, profiled_ms: float | None):
    """The advice a fleetscope run gets, whose step metrics give the unprofiled step: the same evidence with the
    program's own unprofiled timing (planted.json step_ms) as the run's step, through the advisor's own rules
    (each decides what of its gain profiling lengthened: advise/model.py profiled_scale). None where the two
    steps are the same (nothing to scale)."""
    if not steady_ms or not profiled_ms or profiled_ms == steady_ms:
        return None
    import dataclasses
    from fleetscope.analysis.advise.engine import advise_evidence
    from fleetscope.analysis.advise.evidence import gather_evidence
    from fleetscope.analysis.analyze import analyze
    from fleetscope.analysis.inputs.records import read_run_records
    from fleetscope.traces.layout import RunLayout
    report = analyze(directory, write_default_outputs=False, use_hta=False)
    evidence = gather_evidence(read_run_records(RunLayout.at(directory)), report)
    evidence = dataclasses.replace(evidence, step_ms=steady_ms, step_basis="the program's unprofiled timing")
    return advise_evidence(evidence, str(directory))


def _unprofiled_idle_at_least_pct(directory: Path, steady_ms: float | None) -> float | None:
    """The least share of the unprofiled step the GPU idles: the step less the GPU's busy time in the profiled
    steps, which profiling does not shorten (a kernel recorded by the profiler runs no faster). Where a program
    planted healthy still leaves this much idle, a finding on it may be right: nothing was planted, but the host
    it ran on could not keep the GPU busy."""
    from fleetscope.analysis.advise.evidence import gather_evidence
    from fleetscope.analysis.analyze import analyze
    from fleetscope.analysis.inputs.records import read_run_records
    from fleetscope.traces.layout import RunLayout
    report = analyze(directory, write_default_outputs=False, use_hta=False)
    evidence = gather_evidence(read_run_records(RunLayout.at(directory)), report)
    if not steady_ms or evidence.idle_pct is None or not evidence.trace_step_ms:
        return None
    busy_ms = evidence.trace_step_ms * (1.0 - evidence.idle_pct / 100.0)
    return max(100.0 * (steady_ms - busy_ms) / steady_ms, 0.0)


def measurable_causes(planted: dict) -> tuple[list[str], list[str]]:
    """(causes whose measured cost is at least MEASURABLE_PCT of the step, the others)."""
    costs = planted.get("planted_ms_per_step") or {}
    step_ms = planted.get("step_ms") or 0.0
    kept, dropped = [], []
    for cause in planted.get("causes") or []:
        cost = costs.get(cause)
        measurable = cost is None or (step_ms > 0 and cost >= MEASURABLE_PCT / 100 * step_ms)
        (kept if measurable else dropped).append(cause)
    return kept, dropped


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("corpus", type=Path)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    rows = [score(d) for d in sorted(args.corpus.iterdir()) if (d / "planted.json").is_file()]
    single = [r for r in rows if len(r["causes"]) == 1 and "error" not in r]
    double = [r for r in rows if len(r["causes"]) == 2 and "error" not in r]
    healthy = [r for r in rows if not r["causes"] and "error" not in r]
    matrix = Counter((r["causes"][0], r["top"]) for r in single)
    print("planted cause -> top finding: programs")
    for (cause, top), count in sorted(matrix.items()):
        print(f"  {cause:>26} -> {top:<20} {count}{'' if top in RULE_OF_CAUSE.get(cause, {cause}) else '   (wrong)'}")
    print("\nprogram                          planted                        top 3 findings (gain ms)           ok  gain err")
    for r in rows:
        found = ", ".join(f"{rule} {gain:.1f}" if gain is not None else rule for rule, gain, _ in r.get("findings", [])[:3])
        errors = ", ".join(f"{e:.0%}" for e in r.get("gain_errors", {}).values())
        if r.get("scaled_gain_errors") and r["scaled_gain_errors"] != r["gain_errors"]:
            errors += " (scaled " + ", ".join(f"{e:.0%}" for e in r["scaled_gain_errors"].values()) + ")"
        label = "+".join(r["causes"]) or "healthy"
        if r.get("unmeasured"):
            label += f" (no cost: {'+'.join(r['unmeasured'])})"
        print(f"{r['program']:<32} {label:<30} {found or r.get('error', 'none'):<35} "
              f"{'yes' if r.get('right') else 'NO ':<3} {errors}")
    errors = [e for r in rows for e in r.get("gain_errors", {}).values()]
    planted_causes = sum(len(r["causes"]) for r in rows if "error" not in r)
    print(f"\nsingle-problem programs right first: {sum(r['right'] for r in single)}/{len(single)}")
    print(f"two-problem programs with both in the top 3: {sum(r['right'] for r in double)}/{len(double)}")
    print(f"healthy programs with no finding above {HEALTHY_MAX_PCT:g}%: {sum(r['right'] for r in healthy)}/{len(healthy)}")
    for r in healthy:
        if not r["right"] and r.get("unprofiled_idle_at_least_pct") is not None:
            print(f"  {r['program']}: unprofiled, the GPU idles at least {r['unprofiled_idle_at_least_pct']:.0f}% of "
                  "its step (the step less the profiled GPU busy time)")
    print(f"gains within {GAIN_TOLERANCE:.0%} of the planted cost: {sum(e <= GAIN_TOLERANCE for e in errors)} of the "
          f"{len(errors)} found ({planted_causes} planted causes in all)")
    scaled = [e for r in rows for e in r.get("scaled_gain_errors", {}).values()]
    print(f"  the gains a fleetscope run gives, its steady step being the unprofiled one (the advisor rerun on it): "
          f"{sum(e <= GAIN_TOLERANCE for e in scaled)} of {len(scaled)}")
    either = [(r, cause, e) for r in rows for cause, e in r.get("either_order_errors", {}).items()]
    if either:
        print(f"  two-problem gains within {GAIN_TOLERANCE:.0%} of what the fix saves done first or done last (the "
              f"costs interact): {sum(e <= GAIN_TOLERANCE for _, _, e in either)} of {len(either)}, against "
              f"{sum(r['scaled_gain_errors'][cause] <= GAIN_TOLERANCE for r, cause, _ in either)} of {len(either)} "
              "against what it saves first")
        every = [r.get("either_order_errors", {}).get(cause, e) for r in rows
                 for cause, e in r.get("scaled_gain_errors", {}).items()]
        print(f"  all gains so scored: {sum(e <= GAIN_TOLERANCE for e in every)} of {len(every)}")
    spurious = [(r["program"], rule) for r in rows for rule in r.get("spurious", [])]
    print(f"other findings above {HEALTHY_MAX_PCT:g}% of the step in programs with a planted cause (neither a planted "
          f"cause's rule nor recovering its time): {len(spurious)}"
          + (": " + ", ".join(f"{program} {rule}" for program, rule in spurious) if spurious else ""))
    print(f"programs the advisor could not read: {sum('error' in r for r in rows)}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
