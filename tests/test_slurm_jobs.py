"""Whole jobs on the real local Slurm cluster (two nodes n1, n2; see tests/helpers/slurm_cluster.py): the tiny MoE
with FSDP on gloo, 2 nodes x 2 ranks, through submitit, TorchX and the plain sbatch template; a crashing rank;
a requeued job. Each test checks the files a user opens: traces of all ranks, manifest, report, merged trace.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fleetscope.analysis.merge.ideal_overlays import IDEAL_PROCESS_NAME
from fleetscope.analysis.merge.whole_run_counters import WHOLE_RUN_PROCESS_NAME
from fleetscope.launcher.schedulers.slurm import query_job, wait_for_job
from fleetscope.traces.layout import RunLayout, parse_trace_file_name
from helpers.slurm_cluster import REPO_ROOT, SlurmCluster

pytestmark = pytest.mark.slurm

WORLD_SIZE = 4
JOB_TIMEOUT_S = 300
TRAIN_FLAGS = ["--nodes", "2", "--nproc-per-node", "2", "--device", "cpu", "--parallel", "fsdp", "--steps", "4",
               "--profile", "wait=1,warmup=1,active=1,repeat=1", "--cpus-per-task", "1", "--time", "10"]


def fleetscope(*args: str, timeout: float = JOB_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "fleetscope.cli.main", *args], capture_output=True, text=True,
                          timeout=timeout, check=False)


def launch_args(scheduler: str, run_dir: Path, cluster: SlurmCluster, *extra: str) -> list[str]:
    return ["launch", "--scheduler", scheduler, "--run-dir", str(run_dir), "--partition", cluster.partition,
            *TRAIN_FLAGS, *extra]


def job_record(run_dir: Path) -> dict:
    return json.loads(RunLayout.at(run_dir).job_file.read_text())


def merged_process_names(path: Path) -> set[str]:
    from perfetto.protos.perfetto.trace import perfetto_trace_pb2

    trace = perfetto_trace_pb2.Trace()
    trace.ParseFromString(path.read_bytes())
    return {packet.track_descriptor.process.process_name for packet in trace.packet
            if packet.HasField("track_descriptor") and packet.track_descriptor.HasField("process")}


def assert_complete_run(run_dir: Path) -> None:
    """All ranks' traces, a complete manifest and report, one merged trace with a process per rank."""
    layout = RunLayout.at(run_dir)
    manifest = json.loads(layout.manifest_file.read_text())
    assert manifest["missing"] == [] and manifest["problems"] == []
    assert {trace["rank"] for trace in manifest["traces"]} == set(range(WORLD_SIZE))
    report = json.loads(layout.report_json.read_text())
    assert report["complete"], report.get("verdict")
    assert sorted(rank["rank"] for rank in report["ranks"]) == list(range(WORLD_SIZE))
    assert layout.report_html.stat().st_size > 0
    names = merged_process_names(layout.merged_trace)
    assert {name.split(" (")[0] for name in names if name.startswith("rank ")} == {f"rank {rank}" for rank in range(WORLD_SIZE)}
    # besides the ranks, at most the whole run's counters (from the timelines the ranks wrote on their nodes) and
    # the report's ideal replay of the critical-path steps
    assert names - {n for n in names if n.startswith("rank ")} <= {WHOLE_RUN_PROCESS_NAME, IDEAL_PROCESS_NAME}


