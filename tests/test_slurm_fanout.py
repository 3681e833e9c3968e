"""`fleetscope postprocess RUN --slurm` on the real local Slurm cluster (nodes n1, n2; tests/helpers/slurm_cluster.py):
the per-rank parse runs as an array job whose tasks run on both nodes and fill the parsed-trace cache beside
the run, then one reduce job builds the report and the merged trace from that cache without parsing a trace;
its report equals a local `fleetscope analyze` of the same traces. A task cancelled before it ran is named
(task, ranks, log) and the reduce still reports every rank; so is a task killed while it runs. `fleetscope
status` shows what the records say.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from fleetscope.launcher.fanout import shard_blocks
from fleetscope.traces.layout import RunLayout, fanout_dir, fanout_task_log, parsed_trace_cache_dir, slurm_logs_dir
from helpers import fleetscope, synthetic_run_dir
from helpers.slurm_cluster import SlurmCluster

pytestmark = pytest.mark.slurm

RANKS = 8
TASKS = 4
LATE_RANK = 5
TIMEOUT_S = 300


def comparable(report: dict) -> dict:
    """Without when it was made and the notes (one counts the traces read from the parsed-trace cache)."""
    return {key: value for key, value in report.items() if key not in ("created_at", "notes")}


def gathered_run(root: Path) -> Path:
    run_dir = synthetic_run_dir(root, RANKS, ranks_per_host=4, late_rank=LATE_RANK, late_us=300.0)
    gathered = fleetscope("gather", str(run_dir))
    assert gathered.returncode == 0, gathered.stdout + gathered.stderr
    return run_dir


def fanout_args(run_dir: Path, cluster: SlurmCluster, *extra: str) -> list[str]:
    # 3 of a node's 4 CPUs per task: one task per node at a time, so both nodes take tasks
    return ["postprocess", str(run_dir), "--slurm", "--array-tasks", str(TASKS), "--cpus-per-task", "3",
            "--partition", cluster.partition, "--time", "10", *extra]


def array_job_of(run_dir: Path) -> str:
    folders = sorted(slurm_logs_dir(RunLayout.at(run_dir)).glob("fanout-*[0-9]"))
    assert len(folders) == 1, folders
    return folders[0].name.removeprefix("fanout-")


def fanout_cancelling(run_dir: Path, cluster: SlurmCluster, task: int, ready: Callable[[], bool],
                      *extra: str) -> tuple[subprocess.Popen, str, str, str]:
    """Run the fan-out, `scancel` array task `task` once `ready()`, and wait for the command to finish:
    (the process, its stdout, its stderr, the array job)."""
    follow = subprocess.Popen([sys.executable, "-m", "fleetscope.cli.main", *fanout_args(run_dir, cluster, *extra)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not ready() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert ready(), cluster.log_tail()
        array_job = array_job_of(run_dir)
        cluster.run("scancel", f"{array_job}_{task}")
        stdout, stderr = follow.communicate(timeout=TIMEOUT_S)
    finally:
        follow.kill()
    return follow, stdout, stderr, array_job


def accounted(cluster: SlurmCluster, job_id: str) -> dict[str, dict[str, str]]:
    """sacct's JobID -> {State, NodeList, Start, End} of a job (each task of an array)."""
    fields = ["JobID", "State", "NodeList", "Start", "End"]
    text = cluster.run("sacct", "-X", "-n", "-P", f"--format={','.join(fields)}", "-j", job_id).stdout
    rows = [dict(zip(fields, line.split("|"))) for line in text.splitlines() if line.strip()]
    return {row["JobID"]: row for row in rows}


