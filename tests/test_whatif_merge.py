"""The ideal step in the report and the merged trace (whatif/ideal_steps.py, merge/ideal_overlays.py): the window's
critical-path steps replayed with every rank's compute at the ranks' lower median, drawn as a process of its own
(`what-if: ideal replay (all ranks)`, a thread per rank) beside the ranks' recorded processes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from fleetscope.analysis import analyze
from fleetscope.analysis.merge.critical_path_overlays import MAX_START_NS
from fleetscope.analysis.merge.ideal_overlays import (IDEAL_CATEGORY, IDEAL_PROCESS_NAME, plan_ideal_process,
                                                      report_ideal_slices)
from fleetscope.analysis.merge.perfetto.check import check_trace
from fleetscope.analysis.merge.perfetto.sql import find_trace_processor, run_query
from fleetscope.analysis.merge.run import merge
from fleetscope.analysis.merge.verify import verify_merge
from fleetscope.analysis.report.model import UnreadableField, lenient_build
from fleetscope.analysis.whatif.ideal_steps import IdealReplay
from fleetscope.cli.main import main

RUN = Path(__file__).parent / "fixtures" / "gpu" / "h200-ddp-gloo-2rank"


def test_the_ideal_step_is_in_the_report_and_drawn_as_its_own_process_beside_the_ranks(tmp_path):
    run = tmp_path / "run"
    shutil.copytree(RUN, run)
    report = analyze(run, use_hta=False, use_cache=False)
    (window,) = report.windows
    replay = window.ideal_replay
    assert replay is not None and [s.step for s in replay.steps] == [p.step for p in window.critical_path.steps]
    for step, path in zip(replay.steps, window.critical_path.steps):
        assert step.start_ns == path.start_ns and 0 < step.ideal_ms <= step.measured_ms + 1e-6
        assert {op.rank for op in step.ops} == {0, 1}
        assert max(op.end_us for op in step.ops) / 1000 == pytest.approx(step.ideal_ms)
    assert main(["merge", str(run), "--verify"]) == 0
    merged = check_trace(run / "report" / "merged.perfetto-trace")
    ideal = [s for s in merged.slices if s.category == IDEAL_CATEGORY]
    assert {merged.process_of(s.track_uuid).name for s in ideal} == {IDEAL_PROCESS_NAME}
    assert {merged.tracks[s.track_uuid].name for s in ideal} == {"rank 0", "rank 1"}
    assert merged.thread_count_by_process()[IDEAL_PROCESS_NAME] == 2
    assert len(ideal) == sum(len(s.ops) for s in replay.steps)
    assert all(s.annotations["step"] in {st.step for st in replay.steps} for s in ideal)
    # each rank's ideal step starts where its recorded step starts (the critical path's start on the merged clock)
    for step in replay.steps:
        for rank in (0, 1):
            first = min(s.start_ns for s in ideal if s.annotations["step"] == step.step
                        and merged.tracks[s.track_uuid].name == f"rank {rank}")
            assert first == step.start_ns + round(min(op.start_us for op in step.ops if op.rank == rank) * 1000)
    # no rank's own process holds an ideal slice
    assert not [s for s in merged.slices if s.category == IDEAL_CATEGORY
                and merged.process_of(s.track_uuid).name.startswith("rank ")]


def test_the_merged_trace_with_the_ideal_process_loads_in_the_trace_processor(tmp_path):
    binary = find_trace_processor(None)
    if binary is None:
        pytest.skip("no trace_processor_shell")
    run = tmp_path / "run"
    shutil.copytree(RUN, run)
    analyze(run, use_hta=False, use_cache=False)
    result = merge(run, out=tmp_path / "merged.perfetto-trace", use_cache=False)
    assert result.ideal_slices > 0 and result.ideal_threads == 2
    assert verify_merge(result, trace_processor=binary) == []
    rows = run_query(result.output, IDEAL_SQL, binary)
    assert {row["thread"]: int(row["slices"]) for row in rows} == {"rank 0": result.ideal_slices // 2,
                                                                   "rank 1": result.ideal_slices // 2}
    assert {row["process"] for row in rows} == {IDEAL_PROCESS_NAME}


IDEAL_SQL = """
SELECT p.name AS process, t.name AS thread, COUNT(*) AS slices FROM slice s
  JOIN thread_track tt ON s.track_id = tt.id JOIN thread t USING (utid) JOIN process p USING (upid)
  WHERE s.category = 'fleetscope.what_if' GROUP BY p.name, t.name
"""


def replay_of(section) -> IdealReplay | None:
    """What the merge reads of a hand-written `ideal_replay` section (None: nothing parses)."""
    try:
        return lenient_build(IdealReplay, section, [])
    except UnreadableField:
        return None


def test_a_hostile_replay_section_draws_nothing_and_raises_nothing():
    good_op = {"rank": 0, "kind": "compute", "name": "compute", "start_us": 0.0, "end_us": 5.0}
    timed = {"measured_ms": 1.0, "ideal_ms": 1.0}
    for section in (None, [], {"steps": "x"}, {"steps": [None, {"step": True, "start_ns": 1, **timed, "ops": [good_op]}]},
                    {"steps": [{"step": 1, "start_ns": MAX_START_NS, **timed, "ops": [good_op]}]},
                    {"steps": [{"step": 1, "start_ns": 10, **timed, "ops": [{**good_op, "end_us": float("nan")},
                                                                             {**good_op, "start_us": -1.0}, "op"]}]}):
        assert report_ideal_slices(replay_of(section)) == {}, section
    section = {"steps": [{"step": 1, "start_ns": 10, **timed,
                          "ops": [good_op, {**good_op, "rank": 1}, {**good_op, "rank": 7}]}]}
    drawn = report_ideal_slices(replay_of(section), window=0)
    assert {rank: [(s.start_ns, s.end_ns) for s in pieces] for rank, pieces in drawn.items()} == \
        {0: [(10, 5010)], 1: [(10, 5010)], 7: [(10, 5010)]}
    json.dumps([s.annotations for pieces in drawn.values() for s in pieces])
    # each rank moved by its own shift; a rank the merge does not hold is left out; --steps keeps its steps only
    plan = plan_ideal_process([(0, replay_of(section))], lambda rank, window: {0: 0, 1: -4}.get(rank))
    assert {rank: [(s.start_ns, s.end_ns) for s in pieces] for rank, pieces in plan.slices.items()} == \
        {0: [(10, 5010)], 1: [(6, 5006)]}
    assert plan_ideal_process([(0, replay_of(section))], lambda rank, window: 0, frozenset({2})).slices == {}
