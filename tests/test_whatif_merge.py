"""The ideal step in the report and the merged trace (whatif/ideal_steps.py, merge/ideal_overlays.py): the window's
critical-path steps replayed with every rank's compute at the ranks' lower median, drawn on a `what-if: ideal
step` track of each rank beside the recorded events."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from fleetscope.analysis import analyze
from fleetscope.analysis.merge.critical_path_overlays import MAX_START_NS
from fleetscope.analysis.merge.ideal_overlays import IDEAL_CATEGORY, IDEAL_TRACK_NAME, rank_ideal
from fleetscope.analysis.merge.perfetto.check import check_trace
from fleetscope.cli.main import main

RUN = Path(__file__).parent / "fixtures" / "gpu" / "h200-ddp-gloo-2rank"


def test_the_ideal_step_is_in_the_report_and_drawn_on_each_rank_beside_the_recorded_one(tmp_path):
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
    by_rank = {merged.process_of(s.track_uuid).name for s in ideal}
    assert {merged.tracks[s.track_uuid].name for s in ideal} == {IDEAL_TRACK_NAME} and len(by_rank) == 2
    assert len(ideal) == sum(len(s.ops) for s in replay.steps)
    assert all(s.annotations["step"] in {st.step for st in replay.steps} for s in ideal)


def test_a_hostile_replay_section_draws_nothing_and_raises_nothing():
    good_op = {"rank": 0, "kind": "compute", "name": "compute", "start_us": 0.0, "end_us": 5.0}
    for section in (None, [], {"steps": "x"}, {"steps": [None, {"step": True, "start_ns": 1, "ops": [good_op]}]},
                    {"steps": [{"step": 1, "start_ns": MAX_START_NS, "ops": [good_op]}]},
                    {"steps": [{"step": 1, "start_ns": 10, "ops": [{**good_op, "end_us": float("nan")},
                                                                    {**good_op, "start_us": -1.0}, "op"]}]}):
        assert rank_ideal(section, rank=0, report_offset_ns=0) is None, section
    drawn = rank_ideal({"steps": [{"step": 1, "start_ns": 10, "ops": [good_op, {**good_op, "rank": 1}]}]}, rank=0,
                       report_offset_ns=0)
    assert [(s.start_ns, s.end_ns) for s in drawn.slices] == [(10, 5010)]
    json.dumps([s.annotations for s in drawn.slices])
