"""The two halves of a fanned-out parse, run as the real CLI processes an array task and the reduce job run
(without Slurm; tests/test_slurm_fanout.py runs them through a real array job): tasks fill the parsed-trace
cache with exactly their ranks, the reduce parses nothing and reports what `analyze` reports, a task that
did not finish is named with its ranks and log, and a cache a task cannot trust or see is refused."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from fleetscope.cli.fanout_commands import incomplete_tasks
from fleetscope.launcher.fanout import VISIBILITY_FILE_FORMAT, shard_blocks
from fleetscope.traces.fanout import ParseCounts, TaskRecord, write_task_record
from fleetscope.traces.layout import RunLayout, fanout_reduce_record, fanout_task_log, fanout_task_record
from helpers import fleetscope, synthetic_run_dir

RANKS = 6
TASKS = 3
LATE_RANK = 4
ARRAY_JOB = "41"
TOKEN = "feedfacecafebeef"


def comparable(report: dict) -> dict:
    """A report without what differs between two analyses of the same traces: when it was made, and the
    notes (one says how many traces came from the parsed-trace cache)."""
    return {key: value for key, value in report.items() if key not in ("created_at", "notes")}


@pytest.fixture
def run(tmp_path: Path) -> Path:
    run_dir = synthetic_run_dir(tmp_path / "run", RANKS, ranks_per_host=3, late_rank=LATE_RANK, late_us=300.0)
    gathered = fleetscope("gather", str(run_dir))
    assert gathered.returncode == 0, gathered.stdout + gathered.stderr
    return run_dir


def cache_dir(tmp_path: Path) -> Path:
    directory = tmp_path / "shared-cache"
    directory.mkdir(mode=0o700, exist_ok=True)
    (directory / VISIBILITY_FILE_FORMAT.format(token=TOKEN)).write_text("submitting host\n")
    return directory


def parse_shard(run_dir: Path, cache: Path, shard: int):
    return fleetscope("parse-shard", str(run_dir), "--shard", str(shard), "--of", str(TASKS), "--cache-dir",
                      str(cache), "--array-job", ARRAY_JOB, "--visible", TOKEN)


def reduce_shards(run_dir: Path, cache: Path):
    return fleetscope("reduce-shards", str(run_dir), "--of", str(TASKS), "--cache-dir", str(cache),
                      "--array-job", ARRAY_JOB, "--visible", TOKEN)


def test_tasks_fill_the_cache_and_the_reduce_parses_nothing_and_reports_what_analyze_reports(run, tmp_path):
    layout = RunLayout.at(run)
    local = fleetscope("analyze", str(run), "--no-cache", "--json", str(tmp_path / "local.json"),
                       "--html", str(tmp_path / "local.html"))
    assert local.returncode == 0, local.stdout + local.stderr
    cache = cache_dir(tmp_path)

    for shard in range(TASKS):
        task = parse_shard(run, cache, shard)
        assert task.returncode == 0, task.stdout + task.stderr
    reduced = reduce_shards(run, cache)

    assert reduced.returncode == 0, reduced.stdout + reduced.stderr
    records = [json.loads(fanout_task_record(layout, ARRAY_JOB, shard).read_text()) for shard in range(TASKS)]
    assert [record["ranks"] for record in records] == [list(block) for block in shard_blocks(range(RANKS), TASKS)]
    assert sum(record["counts"]["parsed"] for record in records) == RANKS
    assert all(record["counts"]["hits"] == 0 and record["counts"]["failed"] == [] for record in records)
    reduce = json.loads(fanout_reduce_record(layout, ARRAY_JOB).read_text())
    assert reduce["counts"] == {"traces": RANKS, "hits": RANKS, "parsed": 0, "failed": []}
    assert reduce["incomplete"] == [] and reduce["errors"] == [] and reduce["complete"]
    fanned_out = json.loads(layout.report_json.read_text())
    analyzed = json.loads((tmp_path / "local.json").read_text())
    assert fanned_out["windows"][0]["stragglers"]["waited_for_rank"] == LATE_RANK
    assert comparable(fanned_out) == comparable(analyzed)
    assert layout.merged_trace.stat().st_size > 0
    assert not (cache / VISIBILITY_FILE_FORMAT.format(token=TOKEN)).exists(), "the reduce removes its own marker"


def test_a_task_that_did_not_finish_is_named_and_the_reduce_parses_its_ranks(run, tmp_path):
    layout = RunLayout.at(run)
    cache = cache_dir(tmp_path)
    for shard in (0, 2):
        assert parse_shard(run, cache, shard).returncode == 0

    reduced = reduce_shards(run, cache)

    assert reduced.returncode == 3, reduced.stdout + reduced.stderr  # partial: a task is missing
    missing_ranks = list(shard_blocks(range(RANKS), TASKS)[1])
    log = str(fanout_task_log(layout, ARRAY_JOB, 1))
    assert f"task 1 did not complete (ranks {missing_ranks[0]}-{missing_ranks[-1]})" in reduced.stderr
    assert log in reduced.stderr
    reduce = json.loads(fanout_reduce_record(layout, ARRAY_JOB).read_text())
    assert [(t["task"], t["ranks"], t["log_path"]) for t in reduce["incomplete"]] == [(1, missing_ranks, log)]
    assert reduce["counts"]["parsed"] == len(missing_ranks)
    assert reduce["counts"]["hits"] == RANKS - len(missing_ranks)
    report = json.loads(layout.report_json.read_text())
    assert sorted(rank["rank"] for rank in report["ranks"]) == list(range(RANKS))


def test_a_task_whose_record_is_missing_damaged_or_of_other_ranks_counts_as_incomplete(tmp_path):
    layout = RunLayout.at(tmp_path / "run")
    blocks = shard_blocks(range(RANKS), TASKS)

    def record(task: int, ranks: list[int]) -> TaskRecord:
        return TaskRecord(array_job_id=ARRAY_JOB, task=task, tasks=TASKS, node="n1", ranks=ranks,
                          counts=ParseCounts(traces=len(ranks), parsed=len(ranks)), cache_dir="/c", seconds=1.0)

    write_task_record(layout, record(0, list(blocks[0])))
    write_task_record(layout, record(1, [0]))
    fanout_task_record(layout, ARRAY_JOB, 2).write_text("{not json")

    incomplete = {task.task: task for task in incomplete_tasks(layout, ARRAY_JOB, blocks)}

    assert sorted(incomplete) == [1, 2]
    assert "it took rank 0, not its planned ranks 2-3" in incomplete[1].reason
    assert "unreadable record" in incomplete[2].reason
    assert incomplete[2].log_path == str(fanout_task_log(layout, ARRAY_JOB, 2))
    fanout_task_record(layout, ARRAY_JOB, 0).unlink()
    assert "the task did not finish" in incomplete_tasks(layout, ARRAY_JOB, blocks)[0].reason


def test_a_cache_the_task_cannot_see_or_trust_is_refused_before_any_parse(run, tmp_path):
    node_local = tmp_path / "node-local-cache"
    node_local.mkdir(mode=0o700)

    unseen = parse_shard(run, node_local, 0)

    assert unseen.returncode == 2, unseen.stdout + unseen.stderr
    assert str(node_local) in unseen.stderr and "not on storage shared" in unseen.stderr
    assert list(node_local.iterdir()) == []
    shared = cache_dir(tmp_path)
    os.chmod(shared, 0o777)
    untrusted = parse_shard(run, shared, 0)
    assert untrusted.returncode == 2 and "writable by other users" in untrusted.stderr
    assert not list(shared.glob("*.rank.msgpack"))


def test_fanout_flags_need_slurm_and_a_run_directory(run, tmp_path):
    refused = fleetscope("postprocess", str(run), "--array-tasks", "4")
    assert refused.returncode == 2 and "--array-tasks: only with --slurm" in refused.stderr
    (tmp_path / "plain").mkdir()
    not_a_run = fleetscope("postprocess", str(tmp_path / "plain"), "--slurm", "--dry-run")
    assert not_a_run.returncode == 2 and "not a run directory" in not_a_run.stderr
    hostile = fleetscope("postprocess", str(run), "--slurm", "--dry-run", "--partition", "a;id")
    assert hostile.returncode == 2 and "not a Slurm name" in hostile.stderr


def test_dry_run_prints_who_parses_what_and_touches_nothing(run, tmp_path):
    before = sorted(path.relative_to(run) for path in run.rglob("*"))

    dry_run = fleetscope("postprocess", str(run), "--slurm", "--dry-run", "--array-tasks", "4",
                         "--cache-dir", str(tmp_path / "c"))

    assert dry_run.returncode == 0, dry_run.stderr
    assert "#   task 0: ranks 0-1\n#   task 1: ranks 2-3\n#   task 2: rank 4\n#   task 3: rank 5\n" in dry_run.stdout
    assert "--array=0-3" in dry_run.stdout and "--dependency=afterany:<ARRAY_JOB_ID>" in dry_run.stdout
    assert sorted(path.relative_to(run) for path in run.rglob("*")) == before
    assert not (tmp_path / "c").exists()
