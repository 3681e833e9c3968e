"""The local launcher: the exact command (golden file), quoting, bad input, a failing rank."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest
from helpers import REPO, fleetscope

from fleetscope.cli.launch_commands import build_launch_parser
from fleetscope.cli.jobargs import job_spec_from_args
from fleetscope.launcher.schedulers.local import plan_local

GOLDEN = REPO / "tests" / "golden" / "local"
HOSTILE_ARGS = [
    "--python", "/opt/venv/bin/python", "--nproc-per-node", "2", "--run-dir", "/shared/runs/moe run;rm -rf ~",
    "--model", "mixtral", "--parallel", "fsdp", "--steps", "20", "--profile", "wait=2,warmup=1,active=3,repeat=2",
    "--env", "NCCL_DEBUG=INFO", "--set", "performance.alloc_conf=expandable_segments:True",
    "--set", "data.path=/data/it's here.txt", "--set", "data.source=text",
]


def plan_for(args: list[str]):
    return plan_local(job_spec_from_args(build_launch_parser().parse_args(args)))


def test_dry_run_prints_the_golden_command(tmp_path):
    assert plan_for(HOSTILE_ARGS).render() + "\n" == (GOLDEN / "torchrun_hostile_names.txt").read_text()
    # what --dry-run prints once the launch's checks pass; here they do not (no /data on this host), as for
    # the real launch, and nothing is created or run either way
    completed = fleetscope("launch", "--dry-run", *HOSTILE_ARGS, cwd=tmp_path)
    assert completed.returncode == 2 and "data.path: /data/it's here.txt: no such file" in completed.stderr
    assert list(tmp_path.iterdir()) == []  # nothing created, nothing run
    assert not Path("/shared/runs/moe run;rm -rf ~").exists()


def test_rendered_command_parses_back_to_the_exact_argv():
    plan = plan_for(HOSTILE_ARGS)
    words = shlex.split(plan.render())
    environment = dict(word.split("=", 1) for word in words[:len(plan.env)])
    assert environment == plan.env
    assert words[len(plan.env):] == plan.argv
    assert "/shared/runs/moe run;rm -rf ~" in plan.argv


def test_rank_environment_keeps_multicast_off_and_passes_user_variables():
    env = plan_for(HOSTILE_ARGS).env
    assert env["NCCL_NVLS_ENABLE"] == "0" and env["NCCL_DEBUG"] == "INFO"
    assert env["PYTORCH_ALLOC_CONF"] == "expandable_segments:True"


@pytest.mark.parametrize("args, message", [
    (["--tp", "3", "--parallel", "tp"], "parallel.tp: 3 does not divide the world size 2"),
    (["--model", "llama"], "model.family: unknown family 'llama'"),
    (["--steps", "-4"], "steps: must be >= 1"),
    (["--env", "NOEQUALS"], "env: expected NAME=VALUE"),
])
def test_bad_configuration_exits_2_naming_the_field(tmp_path, args, message):
    completed = fleetscope("launch", "--run-dir", str(tmp_path / "run"), "--nproc-per-node", "2", *args, cwd=tmp_path)
    assert completed.returncode == 2
    assert message in completed.stderr
    assert not (tmp_path / "run").exists()


def test_an_existing_run_is_never_reused_without_resume(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "job.json").write_text("{}")
    completed = fleetscope("launch", "--run-dir", str(run), "--steps", "1", cwd=tmp_path)
    assert completed.returncode == 2 and "already holds a run" in completed.stderr
    assert (run / "job.json").read_text() == "{}"


@pytest.mark.slow
def test_a_failing_rank_fails_the_launch_with_its_error_and_keeps_the_traces(tmp_path):
    run = tmp_path / "run"
    completed = fleetscope("launch", "--run-dir", str(run), "--nproc-per-node", "2", "--device", "cpu", "--steps", "8",
                           "--profile", "wait=1,warmup=1,active=2", "--set", "faults.crash_rank=1",
                           "--set", "faults.crash_step=5", cwd=tmp_path)
    assert completed.returncode == 1
    assert "rank 1 [failed first]: InjectedFault: injected crash on rank 1 at step 5" in completed.stderr
    job = json.loads((run / "job.json").read_text())
    assert job["status"] == "failed" and job["failures"][0]["rank"] == 1
    manifest = json.loads((run / "manifest.json").read_text())
    assert sorted(t["rank"] for t in manifest["traces"]) == [0, 1]  # window 0 (steps 2-3) was published
    assert (run / "report" / "merged.perfetto-trace").is_file()


@pytest.mark.slow
def test_torchx_local_scheduler_runs_the_same_job_through_the_cli(tmp_path):
    run = tmp_path / "run"
    completed = fleetscope("launch", "--scheduler", "torchx_local", "--run-dir", str(run), "--nproc-per-node", "2",
                           "--device", "cpu", "--steps", "4", "--profile", "wait=1,warmup=1,active=2", cwd=tmp_path)
    assert completed.returncode == 0, completed.stderr[-3000:]
    job = json.loads((run / "job.json").read_text())
    assert job["status"] == "succeeded" and job["plan"]["kind"] == "torchx_local"
    manifest = json.loads((run / "manifest.json").read_text())
    assert sorted(t["rank"] for t in manifest["traces"]) == [0, 1] and not manifest["missing"]
    assert (run / "report" / "merged.perfetto-trace").is_file()


@pytest.mark.slow
def test_torchx_local_failure_names_the_failing_rank(tmp_path):
    run = tmp_path / "run"
    completed = fleetscope("launch", "--scheduler", "torchx_local", "--run-dir", str(run), "--nproc-per-node", "2",
                           "--device", "cpu", "--steps", "6", "--profile", "wait=1,warmup=1,active=2",
                           "--set", "faults.crash_rank=1", "--set", "faults.crash_step=4", "--no-post", cwd=tmp_path)
    assert completed.returncode == 1
    assert "InjectedFault: injected crash on rank 1 at step 4" in completed.stderr
    assert json.loads((run / "job.json").read_text())["status"] == "failed"
    status = fleetscope("status", str(run), cwd=tmp_path)
    assert status.returncode == 1 and "failed first: rank 1" in status.stdout


def test_logs_of_a_local_run_show_each_ranks_log(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "job.json").write_text(json.dumps({"scheduler": "local", "status": "failed"}))
    for rank in (0, 1):
        log = run / "logs" / "abc123" / "attempt_0" / str(rank) / "stderr.log"
        log.parent.mkdir(parents=True)
        log.write_text(f"first line\nlast line of rank {rank}\n")
    completed = fleetscope("logs", str(run), "--tail", "1", cwd=tmp_path)
    assert completed.returncode == 0, completed.stderr
    assert completed.stdout.count("==>") == 2 and "last line of rank 1" in completed.stdout
    assert "first line" not in completed.stdout
