"""Untrusted text never becomes a command: control characters are refused naming the field, every other
value reaches the processes verbatim. The generated scripts are executed with bash under recording stand-ins
for srun/scontrol/python (they only record their argv and environment, and start the command srun was
given), so a value that escaped its quoting would leave a PWNED file. No Slurm, no torch: seconds.
"""

from __future__ import annotations

import json
import os
import shlex
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from fleetscope.cli.main import main
from fleetscope.launcher.schedulers import scheduler_for
from fleetscope.launcher.schedulers.slurm import SBATCH_TEMPLATE, SlurmRunStatus, record_status
from fleetscope.launcher.spec import JobSpec, SlurmOptions
from fleetscope.trainer.config import TrainConfig, apply_overrides
from fleetscope.traces.jobfile import read_job_record, write_job_record
from fleetscope.traces.layout import RunLayout

SCHEDULERS = ("local", "submitit", "torchx", "torchx_local")
LINE_BREAKERS = ("\n", "\r", "\t", "\x00", "\x1b", "\x7f", "\x85", "\u2028", "\u2029")
HOSTILE = "$(touch PWNED) `touch PWNED` ; touch PWNED && 'q' \"d\" * ? [ab] ~ ü ☃"
SLURM_NAME = "gpu.a+b:c-d_1"
"""Partition, account and qos are read by Slurm unquoted: only this alphabet is allowed there."""


def exit_status(argv: list[str], capsys) -> tuple[int, str]:
    """`fleetscope ARGV` in this process: its exit status and stderr (argparse exits via SystemExit)."""
    try:
        status = main(argv)
    except SystemExit as exited:
        status = exited.code
    return status, capsys.readouterr().err


# --- (a) control characters: exit 2, naming the field -------------------------------------------------------

FIELD_FLAGS = [
    # (field named in the error, flags carrying the bad text in place of {bad})
    ("run_dir", ["--run-dir", "/tmp/fs-runs/a{bad}b"]),
    ("runs_root", ["--runs-root", "/tmp/fs-runs{bad}x"]),
    ("python", ["--python", "/opt/venv{bad}/bin/python"]),
    ("env NCCL_DEBUG", ["--env", "NCCL_DEBUG=INFO{bad}id"]),
    ("slurm.job_name", ["--job-name", "moe{bad}touch PWNED"]),
    ("slurm.partition", ["--partition", "gpu{bad}x"]),
    ("slurm.account", ["--account", "a{bad}b"]),
    ("slurm.qos", ["--qos", "high{bad}x"]),
    ("slurm.mem_per_node", ["--mem", "200{bad}G"]),
    ("slurm.extra_sbatch", ["--sbatch-opt", "--constraint=h200{bad}touch PWNED"]),
    ("data.path", ["--set", "data.path=/data/x{bad}y.txt"]),
    ("performance.alloc_conf", ["--set", "performance.alloc_conf=expandable_segments:{bad}True"]),
]


def dry_run_argv(scheduler: str, flags: list[str]) -> list[str]:
    argv = ["launch", "--dry-run", "--scheduler", scheduler, "--device", "cpu", "--nproc-per-node", "1"]
    if "--run-dir" not in flags and "--runs-root" not in flags:
        argv += ["--run-dir", "/tmp/fs-runs/plain"]
    return argv + flags


@pytest.mark.parametrize("scheduler", SCHEDULERS)
@pytest.mark.parametrize("field_name, flags", FIELD_FLAGS, ids=[name for name, _ in FIELD_FLAGS])
def test_a_newline_in_any_field_exits_2_naming_it(scheduler, field_name, flags, capsys):
    status, stderr = exit_status(dry_run_argv(scheduler, [flag.format(bad="\n") for flag in flags]), capsys)
    assert status == 2, stderr
    assert f"{field_name}: must not contain control characters" in stderr
    assert not Path("/tmp/fs-runs").exists()


@pytest.mark.parametrize("scheduler", SCHEDULERS)
@pytest.mark.parametrize("bad", LINE_BREAKERS, ids=[f"U+{ord(c):04X}" for c in LINE_BREAKERS])
def test_every_control_character_and_line_separator_is_refused(scheduler, bad, capsys):
    status, stderr = exit_status(dry_run_argv(scheduler, ["--run-dir", f"/tmp/fs-runs/a{bad}b"]), capsys)
    assert status == 2 and "run_dir: must not contain control characters" in stderr


def test_plain_unicode_and_shell_characters_are_accepted(capsys):
    status, stderr = exit_status(dry_run_argv("submitit", ["--job-name", HOSTILE, "--env", f"X={HOSTILE}"]), capsys)
    assert status == 0, stderr


