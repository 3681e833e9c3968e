"""Typed configuration: overrides, round trips through the command line, errors that name the field."""

from __future__ import annotations

import pytest

from fleetscope.launcher.spec import JobSpec
from fleetscope.trainer.config import (
    ConfigError,
    TrainConfig,
    apply_overrides,
    parse_train_args,
    train_argv,
)
from fleetscope.trainer.profiling import Window, plan_windows


def test_command_line_round_trips_every_changed_field():
    config = parse_train_args([
        "--run-dir", "/runs/a b", "--model", "mixtral", "--parallel", "fsdp_tp", "--tp", "2", "--steps", "7",
        "--profile", "wait=2,active=3", "--set", "optim.lr=0.001", "--set", "data.source=text",
        "--set", "data.path=/data/corpus.txt", "--set", "performance.compile=max-autotune-no-cudagraphs",
    ])
    assert config.model.family == "mixtral" and config.parallel.tp == 2 and config.profiler.active == 3
    assert parse_train_args(train_argv(config)) == config


def test_defaults_render_to_the_minimal_command_line():
    assert train_argv(TrainConfig(run_dir="/r")) == ["--run-dir", "/r", "--steps", "10"]


def test_assignment_order_does_not_matter_for_validation():
    one = apply_overrides(TrainConfig(run_dir="/r"), ["parallel.tp=2", "parallel.mode=tp"])
    other = apply_overrides(TrainConfig(run_dir="/r"), ["parallel.mode=tp", "parallel.tp=2"])
    assert one == other


@pytest.mark.parametrize("assignments, field", [
    (["steps=-1"], "steps:"),
    (["model.family=llama"], "model.family:"),
    (["model.preset=huge"], "model.preset:"),
    (["parallel.tp=2"], "parallel.tp:"),
    (["parallel.mode=pipeline"], "parallel.mode:"),
    (["profiler.active=0"], "profiler.active:"),
    (["profiler.bogus=1"], "profiler.bogus:"),
    (["data.batch_size=two"], "data.batch_size:"),
    (["data.source=text"], "data.path:"),
    (["profiler=1"], "profiler:"),
    (["performance.compile=reduce-overhead", "parallel.mode=fsdp"], "performance.compile:"),
    (["observability.memory_snapshot_step=3", "performance.device=cpu"], "observability.memory_snapshot_step:"),
])
def test_bad_values_name_the_field(assignments, field):
    with pytest.raises(ConfigError) as error:
        apply_overrides(TrainConfig(run_dir="/r"), assignments)
    assert str(error.value).startswith(field)


@pytest.mark.parametrize("nodes, nproc, mode, tp, message", [
    (1, 2, "tp", 3, "parallel.tp: 3 does not divide the world size 2"),
    (1, 4, "tp", 2, "parallel.tp: mode 'tp' shards over all 4 ranks"),
    (2, 2, "ddp", 1, "nodes: the local scheduler runs on this node only"),
])
def test_job_degrees_are_checked_against_the_world_size(nodes, nproc, mode, tp, message):
    train = apply_overrides(TrainConfig(run_dir="/r"), [f"parallel.mode={mode}", f"parallel.tp={tp}"])
    with pytest.raises(ConfigError, match=message):
        JobSpec(train=train, nodes=nodes, nproc_per_node=nproc)


def test_bad_environment_names_are_refused():
    with pytest.raises(ConfigError, match="env: 'A;B' is not a valid"):
        JobSpec(train=TrainConfig(run_dir="/r"), env={"A;B": "1"})


def test_profiler_windows_follow_the_schedule():
    schedule = apply_overrides(TrainConfig(run_dir="/r"), [
        "profiler.skip_first=3", "profiler.wait=2", "profiler.warmup=1", "profiler.active=2", "profiler.repeat=0",
    ]).profiler
    assert plan_windows(schedule, 20) == [Window(0, 5, 6, 8), Window(1, 10, 11, 13), Window(2, 15, 16, 18)]
    assert [list(w.active_steps) for w in plan_windows(schedule, 14)] == [[6, 7], [11, 12]]


def test_profiler_windows_stop_at_repeat_and_never_run_past_training():
    schedule = TrainConfig(run_dir="/r").profiler  # wait 1, warmup 1, active 2, repeat 1
    assert plan_windows(schedule, 10) == [Window(0, 1, 2, 4)]
    assert plan_windows(schedule, 3) == []
    off = apply_overrides(TrainConfig(run_dir="/r"), ["profiler.enabled=false"]).profiler
    assert plan_windows(off, 100) == []
