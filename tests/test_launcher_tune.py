"""`fleetscope tune`: the relaunch planner (job.json spec + a finding's change -> the new job), its refusals,
and a real round trip on 2 gloo ranks: a deliberately tiny DDP bucket -> `advise` asks for larger buckets ->
`tune --apply` relaunches with them -> the step time is lower."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from fleetscope.analysis.advise import Change, Finding
from fleetscope.analysis.gate import MetricGate, direction
from fleetscope.cli.main import main
from fleetscope.cli.tune_command import pick_finding
from fleetscope.launcher.relaunch import job_spec_from_record, plan_relaunch
from fleetscope.launcher.spec import JobSpec, SlurmOptions, UserEntry, spec_record
from fleetscope.traces.jobfile import write_job_record
from fleetscope.traces.layout import RunLayout
from fleetscope.trainer.config import ConfigError, TrainConfig, apply_overrides


def _spec(run_dir: Path, *assignments: str, **job) -> JobSpec:
    train = apply_overrides(TrainConfig(run_dir=str(run_dir)), ["performance.device=cpu", "seed=7", "steps=14",
                                                                 "profiler.active=3", *assignments])
    return JobSpec(train=train, **job)


def _recorded(spec: JobSpec) -> dict:
    """The spec as job.json holds it (through JSON: tuples come back as lists)."""
    return json.loads(json.dumps(spec_record(spec)["spec"]))


# --- planning ------------------------------------------------------------------------------------


def test_the_record_gives_back_the_launched_spec(tmp_path):
    spec = _spec(tmp_path / "run", "parallel.bucket_cap_mb=0.5", scheduler="submitit", nodes=2, nproc_per_node=4,
                 env={"NCCL_DEBUG": "INFO"}, slurm=SlurmOptions(partition="gpu", extra_sbatch=("--exclusive",)))
    assert job_spec_from_record(_recorded(spec)) == spec
    program = UserEntry(program="/opt/train.py", args=("--lr", "1e-3"), workdir="/opt")
    train = apply_overrides(TrainConfig(run_dir=str(tmp_path / "run")), ["performance.device=cpu", "profiler.active=3"])
    entry = JobSpec(train=train, entry=program)
    assert job_spec_from_record(_recorded(entry)) == entry
    # a user program's record holds no trainer configuration that did not run (model, parallel, data, ...)
    record = spec_record(entry)
    assert set(record["spec"]["train"]) == {"run_dir", "profiler", "performance"}
    assert record["program"]["argv"][-3:] == ["/opt/train.py", "--lr", "1e-3"]


def test_the_change_then_the_users_settings_are_applied_over_the_same_job(tmp_path):
    source = tmp_path / "run"
    recorded = _recorded(_spec(source, "parallel.bucket_cap_mb=0.00001", env={"NCCL_DEBUG": "INFO"}))
    relaunch = plan_relaunch(recorded, source_run=source, new_run_dir=tmp_path / "new",
                             train_args=("--set", "parallel.bucket_cap_mb=25", "--compile", "default"),
                             env=(("PYTORCH_ALLOC_CONF", "expandable_segments:True"),),
                             overrides=["parallel.bucket_cap_mb=50"])
    train = relaunch.spec.train
    assert train.parallel.bucket_cap_mb == 50.0 and train.performance.compile == "default"   # later --set wins
    assert (train.seed, train.steps, train.profiler.active, train.performance.device) == (7, 14, 3, "cpu")
    assert train.run_dir == str(tmp_path / "new") and relaunch.spec.nproc_per_node == 2
    assert relaunch.spec.env == {"NCCL_DEBUG": "INFO", "PYTORCH_ALLOC_CONF": "expandable_segments:True"}
    assert relaunch.record(finding=2) == {
        "run": str(source), "finding": 2, "env": {"PYTORCH_ALLOC_CONF": "expandable_segments:True"},
        "assignments": ["performance.compile=default", "parallel.bucket_cap_mb=25", "parallel.bucket_cap_mb=50"]}


@pytest.mark.parametrize("change, message", [
    (dict(env=(("lower_case", "1"),)), "not an environment variable name"),
    (dict(env=(("NCCL-DEBUG", "1"),)), "not an environment variable name"),
    (dict(env=(("1X", "1"),)), "not an environment variable name"),
    (dict(env=(("NCCL_DEBUG", "INFO\nrm -rf /"),)), "control characters"),
    (dict(train_args=("--run-dir", "/elsewhere")), "unrecognized arguments"),
    (dict(train_args=("--steps", "many")), "invalid int"),
    (dict(train_args=("--set", "parallel.no_such_knob=1")), "unknown setting"),
    (dict(train_args=("--set", "parallel.bucket_cap_mb=0")), "must be > 0"),
    (dict(train_args=("--set", "data.path=a\x1b[2Jb")), "control characters"),
])
def test_a_change_that_cannot_apply_is_refused_naming_why(tmp_path, change, message):
    with pytest.raises(ConfigError, match=message):
        plan_relaunch(_recorded(_spec(tmp_path / "run")), source_run=tmp_path / "run", new_run_dir=tmp_path / "new",
                      **change)


def test_the_new_run_is_never_the_tuned_run_nor_inside_it(tmp_path):
    recorded = _recorded(_spec(tmp_path / "run"))
    for target in (tmp_path / "run", tmp_path / "run" / "again"):
        with pytest.raises(ConfigError, match="the run being tuned"):
            plan_relaunch(recorded, source_run=tmp_path / "run", new_run_dir=target)


def test_a_record_this_version_cannot_relaunch_is_refused(tmp_path):
    recorded = _recorded(_spec(tmp_path / "run"))
    with pytest.raises(ConfigError, match="spec.train.parallel.warp_drive: not a setting"):
        job_spec_from_record({**recorded, "train": {**recorded["train"], "parallel": {
            **recorded["train"]["parallel"], "warp_drive": 1}}})
    with pytest.raises(ConfigError, match="spec.nproc_per_node: expected int"):
        job_spec_from_record({**recorded, "nproc_per_node": "2"})
    with pytest.raises(ConfigError, match="spec.scheduler: must be one of"):
        job_spec_from_record({**recorded, "scheduler": "cron"})


def test_change_values_reach_the_command_line_quoted(tmp_path):
    from fleetscope.launcher.schedulers.local import plan_local
    from fleetscope.launcher.slurm_request import export_lines

    relaunch = plan_relaunch(_recorded(_spec(tmp_path / "run")), source_run=tmp_path / "run",
                             new_run_dir=tmp_path / "new", env=(("NCCL_ALGO", "Ring; touch /tmp/x 'q'"),))
    quoted = "NCCL_ALGO='Ring; touch /tmp/x '\"'\"'q'\"'\"''"
    assert quoted in plan_local(relaunch.spec).render()
    assert f"export {quoted}" in export_lines(relaunch.spec.rank_environment())


def test_a_users_own_program_takes_environment_changes_only(tmp_path):
    entry = UserEntry(program="/opt/train.py", workdir="/opt")
    recorded = _recorded(_spec(tmp_path / "run", entry=entry))
    env_only = plan_relaunch(recorded, source_run=tmp_path / "run", new_run_dir=tmp_path / "new",
                             env=(("PYTORCH_ALLOC_CONF", "expandable_segments:True"),))
    assert env_only.spec.entry == entry and env_only.spec.env["PYTORCH_ALLOC_CONF"] == "expandable_segments:True"
    with pytest.raises(ConfigError, match="runs its own program"):
        plan_relaunch(recorded, source_run=tmp_path / "run", new_run_dir=tmp_path / "new",
                      train_args=("--set", "data.num_workers=8"))


def test_findings_are_picked_by_number_or_rule_and_must_carry_a_change(tmp_path):
    def finding(rule, apply):
        return Finding(rule=rule, title=rule, evidence={}, expected_gain_ms=None, expected_gain_pct=None,
                       confidence="low", change="replace the GPU", why="", apply=apply)

    knob = Change(train_args=("--set", "data.num_workers=8"))
    findings = [finding("straggler", None), finding("data_workers", knob)]
    assert pick_finding(findings, "2", tmp_path)[0] == 2
    assert pick_finding(findings, "data_workers", tmp_path) == (2, findings[1])
    from fleetscope.traces.validate import UsageError
    for wanted, message in (("1", "not a setting a relaunch can change; do it by hand: replace the GPU"),
                            ("3", "no such finding .*1. straggler; 2. data_workers"), ("0", "no such finding"),
                            ("allocator", "no finding of that rule"), ("../x", "expected a finding number")):
        with pytest.raises(UsageError, match=message):
            pick_finding(findings, wanted, tmp_path)


def test_direction_says_which_way_a_metric_moved():
    def gate(interval, higher_is_better=False):
        return MetricGate(name="m", higher_is_better=higher_is_better, base_median=1.0, new_median=1.0, base_steps=9,
                          new_steps=9, change_pct=sum(interval) / 2, interval_pct=interval, gated=True)

    assert direction(gate((-60.0, -40.0))) == "gain" and direction(gate((20.0, 40.0))) == "loss"
    assert direction(gate((20.0, 40.0), higher_is_better=True)) == "gain"
    assert direction(gate((-5.0, 3.0))) == "unclear"
    assert direction(dataclasses.replace(gate((-60.0, -40.0)), gated=False)) == "unclear"
    assert direction(gate((-0.5, -0.01))) == "unclear"           # -0.3%: below the practical threshold


def test_the_prediction_is_printed_against_what_the_relaunch_measured():
    from fleetscope.analysis.advise import Finding
    from fleetscope.analysis.gate import GateResult
    from fleetscope.cli.tune_command import prediction_line

    finding = Finding(rule="data_workers", title="t", evidence={}, expected_gain_ms=30.0, expected_gain_pct=30.0,
                      confidence="high", change="c", why="w")
    step = MetricGate(name="step_time_ms", higher_is_better=False, base_median=100.0, new_median=88.0, base_steps=9,
                      new_steps=9, gated=True)
    line = prediction_line(finding, GateResult(base_runs=["a"], new_runs=["b"], threshold_pct=5.0, metrics=[step]))
    assert line.startswith("prediction: finding data_workers expected up to 30.00 ms/step; measured: step time "
                           "100.00 -> 88.00 ms (saved 12.00 ms/step, 40% of the prediction")
    none = prediction_line(finding, GateResult(base_runs=["a"], new_runs=["b"], threshold_pct=5.0))
    assert "measured: no step time on both sides" in none


# --- the command on a run directory without a job --------------------------------------------------


def _run_with_slow_data(tmp_path: Path) -> Path:
    """A recorded run whose step metrics show data loading taking 30 of 100 ms (no traces)."""
    run = tmp_path / "run"
    layout = RunLayout.at(run)
    run.mkdir()
    write_job_record(layout, **spec_record(_spec(run)))
    layout.metrics_dir.mkdir()
    for rank in (0, 1):
        lines = [dict(step=step, rank=rank, loss=1.0, step_time_ms=100.0, data_ms=30.0, forward_ms=30.0,
                      backward_ms=30.0, optimizer_ms=10.0, tokens_per_s=100.0, profiled=False) for step in range(6)]
        (layout.metrics_dir / f"rank{rank}.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    return run


def test_dry_run_prints_the_change_and_the_exact_command_and_launches_nothing(tmp_path, capsys):
    run = _run_with_slow_data(tmp_path)
    assert main(["tune", str(run), "--apply", "1", "--dry-run", "--set", "data.prefetch_factor=4"]) == 0
    out = capsys.readouterr().out
    assert "finding 1 (data_workers)" in out and f"into {tmp_path / 'run-tune-data_workers'}" in out
    assert "--set data.num_workers=8 --set data.persistent_workers=true --set data.prefetch_factor=4" in out
    assert "torch.distributed.run" in out and "--set seed=7" in out and "--steps 14" in out
    assert not (tmp_path / "run-tune-data_workers").exists()


def test_refusals_name_the_reason_and_touch_nothing(tmp_path, capsys):
    run = _run_with_slow_data(tmp_path)
    occupied = tmp_path / "occupied"
    occupied.mkdir()
    (occupied / "notes.txt").write_text("mine")
    assert main(["tune", str(run), "--apply", "1", "--run-dir", str(occupied)]) == 2
    assert "not an empty directory" in capsys.readouterr().err and (occupied / "notes.txt").read_text() == "mine"
    assert main(["tune", str(run), "--apply", "4", "--dry-run"]) == 2
    assert "no such finding" in capsys.readouterr().err
    traces_only = tmp_path / "other_trainer"
    traces_only.mkdir()
    (traces_only / "rank0_trace.json").write_text("{}")
    assert main(["tune", str(traces_only), "--apply", "1"]) == 2
    assert "has no job.json" in capsys.readouterr().err
    assert main(["tune", str(tmp_path / "absent"), "--apply", "1"]) == 2
    assert "no such run directory" in capsys.readouterr().err


# --- ground truth: a real round trip --------------------------------------------------------------

TINY_BUCKET_MB = 0.00001
"""10 bytes: every gradient tensor of the tiny model (25, of 0.72 MiB together) is its own bucket, so each step
makes 25 gloo all-reduces instead of DDP's default 1; on 2 loaded CPU cores that takes the step from ~15 to
~40 ms (measured at load average 7), a change that no load swamps."""


@pytest.mark.slow
def test_a_tiny_bucket_is_advised_larger_and_the_relaunch_is_faster(tmp_path, capsys):
    from helpers import fleetscope

    from fleetscope.analysis.advise import advise

    run = tmp_path / "tiny_bucket"
    completed = fleetscope("launch", "--nproc-per-node", "2", "--run-dir", str(run), "--parallel", "ddp", "--device",
                           "cpu", "--steps", "14",
                           "--batch-size", "2", "--seq-len", "32", "--profile", "wait=1,warmup=1,active=2,repeat=1",
                           "--set", f"parallel.bucket_cap_mb={TINY_BUCKET_MB:g}", timeout=600)
    assert completed.returncode == 0, completed.stderr[-4000:]
    findings = advise(run).findings
    number = next(i for i, f in enumerate(findings, 1) if f.rule == "gradient_buckets")
    buckets = findings[number - 1]
    assert buckets.apply.train_args == ("--set", "parallel.bucket_cap_mb=25")        # larger, not halved
    assert buckets.evidence["buckets_per_step"] == 25 and buckets.evidence["mean_bucket_mb"] < 0.1

    new = tmp_path / "default_bucket"
    code = main(["tune", str(run), "--apply", str(number), "--run-dir", str(new)])
    out = capsys.readouterr().out
    assert code == 0, out[-4000:]                                    # no regression: the gate's exit code
    assert "prediction: finding gradient_buckets expected up to" in out and "measured: step time" in out
    job = json.loads((new / "job.json").read_text())
    assert job["tuned_from"]["run"] == str(run) and job["tuned_from"]["finding"] == number
    assert job["tuned_from"]["assignments"] == ["parallel.bucket_cap_mb=25"]
    assert job["spec"]["train"]["parallel"]["bucket_cap_mb"] == 25.0
    assert job["spec"]["train"]["seed"] == 0 and job["spec"]["train"]["steps"] == 14
    old = json.loads((run / "job.json").read_text())
    assert {k: v for k, v in job["spec"]["train"].items() if k not in ("run_dir", "parallel")} == \
        {k: v for k, v in old["spec"]["train"].items() if k not in ("run_dir", "parallel")}

    from fleetscope.analysis.gate import gate
    step_time = next(m for m in gate([run], [new]).metrics if m.name == "step_time_ms")
    assert step_time.new_median < step_time.base_median                # the direction, by medians
    assert "step_time_ms:" in out and "lower is better" in out
    rows = [json.loads(line) for line in (new / "metrics" / "rank0.jsonl").read_text().splitlines()]
    assert all(row["comm_buckets"] == 1 for row in rows)               # the change took effect


def test_a_relaunch_the_launch_would_refuse_is_refused_before_anything_starts(tmp_path, capsys):
    # the finding's change plus the user's --set ends the run before its first window: launch refuses it, so does tune
    run = _run_with_slow_data(tmp_path)
    assert main(["tune", str(run), "--apply", "1", "--dry-run", "--set", "steps=3",
                 "--set", "profiler.wait=5"]) == 2
    err = capsys.readouterr().err
    assert "after the run's last step 2" in err and "raise --steps" in err
    assert not (tmp_path / "run-tune-data_workers").exists()