# --- (b) the generated scripts, executed -----------------------------------------------------------------

RECORDER = '''#!{python}
"""Stand-in for {name}: records its argv and the hostile environment variable, then acts like {name}."""
import json, os, subprocess, sys
name = {name!r}
with open(os.environ["FS_RECORD"], "a") as record:
    record.write(json.dumps({{"name": name, "argv": sys.argv[1:], "env": os.environ.get("FS_HOSTILE")}}) + "\\n")
if name == "scontrol":
    print("n1")
if name == "srun":
    # srun starts its command on every node: here once per heterogeneous component (":" separates them)
    components, current, args = [], [], iter(sys.argv[1:])
    for arg in args:
        if arg == ":":
            components.append(current)
            current = []
        elif current or not arg.startswith("-"):
            current.append(arg)
        elif arg in ("--output", "--error"):
            next(args)
    components.append(current)
    for command in components:
        env = dict(os.environ, SLURM_JOB_NODELIST_HET_GROUP_0="n1")
        if subprocess.run(command, env=env).returncode:
            sys.exit(1)
'''


@pytest.fixture
def shims(tmp_path: Path) -> dict:
    """srun and scontrol first on PATH, a python at a hostile path, the record file, an empty working dir."""
    bin_dir = tmp_path / "bin"
    python_dir = tmp_path / f"venv {HOSTILE}" / "bin"
    for directory, name in ((bin_dir, "srun"), (bin_dir, "scontrol"), (python_dir, "python")):
        directory.mkdir(parents=True, exist_ok=True)
        shim = directory / name
        shim.write_text(RECORDER.format(python=sys.executable, name=name))
        shim.chmod(shim.stat().st_mode | stat.S_IXUSR)
    work = tmp_path / "work"
    work.mkdir()
    record = tmp_path / "record.jsonl"
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "FS_RECORD": str(record),
           "SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n1", "SLURM_JOB_NUM_NODES": "1"}
    return {"env": env, "record": record, "work": work, "python": str(python_dir / "python"), "root": tmp_path}


def run_script(text: str, shims: dict, *args: str, env: dict | None = None) -> list[dict]:
    script = shims["root"] / "script.sh"
    script.write_text(text)
    completed = subprocess.run(["bash", str(script), *args], cwd=shims["work"], env={**shims["env"], **(env or {})},
                               capture_output=True, text=True, timeout=60)
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert_not_pwned(shims["root"])
    return [json.loads(line) for line in shims["record"].read_text().splitlines()]


def assert_not_pwned(root: Path) -> None:
    assert not list(root.rglob("PWNED")), "a hostile value ran as a command"


def hostile_spec(scheduler: str, shims: dict) -> JobSpec:
    run_dir = shims["root"] / f"runs {HOSTILE}" / "moe 1"
    train = apply_overrides(TrainConfig(run_dir=str(run_dir)),
                            [f"data.path=/data/{HOSTILE}.txt", "data.source=text", "steps=3"])
    slurm = SlurmOptions(job_name=HOSTILE, partition=SLURM_NAME, account=SLURM_NAME, qos=SLURM_NAME,
                         extra_sbatch=(f"--comment={HOSTILE}", "--exclusive"))
    return JobSpec(train=train, scheduler=scheduler, nodes=1, nproc_per_node=2, python=shims["python"],
                   env={"FS_HOSTILE": HOSTILE}, slurm=slurm)


def trainer_args(argv: list[str]) -> list[str]:
    return argv[argv.index("fleetscope.trainer") + 1:]


def expected_trainer_args(spec: JobSpec) -> list[str]:
    from fleetscope.trainer.config import train_argv

    return train_argv(spec.train)


def test_sbatch_template_passes_hostile_run_dir_and_args_verbatim(shims):
    run_dir = str(shims["root"] / f"runs {HOSTILE}" / "-moe 1")
    user_args = ["--set", f"data.path=/data/{HOSTILE}", HOSTILE, "--steps", "3"]
    records = run_script(SBATCH_TEMPLATE.read_text(), shims, run_dir, *user_args,
                         env={"FLEETSCOPE_PYTHON": shims["python"], "FS_HOSTILE": HOSTILE})
    [srun] = [r for r in records if r["name"] == "srun"]
    assert srun["argv"][2] == shims["python"]
    assert srun["argv"][srun["argv"].index("--run-dir") + 1] == run_dir
    assert trainer_args(srun["argv"])[2:] == user_args
    pythons = [r["argv"] for r in records if r["name"] == "python"]
    assert pythons[0][:3] == ["-m", "torch.distributed.run", "--nnodes"]
    assert pythons[-1] == ["-m", "fleetscope.cli.main", "postprocess", run_dir]
    assert all(r["env"] == HOSTILE for r in records)
    assert Path(run_dir, "logs").is_dir()