def test_array_tasks_on_both_nodes_fill_the_cache_and_the_reduce_parses_nothing(
        slurm_cluster: SlurmCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    marker = tmp_path / "pwned"
    run_dir = gathered_run(tmp_path / f"run x'$(touch {marker}) %j")
    layout = RunLayout.at(run_dir)
    local = fleetscope("analyze", str(run_dir), "--no-cache", "--json", str(tmp_path / "local.json"),
                       "--html", str(tmp_path / "local.html"))
    assert local.returncode == 0, local.stdout + local.stderr
    monkeypatch.delenv("FLEETSCOPE_CACHE_DIR")  # the default: a cache beside the traces

    done = fleetscope(*fanout_args(run_dir, slurm_cluster), timeout=TIMEOUT_S)

    assert done.returncode == 0, done.stdout + done.stderr + slurm_cluster.log_tail()
    assert not marker.exists(), "a shell ran part of the run directory's name"
    array_job = array_job_of(run_dir)
    tasks = accounted(slurm_cluster, array_job)
    assert {row["State"] for row in tasks.values()} == {"COMPLETED"}
    nodes = {int(job_id.split("_")[1]): row["NodeList"] for job_id, row in tasks.items()}
    assert sorted(nodes) == list(range(TASKS)) and set(nodes.values()) == set(slurm_cluster.nodes)
    folder = fanout_dir(layout, array_job)
    records = [json.loads((folder / f"task{task}.json").read_text()) for task in range(TASKS)]
    assert [record["node"] for record in records] == [nodes[task] for task in range(TASKS)]
    assert [record["ranks"] for record in records] == [list(b) for b in shard_blocks(range(RANKS), TASKS)]
    assert sum(record["counts"]["parsed"] for record in records) == RANKS
    assert {record["cache_dir"] for record in records} == {str(parsed_trace_cache_dir(layout))}
    reduce = json.loads((folder / "reduce.json").read_text())
    assert reduce["counts"] == {"traces": RANKS, "hits": RANKS, "parsed": 0, "failed": []}
    assert reduce["incomplete"] == [] and reduce["complete"]
    reduce_job = next(folder.glob("reduce-*.out")).name.removeprefix("reduce-").removesuffix(".out")
    reduce_row = accounted(slurm_cluster, reduce_job)[reduce_job]
    assert reduce_row["State"] == "COMPLETED"
    assert all(reduce_row["Start"] >= row["End"] for row in tasks.values()), "the reduce ran after every task"
    fanned_out = json.loads(layout.report_json.read_text())
    assert fanned_out["windows"][0]["stragglers"]["waited_for_rank"] == LATE_RANK
    assert comparable(fanned_out) == comparable(json.loads((tmp_path / "local.json").read_text()))
    assert layout.merged_trace.stat().st_size > 0
    assert "8 trace(s): 8 from the cache, 0 parsed by the reduce" in done.stdout
    (run_dir / "job.json").write_text(json.dumps({"scheduler": "local", "status": "succeeded"}))  # status needs a run
    status = fleetscope("status", str(run_dir))
    assert (f"parse fan-out, array job {array_job}: {TASKS} of {TASKS} task(s) done ({RANKS} trace(s): {RANKS} "
            "parsed") in status.stdout and "reduce: done, complete" in status.stdout, status.stdout + status.stderr


def test_a_cancelled_task_is_named_and_the_reduce_still_reports_every_rank(
        slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    run_dir = gathered_run(tmp_path / "run")
    layout = RunLayout.at(run_dir)
    # one task at a time, so the last one is still pending when it is cancelled
    follow, stdout, stderr, array_job = fanout_cancelling(
        run_dir, slurm_cluster, TASKS - 1, lambda: bool(list(slurm_logs_dir(layout).glob("fanout-*[0-9]"))),
        "--max-running", "1")

    assert follow.returncode == 3, stdout + stderr + slurm_cluster.log_tail()  # partial
    cancelled_ranks = list(shard_blocks(range(RANKS), TASKS)[TASKS - 1])
    log = str(fanout_task_log(layout, array_job, TASKS - 1))
    assert (f"task {TASKS - 1}: NEVER RAN" in stderr and f"ranks {cancelled_ranks[0]}-{cancelled_ranks[-1]}" in stderr
            and log in stderr), stderr
    reduce = json.loads((fanout_dir(layout, array_job) / "reduce.json").read_text())
    assert [(t["task"], t["ranks"], t["log_path"]) for t in reduce["incomplete"]] == [(TASKS - 1, cancelled_ranks, log)]
    assert reduce["counts"]["parsed"] == len(cancelled_ranks)
    assert reduce["counts"]["hits"] == RANKS - len(cancelled_ranks)
    report = json.loads(layout.report_json.read_text())
    assert sorted(rank["rank"] for rank in report["ranks"]) == list(range(RANKS))


def test_a_task_killed_while_running_is_named_and_the_reduce_parses_its_ranks(
        slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    run_dir = gathered_run(tmp_path / "run")
    layout = RunLayout.at(run_dir)
    killed = TASKS - 1
    started = tmp_path / "killed-task-started"
    # the real python, but the last task first waits (as on a node that stops answering) until it is killed
    wrapper = tmp_path / "python-that-holds-one-task"
    wrapper.write_text(f'#!/bin/sh\nif [ "${{SLURM_ARRAY_TASK_ID:-}}" = "{killed}" ]; then\n'
                       f"  touch {shlex.quote(str(started))}; sleep 300\nfi\n"
                       f'exec {shlex.quote(sys.executable)} "$@"\n')
    wrapper.chmod(0o755)
    follow, stdout, stderr, array_job = fanout_cancelling(run_dir, slurm_cluster, killed, started.exists,
                                                          "--python", str(wrapper))

    assert follow.returncode == 3, stdout + stderr + slurm_cluster.log_tail()  # partial
    killed_ranks = list(shard_blocks(range(RANKS), TASKS)[killed])
    log = str(fanout_task_log(layout, array_job, killed))
    assert f"task {killed}: CANCELLED" in stderr and log in stderr, stderr
    reduce = json.loads((fanout_dir(layout, array_job) / "reduce.json").read_text())
    assert [(t["task"], t["ranks"]) for t in reduce["incomplete"]] == [(killed, killed_ranks)]
    assert reduce["counts"]["parsed"] == len(killed_ranks) and reduce["counts"]["hits"] == RANKS - len(killed_ranks)
    report = json.loads(layout.report_json.read_text())
    assert sorted(rank["rank"] for rank in report["ranks"]) == list(range(RANKS))
    assert report["windows"][0]["stragglers"]["waited_for_rank"] == LATE_RANK
    (run_dir / "job.json").write_text(json.dumps({"scheduler": "local", "status": "succeeded"}))
    status = fleetscope("status", str(run_dir))
    assert f"{TASKS - 1} of {TASKS} task(s) done" in status.stdout and f"task {killed}: no record" in status.stdout
