"""The job's outcome, from its record (job.json: status, return code, the ranks that failed in the order they
failed) and its hang report (hang.py: Flight Recorder dumps, the watchdog's markers): what a report says first
when the job did not complete.

States: STATE_COMPLETED (the record says it succeeded), STATE_FAILED (a rank exited with an error),
STATE_HUNG (the hang watchdog stopped it, or its Flight Recorder dumps say why it hung), STATE_CANCELLED,
STATE_RUNNING (not finished when analyzed). A folder of traces with no job record has no outcome (None).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from fleetscope.analysis.cross_rank.hang import HangReport
from fleetscope.traces.exit_status import EXIT_HUNG
from fleetscope.analysis.inputs.records import RunRecords

STATE_COMPLETED, STATE_FAILED, STATE_HUNG = "completed", "failed", "hung"
OUTCOME_PROBLEM_LABEL = "job"
"""The label of the problem a job that did not complete puts first in its report (the job's, not a trace's)."""
STATE_CANCELLED, STATE_RUNNING = "cancelled", "running"
EXIT_MEANINGS = {
    EXIT_HUNG: "the hang watchdog stopped it: no step finished for observability.hang_timeout_s",
    1: "an error (its traceback is in its log)",
    134: "aborted (SIGABRT)",
    137: "killed (SIGKILL: out of host memory, or stopped by the scheduler)",
    139: "crashed (SIGSEGV)",
    143: "terminated (SIGTERM: cancelled, preempted or out of time)",
}
"""What a rank's exit status says (128 + N: killed by signal N)."""
SIGNAL_NAMES = {6: "SIGABRT", 9: "SIGKILL", 11: "SIGSEGV", 15: "SIGTERM"}
MESSAGE_CHARS = 300
"""A failure's message is cut to its first line and this many characters."""


@dataclass(frozen=True, kw_only=True)
class JobOutcome:
    state: str
    returncode: int | None = None
    """The launcher's exit status for the whole job (job.json returncode)."""
    failed_first: int | None = None
    """The rank that failed first (the others usually lost their peer)."""
    failure: str = ""
    """Its error, first line."""
    exit_code: int | None = None
    exit_meaning: str = ""
    then_failed: list[int] = field(default_factory=list)
    hang: str = ""
    """The hang report's verdict where the job hung ("rank(s) [0] wait in collective #16 ... never entered")."""
    sentence: str = ""
    """What the report says first."""

    @property
    def completed(self) -> bool:
        return self.state in (STATE_COMPLETED, STATE_RUNNING)


def job_outcome(records: RunRecords | None, hang: HangReport | None) -> JobOutcome | None:
    """The outcome of the job whose records are `records` (module docstring); None without a job record that
    says (the inputs stage names an unreadable one)."""
    if records is None:
        return None
    record = records.job
    status = record.get("status")
    if not isinstance(status, str):
        return None
    failures = _failures(record.get("failures"))
    returncode = record.get("returncode") if _is_int(record.get("returncode")) else None
    first = failures[0] if failures else {}
    exit_code = first.get("exitcode") if _is_int(first.get("exitcode")) else None
    hung = status == "failed" and (exit_code == EXIT_HUNG or any(f.get("exitcode") == EXIT_HUNG for f in failures)
                                   or (hang is not None and bool(hang.detected_by)))
    state = _state(status, hung)
    outcome = JobOutcome(
        state=state, returncode=returncode,
        failed_first=first.get("rank") if _is_int(first.get("rank")) else None,
        failure=_first_line(first.get("message")), exit_code=exit_code, exit_meaning=exit_meaning(exit_code),
        then_failed=[f["rank"] for f in failures[1:] if _is_int(f.get("rank"))],
        hang=hang.verdict if hung and hang is not None else "")
    return dataclasses.replace(outcome, sentence=outcome_sentence(outcome))


def _state(status: str, hung: bool) -> str:
    if hung:
        return STATE_HUNG
    return {"succeeded": STATE_COMPLETED, "failed": STATE_FAILED, "cancelled": STATE_CANCELLED}.get(
        status, STATE_RUNNING)


def exit_meaning(code: int | None) -> str:
    """What an exit status says (EXIT_MEANINGS; a negative one is the signal that killed the process)."""
    if code is None:
        return ""
    if code < 0:
        return f"killed by signal {-code}" + (f" ({SIGNAL_NAMES[-code]})" if -code in SIGNAL_NAMES else "")
    return EXIT_MEANINGS.get(code, f"killed by signal {code - 128}" if 128 < code < 160 else "")


def outcome_sentence(outcome: JobOutcome) -> str:
    """The report's first words on a job that did not complete ("" for one that did, or is running)."""
    if outcome.completed:
        return ""
    if outcome.state == STATE_CANCELLED:
        return "The job was CANCELLED before it completed."
    who = f"rank {outcome.failed_first}" if outcome.failed_first is not None else "a rank"
    code = (f" (exit code {outcome.exit_code}: {outcome.exit_meaning})" if outcome.exit_code is not None
            and outcome.exit_meaning else (f" (exit code {outcome.exit_code})" if outcome.exit_code is not None else ""))
    error = f": {outcome.failure}" if outcome.failure else ""
    then = (f"; then rank(s) {', '.join(map(str, outcome.then_failed))} (their peer was gone)"
            if outcome.then_failed else "")
    if outcome.state == STATE_HUNG:
        # the hang watchdog stops every rank, the one that hung and those waiting for it, within moments of each
        # other: which exited first says nothing about which hung (the Flight Recorder says that)
        why = f"{outcome.hang} (Flight Recorder)" if outcome.hang else "no Flight Recorder dump says where"
        stopped = sorted({r for r in [outcome.failed_first, *outcome.then_failed] if r is not None})
        ranks = f"rank(s) {', '.join(map(str, stopped))}" if stopped else "its ranks"
        return f"The job HUNG: {why}; {ranks} stopped{code}."
    return f"The job FAILED: {who} failed first{code}{error}{then}."


def _failures(value: object) -> list[dict]:
    return [f for f in value if isinstance(f, dict)] if isinstance(value, list) else []


def _first_line(message: object) -> str:
    if not isinstance(message, str) or not message.strip():
        return ""
    return message.strip().splitlines()[0][:MESSAGE_CHARS]


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
