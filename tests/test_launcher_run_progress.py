"""`fleetscope status` shows a run's progress from its step records: the step every rank finished, the slowest
rank, the pace and the time left, the steps the profiler ran in."""

from __future__ import annotations

import json
import re

import pytest

from fleetscope.cli.main import main
from fleetscope.cli.render import render_progress
from fleetscope.launcher.progress import MEASURE_BEHIND, MEASURE_OWN_WORK, MEASURE_STEP_TIME, run_progress
from fleetscope.traces.jobfile import write_job_record
from fleetscope.traces.layout import RunLayout


def _records(layout: RunLayout, rank: int, steps: range, ms: float, profiled: tuple[int, ...] = ()) -> None:
    layout.metrics_dir.mkdir(parents=True, exist_ok=True)
    lines = [dict(step=s, rank=rank, loss=1.0, step_time_ms=ms * (3 if s in profiled else 1), data_ms=1.0,
                  forward_ms=1.0, backward_ms=1.0, optimizer_ms=1.0, tokens_per_s=1.0, profiled=s in profiled)
             for s in steps]
    layout.metrics_file(rank).write_text("".join(json.dumps(line) + "\n" for line in lines))


def test_progress_is_the_slowest_ranks_with_the_pace_of_recent_unprofiled_steps(tmp_path):
    layout = RunLayout.at(tmp_path)
    _records(layout, 0, range(0, 41), 100.0, profiled=(10, 11))
    _records(layout, 1, range(0, 38), 120.0, profiled=(10, 11))
    progress = run_progress(layout, total_steps=100)
    assert (progress.done_step, progress.front_step, progress.slowest.rank) == (37, 40, 1)
    assert (progress.slowest.measure, progress.slowest.steps_behind) == (MEASURE_BEHIND, 3)
    assert progress.pace_ms == 120.0                 # per step the slowest rank's time, profiled steps left out
    assert progress.eta_s == pytest.approx(62 * 0.120)
    assert progress.profiled_steps == [10, 11]


def test_status_prints_the_progress_and_names_a_records_problem(tmp_path, capsys):
    layout = RunLayout.at(tmp_path / "run")
    layout.root.mkdir()
    write_job_record(layout, scheduler="local", status="running", spec={"train": {"steps": 50}})
    _records(layout, 0, range(0, 21), 50.0, profiled=(5, 6))
    layout.metrics_file(1).parent.mkdir(exist_ok=True)
    (layout.metrics_dir / "rank1.jsonl").symlink_to("/etc/passwd")   # a record that leads out of the run
    assert main(["status", str(layout.root)]) == 0
    out = capsys.readouterr().out
    assert "step 20 done on every rank (the run's steps: 0-49)" in out
    assert "20.00 steps/s (50.00 ms a step" in out and "1 s left at that pace" in out
    assert "in steps 5-6 so far" in out and "rank1.jsonl: not read" in out
    # once the job has ended (here cancelled), no time is left and no window is still to come
    write_job_record(layout, status="cancelled")
    assert main(["status", str(layout.root)]) == 0
    out = capsys.readouterr().out
    assert "left at that pace" not in out and "in steps 5-6" in out and "so far" not in out


def test_a_run_without_records_says_no_step_finished(tmp_path, capsys):
    layout = RunLayout.at(tmp_path / "run")
    layout.root.mkdir()
    write_job_record(layout, scheduler="local", status="running")
    assert main(["status", str(layout.root)]) == 0
    assert "no step finished yet" in capsys.readouterr().out


def _synchronous(layout: RunLayout, own_work: dict[int, list[float]], step_ms: list[float],
                 exposed: bool = True) -> None:
    """Records of a synchronous data-parallel job: every rank's step takes the same time; the rest of a rank's step
    beyond its own work is its gradient communication, which holds its waiting for the later rank. Rank 0's steps
    are half a millisecond longer (where its wait falls)."""
    layout.metrics_dir.mkdir(parents=True, exist_ok=True)
    for rank, works in own_work.items():
        lines = [dict(step=s, rank=rank, loss=1.0, step_time_ms=ms + 0.5 * (rank == 0), data_ms=0.2, forward_ms=work,
                      backward_ms=ms - work, optimizer_ms=0.0, tokens_per_s=1.0, profiled=False,
                      comm_exposed_ms=ms + 0.5 * (rank == 0) - work if exposed else None)
                 for s, (work, ms) in enumerate(zip(works, step_ms))]
        layout.metrics_file(rank).write_text("".join(json.dumps(line) + "\n" for line in lines))


