"""The ideal step in the merged trace (pure planning): per rank, a `what-if: ideal step` track with the report's
replay of the window's critical-path steps (whatif/ideal_steps.py): that rank's compute and collective transfers
as they would run with every rank's compute at the ranks' lower median, from the step's start on the merged
clock, so the recorded step and the one without stragglers sit side by side. Slices are named by the op
(`compute 2`, the collective's name) and annotated with the step, its kind, and the step's recorded and ideal
times. A report without the replay (an older report, a pipeline job, a window without collectives) draws nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fleetscope.analysis.merge.critical_path_overlays import MAX_START_NS, _is_int
from fleetscope.analysis.merge.tracks import GROUP_ANALYSIS, NO_EVENT, lay_out_track
from fleetscope.traces.validate import bounded_name, finite_number

if TYPE_CHECKING:
    from fleetscope.analysis.merge.tracks import RankTracks

IDEAL_TRACK_NAME = "what-if: ideal step"
IDEAL_TRACK = ("analysis", IDEAL_TRACK_NAME, "")
IDEAL_CATEGORY = "fleetscope.what_if"
MAX_OP_US = 1e12
"""Bound of a replayed op's times (microseconds after its step's start) a report may place."""


@dataclass(frozen=True, kw_only=True)
class IdealSlice:
    start_ns: int
    end_ns: int
    name: str
    annotations: dict[str, Any]


@dataclass(frozen=True, kw_only=True)
class RankIdeal:
    """What the `what-if: ideal step` track of one rank holds in one window, on the report's clock."""

    slices: list[IdealSlice] = field(default_factory=list)
    report_offset_ns: int = 0
    """The clock offset the report removed from this rank: a merge using another one moves the slices."""


def rank_ideal(replay: Any, *, rank: int, report_offset_ns: int) -> RankIdeal | None:
    """This rank's ops of the window's `ideal_replay` section (report JSON); None without any."""
    if not isinstance(replay, dict) or not isinstance(replay.get("steps"), list):
        return None
    slices = [piece for step in replay["steps"] for piece in _step_slices(step, rank)]
    return RankIdeal(slices=slices, report_offset_ns=report_offset_ns) if slices else None


def _step_slices(step: Any, rank: int) -> list[IdealSlice]:
    if not isinstance(step, dict) or not _is_int(step.get("step")) or not _is_int(step.get("start_ns")) \
            or not 0 <= step["start_ns"] < MAX_START_NS or not isinstance(step.get("ops"), list):
        return []
    notes = {"step": step["step"], "recorded_step_ms": _number(step.get("measured_ms")),
             "ideal_step_ms": _number(step.get("ideal_ms")),
             "ideal": "every rank's compute at the ranks' lower median, collectives as recorded"}
    found = []
    for op in step["ops"]:
        if not _valid_op(op) or op["rank"] != rank:
            continue
        start = step["start_ns"] + round(op["start_us"] * 1000)
        end = step["start_ns"] + round(op["end_us"] * 1000)
        if end > start:
            found.append(IdealSlice(start_ns=start, end_ns=end, name=bounded_name(str(op["name"])),
                                    annotations={**notes, "kind": str(op.get("kind") or "")}))
    return found


def _valid_op(op: Any) -> bool:
    return (isinstance(op, dict) and _is_int(op.get("rank")) and isinstance(op.get("name"), str)
            and all(_number(op.get(key)) is not None and 0 <= op[key] < MAX_OP_US for key in ("start_us", "end_us")))


def _number(value: Any) -> float | None:
    number = finite_number(value)
    return number if number is not None and abs(number) < 1e15 else None


def plan_ideal_track(ideal: RankIdeal | None, clock_offset_ns: int, tracks: "RankTracks", operations: list[tuple],
                     new_tracks: list) -> int:
    """Lay the rank's ideal ops out on its `what-if: ideal step` track (merged clock: moved by the difference
    between the report's offset and `clock_offset_ns`, the one this merge removed). Returns the slices laid."""
    if ideal is None or not ideal.slices:
        return 0
    shift = ideal.report_offset_ns - clock_offset_ns
    slices = [(piece.start_ns + shift, piece.end_ns + shift, piece.name, IDEAL_CATEGORY, NO_EVENT, piece.annotations)
              for piece in ideal.slices]
    tracks.register(IDEAL_TRACK, IDEAL_TRACK_NAME, GROUP_ANALYSIS)
    lay_out_track(IDEAL_TRACK, slices, tracks, operations, new_tracks)
    return len(slices)