def test_submitit_script_runs_every_value_verbatim(shims):
    spec = hostile_spec("submitit", shims)
    plan = scheduler_for("submitit").plan(spec)
    records = run_script(plan.sbatch_script, shims)
    [srun, python] = records
    assert srun["argv"][srun["argv"].index("--output") + 1] == f"{plan.folder}/%j_%t_log.out"
    assert python["argv"] == ["-u", "-m", "submitit.core._submit", plan.folder]
    assert python["env"] == HOSTILE
    # the trainer's arguments travel pickled with the task, never through a shell
    assert plan.rank_task.trainer_argv == expected_trainer_args(spec)
    assert_sbatch_lines_read_back(plan.sbatch_script, {"--job-name": HOSTILE, "--partition": SLURM_NAME,
                                                       "--account": SLURM_NAME, "--qos": SLURM_NAME,
                                                       "--comment": HOSTILE})


def assert_sbatch_lines_read_back(script: str, expected: dict[str, str]) -> None:
    """sbatch reads `#SBATCH` lines with shell quoting: each option must come back as one verbatim word."""
    words = [word for line in script.splitlines() if line.startswith("#SBATCH")
             for word in shlex.split(line.removeprefix("#SBATCH"))]
    options = dict(word.split("=", 1) for word in words if "=" in word)
    for option, value in expected.items():
        assert options[option] == value, option


def test_torchx_script_runs_every_value_verbatim(shims):
    spec = hostile_spec("torchx", shims)
    plan = scheduler_for("torchx").plan(spec)
    records = run_script(plan.sbatch_script, shims)
    torchruns = [r for r in records if r["name"] == "python"]
    assert len(torchruns) == spec.nodes
    for record in torchruns:
        argv = record["argv"]
        assert argv[:2] == ["-m", "torch.distributed.run"]
        assert argv[argv.index("--rdzv-id") + 1] == "7"  # TorchX's macro, filled in by the batch shell
        assert argv[argv.index("--rdzv-endpoint") + 1] == "n1:29500"
        assert argv[argv.index("--log-dir") + 1] == str(RunLayout.at(spec.train.run_dir).logs_dir / "torchx-node0")
        assert trainer_args(argv) == expected_trainer_args(spec)
        assert record["env"] == HOSTILE
    assert_sbatch_lines_read_back(plan.sbatch_script, {"--account": SLURM_NAME, "--qos": SLURM_NAME,
                                                       "--partition": SLURM_NAME, "--comment": HOSTILE})


@pytest.mark.parametrize("scheduler", ["submitit", "torchx"])
def test_postprocess_script_and_command_keep_values_verbatim(scheduler, shims):
    spec = hostile_spec(scheduler, shims)
    plan = scheduler_for(scheduler).plan(spec)
    [python] = run_script(plan.postprocess.script, shims)
    assert python["argv"] == ["-m", "fleetscope.cli.main", "postprocess", str(plan.run_dir)]
    argv = plan.postprocess.argv("42", f"/tmp/{HOSTILE}.sh")
    assert shlex.split(plan.postprocess.render("42", f"/tmp/{HOSTILE}.sh")) == argv
    assert f"--job-name={HOSTILE}-postprocess" in argv and argv[-1] == f"/tmp/{HOSTILE}.sh"


def test_torchx_local_command_runs_every_value_verbatim(shims):
    spec = hostile_spec("torchx_local", shims)
    plan = scheduler_for("torchx_local").plan(spec)
    for replicas in plan.dryrun_info.request.role_params.values():
        for replica in replicas:
            # local_cwd puts its working directory in front of PATH when it starts the replica
            env = {**shims["env"], **replica.env, "PATH": f"{replica.env['PATH']}{os.pathsep}{shims['env']['PATH']}"}
            completed = subprocess.run(replica.args, cwd=shims["work"], env=env, capture_output=True, text=True,
                                       timeout=60)
            assert completed.returncode == 0, completed.stderr
    assert_not_pwned(shims["root"])
    [record] = [json.loads(line) for line in shims["record"].read_text().splitlines()]
    assert record["argv"][:2] == ["-m", "torch.distributed.run"]
    assert trainer_args(record["argv"]) == expected_trainer_args(spec)
    assert record["env"] == HOSTILE


