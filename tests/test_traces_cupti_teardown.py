"""CUPTI teardown after each profiling window (traces/cupti.py) on every rank fleetscope starts, and the report's
statement of what profiling cost a run (analysis/per_rank/profiling_cost.py)."""

from __future__ import annotations

import json

import pytest
from helpers import fleetscope

from fleetscope.analysis.inputs.records import read_run_records
from fleetscope.analysis.cross_rank.records import record_warnings
from fleetscope.analysis.per_rank.profiling_cost import median_difference, profiling_cost
from fleetscope.analysis.per_rank.trainer_records import read_rank_records
from fleetscope.cli.launch_commands import build_launch_parser
from fleetscope.cli.jobargs import job_spec_from_args
from fleetscope.launcher.schedulers import scheduler_for
from fleetscope.launcher.spec import JobSpec, SlurmOptions, UserEntry
from fleetscope.traces import cupti
from fleetscope.traces.layout import RunLayout
from fleetscope.trainer.config import TrainConfig, apply_overrides
from fleetscope.traces.formats import StepRecord, parse_step_record

SLURM = SlurmOptions(job_name="t", time_minutes=10, gpus_per_node=2)


def spec(scheduler: str = "local", *, settings: tuple[str, ...] = (), env: dict | None = None,
         user_program: bool = False) -> JobSpec:
    train = apply_overrides(TrainConfig(run_dir="/shared/runs/r"), ["profiler.wait=2", "profiler.repeat=3", *settings])
    entry = UserEntry(program="/home/u/train.py", workdir="/home/u") if user_program else None
    return JobSpec(train=train, scheduler=scheduler, nodes=1 if scheduler == "local" else 2, nproc_per_node=2,
                   env=env or {}, entry=entry, slurm=SLURM)


def rendered(job: JobSpec) -> str:
    plan = scheduler_for(job.scheduler).plan(job)
    if job.scheduler == "local":
        return plan.render()
    if job.scheduler == "submitit":
        return plan.sbatch_script
    return plan.app.roles[0].args[1]


@pytest.mark.parametrize("scheduler", ["local", "submitit", "torchx"])
@pytest.mark.parametrize("user_program", [False, True])
def test_every_rank_starts_with_cupti_teardown(scheduler, user_program):
    job = spec(scheduler, user_program=user_program)
    assert job.rank_environment()[cupti.TEARDOWN_VAR] == "1"
    text = rendered(job)
    assert "TEARDOWN_CUPTI=1" in text and "NCCL_NVLS_ENABLE=0" in text


def test_the_setting_turns_it_off_and_back_to_back_windows_never_get_it():
    assert cupti.TEARDOWN_VAR not in spec(settings=("profiler.cupti_teardown=false",)).rank_environment()
    assert cupti.TEARDOWN_VAR not in spec(settings=("profiler.wait=0",)).rank_environment()  # kineto #1554
    assert spec(settings=("profiler.wait=0", "profiler.repeat=1")).rank_environment()[cupti.TEARDOWN_VAR] == "1"


def test_a_users_own_variable_wins(monkeypatch):
    environment = spec(env={"TEARDOWN_CUPTI": "0"}).rank_environment()
    assert environment[cupti.TEARDOWN_VAR] == "0" and cupti.DEFAULT_MARK_VAR not in environment
    monkeypatch.setenv("TEARDOWN_CUPTI", "0")  # the launching shell's
    job = job_spec_from_args(build_launch_parser().parse_args(["--run-dir", "/shared/runs/x", "--steps", "20"]))
    assert job.rank_environment()[cupti.TEARDOWN_VAR] == "0"


@pytest.mark.parametrize("cuda, expected", [("12.4", "0"), ("11.8", "0"), ("12.6", "1"), ("13.0", "1"), (None, "1")])
def test_the_rank_turns_the_default_off_below_cuda_12_6(cuda, expected):
    environ = cupti.launcher_environment(enabled=True, windows_apart=True, user_env={})
    assert cupti.guard_rank_environment(cuda, environ) == expected
    users = {cupti.TEARDOWN_VAR: "1"}  # set by the user: left alone
    assert cupti.guard_rank_environment("12.4", users) == "1"


def typed(lines: list[dict]) -> list[StepRecord]:
    return [parse_step_record(line)[0] for line in lines]


