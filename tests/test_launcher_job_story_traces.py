"""Only this job's traces, and what cannot work refused before the start (review 2026-12-04, findings 2, 11,
12, 15): real `fleetscope launch` / `collect-traces` runs of a tiny program that writes its own Kineto traces
with torch.profiler's tensorboard_trace_handler (one rank, no process group: seconds), and the launch checks
that `--dry-run` runs as the real launch does."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import fleetscope

from fleetscope.cli.main import main
from fleetscope.launcher.checks import LAUNCH_CHECKS, first_window, schedule_problem
from fleetscope.traces.own_traces import CLOCK_SLACK_S
from fleetscope.trainer.config import ProfilerSchedule
from fleetscope.trainer.profiling import plan_windows

PROGRAM = """\
import os, sys
import torch
from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler

out = sys.argv[1] if len(sys.argv) > 1 else "tb"
rank = int(os.environ.get("RANK", "0"))
with profile(activities=[ProfilerActivity.CPU], schedule=schedule(wait=1, warmup=1, active=1),
             on_trace_ready=tensorboard_trace_handler(out, worker_name=f"rank{rank}")) as prof:
    for _ in range(4):
        torch.ones(64).sum()
        prof.step()
"""


@pytest.fixture
def job(tmp_path: Path) -> Path:
    """A working directory holding the program (what `cd myjob` is in the review)."""
    workdir = tmp_path / "myjob"
    workdir.mkdir()
    (workdir / "train.py").write_text(PROGRAM)
    return workdir


def run_program(workdir: Path, out: str = "tb") -> None:
    """The program run by hand (an earlier run's traces: they stay in `out`)."""
    subprocess.run([sys.executable, "train.py", out], cwd=workdir, check=True, capture_output=True, timeout=120)


def age(paths: list[Path], seconds: float) -> None:
    for path in paths:
        stamp = path.stat().st_mtime - seconds
        os.utime(path, (stamp, stamp))


def launch(workdir: Path, run: Path, *flags: str) -> subprocess.CompletedProcess:
    return fleetscope("launch", "--run-dir", str(run), "--no-post", *flags, "--", "python", "train.py", cwd=workdir)


def published(run: Path) -> list[Path]:
    return sorted((run / "traces").rglob("*.pt.trace.json.gz")) if (run / "traces").is_dir() else []


# --- 1. only this job's traces -------------------------------------------------------------------------------


@pytest.mark.slow  # a real launch (torchrun, one rank): ~10 s
def test_traces_left_by_an_earlier_run_are_skipped_in_one_line_and_left_in_place(job, tmp_path):
    run_program(job)
    old = sorted((job / "tb").iterdir())
    age(old, 600)
    completed = launch(job, tmp_path / "run", "--collect-traces", "tb/*.pt.trace.json")
    assert completed.returncode == 0, completed.stdout[-2000:] + completed.stderr[-2000:]
    assert "collected 1 trace(s) matching" in completed.stdout
    skipped = [line for line in completed.stdout.splitlines() if "modified before this job started" in line]
    assert len(skipped) == 1 and "skipped 1 matched file(s)" in skipped[0] and str(old[-1]) in skipped[0]
    assert "10 min before the job started" in skipped[0]
    assert all(path.is_file() for path in old)  # never moved, never deleted
    assert len(published(tmp_path / "run")) == 1


@pytest.mark.slow  # a real launch (torchrun, one rank): ~10 s
def test_collecting_into_a_finished_run_skips_traces_written_after_it(job, tmp_path):
    completed = launch(job, tmp_path / "run", "--collect-traces", "tb/*.pt.trace.json")
    assert completed.returncode == 0, completed.stderr[-2000:]
    time.sleep(CLOCK_SLACK_S + 1.1)  # job.json keeps whole seconds
    run_program(job)  # a later run in the same folder
    again = fleetscope("collect-traces", str(tmp_path / "run"), "tb/*.pt.trace.json", cwd=job)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "skipped 1 matched file(s) modified after this job ended" in again.stdout
    assert len(published(tmp_path / "run")) == 1


def test_two_traces_of_one_rank_covering_the_same_steps_are_refused_naming_both(job, tmp_path):
    run_program(job)
    run_program(job)  # two runs, no job.json to tell them apart: both cover step 2 of rank 0
    first, second = sorted((job / "tb").iterdir())
    run = tmp_path / "run"
    run.mkdir()
    completed = fleetscope("collect-traces", str(run), "tb/*.pt.trace.json", cwd=job)
    assert completed.returncode == 3, completed.stdout + completed.stderr
    refused = [line for line in completed.stdout.splitlines() if "refused" in line]
    assert len(refused) == 1 and str(first) in refused[0] and str(second) in refused[0]
    assert "step(s) 2" in refused[0] and "neither collected" in refused[0]
    assert "no job.json" in completed.stdout
    assert published(run) == [] and first.is_file() and second.is_file()


@pytest.mark.slow  # a real launch (torchrun, one rank): ~10 s
def test_new_traces_without_collect_traces_are_named_with_the_flag_that_files_them(job, tmp_path):
    run_program(job)
    age(sorted((job / "tb").iterdir()), 600)  # an earlier run's: not this job's
    run = tmp_path / "run"
    completed = launch(job, run)
    assert completed.returncode == 0, completed.stderr[-2000:]
    hint = [line for line in completed.stdout.splitlines() if "new Kineto trace" in line]
    assert len(hint) == 1 and "found 1 new Kineto trace(s)" in hint[0], completed.stdout
    assert f"in {job / 'tb'}" in hint[0]
    assert "--collect-traces 'tb/*.pt.trace.json'" in hint[0]
    command = f"fleetscope collect-traces {run} 'tb/*.pt.trace.json'"
    assert command in hint[0]
    # recorded for the run's report, not only said in the launch's terminal
    recorded = json.loads((run / "job.json").read_text())["uncollected_traces"]
    assert recorded.startswith("found 1 new Kineto trace(s)") and command in recorded
    collected = fleetscope("collect-traces", str(run), "tb/*.pt.trace.json", cwd=job)  # the command it names
    assert collected.returncode == 0 and "collected 1 trace(s)" in collected.stdout, collected.stdout
    assert len(published(run)) == 1


@pytest.mark.slow  # a real launch (torchrun, one rank): ~10 s
def test_a_glob_that_matches_nothing_says_so_with_a_hint(job, tmp_path):
    completed = launch(job, tmp_path / "run", "--collect-traces", "tb_trace/*.json")
    assert completed.returncode == 0, completed.stderr[-2000:]
    line = next(line for line in completed.stdout.splitlines() if "collected 0 trace(s)" in line)
    assert f"nothing matches {job / 'tb_trace'}/*.json" in line
    assert f"no folder {job / 'tb_trace'}" in line
    assert f"try '{job / 'tb'}/*.pt.trace.json'" in line


# --- 2. a schedule that never fires is refused before the start -----------------------------------------------

NEVER_FIRES = ["--steps", "5", "--profile", "skip_first=3,wait=2,warmup=1,active=2"]


@pytest.mark.parametrize("dry_run", [[], ["--dry-run"]])
def test_a_schedule_whose_first_window_starts_after_the_last_step_exits_2_before_start(dry_run, tmp_path, capsys):
    run = tmp_path / "nowin"
    assert main(["launch", "--nproc-per-node", "2", "--device", "cpu", "--run-dir", str(run), *NEVER_FIRES,
                 *dry_run]) == 2
    err = capsys.readouterr().err
    assert "the first window starts at step 5 (warmup from step 5, recording steps 6-7)" in err
    assert "after the run's last step 4 (--steps 5 runs steps 0-4)" in err
    assert "raise --steps to at least 8" in err
    assert not run.exists()


def test_a_window_that_starts_but_cannot_finish_is_refused_and_one_that_fits_is_not(tmp_path, capsys):
    base = ["launch", "--dry-run", "--device", "cpu", "--run-dir", str(tmp_path / "r"),
            "--profile", "skip_first=3,wait=2,warmup=1,active=2"]
    assert main([*base, "--steps", "7"]) == 2
    assert "the first window ends at step 7" in capsys.readouterr().err
    assert main([*base, "--steps", "8"]) == 0


def test_the_default_schedule_on_a_short_run_is_only_noted(tmp_path, capsys):
    assert main(["launch", "--dry-run", "--device", "cpu", "--steps", "2", "--run-dir", str(tmp_path / "r")]) == 0
    assert "note: the default --profile schedule: the first window ends at step 3" in capsys.readouterr().err


@pytest.mark.parametrize("skip_first, wait, warmup, active, repeat", [
    (0, 0, 0, 1, 1), (0, 1, 1, 2, 1), (3, 2, 1, 2, 0), (5, 0, 0, 2, 3), (1, 4, 2, 3, 2)])
def test_the_check_agrees_with_the_trainers_window_plan(skip_first, wait, warmup, active, repeat):
    schedule = ProfilerSchedule(skip_first=skip_first, wait=wait, warmup=warmup, active=active, repeat=repeat)
    for steps in range(1, 16):
        planned = plan_windows(schedule, steps)
        assert (schedule_problem(schedule, steps) is None) == bool(planned), (steps, planned)
        if planned:
            window = first_window(schedule)
            assert (window.warmup_start, window.active_start, window.end) == (
                planned[0].warmup_start, planned[0].active_start, planned[0].end)


# --- 3. --dry-run runs every check the launch runs --------------------------------------------------------------


def existing_run(tmp_path: Path) -> Path:
    run = tmp_path / "dd"
    run.mkdir()
    (run / "job.json").write_text('{"scheduler": "local"}\n')
    return run


@pytest.mark.parametrize("case, expected", [
    ("data_path", "data.path: nothere.txt: no such file (nothing was started)"),
    ("existing_run", "already holds a run; pass --resume"),
    ("torchrun", "fleetscope runs torchrun itself: use `-- python train.py ARGS`"),
    ("torchrun_module", "not `-- -m torch.distributed.run ...`"),
    ("absent_script", "absent.py: no such file (nothing was started)"),
])
def test_dry_run_refuses_what_the_launch_refuses_with_the_same_words(case, expected, job, tmp_path, monkeypatch,
                                                                      capsys):
    monkeypatch.chdir(job)
    run = str(existing_run(tmp_path)) if case == "existing_run" else str(tmp_path / "new")
    argv = {"data_path": ["--set", "data.source=text", "--set", "data.path=nothere.txt"], "existing_run": [],
            "torchrun": ["--nproc-per-node", "2", "--", "torchrun", "--nproc_per_node", "2", "train.py"],
            "torchrun_module": ["--", "python", "-m", "torch.distributed.run", "train.py"],
            "absent_script": ["--", "python", "absent.py"]}[case]
    flags = ["--device", "cpu"] if case in ("data_path", "existing_run") else []
    messages = []
    for dry_run in (["--dry-run"], []):
        assert main(["launch", "--run-dir", run, *flags, *dry_run, *argv]) == 2
        messages.append(capsys.readouterr().err)
    assert messages[0] == messages[1] and expected in messages[0]
    assert case == "existing_run" or not Path(run).exists()
    assert sorted(os.listdir(job)) == ["train.py"]


def test_one_list_of_checks_names_each_refusal_of_the_review():
    assert [check.__name__ for check in LAUNCH_CHECKS] == [
        "check_run_dir", "check_program", "check_input_files", "check_profile_schedule"]


def test_resume_passes_the_run_directory_check_in_a_dry_run(tmp_path, capsys):
    run = existing_run(tmp_path)
    assert main(["launch", "--dry-run", "--resume", "--device", "cpu", "--run-dir", str(run)]) == 0
    assert "torch.distributed.run" in capsys.readouterr().out


def test_the_report_carries_the_uncollected_traces_hint_the_launch_recorded(tmp_path):
    """A teammate opening the report sees what the launch's terminal said: the traces the program wrote
    outside the run, and the command that files them."""
    from fleetscope.analysis import analyze
    from fleetscope.traces.jobfile import write_job_record
    from fleetscope.traces.own_traces import UNCOLLECTED_FIELD
    from hostile_runs import make_run

    layout = make_run(tmp_path / "run")
    hint = "found 2 new Kineto trace(s) this job wrote in /w/tb, not filed into the run: rerun with ..."
    write_job_record(layout, status="succeeded", **{UNCOLLECTED_FIELD: hint})
    report = analyze(layout.root, use_hta=False, write_default_outputs=False, use_cache=False)
    assert hint in report.notes
    write_job_record(layout, **{UNCOLLECTED_FIELD: ["not", "a", "string"]})
    assert not any("Kineto" in note for note in analyze(layout.root, use_hta=False, write_default_outputs=False,
                                                        use_cache=False).notes)
