"""Which ranks failed, and which failed first: the one reader of torchrun's error files and summaries.

Every scheduler leaves per-rank error files in torchrun's layout (`.../attempt_<K>/<rank>/error.json`, written
by torch.distributed.elastic's `@record`): local torchrun and submitit under <run>/logs/. TorchX's per-node
torchrun knows local ranks only, so for it the global rank comes from the "Root Cause" summary torchrun prints
to the node's stderr. Local status and Slurm status both read failures through this module.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass
from pathlib import Path

_ROOT_CAUSE_HEADER = "Root Cause (first observed failure):"
_ROOT_CAUSE_RANK = re.compile(r"^\s*rank\s*:\s*(?P<rank>\d+)\s*\(local_rank:\s*\d+\)", re.MULTILINE)
_ROOT_CAUSE_FIELD = r"^\s*{name}\s*:\s*(?P<value>.*)$"


@dataclass(frozen=True, kw_only=True)
class RankFailure:
    """A rank that exited with an error, from torchrun's per-rank error file and logs."""

    rank: int
    exitcode: int | None
    message: str
    timestamp: float | None = None
    """When the rank failed (Unix seconds): the earliest failure is usually the cause, the others
    are ranks that lost their peer."""
    log_path: str | None = None


@dataclass(frozen=True, kw_only=True)
class ErrorFile:
    """The content of one torchrun error.json."""

    message: str
    exitcode: int | None
    recorded_at: str | None
    """The file's own timestamp (whole seconds, as text)."""


def read_error_file(path: Path) -> ErrorFile:
    """Parse an error.json; an unreadable file becomes a message that says so (it is still a failure)."""
    try:
        content = json.loads(path.read_text())["message"]
        if not isinstance(content, dict):
            content = {"message": str(content)}
        extra = content.get("extraInfo", {})
        return ErrorFile(message=str(content.get("message", "")).strip(), exitcode=extra.get("exitcode"),
                         recorded_at=None if extra.get("timestamp") is None else str(extra["timestamp"]))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        return ErrorFile(message=f"unreadable error file {path}: {error}", exitcode=None, recorded_at=None)


def collect_failures(logs_root: Path) -> list[RankFailure]:
    """Failed ranks from a torchrun log tree: <logs_root>/<run_id>/attempt_<n>/<rank>/error.json."""
    failures = [_failure_from_error_file(path) for path in sorted(logs_root.glob("*/attempt_*/*/error.json"))]
    return sorted(failures, key=failure_order)


def _failure_from_error_file(error_file: Path) -> RankFailure:
    rank_dir = error_file.parent
    stderr_log = rank_dir / "stderr.log"
    content = read_error_file(error_file)
    return RankFailure(rank=int(rank_dir.name), exitcode=content.exitcode, message=content.message,
                       timestamp=_failure_time(content.recorded_at, error_file),
                       log_path=str(stderr_log) if stderr_log.exists() else None)


def _failure_time(recorded: str | None, error_file: Path) -> float | None:
    """The error file's own timestamp has whole seconds; its modification time orders ranks that
    failed within the same second (the first to fail writes its file first)."""
    try:
        return error_file.stat().st_mtime_ns / 1e9
    except OSError:
        return float(recorded) if str(recorded).isdigit() else None


def root_causes(stderr_files: list[Path]) -> list[RankFailure]:
    """The "Root Cause (first observed failure)" of each torchrun summary in these logs, with the global rank.

    The time is the error file's recorded timestamp: the file sits on the node that failed, and its
    modification time need not be comparable with the other nodes' files."""
    failures = []
    for stderr in stderr_files:
        text = stderr.read_text(errors="replace")
        for block in text.split(_ROOT_CAUSE_HEADER)[1:]:
            failure = _root_cause(block, stderr)
            if failure is not None:
                failures.append(failure)
    return failures


def summary_failures(stderr_files: list[Path]) -> list[RankFailure]:
    """Every rank torchrun's failure summary lists (its "Root Cause" entry, then its "Failures:" entries),
    each rank once, the root cause first: what is left of a rank that exited with a status of its own
    (sys.exit(7)) and wrote no error file."""
    failures: dict[int, RankFailure] = {}
    for stderr in stderr_files:
        try:
            text = stderr.read_text(errors="replace")
        except OSError:
            continue
        for summary in text.split(_SUMMARY_RULE)[1:]:
            listed, _, root = summary.partition(_ROOT_CAUSE_HEADER)
            for section in (root, listed):
                for entry in _SUMMARY_ENTRY.split(section)[1:]:
                    failure = _root_cause(entry, stderr)
                    if failure is not None:
                        failures.setdefault(failure.rank, failure)
    return list(failures.values())


_SUMMARY_RULE = "-" * 60 + "\nFailures:"
_SUMMARY_ENTRY = re.compile(r"^\[\d+\]:\s*$", re.MULTILINE)


def _root_cause(block: str, stderr: Path) -> RankFailure | None:
    rank = _ROOT_CAUSE_RANK.search(block)
    if rank is None:
        return None
    exitcode = _summary_field(block, "exitcode")
    error_file = _summary_field(block, "error_file")
    message, timestamp = "", None
    if error_file.startswith("/") and Path(error_file).is_file():
        content = read_error_file(Path(error_file))
        message = content.message
        timestamp = int(content.recorded_at) if str(content.recorded_at).isdigit() else None
    code = re.match(r"-?\d+", exitcode)
    return RankFailure(rank=int(rank["rank"]), exitcode=int(code.group()) if code else None,
                       message=message or (f"exit code {code.group()}" if code else f"exit code {exitcode}"),
                       timestamp=timestamp, log_path=str(stderr))


def _summary_field(block: str, name: str) -> str:
    match = re.search(_ROOT_CAUSE_FIELD.format(name=name), block, re.MULTILINE)
    return match["value"].strip() if match else ""


def failure_order(failure: RankFailure) -> tuple[bool, float, int]:
    """Earliest first; failures without a time last."""
    return (failure.timestamp is None, failure.timestamp or 0, failure.rank)


def earliest_per_rank(failures: list[RankFailure]) -> list[RankFailure]:
    """Every failed rank once (its earliest report), the earliest first: the first is the likely cause."""
    earliest: dict[int, RankFailure] = {}
    for failure in failures:
        known = earliest.get(failure.rank)
        if known is None or failure_order(failure) < failure_order(known):
            earliest[failure.rank] = failure
    return sorted(earliest.values(), key=failure_order)
