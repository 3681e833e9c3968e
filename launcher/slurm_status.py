"""`fleetscope status|logs|cancel RUN_DIR` for Slurm jobs: job.json + Slurm's state + which rank failed first.

Failed ranks come from the per-rank error files both paths leave in the run directory:
  * submitit: <run>/logs/submitit-<job>/attempt_<K>/<rank>/error.json (global rank in the path);
  * TorchX: torchrun's per-node log tree has local ranks only, so the global rank, host and error file are
    read from the "Root Cause" summary torchrun prints to the node's stderr (<run>/logs/slurm/slurm-*.err).
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..traces.layout import RunLayout
from .jobrecord import read_job_record
from .local import RankFailure, collect_failures
from .slurm_common import SLURM_LOGS_SUBDIR
from .slurm_jobs import SlurmJobStatus, query_job

_ROOT_CAUSE_RANK = re.compile(r"^\s*rank\s*:\s*(?P<rank>\d+)\s*\(local_rank:\s*\d+\)", re.MULTILINE)
_ROOT_CAUSE_FIELD = r"^\s*{name}\s*:\s*(?P<value>.*)$"


@dataclass(kw_only=True)
class SlurmRunStatus:
    """What `fleetscope status` shows for a run submitted to Slurm."""

    run_dir: Path
    scheduler: str
    job_id: str
    postprocess_job_id: str
    training: SlurmJobStatus | None
    postprocess: SlurmJobStatus | None
    failures: list[RankFailure] = field(default_factory=list)
    outputs: dict[str, Path] = field(default_factory=dict)

    @property
    def state(self) -> str:
        return self.training.state if self.training is not None else "UNKNOWN"

    def to_json(self) -> dict[str, Any]:
        return {
            "scheduler": self.scheduler, "job_id": self.job_id, "postprocess_job_id": self.postprocess_job_id,
            "state": self.state,
            "exit_code": self.training.exit_code if self.training else None,
            "restarts": self.training.restarts if self.training else None,
            "postprocess_state": self.postprocess.state if self.postprocess else None,
            "failures": [vars(failure) for failure in self.failures],
        }


def slurm_job_ids(record: dict[str, Any], layout: RunLayout) -> tuple[str, str]:
    job_id = str(record.get("job_id") or "")
    if not job_id:
        raise ValueError(f"{layout.job_file}: no Slurm job id recorded (was this run submitted to Slurm?)")
    return job_id, str(record.get("postprocess_job_id") or "")


def run_status(run_dir: str | Path) -> SlurmRunStatus:
    """Query Slurm for the run's jobs and read its failure files (nothing is written)."""
    layout = RunLayout.at(run_dir)
    record = read_job_record(layout)
    job_id, postprocess_job_id = slurm_job_ids(record, layout)
    return SlurmRunStatus(
        run_dir=layout.root,
        scheduler=str(record.get("scheduler", "")),
        job_id=job_id,
        postprocess_job_id=postprocess_job_id,
        training=query_job(job_id),
        postprocess=query_job(postprocess_job_id) if postprocess_job_id else None,
        failures=rank_failures(layout, job_id),
        outputs=existing_outputs(layout),
    )


def existing_outputs(layout: RunLayout) -> dict[str, Path]:
    candidates = {"manifest": layout.manifest_file, "report_json": layout.report_json,
                  "report_html": layout.report_html, "merged_trace": layout.merged_trace}
    return {name: path for name, path in candidates.items() if path.exists()}


def rank_failures(layout: RunLayout, job_id: str) -> list[RankFailure]:
    """Every failed rank, the earliest first; a rank reported twice keeps its earliest failure."""
    earliest: dict[int, RankFailure] = {}
    submitit = [with_submitit_log(failure, layout, job_id) for failure in collect_failures(layout)]
    for failure in [*submitit, *torchrun_root_causes(layout)]:
        known = earliest.get(failure.rank)
        if known is None or _sort_key(failure) < _sort_key(known):
            earliest[failure.rank] = failure
    return sorted(earliest.values(), key=_sort_key)


def with_submitit_log(failure: RankFailure, layout: RunLayout, job_id: str) -> RankFailure:
    """Point a submitit rank's failure at its stderr: <run>/logs/slurm/<job>_<rank>_log.err."""
    stderr = layout.logs_dir / SLURM_LOGS_SUBDIR / f"{job_id}_{failure.rank}_log.err"
    if failure.log_path is None and stderr.exists():
        return dataclasses.replace(failure, log_path=str(stderr))
    return failure


def _sort_key(failure: RankFailure) -> tuple[bool, int, int]:
    return (failure.timestamp is None, failure.timestamp or 0, failure.rank)


def torchrun_root_causes(layout: RunLayout) -> list[RankFailure]:
    """The "Root Cause (first observed failure)" of each node's torchrun, with the global rank."""
    failures = []
    for stderr in sorted((layout.logs_dir / SLURM_LOGS_SUBDIR).glob("slurm-*.err")):
        text = stderr.read_text(errors="replace")
        for block in text.split("Root Cause (first observed failure):")[1:]:
            failure = _root_cause(block, stderr)
            if failure is not None:
                failures.append(failure)
    return failures


def _root_cause(block: str, stderr: Path) -> RankFailure | None:
    rank = _ROOT_CAUSE_RANK.search(block)
    if rank is None:
        return None
    exitcode = _field(block, "exitcode")
    error_file = _field(block, "error_file")
    message, timestamp = _error_file_message(Path(error_file)) if error_file.startswith("/") else ("", None)
    code = re.match(r"-?\d+", exitcode)
    return RankFailure(rank=int(rank["rank"]), exitcode=int(code.group()) if code else None,
                       message=message or f"exit code {exitcode}", timestamp=timestamp, log_path=str(stderr))


def _field(block: str, name: str) -> str:
    match = re.search(_ROOT_CAUSE_FIELD.format(name=name), block, re.MULTILINE)
    return match["value"].strip() if match else ""


def _error_file_message(path: Path) -> tuple[str, int | None]:
    try:
        content = json.loads(path.read_text())["message"]
    except (OSError, ValueError, KeyError, TypeError):
        return "", None
    if not isinstance(content, dict):
        return str(content), None
    timestamp = content.get("extraInfo", {}).get("timestamp")
    return str(content.get("message", "")).strip(), int(timestamp) if str(timestamp).isdigit() else None


def log_files(layout: RunLayout) -> list[Path]:
    """The scheduler's and the ranks' logs of a run, in a stable order."""
    slurm_logs = sorted((layout.logs_dir / SLURM_LOGS_SUBDIR).glob("*.out"))
    slurm_logs += sorted((layout.logs_dir / SLURM_LOGS_SUBDIR).glob("*.err"))
    rank_logs = sorted(layout.logs_dir.glob("torchx-node*/*/attempt_*/*/std*.log"))
    return slurm_logs + rank_logs