def test_the_slowest_rank_of_a_synchronous_job_is_the_one_with_the_most_own_work_not_the_longest_step(tmp_path):
    # rank 1 computes 65 ms where rank 0 computes 25 ms; rank 0 waits 40 ms in its gradient all-reduce, so
    # its step time ends up as long as rank 1's (here half a millisecond longer)
    layout = RunLayout.at(tmp_path)
    _synchronous(layout, {0: [25.0 + s % 3 for s in range(12)], 1: [65.0 - s % 2 for s in range(12)]}, [70.0] * 12)
    slowest = run_progress(layout, total_steps=12).slowest
    assert slowest.rank == 1
    assert (slowest.measure, slowest.consistent) == (MEASURE_OWN_WORK, True)
    assert (slowest.steps_over, slowest.steps_compared) == (11, 11)       # every step but the first (not steady)
    assert slowest.ms == pytest.approx(64.0) and slowest.others_ms == pytest.approx(26.0)
    lines = render_progress(run_progress(layout, total_steps=12), ended=True)
    text = "\n".join(lines)
    assert "rank 1, the one the others wait for, has the most own work: 64.00 ms a step against 26.00 ms" in text
    assert "own work: step time less the gradient communication the rank waited for" in text


def test_equal_ranks_name_no_rank_as_the_one_waited_for(tmp_path):
    layout = RunLayout.at(tmp_path)
    _synchronous(layout, {0: [30.0 + (s % 2) for s in range(12)], 1: [30.0 + ((s + 1) % 2) for s in range(12)]},
                 [40.0] * 12)
    progress = run_progress(layout, total_steps=12)
    assert not progress.slowest.consistent
    assert "slowest rank: no rank is consistently the one waited for; rank " in "\n".join(render_progress(progress))


def test_without_gradient_communication_records_the_step_time_names_the_rank_and_says_so(tmp_path):
    layout = RunLayout.at(tmp_path)
    _synchronous(layout, {0: [30.0] * 6, 1: [30.0] * 6}, [40.0] * 6, exposed=False)
    slowest = run_progress(layout, total_steps=6).slowest
    assert (slowest.rank, slowest.measure) == (0, MEASURE_STEP_TIME)      # rank 0's steps are 0.5 ms longer
    text = "\n".join(render_progress(run_progress(layout, total_steps=6)))
    assert "has the longest step time" in text and "a rank that waits for another is not told apart" in text


def test_one_rank_has_no_slowest_rank_line(tmp_path):
    layout = RunLayout.at(tmp_path)
    _records(layout, 0, range(0, 5), 10.0)
    assert run_progress(layout, total_steps=5).slowest is None
    assert not any(line.startswith("slowest rank") for line in render_progress(run_progress(layout, 5)))


def test_a_few_or_unsteady_steps_name_no_rank_as_consistently_waited_for(tmp_path):
    layout = RunLayout.at(tmp_path)
    _synchronous(layout, {0: [25.0] * 6, 1: [65.0] * 6}, [70.0] * 6)      # 5 steady steps: too few to say
    slowest = run_progress(layout, total_steps=6).slowest
    assert (slowest.rank, slowest.steps_over, slowest.consistent) == (1, 5, False)


def test_a_running_job_without_a_step_record_for_many_steps_is_said_to_be_stalled(tmp_path, capsys):
    import os
    import time
    layout = RunLayout.at(tmp_path / "run")
    layout.root.mkdir()
    write_job_record(layout, scheduler="local", status="running",
                     spec={"train": {"steps": 100, "observability": {"hang_timeout_s": 600.0}}})
    _synchronous(layout, {0: [25.0] * 12, 1: [65.0] * 12}, [70.0] * 12)
    assert main(["status", str(layout.root)]) == 0
    assert "stalled" not in capsys.readouterr().out          # records written just now
    old = time.time() - 90
    for rank in (0, 1):
        os.utime(layout.metrics_file(rank), (old, old))
    assert main(["status", str(layout.root)]) == 0
    out = capsys.readouterr().out
    assert re.search(r"stalled: +no step recorded for 9\d s, where a step took about 70 ms: a rank may hang; its "
                     r"hang watchdog stops the job after 10 min without a step \(observability.hang_timeout_s\), "
                     rf"in about 8 min, then `fleetscope hang {re.escape(str(layout.root))}` names the rank", out), out
    assert "left at that pace" not in out
    write_job_record(layout, status="failed")                # an ended job is not stalled: it ended
    assert main(["status", str(layout.root)]) == 1           # the exit status of a failed run
    assert "stalled" not in capsys.readouterr().out