def test_submitit_job_with_hostile_name_runs_2x2_and_leaves_a_complete_run(
        slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    hostile = f"a;rm -rf ~ $(touch {marker}) `touch {marker}` 'q'"
    run_dir = tmp_path / "run"
    args = launch_args("submitit", run_dir, slurm_cluster, "--job-name", hostile)
    dry_run = fleetscope(*args, "--dry-run")
    assert dry_run.returncode == 0, dry_run.stderr

    launched = fleetscope(*args, "--wait")

    assert launched.returncode == 0, launched.stdout + launched.stderr + slurm_cluster.log_tail()
    assert not marker.exists(), "a shell ran part of the job name"
    record = job_record(run_dir)
    submitted_script = (RunLayout.at(run_dir).logs_dir / "slurm" / f"{record['job_id']}_submission.sh").read_text()
    assert submitted_script in dry_run.stdout, "sbatch received another script than the dry run printed"
    name = slurm_cluster.run("sacct", "-X", "-n", "-P", "--format=JobName%300", "-j", record["job_id"]).stdout
    assert name.strip() == hostile
    assert record["status"] == "completed"
    assert_complete_run(run_dir)


def test_torchx_job_runs_2x2_and_leaves_a_complete_run(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    from torchx.runner import get_runner
    from torchx.specs import AppState

    run_dir = tmp_path / "run"
    args = launch_args("torchx", run_dir, slurm_cluster)
    dry_run = fleetscope(*args, "--dry-run")

    launched = fleetscope(*args, "--wait")

    assert launched.returncode == 0, launched.stdout + launched.stderr + slurm_cluster.log_tail()
    record = job_record(run_dir)
    assert Path(record["sbatch_script"]).read_text() in dry_run.stdout
    status = get_runner().status(record["torchx_app_handle"])  # TorchX's own view, through accounting
    assert status is not None and status.state == AppState.SUCCEEDED
    assert_complete_run(run_dir)


def test_crashing_rank_ends_the_job_promptly_and_status_names_it(
        slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    # TorchX's failure report (torchrun's root cause) is read by the same status; its parsing is tested in
    # test_slurm_status.py on torchrun's own text, to keep this tier's time down.
    run_dir = tmp_path / "run"
    args = launch_args("submitit", run_dir, slurm_cluster, "--set", "faults.crash_rank=3",
                       "--set", "faults.crash_step=1")
    started = time.monotonic()

    launched = fleetscope(*args, "--wait")

    assert launched.returncode == 1, launched.stdout + launched.stderr
    # --wait names the first failed rank and its error in one line, not torchrun's traceback
    assert "failed first: rank 3" in launched.stdout and "InjectedFault" in launched.stdout, launched.stdout
    assert "Traceback" not in launched.stdout + launched.stderr
    # The time limit is 10 minutes: a job that waited for it would take that long.
    assert time.monotonic() - started < 150
    status = fleetscope("status", str(run_dir))
    assert status.returncode == 1
    assert "state:        FAILED" in status.stdout
    assert "failed first: rank 3" in status.stdout and "InjectedFault" in status.stdout, status.stdout
    assert job_record(run_dir)["slurm"]["failures"][0]["rank"] == 3


INTERRUPTED_RUN = ("--steps", "10", "--profile", "wait=3,warmup=1,active=1,repeat=2", "--set", "checkpoint.at_exit=true",
                   "--set", "faults.straggle_rank=1", "--set", "faults.straggle_ms=300")
"""Two profiler windows: steps 0-4 (recorded at step 4, before the interruption) and 5-9 (recorded at step 9,
after it); the interruption comes once the first window is published, so the checkpoint falls in between.
A straggling rank makes every step last >= 0.3 s: the 5 steps of that margin take >= 1.5 s on any machine."""


def steps_of(metrics_file: Path) -> list[int]:
    return [json.loads(line)["step"] for line in metrics_file.read_text().splitlines() if line.strip()]


def wait_for_file(directory: Path, pattern: str, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if directory.is_dir() and any(directory.glob(pattern)):
            return
        time.sleep(0.5)
    raise TimeoutError(f"no {pattern} in {directory} after {timeout_s}s")


INTERRUPTIONS = {
    # what a preemption with PreemptMode=REQUEUE does: Slurm requeues, the ranks get SIGTERM
    "scontrol requeue": lambda cluster, job_id: cluster.run("scontrol", "requeue", job_id),
    # what the time limit does with submitit's `--signal=USR2@90`: every rank gets USR2, nobody requeues
    # but the job itself
    "time-limit notice": lambda cluster, job_id: cluster.run("scancel", "--signal=USR2", job_id),
}


@pytest.mark.parametrize("interruption", sorted(INTERRUPTIONS))
def test_interrupted_job_checkpoints_resumes_and_keeps_both_attempts_traces(
        slurm_cluster: SlurmCluster, tmp_path: Path, interruption: str) -> None:
    run_dir = tmp_path / "run"
    layout = RunLayout.at(run_dir)
    args = launch_args("submitit", run_dir, slurm_cluster, *INTERRUPTED_RUN)
    launched = fleetscope(*args)
    assert launched.returncode == 0, launched.stderr
    job_id = job_record(run_dir)["job_id"]
    wait_for_file(layout.window_dir(0), "rank0.*")

    INTERRUPTIONS[interruption](slurm_cluster, job_id)

    final = wait_for_job(job_id, poll_s=1, timeout_s=JOB_TIMEOUT_S)
    assert final.state == "COMPLETED" and final.restarts == 1
    postprocess = wait_for_job(job_record(run_dir)["postprocess_job_id"], poll_s=1, timeout_s=JOB_TIMEOUT_S)
    assert postprocess.finished
    saved_steps = sorted(int(path.name.removeprefix("step")) for path in layout.checkpoints_dir.glob("step*"))
    assert saved_steps and saved_steps[0] < 10, f"no checkpoint was saved on the {interruption}: {saved_steps}"
    assert trace_attempts(layout, 0) == {(rank, 0) for rank in range(WORLD_SIZE)}, \
        "the second attempt redid the first window: it did not resume from the checkpoint"
    assert trace_attempts(layout, 1) == {(rank, 1) for rank in range(WORLD_SIZE)}
    assert steps_of(layout.metrics_file(0))[-1] == 9
    assert layout.merged_trace.exists() and layout.report_json.exists()
    # every rank dumped its Flight Recorder when the interruption reached it, before the requeue
    assert all(layout.flight_recorder_file(rank).is_file() for rank in range(WORLD_SIZE)), \
        sorted(p.name for p in layout.flight_recorder_dir.glob("*")) if layout.flight_recorder_dir.is_dir() else []
    if interruption == "time-limit notice":
        # the trainer took the notice (not submitit's handler, which would end rank 0 before any checkpoint)
        rank0_log = (layout.logs_dir / "slurm" / f"{job_id}_0_log.err").read_text()
        assert "stopped on SIGUSR2" in rank0_log and "the job must be requeued to resume" in rank0_log
        assert "Exiting gracefully after preemption/timeout" not in rank0_log


def trace_attempts(layout: RunLayout, window: int) -> set[tuple[int, int]]:
    """(rank, attempt) of every trace of a window."""
    names = [parse_trace_file_name(path.name) for path in layout.window_dir(window).glob("*.json.gz")]
    return {(name.rank, name.attempt) for name in names if name is not None}


def submit_template(cluster: SlurmCluster, tmp_path: Path, run_dir: Path, *trainer_flags: str) -> str:
    template = REPO_ROOT / "slurm" / "sbatch" / "fleetscope-torchrun.sbatch"
    env = {**os.environ, "FLEETSCOPE_PYTHON": sys.executable, "NPROC_PER_NODE": "2"}
    submitted = subprocess.run(
        ["sbatch", "--parsable", "--nodes=2", f"--partition={cluster.partition}",
         f"--output={tmp_path}/template-%j.out", str(template), str(run_dir),
         "--device", "cpu", "--parallel", "fsdp", *trainer_flags],
        env=env, capture_output=True, text=True, check=True, timeout=60,
    )
    return submitted.stdout.strip()


def test_plain_sbatch_template_runs_torchrun_per_node_and_requeues_itself_on_the_time_limit_notice(
        slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    """The template's job, signalled as the time limit nears, requeues itself; its second attempt runs to the end
    as a job without the notice does (one torchrun per node, a complete run)."""
    run_dir = tmp_path / "run"
    layout = RunLayout.at(run_dir)
    job_id = submit_template(slurm_cluster, tmp_path, run_dir, *INTERRUPTED_RUN)
    wait_for_file(layout.window_dir(0), "rank0.*")

    # what `--signal=B:USR1@90` does 90 s before the time limit: only the batch script is signalled
    slurm_cluster.run("scancel", "--batch", "--signal=USR1", job_id)

    final = wait_for_job(job_id, poll_s=1, timeout_s=JOB_TIMEOUT_S)
    output = next(tmp_path.glob("template-*.out")).read_text()
    assert final.state == "COMPLETED" and final.restarts == 1, output
    assert query_job(job_id) is not None
    assert "time limit near: requeueing job" in output
    saved_steps = sorted(int(path.name.removeprefix("step")) for path in layout.checkpoints_dir.glob("step*"))
    assert saved_steps and saved_steps[0] < 10, f"no checkpoint was saved on the requeue: {saved_steps}\n{output}"
    assert trace_attempts(layout, 0) == {(rank, 0) for rank in range(WORLD_SIZE)}, output
    assert trace_attempts(layout, 1) == {(rank, 1) for rank in range(WORLD_SIZE)}, output
    assert steps_of(layout.metrics_file(0))[-1] == 9
    assert_complete_run(run_dir)


# --- users' own programs ------------------------------------------------------------------------------------

USER_SCRIPT = REPO_ROOT / "tests" / "dist_scripts" / "resumable_user_train.py"
USER_FLAGS = ["--nodes", "2", "--nproc-per-node", "2", "--device", "cpu", "--cpus-per-task", "1", "--time", "10"]


def fleetscope_in(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """`fleetscope` started from `cwd` (a user's program starts where launch ran)."""
    return subprocess.run([sys.executable, "-m", "fleetscope.cli.main", *args], capture_output=True, text=True,
                          timeout=JOB_TIMEOUT_S, check=False, cwd=cwd)


def test_user_program_on_submitit_exits_75_on_requeue_and_resumes(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    layout = RunLayout.at(run_dir)
    launched = fleetscope_in(tmp_path, "launch", "--scheduler", "submitit", "--run-dir", str(run_dir), "--partition",
                             slurm_cluster.partition, *USER_FLAGS, "--profile", "wait=6,warmup=1,active=1,repeat=2",
                             "--", "python", str(USER_SCRIPT), "checkpoint", "20", "0.3")
    assert launched.returncode == 0, launched.stderr
    job_id = job_record(run_dir)["job_id"]
    wait_for_file(layout.window_dir(0), "rank0.*")

    slurm_cluster.run("scontrol", "requeue", job_id)

    final = wait_for_job(job_id, poll_s=1, timeout_s=JOB_TIMEOUT_S)
    assert final.state == "COMPLETED" and final.restarts == 1, slurm_cluster.log_tail()
    wait_for_job(job_record(run_dir)["postprocess_job_id"], poll_s=1, timeout_s=JOB_TIMEOUT_S)
    resumed_at = int((tmp_path / "checkpoint" / "step.txt").read_text())
    assert 8 <= resumed_at < 14  # stopped after window 0 (steps 6-7), before window 1 (steps 14-15)
    assert trace_attempts(layout, 0) == {(rank, 0) for rank in range(WORLD_SIZE)}
    assert trace_attempts(layout, 1) == {(rank, 1) for rank in range(WORLD_SIZE)}, \
        "the requeued attempt did not profile the second window"
    assert_complete_run(run_dir)


GLIBC_HEAP_ABORTS = ("malloc(): ", "free(): ", "double free or corruption", "corrupted size vs. prev_size")
"""What glibc prints as it aborts a process whose heap was corrupted."""


def heap_corrupted(run_dir: Path) -> bool:
    """glibc aborted a rank of the run for a corrupted heap (the Slurm logs of its nodes say so)."""
    logs = (RunLayout.at(run_dir).logs_dir / "slurm").glob("*.err")
    return any(marker in path.read_text(errors="replace") for path in logs for marker in GLIBC_HEAP_ABORTS)


def test_user_program_on_torchx_with_collected_traces(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    def launch(workdir: Path) -> tuple[Path, subprocess.CompletedProcess[str]]:
        workdir.mkdir()
        run_dir = workdir / "run"
        return run_dir, fleetscope_in(
            workdir, "launch", "--scheduler", "torchx", "--run-dir", str(run_dir), "--partition",
            slurm_cluster.partition, *USER_FLAGS, "--wait",
            "--collect-traces", "outputs/profiling/traces/iteration_*/rank*_trace.json.gz", "--",
            "python", str(REPO_ROOT / "docs" / "examples" / "torchtitan_layout.py"), "--steps", "10")

    run_dir, launched = launch(tmp_path / "first")
    if launched.returncode != 0 and heap_corrupted(run_dir):
        # torch 2.13's profiler, cycling in this stock program (no fleetscope code runs in its processes), now
        # and then corrupts the heap ("malloc(): unsorted double linked list corrupted") and glibc aborts a
        # rank: that run says nothing of fleetscope, so it runs once more, from a clean directory
        run_dir, launched = launch(tmp_path / "again")
    assert launched.returncode == 0, launched.stdout + launched.stderr + slurm_cluster.log_tail()
    node_logs = "".join(path.read_text() for path in (RunLayout.at(run_dir).logs_dir / "slurm").glob("*.out"))
    assert "fleetscope: collected" in node_logs
    assert_complete_run(run_dir)