def step_records(*, slower_after: float, windows=((15, 20), (25, 30)), steps: int = 60) -> list[dict]:
    profiled = {s for start, end in windows for s in range(start, end)}
    last = max(profiled)
    rows = []
    for step in range(steps):
        ms = 10.0 + 0.1 * (step % 5) + (30.0 if step == 0 else 0.0)
        ms *= (1 + slower_after) if step > last else 1.0
        ms *= 1.5 if step in profiled else 1.0
        rows.append({"step": step, "step_time_ms": ms, "profiled": step in profiled, "data_ms": 1.0 + 9 * (step in profiled),
                     "rank": 0, "loss": 1.0})
    return rows


def test_profiling_cost_compares_before_inside_and_after():
    cost = profiling_cost(typed(step_records(slower_after=0.2)))
    assert (cost.first_profiled_step, cost.last_profiled_step) == (15, 29)
    assert cost.before.steps == list(range(3, 15)) and len(cost.inside.steps) == 10 and cost.after.steps[0] == 30
    assert cost.after_vs_before.median_pct == pytest.approx(20.0, abs=1.0) and cost.after_vs_before.low_pct > 15
    assert cost.inside_vs_before.median_pct == pytest.approx(50.0, abs=1.0)
    assert profiling_cost(typed([r | {"profiled": False} for r in step_records(slower_after=0.0)])) is None


def write_metrics(tmp_path, rows) -> RunLayout:
    layout = RunLayout.at(tmp_path)
    layout.metrics_dir.mkdir(parents=True)
    layout.metrics_file(0).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return layout


def test_a_run_slower_after_its_windows_is_warned_about_and_names_cupti(tmp_path):
    records = read_rank_records(read_run_records(write_metrics(tmp_path, step_records(slower_after=0.2))), 0, set())
    warnings = record_warnings(records)
    assert any("after the last profile window" in w and "TEARDOWN_CUPTI" in w for w in warnings), warnings


def test_no_warning_when_steps_after_cost_what_steps_before_cost(tmp_path):
    records = read_rank_records(read_run_records(write_metrics(tmp_path, step_records(slower_after=0.0))), 0, set())
    assert not [w for w in record_warnings(records) if "profile window" in w]
    assert records.profiling.after_vs_before.low_pct <= 0 <= records.profiling.after_vs_before.high_pct


def test_input_share_leaves_out_step_0_and_profiled_steps(tmp_path):
    records = read_rank_records(read_run_records(write_metrics(tmp_path, step_records(slower_after=0.0))), 0, set())
    assert records.input.mean_data_ms == pytest.approx(1.0)  # profiled steps wait 10 ms: left out
    assert records.input.steps == 60 - 1 - 10 and "left out" in records.input.basis
    assert len(records.input.recorded_steps) == 60


def test_median_difference_resamples_runs():
    same = median_difference([[10.0, 10.1, 9.9]] * 3, [[10.0, 10.05, 9.95]] * 3)
    assert same.low_pct <= 0 <= same.high_pct
    apart = median_difference([[10.0], [20.0], [30.0]], [[20.0], [20.0], [20.0]])
    assert apart.low_pct < -40 and apart.high_pct > 40  # between-run spread shows in the interval
    assert median_difference([], [[1.0]]) is None


def test_a_launched_rank_sees_the_teardown_setting(tmp_path):
    """A real local launch (torchrun, one rank): the program finds TEARDOWN_CUPTI=1 in its own environment."""
    probe = tmp_path / "probe.py"
    probe.write_text("import json, os, pathlib\n"
                     "pathlib.Path(os.environ['FLEETSCOPE_RUN_DIR'], 'env.json').write_text(json.dumps(\n"
                     "    {k: os.environ.get(k) for k in ('TEARDOWN_CUPTI', 'FLEETSCOPE_CUPTI_TEARDOWN')}))\n")
    run = tmp_path / "run"
    completed = fleetscope("launch", "--run-dir", str(run), "--nproc-per-node", "1", "--device", "cpu",
                           "--no-post", "--", "python", str(probe), cwd=tmp_path)
    assert completed.returncode == 0, completed.stderr[-2000:]
    assert json.loads((run / "env.json").read_text()) == {"TEARDOWN_CUPTI": "1", "FLEETSCOPE_CUPTI_TEARDOWN": "1"}
