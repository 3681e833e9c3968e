"""Which rank failed first, read from the files Slurm jobs leave in a run directory (no cluster needed)."""

from __future__ import annotations

import json
from pathlib import Path

from fleetscope.launcher.schedulers.slurm import rank_failures, torchrun_root_causes
from fleetscope.traces.layout import RunLayout

# torchrun's summary on one node of a TorchX job (torch 2.13): the node's first failure and another rank.
TORCHRUN_SUMMARY = """\
[W1129 13:19:11] torch.distributed.elastic.agent.server.api: Received 15 death signal, shutting down workers
============================================================
fleetscope.trainer FAILED
------------------------------------------------------------
Failures:
[1]:
  time      : 2026-11-29_13:19:11
  host      : localhost
  rank      : 3 (local_rank: 1)
  exitcode  : -15 (pid: 14579)  (SIGTERM)
  error_file: <N/A>
  traceback : Signal 15 (SIGTERM) received by PID 14579
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-29_13:19:07
  host      : localhost
  rank      : 2 (local_rank: 0)
  exitcode  : 1 (pid: 14576)
  error_file: {error_file}
  traceback : Traceback (most recent call last):
    File "/work/main/trainer/loop.py", line 78, in train_step
      inject_faults(state.step, config, runtime)
============================================================
"""


def write_error_file(path: Path, message: str, timestamp: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"message": {"message": message,
                                            "extraInfo": {"py_callstack": "...", "timestamp": str(timestamp)}}}))


def test_torchrun_root_cause_gives_the_global_rank_and_the_error_files_message(tmp_path: Path) -> None:
    layout = RunLayout.at(tmp_path)
    error_file = layout.logs_dir / "torchx-node1" / "14_x" / "attempt_0" / "0" / "error.json"
    write_error_file(error_file, "InjectedFault: injected crash on rank 2", 1764422347)
    stderr = layout.logs_dir / "slurm" / "slurm-14-fleetscope-1.err"
    stderr.parent.mkdir(parents=True)
    stderr.write_text(TORCHRUN_SUMMARY.format(error_file=error_file))

    [failure] = torchrun_root_causes(layout)

    assert failure.rank == 2  # the global rank, not the local rank 0 of the error file's folder
    assert failure.exitcode == 1 and failure.message.startswith("InjectedFault")
    assert failure.timestamp == 1764422347 and failure.log_path == str(stderr)


def test_submitit_error_files_are_ordered_by_time_and_point_at_the_ranks_stderr(tmp_path: Path) -> None:
    layout = RunLayout.at(tmp_path)
    attempt = layout.logs_dir / "submitit-7" / "attempt_0"
    write_error_file(attempt / "3" / "error.json", "InjectedFault: injected crash on rank 3", 100)
    write_error_file(attempt / "0" / "error.json", "RuntimeError: Connection closed by peer", 105)
    stderr = layout.logs_dir / "slurm" / "7_3_log.err"
    stderr.parent.mkdir(parents=True)
    stderr.write_text("traceback of rank 3\n")

    failures = rank_failures(layout, "7")

    assert [failure.rank for failure in failures] == [3, 0]
    assert failures[0].log_path == str(stderr) and failures[1].log_path is None
