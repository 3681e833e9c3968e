"""Slurm planning without a cluster: golden texts of every scheduler's dry run, quoting of untrusted strings,
validation, and a dry run that provably runs no Slurm command.

Regenerate the golden files after an intended change with FLEETSCOPE_UPDATE_GOLDEN=1.
"""

from __future__ import annotations

import os
import re
import shlex
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from fleetscope.launcher.schedulers import scheduler_for
from fleetscope.launcher.schedulers.slurm import SlurmJobStatus, parse_sacct, parse_scontrol_job
from fleetscope.launcher.slurm_request import SbatchOption, SlurmResources, plan_postprocess_job
from fleetscope.launcher.spec import JobSpec, SlurmOptions
from fleetscope.trainer.config import ConfigError, TrainConfig, apply_overrides

GOLDEN_DIR = Path(__file__).parent / "golden" / "slurm"
REPO_ROOT = Path(__file__).resolve().parent.parent
HOSTILE_NAME = "a;rm -rf ~ $(touch /tmp/pwned) `id` 'q' \"d\""
SLURM_COMMANDS = ("sbatch", "srun", "salloc", "sinfo", "squeue", "scontrol", "sacct", "scancel")


def plan_slurm(spec: JobSpec, *, postprocess: bool = True):
    return scheduler_for(spec.scheduler).plan(spec, postprocess=postprocess)


def golden_spec(scheduler: str, **slurm: object) -> JobSpec:
    train = apply_overrides(TrainConfig(run_dir="/shared/runs/moe 1"),
                            ["parallel.mode=fsdp", "model.family=qwen3_moe", "steps=20", "profiler.repeat=2"])
    options = dict(job_name="moe-fsdp", partition="gpu", time_minutes=90, account="proj_a", qos="high",
                   cpus_per_task=8, mem_per_node="200G", gpus_per_node=4,
                   extra_sbatch=("--exclusive", "--constraint=h200&ib"))
    options.update(slurm)
    return JobSpec(train=train, scheduler=scheduler, nodes=2, nproc_per_node=4, python="/opt/venv/bin/python",
                   env={"NCCL_DEBUG": "WARN", "TORCHINDUCTOR_CACHE_DIR": "/shared/cache/inductor"},
                   slurm=SlurmOptions(**options))


def check_golden(name: str, text: str) -> None:
    path = GOLDEN_DIR / name
    if os.environ.get("FLEETSCOPE_UPDATE_GOLDEN") == "1":
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    assert path.exists(), f"{path} missing: run with FLEETSCOPE_UPDATE_GOLDEN=1 once"
    assert text == path.read_text(), f"{name} differs from the golden file (FLEETSCOPE_UPDATE_GOLDEN=1 to accept)"


@pytest.mark.parametrize("scheduler", ["submitit", "torchx"])
def test_dry_run_text_matches_golden_file(scheduler: str) -> None:
    check_golden(f"{scheduler}_2x4.txt", plan_slurm(golden_spec(scheduler)).render() + "\n")


def test_postprocess_job_matches_golden_file() -> None:
    spec = golden_spec("submitit")
    job = plan_postprocess_job(spec, SlurmResources.from_spec(spec))
    check_golden("postprocess.txt", job.render("1234", "/shared/runs/moe 1/logs/slurm/post.sh") + "\n" + job.script)


def test_sbatch_template_is_valid_bash() -> None:
    template = REPO_ROOT / "slurm" / "sbatch" / "fleetscope-torchrun.sbatch"
    subprocess.run(["bash", "-n", str(template)], check=True)
    text = template.read_text()
    assert "--rdzv-backend c10d" in text and "scontrol show hostnames" in text
    assert "fleetscope.cli.main postprocess" in text


@pytest.mark.parametrize("scheduler", ["submitit", "torchx"])
def test_generated_batch_scripts_are_valid_bash(scheduler: str, tmp_path: Path) -> None:
    plan = plan_slurm(golden_spec(scheduler, job_name=HOSTILE_NAME))
    for name, text in (("job.sh", plan.sbatch_script), ("post.sh", plan.postprocess.script)):
        (tmp_path / name).write_text(text)
        subprocess.run(["bash", "-n", str(tmp_path / name)], check=True)


def sbatch_lines(script: str) -> list[str]:
    return [line for line in script.splitlines() if line.startswith("#SBATCH")]


def test_hostile_job_name_stays_one_quoted_word_in_submitit_script() -> None:
    plan = plan_slurm(golden_spec("submitit", job_name=HOSTILE_NAME))
    [name_line] = [line for line in sbatch_lines(plan.sbatch_script) if "--job-name" in line]
    # sbatch reads #SBATCH lines with shell quoting: exactly one word, the name unchanged.
    assert shlex.split(name_line.removeprefix("#SBATCH ")) == [f"--job-name={HOSTILE_NAME}"]
    # Outside #SBATCH comments the name appears nowhere in the script that bash executes.
    executed = [line for line in plan.sbatch_script.splitlines() if not line.startswith("#")]
    assert not any("rm -rf" in line for line in executed)


def test_hostile_job_name_is_reduced_for_torchx_and_quoted_for_postprocess() -> None:
    plan = plan_slurm(golden_spec("torchx", job_name=HOSTILE_NAME))
    for line in sbatch_lines(plan.sbatch_script):
        assert re.search(r"--job-name=[A-Za-z0-9_.-]+-\d( |$)", line) or "hetjob" in line, line
    argv = plan.postprocess.argv("42", "/tmp/post.sh")
    assert f"--job-name={HOSTILE_NAME}-postprocess" in argv  # an argv element: no shell ever parses it
    assert shlex.split(plan.postprocess.render("42", "/tmp/post.sh")) == argv


