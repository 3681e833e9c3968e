"""The default merge: the focus set (which ranks are drawn in full, and why), the summary of every rank,
sharded output, and what the CLI says about them."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from fleetscope.analysis.merge.focus import (
    REASON_ALL_FIT,
    REASON_MEDIAN,
    REASON_SLOWEST_NO_REPORT,
    FocusConfig,
    NamedRank,
    RankFacts,
    fallback_named,
    host_reason,
    peer_reason,
    plan_focus,
)
from fleetscope.analysis.merge.focus import FULL_BYTES_PER_EVENT
from fleetscope.analysis.merge.options import MergeOptions
from fleetscope.analysis.merge.perfetto.sql import run_query
from fleetscope.analysis.merge.report_view import report_named_ranks
from fleetscope.analysis.report.model import Report
from fleetscope.analysis.merge.run import merge
from fleetscope.analysis.merge.stages import STAGES_NOTE
from fleetscope.analysis.merge.summary import SUMMARY_PROCESS_NAME
from fleetscope.analysis.merge.verify import verify_outputs
from fleetscope.cli.main import main
from fleetscope.analysis.quantities import step_ranges
from helpers import REPO, requires_trace_processor, trace_processor

MB = 1_000_000
WAITED = "straggler: the rank the others wait for"
CAUSE = "straggler cause: host-side delay"


# --- the planner, on facts with a known answer -------------------------------------------------

def facts_32_ranks() -> list[RankFacts]:
    """32 ranks, 8 per host, 10 MB each; step time 100 + rank ms, rank 5 at 500 ms."""
    return [RankFacts(rank=r, host=f"node{r // 8}", estimated_bytes=10 * MB,
                      median_step_ms=500.0 if r == 5 else 100.0 + r) for r in range(32)]


GROUPS = {"default_pg": list(range(32)), "mesh_tp pg 1": [4, 5, 6, 7], "mesh_tp pg 5": [20, 21, 22, 23]}
NAMED = [NamedRank(rank=5, reason=WAITED), NamedRank(rank=5, reason=CAUSE), NamedRank(rank=20, reason="critical path")]


def test_focus_is_the_named_ranks_their_smallest_group_the_median_and_one_rank_per_host():
    plan = plan_focus(facts_32_ranks(), NAMED, groups=GROUPS, config=FocusConfig(budget_bytes=200 * MB))
    reasons = {c.rank: c.reasons for c in plan.chosen}
    # the lower median of 31 ranks at 100 + r ms and rank 5 at 500 ms is the 16th fastest: rank 16
    assert sorted(reasons) == [0, 4, 5, 6, 7, 8, 16, 20, 21, 22, 23, 24]
    assert reasons[5] == (WAITED, CAUSE)
    assert reasons[20] == ("critical path",)
    assert reasons[16] == (REASON_MEDIAN, host_reason("node2"))
    assert reasons[4] == reasons[6] == reasons[7] == (peer_reason(5, "mesh_tp pg 1"),)
    assert reasons[21] == (peer_reason(20, "mesh_tp pg 5"),)
    assert reasons[0] == (host_reason("node0"),) and reasons[24] == (host_reason("node3"),)
    assert plan.over_budget == () and len(plan.left_out) == 20 and plan.estimated_bytes == 120 * MB


def test_the_budget_takes_candidates_in_priority_order_and_counts_the_summary():
    plan = plan_focus(facts_32_ranks(), NAMED, groups=GROUPS, config=FocusConfig(budget_bytes=55 * MB),
                      summary_bytes=4 * MB)
    # 4 MB of summary + 5 ranks of 10 MB fit in 55 MB: 5, 20, the median 16, peers 4 and 6 of rank 5
    assert [c.rank for c in plan.chosen] == [4, 5, 6, 16, 20]
    assert plan.estimated_bytes == 54 * MB <= plan.budget_bytes
    assert [c.rank for c in plan.over_budget] == [7, 21, 22, 23, 0, 8, 24]
    assert set(plan.left_out) == set(range(32)) - {4, 5, 6, 16, 20}


def test_the_first_candidate_is_drawn_even_over_the_budget():
    plan = plan_focus(facts_32_ranks(), NAMED, groups=GROUPS, config=FocusConfig(budget_bytes=1 * MB))
    assert [(c.rank, c.reasons) for c in plan.chosen] == [(5, (WAITED, CAUSE))]
    assert len(plan.left_out) == 31


def test_peers_are_capped_nearest_first():
    plan = plan_focus(facts_32_ranks(), NAMED[:1], groups={"pg 0": list(range(32))},
                      config=FocusConfig(budget_bytes=100 * MB, max_peers=2))
    peers = [c.rank for c in plan.chosen if any(r.startswith("process-group peer") for r in c.reasons)]
    assert peers == [4, 6]


def test_every_rank_fits_then_every_rank_is_drawn():
    plan = plan_focus(facts_32_ranks(), NAMED, groups=GROUPS, config=FocusConfig(budget_bytes=320 * MB))
    assert [c.rank for c in plan.chosen] == list(range(32)) and plan.left_out == ()
    assert dict((c.rank, c.reasons) for c in plan.chosen)[5] == (WAITED, CAUSE, REASON_ALL_FIT)


def test_without_a_report_the_slowest_median_step_is_named():
    assert fallback_named(facts_32_ranks()) == [NamedRank(rank=5, reason=REASON_SLOWEST_NO_REPORT)]


def read(report: dict) -> Report:
    """The typed report the merge reads from a hand-written one (what parses of it)."""
    return Report.from_json_lenient(report)[0]


def cause_finding(rank, cause: str) -> dict:
    figures = ("explained_share", "wait_share", "late_instances", "median_lateness_us", "mean_lateness_us",
               "mean_extra_compute_us", "mean_extra_idle_us", "mean_carried_us", "ops_compared")
    return {"rank": rank, "cause": cause, **dict.fromkeys(figures, 0)}


def test_named_ranks_of_a_report():
    report = {
        "capture": {"hang": {"dumped_ranks": [], "missing_dumps": [], "detected_by": [], "dump_reasons": {},
                             "groups": [], "late_ranks": [9], "verdict": ""}},
        "windows": [{
            "window": 0,
            "ranks": [{"rank": 0, "event_count": 1, "collective_count": 0},
                      {"rank": 1, "event_count": 1, "collective_count": 0}],
            "stragglers": {"waited_for_rank": 3, "slowest_rank": 3},
            "causes": {"findings": [cause_finding(3, "host-side delay"), cause_finding("x", "network")]},
            "critical_path": {"by_rank": [{"rank": r, "kind": "compute", "duration_us": 1.0, "share": share}
                                          for r, share in ((3, 0.5), (7, 0.3), (7, 0.3), (2, 0.0))]},
        }],
        "moe": {"findings": [{"layer": 1, "expert": 6, "tokens_vs_mean": 3.0, "ranks": [12, 13], "sentence": ""}]},
    }
    assert report_named_ranks(read(report)) == [
        (9, "hang: never entered the collective the others wait in"),
        (3, WAITED), (3, "straggler: slowest step time"), (3, CAUSE),
        (7, "critical path"), (3, "critical path"),
        (12, "hot expert 6 of layer 1"), (13, "hot expert 6 of layer 1"),
    ]
    assert report_named_ranks(read({"windows": "not a list", "moe": None})) == []
    hostile = {"windows": [{"ranks": [{}, {}], "stragglers": {"waited_for_rank": True, "slowest_rank": "3"},
                            "causes": {"findings": [{"rank": None}]}, "critical_path": {"by_rank": [{"rank": 1}]}}]}
    assert report_named_ranks(read(hostile)) == []


def test_rank_ranges_are_short():
    assert step_ranges([0, 1, 2, 3, 7, 9, 10]) == "0-3, 7, 9-10"
    # bounded on the ranges printed, never on the numbers they hold
    assert step_ranges(range(0, 100, 2)) == "0, 2, 4, 6, ..., 94, 96, 98"
    assert step_ranges(range(0, 1024)) == "0-1023"


# --- end to end on real gloo collectives -------------------------------------------------------

GLOO_RANK0 = REPO / "tests/fixtures/gpu/h200-ddp-gloo-2rank/traces/window000/rank0.vm.pt.trace.json.gz"
RANKS = 8


@pytest.fixture(scope="module")
def gloo_set(tmp_path_factory) -> Path:
    """8 ranks, each rank 0's events of the real 2-rank gloo run under its own rank and host (4 per host)."""
    directory = tmp_path_factory.mktemp("gloo8") / "traces"
    directory.mkdir()
    document = json.loads(gzip.decompress(GLOO_RANK0.read_bytes()))
    for rank in range(RANKS):
        copy = {**document, "distributedInfo": {**document.get("distributedInfo", {}), "rank": rank,
                                                "world_size": RANKS},
                "host_name": f"node{rank // 4}", "baseTimeNanoseconds": document["baseTimeNanoseconds"] + rank * 7_000}
        (directory / f"rank{rank}.node{rank // 4}.pt.trace.json").write_text(json.dumps(copy))
    return directory


