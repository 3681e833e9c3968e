"""Planning of the parse fan-out over a Slurm array job, without a cluster: which ranks each task takes,
the exact sbatch lines and scripts (golden file), quoting of hostile paths (the scripts are run with bash
and the argv their command receives is checked word for word), and what is refused."""

from __future__ import annotations

import os
import shlex
import subprocess
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fleetscope.cli.fanout_commands import fanout_cache_dir, shard_keys_of
from fleetscope.launcher.fanout import (
    MAX_ARRAY_TASKS,
    FanoutConfig,
    default_task_count,
    describe_keys,
    plan_fanout,
    sbatch_path,
    shard_blocks,
)
from fleetscope.trainer.config import ConfigError
from fleetscope.traces.layout import RunLayout, parsed_trace_cache_dir

GOLDEN = Path(__file__).parent / "golden" / "slurm" / "fanout.txt"
TOKEN = "0123456789abcdef"
HOSTILE_DIR = "run x'$(touch {marker}) `touch {marker}` \"d\" %j %A $HOME"


def config(run_dir: str = "/shared/runs/moe 1", **fields) -> FanoutConfig:
    values = dict(run_dir=Path(run_dir), cache_dir=Path(run_dir) / "cache" / "parsed-traces",
                  python="/opt/venv/bin/python", partition="cpu", account="proj_a", qos="low", time_minutes=30,
                  cpus_per_task=4, mem="16G", job_name="moe-fsdp", extra_sbatch=("--exclusive", "--comment=a b"))
    values.update(fields)
    return FanoutConfig(**values)


keys = st.lists(st.one_of(st.integers(0, 20_000), st.text("abc/._", min_size=1, max_size=6)), max_size=300)


@settings(max_examples=300, deadline=None)
@given(keys=keys, tasks=st.integers(1, 1200))
def test_every_rank_is_in_exactly_one_contiguous_block_of_balanced_size(keys, tasks):
    blocks = shard_blocks(keys, tasks)
    flat = [key for block in blocks for key in block]
    assert sorted(map(repr, flat)) == sorted(map(repr, set(keys))), "each key exactly once"
    assert len(blocks) == min(tasks, len(set(keys)))
    assert all(blocks), "no empty task"
    if blocks:
        assert max(map(len, blocks)) - min(map(len, blocks)) <= 1
    ranks = [key for key in flat if isinstance(key, int)]
    assert ranks == sorted(ranks), "blocks are contiguous runs of the rank order"
    assert shard_blocks(list(reversed(keys)), tasks) == blocks, "the same blocks whatever order the keys came in"


def test_ten_thousand_ranks_default_to_one_task_per_64_ranks_within_slurms_array_limit():
    assert default_task_count(10_000) == 157
    blocks = shard_blocks(range(10_000), default_task_count(10_000))
    assert len(blocks) == 157 and {len(block) for block in blocks} == {63, 64}
    assert default_task_count(10**6) == MAX_ARRAY_TASKS
    assert default_task_count(3) == 1


def test_tasks_are_described_as_rank_ranges():
    assert describe_keys([7, 0, 1, 2, 3, 9, 10]) == "ranks 0-3, 7, 9-10"
    assert describe_keys([5]) == "rank 5"
    assert describe_keys([1, "traces/x.json"]) == "rank 1, trace traces/x.json"


def test_a_trace_without_a_known_rank_is_sharded_by_its_label():
    class Source:
        def __init__(self, rank, label):
            self.rank, self.label = rank, label

    assert shard_keys_of([Source(3, "a"), Source(None, "b/c.json")]) == [3, "b/c.json"]


def test_dry_run_text_matches_golden_file():
    text = plan_fanout(config(array_tasks=3, max_running=2), range(10), TOKEN).render() + "\n"
    if os.environ.get("FLEETSCOPE_UPDATE_GOLDEN") == "1":
        GOLDEN.write_text(text)
    assert text == GOLDEN.read_text(), "fanout.txt differs from the golden file (FLEETSCOPE_UPDATE_GOLDEN=1 to accept)"


def argv_recorder(tmp_path: Path) -> tuple[Path, Path]:
    """An executable standing in for python that writes the argv it gets, NUL-separated."""
    out = tmp_path / "argv.bin"
    recorder = tmp_path / "record-argv"
    recorder.write_text(f"#!/bin/sh\nfor a in \"$@\"; do printf '%s\\0' \"$a\"; done > {shlex.quote(str(out))}\n")
    recorder.chmod(0o755)
    return recorder, out