@pytest.mark.parametrize("status, trails", [("running", True), ("failed", True), ("succeeded", False)])
def test_the_progress_says_the_records_may_trail_the_steps_run_unless_the_job_succeeded(tmp_path, capsys, status,
                                                                                          trails):
    # the trainer writes a step's record once the next step has run: `hang` counts one step more from its watchdogs
    layout = RunLayout.at(tmp_path / "run")
    layout.root.mkdir()
    write_job_record(layout, scheduler="local", status=status, spec={"train": {"steps": 8}})
    _records(layout, 0, range(0, 4), 50.0)
    main(["status", str(layout.root)])
    out = capsys.readouterr().out
    assert "step 3 done on every rank (the run's steps: 0-7)" in out
    assert ("; the records may trail the steps run by one (a step's record is written once the next step has run)"
            in out) is trails


# --- cancel of a local run ----------------------------------------------------------------------------


def _running(tmp_path, launcher) -> RunLayout:
    layout = RunLayout.at(tmp_path / "run")
    layout.root.mkdir()
    write_job_record(layout, scheduler="local", status="running", launcher=launcher)
    return layout


@pytest.mark.parametrize("launcher, status, message", [
    (None, "running", "names no torchrun process"),
    ({"pid": 1, "host": "elsewhere", "started": 1}, "running", "runs on 'elsewhere', not on this host"),
    ({"pid": 2**22 + 7, "host": None, "started": 5}, "running", "is no longer running"),
    ({"pid": 1, "host": None, "started": 1}, "succeeded", "the run is not running"),
])
def test_cancel_of_a_local_run_refuses_what_is_not_its_running_torchrun(tmp_path, capsys, launcher, status,
                                                                         message):
    import socket
    if launcher is not None and launcher["host"] is None:
        launcher = {**launcher, "host": socket.gethostname()}
    layout = _running(tmp_path, launcher)
    write_job_record(layout, status=status)
    assert main(["cancel", str(layout.root)]) == 2
    assert message in capsys.readouterr().err
    assert "cancel_requested_at" not in json.loads(layout.job_file.read_text())


def test_a_reused_pid_is_not_the_runs_torchrun(tmp_path, capsys):
    import os
    import socket

    from fleetscope.launcher.schedulers.local import launcher_record
    mine = launcher_record(os.getpid())
    layout = _running(tmp_path, {**mine, "started": mine["started"] - 1, "host": socket.gethostname()})
    assert main(["cancel", str(layout.root)]) == 2 and "is no longer running" in capsys.readouterr().err


@pytest.mark.slow
def test_cancel_stops_a_running_local_launch_and_it_ends_cancelled(tmp_path):
    import subprocess
    import sys
    import time

    run = tmp_path / "run"
    launch = subprocess.Popen([sys.executable, "-m", "fleetscope.cli.main", "launch", "--nproc-per-node", "1",
                               "--device", "cpu", "--steps", "100000", "--run-dir", str(run), "--profile", "off"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline, records = time.monotonic() + 240, run / "metrics" / "rank0.jsonl"
        while time.monotonic() < deadline and (not records.is_file() or records.read_text().count("\n") < 3):
            time.sleep(0.5)
        assert records.is_file() and records.read_text().count("\n") >= 3, "3 steps not done in 4 minutes"
        status = subprocess.run([sys.executable, "-m", "fleetscope.cli.main", "status", str(run)],
                                capture_output=True, text=True, timeout=120)
        assert "done on every rank (the run's steps: 0-99999)" in status.stdout and "left at that pace" in status.stdout
        cancel = subprocess.run([sys.executable, "-m", "fleetscope.cli.main", "cancel", str(run)],
                                capture_output=True, text=True, timeout=120)
        assert cancel.returncode == 0 and "SIGTERM sent to torchrun (pid" in cancel.stdout, cancel.stderr
        launch.wait(timeout=240)
    finally:
        if launch.poll() is None:
            launch.kill()
    assert launch.returncode != 0
    record = json.loads((run / "job.json").read_text())
    assert record["status"] == "cancelled" and "cancel_requested_at" in record


def test_status_of_a_hung_job_gives_the_step_its_watchdogs_stopped_it_in_beside_the_records():
    from fleetscope.cli.render import render_progress
    lines = render_progress(None, ended=True, stopped_in={0: 5, 1: 5})
    assert any("stopped in" in line and "step 5 (the hang watchdog of rank(s) 0-1, as `hang` reads it)" in line
               for line in lines)
    assert not any("stopped in" in line for line in render_progress(None, ended=True))