@pytest.mark.parametrize("bad_name", ["line1\nrm -rf ~", "tab\there", "nul\x00"])
def test_control_characters_are_refused_with_the_field_named(bad_name: str) -> None:
    with pytest.raises(ConfigError, match="slurm.job_name"):
        plan_slurm(golden_spec("submitit", job_name=bad_name))


@pytest.mark.parametrize("field_name", ["partition", "account", "qos"])
def test_names_slurm_reads_unquoted_must_be_plain(field_name: str) -> None:
    with pytest.raises(ConfigError, match=f"slurm.{field_name}"):
        plan_slurm(golden_spec("torchx", **{field_name: "gpu --exclusive"}))


def test_environment_values_are_quoted_and_newlines_refused() -> None:
    spec = golden_spec("submitit")
    quoted = JobSpec(train=spec.train, scheduler="submitit", nodes=2, nproc_per_node=4, python=spec.python,
                     env={"NCCL_SOCKET_IFNAME": "ib0,ib1 $(id)"}, slurm=spec.slurm)
    assert "export NCCL_SOCKET_IFNAME='ib0,ib1 $(id)'" in plan_slurm(quoted).sbatch_script
    with pytest.raises(ConfigError, match="env NCCL_DEBUG"):
        plan_slurm(JobSpec(train=spec.train, scheduler="torchx", nodes=2, nproc_per_node=4,
                           env={"NCCL_DEBUG": "INFO\nid"}, slurm=spec.slurm))


@pytest.mark.parametrize("text, message", [
    ("--nodes=3", "set by its own flag"),
    ("--job-name=x", "set by its own flag"),
    ("-N 2", "form --name"),
    ("--constraint=a\nb", "control characters"),
])
def test_extra_sbatch_options_are_validated(text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        SbatchOption.parse(text)


def test_extra_sbatch_option_values_are_quoted() -> None:
    assert SbatchOption.parse("--constraint=h200&ib").argument() == "--constraint='h200&ib'"
    assert SbatchOption.parse("--exclusive").argument() == "--exclusive"


def test_gpus_default_to_one_per_process_except_on_cpu() -> None:
    spec = golden_spec("submitit", gpus_per_node=None)
    assert SlurmResources.from_spec(spec).gpus_per_node == 4
    cpu_train = apply_overrides(spec.train, ["performance.device=cpu"])
    cpu_spec = JobSpec(train=cpu_train, scheduler="submitit", nodes=2, nproc_per_node=4, slurm=spec.slurm)
    assert SlurmResources.from_spec(cpu_spec).gpus_per_node == 0


def write_tripwires(directory: Path, record: Path) -> None:
    """Executables named like Slurm's commands that only record that they were called."""
    for name in SLURM_COMMANDS:
        tripwire = directory / name
        tripwire.write_text(f"#!/bin/sh\necho {name} >> '{record}'\nexit 1\n")
        tripwire.chmod(tripwire.stat().st_mode | stat.S_IXUSR)


@pytest.mark.parametrize("scheduler", ["submitit", "torchx"])
def test_cli_dry_run_prints_the_plan_and_runs_no_slurm_command(scheduler: str, tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    record = tmp_path / "called.txt"
    write_tripwires(bin_dir, record)
    run_dir = tmp_path / "run"
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"}
    completed = subprocess.run(
        [sys.executable, "-m", "fleetscope.cli.main", "launch", "--scheduler", scheduler, "--nodes", "2",
         "--nproc-per-node", "2", "--device", "cpu", "--run-dir", str(run_dir), "--job-name", HOSTILE_NAME,
         "--partition", "debug", "--dry-run"],
        env=env, capture_output=True, text=True, check=False, timeout=120,
    )
    assert completed.returncode == 0, completed.stderr
    assert not record.exists(), f"the dry run called {record.read_text().split()}"
    assert not run_dir.exists(), "the dry run created the run directory"
    assert "#SBATCH" in completed.stdout and "fleetscope.trainer" in completed.stdout
    assert "postprocess" in completed.stdout


def test_scontrol_heterogeneous_job_is_parsed_per_component() -> None:
    text = (
        "JobId=14 HetJobId=14 HetJobOffset=0 JobName=x-0 JobState=FAILED Reason=NonZeroExitCode Dependency=(null) "
        "Requeue=1 Restarts=0 BatchFlag=1 ExitCode=1:0 NodeList=n1\n"
        "JobId=15 HetJobId=14 HetJobOffset=1 JobName=x-1 JobState=COMPLETED Reason=None Dependency=(null) "
        "Requeue=1 Restarts=0 BatchFlag=1 ExitCode=0:0 NodeList=n2\n"
    )
    status = SlurmJobStatus(job_id="14", components=parse_scontrol_job(text))
    assert [c.job_id for c in status.components] == ["14+0", "14+1"]
    assert status.state == "FAILED" and status.finished and not status.succeeded
    assert status.exit_code == "1:0" and status.restarts == 0


def test_sacct_states_keep_the_first_word_and_requeued_jobs_are_not_finished() -> None:
    components = parse_sacct("7|CANCELLED by 0|0:15|n[1-2]|None\n")
    assert components[0].state == "CANCELLED"
    requeued = SlurmJobStatus(job_id="8", components=parse_sacct("8|REQUEUED|0:0|n1|None\n"))
    assert not requeued.finished


@pytest.mark.parametrize("scheduler", ["submitit", "torchx"])
def test_no_post_plans_no_postprocessing_job(scheduler: str) -> None:
    plan = plan_slurm(golden_spec(scheduler), postprocess=False)
    assert plan.postprocess is None
    assert "--dependency=afterany" not in plan.render() and "no post-processing job" in plan.render()
