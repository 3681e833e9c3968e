"""`fleetscope hang` states its step and collective numbers in one vocabulary, each with where it comes from: the
watchdog's count of finished steps as step indices, the step metrics' one-step lag said, and the Flight Recorder's
last completed operation as a collective number (#N) comparable with the last one entered."""

from __future__ import annotations

import json
import shutil

import pytest

from fleetscope.analysis.inputs.records import read_run_records
from fleetscope.analysis.cross_rank.hang import analyze_hang
from fleetscope.analysis.render.capture_text import render_hang
from fleetscope.traces.layout import RunLayout

from helpers import REPO

HANG_FIXTURE = REPO / "tests" / "fixtures" / "flight_recorder_hang"
GLOO_OP_OFFSET = 33
"""In a gloo run the group's operation count (op_id) ran 33 ahead of its collective count: #16 was op 49."""


def _hang_dir(tmp_path, *, op_offset: int = 0, status_offset: int = 0) -> RunLayout:
    """The fixture's dumps (op_id equal to collective_seq_id there), with the op ids and pg_status moved on."""
    layout = RunLayout.at(tmp_path)
    shutil.copytree(HANG_FIXTURE, layout.flight_recorder_dir)
    for rank in (0, 1):
        path = layout.flight_recorder_file(rank)
        dump = json.loads(path.read_text())
        for entry in dump["entries"]:
            entry["op_id"] = entry["collective_seq_id"] + op_offset
        for status in dump["pg_status"].values():
            status["last_enqueued_collective"] += status_offset
            status["last_completed_collective"] += status_offset
        path.write_text(json.dumps(dump))
    return layout


def _completed(layout: RunLayout) -> dict[int, int | None]:
    group = next(g for g in analyze_hang(read_run_records(layout)).groups if g.desc == "default_pg")
    return {m.rank: m.last_completed_seq for m in group.members}


def test_gloo_counts_operations_and_the_report_gives_the_collective_number(tmp_path):
    layout = _hang_dir(tmp_path, op_offset=GLOO_OP_OFFSET, status_offset=GLOO_OP_OFFSET)
    assert _completed(layout) == {0: 17, 1: 17}          # op 50 is collective #17; rank 0 entered #18
    text = render_hang(analyze_hang(read_run_records(layout)))
    assert "rank 0: last entered #18 gloo:broadcast" in text and "last completed #17" in text
    assert "#50" not in text


def test_a_status_counted_in_collectives_is_kept(tmp_path):
    # NCCL counts pg_status in collectives: the group's last entry is the last enqueued, whatever its op id
    assert _completed(_hang_dir(tmp_path, op_offset=GLOO_OP_OFFSET)) == {0: 17, 1: 17}


def test_a_status_in_neither_numbering_is_not_printed_as_a_collective(tmp_path):
    layout = _hang_dir(tmp_path, op_offset=GLOO_OP_OFFSET, status_offset=7)
    assert _completed(layout) == {0: None, 1: None}
    assert "last completed #24" not in render_hang(analyze_hang(read_run_records(layout)))


def _metrics(layout: RunLayout, last_step: int) -> None:
    layout.metrics_dir.mkdir(parents=True, exist_ok=True)
    for rank in (0, 1):
        lines = [dict(step=s, rank=rank, loss=1.0, step_time_ms=50.0, data_ms=1.0, forward_ms=1.0, backward_ms=1.0,
                      optimizer_ms=1.0, tokens_per_s=1.0) for s in range(last_step + 1)]
        layout.metrics_file(rank).write_text("".join(json.dumps(line) + "\n" for line in lines))


@pytest.mark.parametrize("last_metrics, said", [
    (2, " (metrics/rank<R>.jsonl: a step's line is written once the next step has run, so step 3, finished before "
        "the hang, has none)"),
    (3, ""),
])
def test_the_steps_the_watchdog_counted_and_the_last_metrics_agree_or_are_explained(tmp_path, last_metrics, said):
    layout = _hang_dir(tmp_path)                  # the watchdogs' markers: 4 steps done on each rank
    _metrics(layout, last_metrics)
    text = render_hang(analyze_hang(read_run_records(layout)))
    assert "rank 0: no step finished for 6 s after step 3, so it stopped in step 4 (its hang watchdog" in text
    assert "after 4 steps" not in text
    assert f"last step with metrics: rank 0: {last_metrics}, rank 1: {last_metrics}{said}\n" in text
    assert "#N: a collective's number in its process group" in text and "so #N is no step number" in text


def _crashed(tmp_path) -> RunLayout:
    """The fixture's dumps as a crash leaves them: no watchdog fired; the waiting rank's collective ended in the
    error of its peer's closed connection, which its recorder counts as completed."""
    from fleetscope.traces.jobfile import write_job_record
    layout = _hang_dir(tmp_path / "run")
    for marker in layout.flight_recorder_dir.glob("hang.rank*.json"):
        marker.unlink()
    path = layout.flight_recorder_file(0)
    dump = json.loads(path.read_text())
    dump["pg_status"]["0"]["last_completed_collective"] = 18
    path.write_text(json.dumps(dump))
    write_job_record(layout, scheduler="local", status="failed",
                     failures=[{"rank": 1, "exitcode": 1, "message": "InjectedFault: injected crash"}])
    return layout


def test_a_crashed_jobs_collectives_are_no_hang_and_a_collective_ended_without_its_peers_is_said_to_fail(
        tmp_path, capsys):
    from fleetscope.cli.main import main
    layout = _crashed(tmp_path)
    assert main(["hang", str(layout.root)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("Collectives when the job failed (Flight Recorder)")
    assert ("rank 0: last entered #18 gloo:broadcast [[16]] ['Float']; last completed #18 (ended without the ranks "
            "that never entered it: it failed") in out
    assert "rank 1: last entered #17" in out and "(ended without" not in out.split("rank 1: last entered")[1]
