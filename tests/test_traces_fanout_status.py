"""`fleetscope status` of a run with parse fan-outs: what each array's records say, from disk alone
(finished tasks, missing ones with their logs, unreadable records, the reduce), never following a
symlinked or foreign folder."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from fleetscope.traces.fanout import (
    IncompleteTask,
    ParseCounts,
    ReduceRecord,
    TaskRecord,
    ShardTraceProblem,
    fanout_states,
    write_reduce_record,
    write_task_record,
)
from fleetscope.traces.layout import RunLayout, fanout_dir, fanout_task_log, fanout_task_record, slurm_logs_dir

ARRAY = "4242"


def _run(tmp_path: Path) -> RunLayout:
    run = tmp_path / "run"
    run.mkdir()
    (run / "job.json").write_text(json.dumps({"scheduler": "local", "status": "succeeded"}))
    return RunLayout.at(run)


def _task(task: int, *, tasks: int = 3, parsed: int = 4, hits: int = 0, failed: int = 0) -> TaskRecord:
    problems = [ShardTraceProblem(label=f"rank{task}.json", reason="truncated gzip")] * failed
    return TaskRecord(array_job_id=ARRAY, task=task, tasks=tasks, node=f"node{task % 2}",
                      ranks=list(range(4 * task, 4 * task + 4)),
                      counts=ParseCounts(traces=parsed + hits + failed, hits=hits, parsed=parsed, failed=problems),
                      cache_dir="/cache", seconds=1.5)


def _status(layout: RunLayout) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fleetscope.cli.main", "status", str(layout.root)],
                          capture_output=True, text=True, timeout=60)


def test_status_names_the_finished_tasks_the_missing_one_and_the_reduce(tmp_path):
    layout = _run(tmp_path)
    write_task_record(layout, _task(0, parsed=3, hits=1))
    write_task_record(layout, _task(2, parsed=3, failed=1))
    write_reduce_record(layout, ReduceRecord(
        array_job_id=ARRAY, tasks=3, counts=ParseCounts(traces=12, hits=8, parsed=4, failed=[]),
        incomplete=[IncompleteTask(task=1, ranks=[4, 5, 6, 7], log_path="log", reason="no record")],
        outputs={}, errors=[], seconds={"analyze": 1.0}, complete=True))

    done = _status(layout)

    assert done.returncode == 0, done.stderr
    assert (f"parse fan-out, array job {ARRAY}: 2 of 3 task(s) done (8 trace(s): 6 parsed, 1 already cached, "
            "1 unreadable)") in done.stdout
    assert f"task 1: no record" in done.stdout and str(fanout_task_log(layout, ARRAY, 1)) in done.stdout
    assert ("reduce: done, complete: 12 trace(s): 8 from the cache, 4 parsed by the reduce, 0 unreadable; "
            "1 task(s) it found incomplete") in done.stdout


def test_a_fanout_still_running_says_so_and_a_broken_record_is_named(tmp_path):
    layout = _run(tmp_path)
    fanout_dir(layout, ARRAY).mkdir(parents=True)
    fresh = fanout_states(layout)
    assert [(s.array_job_id, s.planned_tasks, s.finished, s.reduce) for s in fresh] == [(ARRAY, None, [], None)]
    assert "no record yet" in fresh[0].reduce_problem

    write_task_record(layout, _task(0))
    fanout_task_record(layout, ARRAY, 1).write_text('{"array_job_id": 1}')   # another writer, half a record
    done = _status(layout)
    assert done.returncode == 0, done.stderr
    assert "1 of 3 task(s) done" in done.stdout
    assert "task1.json: unreadable record: ValueError" in done.stdout
    assert "task 1: no record" in done.stdout and "task 2: no record" in done.stdout
    assert "reduce: no record yet" in done.stdout


def test_folders_that_are_no_fanouts_are_not_read(tmp_path):
    layout = _run(tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    write_task_record(RunLayout.at(elsewhere), _task(0))
    slurm_logs_dir(layout).mkdir(parents=True)
    os.symlink(fanout_dir(RunLayout.at(elsewhere), ARRAY), fanout_dir(layout, "77"))   # a symlinked fan-out
    (slurm_logs_dir(layout) / "fanout-x1").mkdir()                                     # not an array job id
    (slurm_logs_dir(layout) / "fanout-12.out").write_text("a log, not a folder")
    assert fanout_states(layout) == []
    done = _status(layout)
    assert done.returncode == 0 and "parse fan-out" not in done.stdout, done.stdout + done.stderr


def test_a_thousand_task_array_lists_ten_missing_tasks_and_counts_the_rest(tmp_path):
    layout = _run(tmp_path)
    write_task_record(layout, _task(0, tasks=1000))
    done = _status(layout)
    assert "1 of 1000 task(s) done" in done.stdout and "task 10: no record" in done.stdout
    assert "task 11: no record" not in done.stdout and "... and 989 more task(s) without a record" in done.stdout


def test_a_record_claiming_an_impossible_task_count_is_unreadable(tmp_path):
    layout = _run(tmp_path)
    record = _task(0).to_json() | {"tasks": 10**12}
    fanout_dir(layout, ARRAY).mkdir(parents=True)
    fanout_task_record(layout, ARRAY, 0).write_text(json.dumps(record))
    (state,) = fanout_states(layout)
    assert state.planned_tasks is None and "field tasks: not an integer from 0 to" in state.unreadable[0]