@pytest.fixture(scope="module")
def everything(gloo_set: Path):
    """The set merged with --ranks all."""
    return merge(gloo_set, gloo_set.parent / "all.perfetto-trace", options=MergeOptions(focus=None))


@pytest.fixture(scope="module")
def small_budget(everything) -> FocusConfig:
    """Room for the summary and three ranks."""
    return FocusConfig(budget_bytes=int(3.5 * FULL_BYTES_PER_EVENT * everything.per_rank[0].slice_count))


@requires_trace_processor
def test_default_merge_draws_the_focus_set_in_full_and_every_rank_in_the_summary(gloo_set, everything, small_budget,
                                                                                   tmp_path):
    result = merge(gloo_set, tmp_path / "focus.perfetto-trace", options=MergeOptions(focus=small_budget))
    focus = sorted(result.focus.ranks)
    assert 1 <= len(focus) < RANKS and result.ranks == focus
    assert sorted(result.focus.left_out) == sorted(set(range(RANKS)) - set(focus))
    assert verify_outputs(result, engine=True) == []
    binary = trace_processor()
    processes = [row["name"] for row in run_query(result.output, "SELECT name FROM process WHERE pid > 0 ORDER BY pid",
                                                  binary)]
    assert processes == [SUMMARY_PROCESS_NAME] + [f"rank {r} (node{r // 4})" for r in focus]
    summaries = run_query(result.output, "SELECT t.name, COUNT(s.id) AS n FROM track t LEFT JOIN slice s "
                                         "ON s.track_id = t.id WHERE t.name GLOB 'rank *: steps' GROUP BY t.name", binary)
    assert sorted(int(row["name"].split(":")[0][5:]) for row in summaries) == list(range(RANKS))
    assert all(int(row["n"]) >= 2 for row in summaries)   # the window and its steps
    assert {r: result.slices_per_rank[r] for r in focus} == {r: everything.slices_per_rank[r] for r in focus}
    flow_processes = run_query(result.output, """
        SELECT DISTINCT p.name FROM flow f JOIN slice s ON s.id IN (f.slice_out, f.slice_in)
        JOIN thread_track tt ON s.track_id = tt.id JOIN thread USING (utid) JOIN process p USING (upid)
        UNION SELECT DISTINCT p.name FROM flow f JOIN slice s ON s.id IN (f.slice_out, f.slice_in)
        JOIN process_track pt ON s.track_id = pt.id JOIN process p USING (upid)""", binary)
    assert {row["name"] for row in flow_processes} <= {f"rank {r} (node{r // 4})" for r in focus}