def test_local_command_line_parses_back_to_the_hostile_values(shims):
    spec = hostile_spec("local", shims)
    plan = scheduler_for("local").plan(spec)
    words = shlex.split(plan.render())
    assert words[:len(plan.env)] == [f"{name}={value}" for name, value in sorted(plan.env.items())]
    assert words[len(plan.env):] == plan.argv and plan.argv[0] == shims["python"]
    assert trainer_args(plan.argv) == expected_trainer_args(spec)


# --- run directories, recorded statuses, usage errors -------------------------------------------------------

@pytest.mark.parametrize("existing", ["traces", "report", "manifest.json"])
@pytest.mark.parametrize("resume", [False, True])
def test_launch_never_writes_into_a_directory_holding_an_unrecorded_run(existing, resume, tmp_path, capsys):
    run = tmp_path / "run"
    (run / "traces").mkdir(parents=True) if existing == "traces" else None
    (run / "report").mkdir(parents=True) if existing == "report" else None
    if existing == "manifest.json":
        run.mkdir()
        (run / "manifest.json").write_text("{}")
    before = sorted(p.name for p in run.iterdir())
    argv = ["launch", "--run-dir", str(run), "--steps", "1", "--device", "cpu", *(["--resume"] if resume else [])]
    status, stderr = exit_status(argv, capsys)
    assert status == 2 and existing in stderr and "no job.json" in stderr
    assert sorted(p.name for p in run.iterdir()) == before


def forgotten_status(layout: RunLayout, recorded: str) -> SlurmRunStatus:
    return SlurmRunStatus(run_dir=layout.root, scheduler="submitit", job_id="7", postprocess_job_id="",
                          training=None, postprocess=None, recorded_status=recorded)


@pytest.mark.parametrize("recorded, state, verdict", [
    ("completed", "COMPLETED", "ok"), ("failed", "FAILED", "failed"), ("cancelled", "CANCELLED", "failed"),
    ("succeeded", "COMPLETED", "ok"),
])
def test_a_final_status_survives_slurm_forgetting_the_job(recorded, state, verdict, tmp_path):
    from fleetscope.cli.render import render_status

    layout = RunLayout.at(tmp_path)
    write_job_record(layout, scheduler="submitit", job_id="7", status=recorded)
    status = forgotten_status(layout, recorded)
    record_status(layout, status)
    assert read_job_record(layout)["status"] == recorded
    assert status.state == state and status.verdict.value == verdict
    assert "Slurm no longer knows the job" in render_status(status)


def test_a_job_slurm_forgot_before_it_ended_is_unknown(tmp_path):
    layout = RunLayout.at(tmp_path)
    write_job_record(layout, scheduler="submitit", job_id="7", status="submitted")
    status = forgotten_status(layout, "submitted")
    record_status(layout, status)
    assert status.state == "UNKNOWN" and read_job_record(layout)["status"] == "unknown"


@pytest.mark.parametrize("argv", [
    ["launch", "--scheduler", "slurm"], ["launch", "--nodes", "x"], ["launch", "--nodes", "0", "--dry-run"],
    ["launch", "--sbatch-opt", "-N 2", "--scheduler", "submitit", "--nproc-per-node", "2", "--dry-run"],
    ["launch", "--env", "1BAD=x", "--dry-run"], ["launch", "--time", "0", "--dry-run"],
    ["status"], ["status", "{tmp}/not-a-run"], ["logs", "{tmp}/not-a-run"], ["logs", "{tmp}/local", "--tail", "-1"],
    ["cancel", "{tmp}/not-a-run"], ["cancel", "{tmp}/local"],
    ["compare", "{tmp}/missing", "{tmp}/local"], ["compare", "{tmp}/local", "{tmp}/local", "--threshold", "-1"],
    ["compare", "{tmp}/local"], [],
])
def test_bad_usage_exits_2(argv, tmp_path, capsys):
    write_job_record(RunLayout.at(tmp_path / "local"), scheduler="local", status="succeeded")
    status, stderr = exit_status([arg.format(tmp=tmp_path) for arg in argv], capsys)
    assert status == 2, stderr


def test_launch_into_a_file_is_a_usage_error(tmp_path, capsys):
    target = tmp_path / "notes.txt"
    target.write_text("mine\n")
    status, stderr = exit_status(["launch", "--run-dir", str(target), "--steps", "1", "--device", "cpu"], capsys)
    assert status == 2 and "is not a directory" in stderr
    assert target.read_text() == "mine\n"
