"""Checkpoints with real torchrun runs: resume continues the same loss curve, step numbers and
profiling schedule; a preemption notice to one rank stops every rank at the same step with a checkpoint."""

from __future__ import annotations

import json
import re

import pytest
from helpers import metrics, torchrun

pytestmark = pytest.mark.slow

COMMON = ["-m", "fleetscope.trainer", "--device", "cpu", "--parallel", "fsdp",
          "--profile", "wait=1,warmup=1,active=1,repeat=0", "--set", "observability.clock_round_trips=0"]


def train(run_dir, steps: int, *extra: str):
    return torchrun(2, *COMMON, "--run-dir", str(run_dir), "--steps", str(steps), *extra)


def losses(run_dir, rank=0) -> list[tuple[int, float]]:
    return [(row["step"], round(row["loss"], 6)) for row in metrics(run_dir, rank)]


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("straight")
    completed = train(run_dir, 6)
    assert completed.returncode == 0, completed.stderr[-3000:]
    return run_dir


def test_three_plus_three_steps_equal_six(straight, tmp_path):
    first = train(tmp_path, 3, "--set", "checkpoint.at_exit=true")
    assert first.returncode == 0, first.stderr[-3000:]
    assert (tmp_path / "checkpoints" / "step00000003").is_dir()
    second = train(tmp_path, 6)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resumed from" in second.stderr
    for rank in range(2):
        assert losses(tmp_path, rank) == losses(straight, rank)
    windows = sorted(p.name for p in (tmp_path / "traces").iterdir())
    assert windows == ["window000", "window001"]  # steps 2 and 5: the schedule continued after the resume


def test_preemption_notice_stops_every_rank_at_one_step_and_resumes(straight, tmp_path):
    stopped = train(tmp_path, 6, "--set", "faults.signal_rank=1", "--set", "faults.signal_step=2")
    assert stopped.returncode != 0
    assert "exiting with status 75" in stopped.stderr
    # rank 0 got no signal, yet knows the stop was a notice (nobody else requeues): the level is agreed
    assert re.search(r"rank0 WARNING stopped on another rank's signal after \d+ steps; checkpoint saved; "
                     r"the job must be requeued to resume", stopped.stderr), stopped.stderr[-3000:]
    assert re.search(r"rank1 WARNING stopped on SIGUSR1 after", stopped.stderr)
    saved = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert len(saved) == 1
    steps_done = int(saved[0][len("step"):])
    for rank in range(2):  # both ranks recorded exactly the steps the checkpoint holds
        assert [step for step, _ in losses(tmp_path, rank)] == list(range(steps_done))
    resumed = train(tmp_path, 6)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    for rank in range(2):
        assert losses(tmp_path, rank) == losses(straight, rank)
    job = [json.loads(line) for line in (tmp_path / "metrics" / "rank0.jsonl").read_text().splitlines()]
    assert len(job) == 6
