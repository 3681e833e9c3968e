"""On-demand profiling of a job on the real local Slurm cluster (tests/helpers/slurm_cluster.py: nodes n1, n2):
`fleetscope profile --ranks 1,2` while a submitit job of 2 nodes x 2 ranks runs; the window is agreed across
both nodes, recorded by the chosen ranks only, published, gathered and analyzed by the post-processing job."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fleetscope.launcher.schedulers.slurm import wait_for_job
from fleetscope.traces.layout import RunLayout
from helpers.slurm_cluster import SlurmCluster

pytestmark = pytest.mark.slurm

JOB_TIMEOUT_S = 300


def fleetscope(*args: str, timeout: float = JOB_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "fleetscope.cli.main", *args], capture_output=True, text=True,
                          timeout=timeout, check=False)


def test_a_window_requested_while_a_two_node_job_runs(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    layout = RunLayout.at(run_dir)
    launched = fleetscope(
        "launch", "--scheduler", "submitit", "--run-dir", str(run_dir), "--partition", slurm_cluster.partition,
        "--nodes", "2", "--nproc-per-node", "2", "--device", "cpu", "--parallel", "fsdp", "--steps", "40",
        "--profile", "off", "--cpus-per-task", "1", "--time", "10", "--set", "profiler.request_poll_steps=2",
        "--set", "faults.straggle_rank=0", "--set", "faults.straggle_ms=100")
    assert launched.returncode == 0, launched.stdout + launched.stderr
    record = json.loads(layout.job_file.read_text())
    deadline = time.monotonic() + JOB_TIMEOUT_S
    metrics = layout.metrics_file(0)
    while (not metrics.exists() or len(metrics.read_text().splitlines()) < 3) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert metrics.exists(), slurm_cluster.log_tail()

    asked = fleetscope("profile", str(run_dir), "--ranks", "1,2", "--steps", "2", "--warmup", "1", "--wait",
                       "--timeout", str(JOB_TIMEOUT_S))

    assert asked.returncode == 0, asked.stdout + asked.stderr + slurm_cluster.log_tail()
    assert "accepted: window 0" in asked.stdout and "published: window 0 (2 trace(s))" in asked.stdout
    assert wait_for_job(record["job_id"], poll_s=1, timeout_s=JOB_TIMEOUT_S).state == "COMPLETED"
    assert wait_for_job(json.loads(layout.job_file.read_text())["postprocess_job_id"], poll_s=1,
                        timeout_s=JOB_TIMEOUT_S).finished
    manifest = json.loads(layout.manifest_file.read_text())
    assert [(c["window"], c["kind"], c["ranks"]) for c in manifest["captures"]] == [(0, "requested", [1, 2])]
    steps = {t["rank"]: t["steps"] for t in manifest["traces"] if t["window"] == 0}
    assert set(steps) == {1, 2} and steps[1] == steps[2] and len(steps[1]) == 2
    assert manifest["missing"] == [] and manifest["problems"] == []
    report = json.loads(layout.report_json.read_text())
    assert report["capture"]["windows"][0]["ranks"] == [1, 2] and report["complete"]


def test_a_hung_rank_on_two_nodes_is_stopped_dumped_and_named(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    """Rank 3 (on n2) blocks before step 4's collectives: every rank's watchdog sees no step for 5 s, every rank
    dumps its Flight Recorder into the run directory on shared storage, the job ends in bounded time, and
    `fleetscope hang` names rank 3 and the collective the others wait in."""
    run_dir = tmp_path / "run"
    layout = RunLayout.at(run_dir)
    started = time.monotonic()
    launched = fleetscope(
        "launch", "--scheduler", "submitit", "--run-dir", str(run_dir), "--partition", slurm_cluster.partition,
        "--nodes", "2", "--nproc-per-node", "2", "--device", "cpu", "--parallel", "ddp", "--steps", "30",
        "--profile", "wait=1,warmup=1,active=2", "--cpus-per-task", "1", "--time", "10",
        "--set", "faults.hang_rank=3", "--set", "faults.hang_step=4", "--set", "observability.hang_timeout_s=5",
        "--set", "observability.hang_grace_s=10")
    assert launched.returncode == 0, launched.stdout + launched.stderr
    record = json.loads(layout.job_file.read_text())
    state = wait_for_job(record["job_id"], poll_s=1, timeout_s=JOB_TIMEOUT_S)
    assert state.finished and state.state != "COMPLETED", slurm_cluster.log_tail()
    assert time.monotonic() - started < JOB_TIMEOUT_S
    assert all(layout.flight_recorder_file(rank).is_file() for rank in range(4)), slurm_cluster.log_tail()
    hang = fleetscope("hang", str(run_dir))
    assert hang.returncode == 0, hang.stdout + hang.stderr
    # rank 3 never reached step 4's collectives; a rank stuck behind it in an earlier one may be late too
    assert "furthest behind: rank(s) [3]" in hang.stdout or "that rank(s) [3] never entered" in hang.stdout, \
        hang.stdout