def run_script(script: str, tmp_path: Path, out: Path) -> list[str]:
    path = tmp_path / "script.sh"
    path.write_text(script)
    env = {**os.environ, "SLURM_ARRAY_TASK_ID": "2", "SLURM_ARRAY_JOB_ID": "77"}
    subprocess.run(["bash", str(path)], check=True, env=env, cwd=tmp_path, timeout=30)
    return out.read_bytes().decode().split("\0")[:-1]


def test_hostile_run_dir_reaches_the_task_and_the_reduce_as_one_word(tmp_path):
    marker = tmp_path / "pwned"
    run_dir = tmp_path / HOSTILE_DIR.format(marker=marker)
    recorder, out = argv_recorder(tmp_path)
    plan = plan_fanout(config(str(run_dir), python=str(recorder), array_tasks=4), range(8), TOKEN)

    task_argv = run_script(plan.array_script, tmp_path, out)
    reduce_argv = run_script(plan.reduce_script("77"), tmp_path, out)

    assert not marker.exists(), "a shell ran part of the run directory's name"
    cache = str(run_dir / "cache" / "parsed-traces")
    common = ["-m", "fleetscope.cli.main"]
    assert task_argv == [*common, "parse-shard", str(run_dir), "--cache-dir", cache, "--visible", TOKEN,
                         "--of", "4", "--shard", "2", "--array-job", "77"]
    assert reduce_argv == [*common, "reduce-shards", str(run_dir), "--cache-dir", cache, "--visible", TOKEN,
                           "--array-job", "77", "--of", "4"]


def test_paths_in_sbatch_log_patterns_keep_their_percent_signs():
    plan = plan_fanout(config("/runs/a%jb"), range(4), TOKEN)
    output = next(arg for arg in plan.array_sbatch if arg.startswith("--output="))
    assert output == "--output=/runs/a%%jb/logs/slurm/fanout-%A_%a.out"
    assert "--output=/runs/a%%jb/logs/slurm/fanout-9/reduce-%j.out" in plan.reduce_sbatch("9")
    assert "--dependency=afterany:9" in plan.reduce_sbatch("9")
    with pytest.raises(ConfigError, match="backslash"):
        sbatch_path(Path("/runs/a\\b"), "run_dir")


@pytest.mark.parametrize("fields, message", [
    (dict(run_dir=Path("/runs/a\nrm -rf ~")), "control characters"),
    (dict(cache_dir=Path("relative/cache")), "absolute"),
    (dict(partition="gpu;id"), "not a Slurm name"),
    (dict(mem="lots"), "not like"),
    (dict(array_tasks=0), "array_tasks"),
    (dict(array_tasks=MAX_ARRAY_TASKS + 1), "array_tasks"),
    (dict(cpus_per_task=0), "cpus_per_task"),
    (dict(extra_sbatch=("--array=0-99",)), "set by the fan-out"),
    (dict(extra_sbatch=("--dependency=afterok:1",)), "set by its own flag"),
    (dict(extra_sbatch=("--x=a\nb",)), "control characters"),
])
def test_bad_values_are_refused_naming_the_field(fields, message):
    with pytest.raises(ConfigError, match=message):
        config(**fields)


def test_planning_refuses_a_run_without_traces_and_a_bad_job_id():
    with pytest.raises(ConfigError, match="no traces"):
        plan_fanout(config(), [], TOKEN)
    plan = plan_fanout(config(), range(3), TOKEN)
    with pytest.raises(ValueError, match="not a Slurm job id"):
        plan.reduce_sbatch("1;id")


def test_the_cache_is_on_the_run_directory_unless_chosen(tmp_path, monkeypatch):
    layout = RunLayout.at(tmp_path / "run")
    monkeypatch.delenv("FLEETSCOPE_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "node-local"))
    assert fanout_cache_dir(None, layout)[0] == parsed_trace_cache_dir(layout) == layout.root / "cache/parsed-traces"
    monkeypatch.setenv("FLEETSCOPE_CACHE_DIR", str(tmp_path / "shared"))
    assert fanout_cache_dir(None, layout) == (tmp_path / "shared", "$FLEETSCOPE_CACHE_DIR")
    assert fanout_cache_dir(Path("/scratch/c"), layout) == (Path("/scratch/c"), "--cache-dir")
