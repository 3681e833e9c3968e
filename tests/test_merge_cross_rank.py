"""A merge without an analysis report runs the cross-rank stages itself (merge/stages.py), so its focus set
holds the rank the others wait for; a report of the same traces is used as before, one of other traces is
not. Ground truth: 32 ranks made from one real H200 trace, rank LATE_RANK late at every collective."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from fleetscope.analysis import analyze
from fleetscope.analysis.merge.focus import REASON_MEDIAN, REASON_SLOWEST_NO_REPORT, FocusConfig
from fleetscope.analysis.merge.options import MergeOptions
from fleetscope.analysis.merge.outputs import plan_merge_focus
from fleetscope.analysis.merge.run import merge
from fleetscope.analysis.merge.sources import find_merge_inputs
from fleetscope.analysis.merge.stages import STAGES_NOTE, merge_analysis
from fleetscope.analysis.synthetic import TraceSetSpec, make_trace_set
from fleetscope.cli.main import main
from helpers import SYNTHETIC_SOURCE

RANKS = 32
RANKS_PER_HOST = 8
LATE_RANK = 13          # not rank 0, not the median rank (15: all step times are equal), not a host's first
LATE_US = 300.0
BUDGET_MB = 3.0         # the summary of 32 ranks and about five ranks in full
WAITED = "straggler: the rank the others wait for"


@pytest.fixture(scope="module")
def late_set(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("late32") / "traces"
    make_trace_set(SYNTHETIC_SOURCE, directory, TraceSetSpec(ranks=RANKS, ranks_per_host=RANKS_PER_HOST,
                                                              late_rank=LATE_RANK, late_us=LATE_US))
    return directory


def focus_options() -> MergeOptions:
    return MergeOptions(focus=FocusConfig(budget_bytes=int(BUDGET_MB * 1e6)))


def reasons_of(result) -> dict[int, tuple[str, ...]]:
    return {choice.rank: choice.reasons for choice in result.focus.chosen}


@pytest.fixture(scope="module")
def merged_without_report(late_set):
    return merge(late_set, late_set.parent / "merged.perfetto-trace", options=focus_options(), use_cache=False)


def test_without_a_report_the_rank_the_others_wait_for_is_drawn_in_full(merged_without_report):
    result = merged_without_report
    assert result.focus.left_out, "the budget must leave ranks out"
    reasons = reasons_of(result)
    assert LATE_RANK in result.focus.ranks and LATE_RANK in result.ranks
    assert reasons[LATE_RANK][0] == f"{WAITED} ({STAGES_NOTE})"
    assert all(STAGES_NOTE in reason for reason in reasons[LATE_RANK])
    assert REASON_MEDIAN in reasons[15]
    assert not any(REASON_SLOWEST_NO_REPORT in r for rs in reasons.values() for r in rs)
    assert result.summary[LATE_RANK].in_full and len(result.summary) == RANKS


def test_the_cli_says_where_the_reasons_came_from(late_set, tmp_path, capsys):
    out = tmp_path / "cli.perfetto-trace"
    assert main(["merge", str(late_set), "-o", str(out), "--budget-mb", str(BUDGET_MB)]) == 0
    printed = capsys.readouterr().out
    assert f"in full, {WAITED} ({STAGES_NOTE}): {LATE_RANK}" in printed
    left = next(line for line in printed.splitlines() if "left out (summary only)" in line)
    listed = set()
    for part in left.split("ranks:", 1)[1].split(","):
        first, _, last = part.strip().partition("-")
        if first.isdigit():
            listed.update(range(int(first), int(last or first) + 1))
    assert listed and LATE_RANK not in listed


def test_a_report_of_these_traces_is_used_as_before(late_set, tmp_path):
    report = analyze(late_set, use_hta=False, use_cache=False)
    result = merge(late_set, tmp_path / "merged.perfetto-trace", options=focus_options(), report=report)
    reasons = reasons_of(result)
    assert reasons[LATE_RANK][0] == WAITED
    assert not any(STAGES_NOTE in r for rs in reasons.values() for r in rs)
    assert not [p for p in result.problems if "analysis report" in p.reason]


def test_a_report_that_does_not_match_the_traces_is_not_used(late_set, tmp_path):
    report = analyze(late_set, use_hta=False, use_cache=False).to_json()
    report["windows"][0]["ranks"][3]["event_count"] += 1
    result = merge(late_set, tmp_path / "merged.perfetto-trace", options=focus_options(), report=report)
    (problem,) = [p.reason for p in result.problems if "analysis report" in p.reason]
    assert problem.startswith("analysis report not used: it does not match the traces (rank 3 in window -:")
    assert reasons_of(result)[LATE_RANK][0] == f"{WAITED} ({STAGES_NOTE})"
    fewer = tmp_path / "fewer"
    fewer.mkdir()
    for rank in range(RANKS - 2):
        shutil.copyfile(late_set / f"rank{rank}.json.gz", fewer / f"rank{rank}.json.gz")
    other = analyze(fewer, use_hta=False, use_cache=False)
    result = merge(late_set, tmp_path / "other.perfetto-trace", options=focus_options(), report=other)
    assert [p.reason for p in result.problems if "analysis report" in p.reason] == [
        "analysis report not used: it does not match the traces (rank 30 in window - is not in the report "
        "(2 rank trace(s) in all))"]


def test_when_every_rank_fits_no_stages_run(late_set):
    def refuse():
        raise AssertionError("the cross-rank stages ran although every rank fits")

    inputs = find_merge_inputs(late_set, cache=None)
    plan = plan_merge_focus(inputs, None, FocusConfig(), analysis=refuse)
    assert plan.left_out == () and sorted(plan.ranks) == list(range(RANKS))
    small = plan_merge_focus(inputs, None, focus_options().focus, analysis=lambda: merge_analysis(inputs))
    assert LATE_RANK in small.ranks