@requires_trace_processor
def test_sharded_merge_writes_every_rank_in_full_plus_the_summary_file(gloo_set, everything, tmp_path):
    result = merge(gloo_set, tmp_path / "merged.perfetto-trace", options=MergeOptions(shard_ranks=3))
    assert [p.name for p in result.outputs] == ["merged.ranks0-2.perfetto-trace", "merged.ranks3-5.perfetto-trace",
                                                "merged.ranks6-7.perfetto-trace", "merged.summary.perfetto-trace"]
    assert [shard.ranks for shard in result.shards] == [[0, 1, 2], [3, 4, 5], [6, 7]]
    assert result.slices_per_rank == everything.slices_per_rank
    assert [c.rank for c in result.summary] == list(range(RANKS)) and result.per_rank == []
    assert not (tmp_path / "merged.perfetto-trace").exists()
    assert verify_outputs(result, engine=True) == []
    firsts = [run_query(p, "SELECT MIN(ts) AS t FROM slice", trace_processor())[0]["t"] for p in result.outputs[:3]]
    assert len(set(firsts)) == 3 and max(map(int, firsts)) - min(map(int, firsts)) < 10**6   # one clock


def test_cli_says_what_is_in_full_and_what_was_left_out(gloo_set, small_budget, tmp_path, capsys):
    budget_mb = small_budget.budget_bytes / 1e6
    out = tmp_path / "cli.perfetto-trace"
    assert main(["merge", str(gloo_set), "-o", str(out), "--budget-mb", f"{budget_mb:.6f}", "--verify"]) == 0
    printed = capsys.readouterr().out
    assert "size budget" in printed and "ranks in full" in printed
    assert f"({STAGES_NOTE}):" in printed            # no report: the merge ran the cross-rank stages itself
    left = [line for line in printed.splitlines() if "left out (summary only)" in line]
    assert len(left) == 1 and "ranks:" in left[0]
    assert "summary tracks of all 8 ranks" in printed and "verified: read back" in printed
    assert main(["merge", str(gloo_set), "-o", str(out), "--ranks", "all"]) == 0
    printed = capsys.readouterr().out
    assert "merged 8 rank(s) in full into 1 file(s)" in printed and "size budget" not in printed
    assert main(["merge", str(gloo_set), "-o", str(out), "--shard-ranks", "4", "--ranks", "1"]) == 2
    with pytest.raises(SystemExit) as refused:
        main(["merge", str(gloo_set), "-o", str(out), "--shard-ranks", "0"])
    assert refused.value.code == 2
