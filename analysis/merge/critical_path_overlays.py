"""The cross-rank critical path in the merged trace (pure planning): per rank, a `critical path` track with
one slice per segment of the report's path (cross_rank/critical_path.py) that lies on that rank, and flows
between ranks where the path crosses a collective.

  * slices are named by the segment's kind (`compute`, `host gap`, `data movement`, `work`) and annotated
    with the step, its share of the step's path, its duration, the collective it leads to or belongs to,
    and, on the first segment after a crossing, the rank it waited for (`waited_for_rank`) and where
    (`waited_at`);
  * the segments of a step tile its path from the path's start (`start_ns`, on the merged clock): the
    compute and host gap before one arrival share an interval in the analysis (their amounts are known,
    not how they interleave) and are drawn one after the other, compute first;
  * a flow joins the segment of the rank waited for (the last to arrive: its data movement) to the
    waiting rank's next segment; its id is the same on both ranks (made from window, step and crossing),
    with the cross-rank bit set, so ranks merged in different processes still meet. Like the collective
    flows, both ends carry it as an outgoing id and the engine joins them in time order: a merge that
    moved one rank's clock away from the report's may turn an arrow round, never drop it.
A report without the path (an older report, a window without collectives on two ranks) draws nothing.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fleetscope.analysis.merge.tracks import GROUP_ANALYSIS, NO_EVENT, lay_out_track
from fleetscope.traces.validate import finite_number

if TYPE_CHECKING:
    from fleetscope.analysis.cross_rank.critical_path import CriticalPaths, PathSegment, StepPath
    from fleetscope.analysis.merge.flows import FlowPlan
    from fleetscope.analysis.merge.tracks import RankTracks

PATH_TRACK_NAME = "critical path"
PATH_TRACK = ("analysis", PATH_TRACK_NAME, "")
PATH_CATEGORY = "fleetscope.critical_path"
_CROSS_RANK_FLOW_BIT = 1 << 63
MAX_START_NS = 1 << 62
MAX_SEGMENT_US = 1e12
"""Bounds of what a report may place (a step start, a segment): the sums stay inside int64 nanoseconds."""


@dataclass(frozen=True, kw_only=True)
class PathSlice:
    """One segment of a step's path on this rank, on the report's common clock."""

    start_ns: int
    end_ns: int
    kind: str
    annotations: dict[str, Any]
    flows_out: tuple[int, ...] = ()
    flows_in: tuple[int, ...] = ()


@dataclass(frozen=True, kw_only=True)
class RankPath:
    """What the `critical path` track of one rank holds in one window."""

    slices: list[PathSlice] = field(default_factory=list)
    report_offset_ns: int = 0
    """The clock offset the report removed from this rank: a merge using another one moves the slices."""


def path_flow_id(window_key: int, step: int, crossing: int) -> int:
    """The same on both ranks of a crossing."""
    digest = hashlib.blake2b(f"critical path|window {window_key}|step {step}|{crossing}".encode(),
                             digest_size=8).digest()
    return _CROSS_RANK_FLOW_BIT | (int.from_bytes(digest, "big") >> 1)


def rank_path(critical_path: "CriticalPaths", *, rank: int, window_key: int,
              report_offset_ns: int) -> RankPath | None:
    """This rank's segments of the window's critical path; None without any."""
    slices = []
    for path in critical_path.steps:
        slices += _step_slices(path, rank, window_key)
    return RankPath(slices=slices, report_offset_ns=report_offset_ns) if slices else None


def _step_slices(path: "StepPath", rank: int, window_key: int) -> list[PathSlice]:
    if not 0 <= path.start_ns < MAX_START_NS:
        return []
    segments = [s for s in path.segments if _valid_segment(s)]
    step, cursor = path.step, path.start_ns
    mine: list[PathSlice] = []
    previous, previous_drawn = None, False
    for index, segment in enumerate(segments):
        start, cursor = cursor, cursor + round(segment.duration_us * 1000)
        crossed = previous is not None and previous.rank != segment.rank
        flow = path_flow_id(window_key, step, index) if crossed else None
        if crossed and previous_drawn:
            mine[-1] = _with_flow_out(mine[-1], flow)
        previous_drawn = segment.rank == rank and cursor > start
        if previous_drawn:
            notes = _annotations(step, segment, previous if crossed else None)
            mine.append(PathSlice(start_ns=start, end_ns=cursor, kind=segment.kind, annotations=notes,
                                  flows_in=(flow,) if flow is not None else ()))
        previous = segment
    return mine


def _with_flow_out(piece: PathSlice, flow_id: int) -> PathSlice:
    return PathSlice(start_ns=piece.start_ns, end_ns=piece.end_ns, kind=piece.kind, annotations=piece.annotations,
                     flows_out=piece.flows_out + (flow_id,), flows_in=piece.flows_in)


def _annotations(step: int, segment: "PathSegment", waited_on: "PathSegment | None") -> dict[str, Any]:
    share = segment.share if _is_number(segment.share) else 0.0
    notes = {"step": step, "share_pct": round(100.0 * share, 3),
             "duration_us": segment.duration_us, "collective": segment.collective}
    if waited_on is not None:
        notes["waited_for_rank"] = waited_on.rank
        notes["waited_at"] = waited_on.collective
    return notes


def _valid_segment(segment: "PathSegment") -> bool:
    return _is_number(segment.duration_us) and 0 <= segment.duration_us < MAX_SEGMENT_US


def _is_number(value: Any) -> bool:
    number = finite_number(value)
    return number is not None and abs(number) < 1e15


def plan_path_track(path: RankPath | None, clock_offset_ns: int, tracks: "RankTracks", operations: list[tuple],
                    new_tracks: list, flows: "FlowPlan", first_ident: int) -> tuple[int, int]:
    """Lay the rank's path slices out on its `critical path` track (merged clock: moved by the difference
    between the report's offset and `clock_offset_ns`, the one this merge removed); their flows go into
    `flows` under made-up idents counting down from `first_ident`. Returns (slices, next free ident)."""
    if path is None or not path.slices:
        return 0, first_ident
    shift = path.report_offset_ns - clock_offset_ns
    slices, ident = [], first_ident
    for piece in path.slices:
        if piece.flows_out or piece.flows_in:
            flows.outgoing[ident].extend(piece.flows_out + piece.flows_in)   # joined in time order
            slices.append((piece.start_ns + shift, piece.end_ns + shift, piece.kind, PATH_CATEGORY, ident,
                           piece.annotations))
            ident -= 1
        else:
            slices.append((piece.start_ns + shift, piece.end_ns + shift, piece.kind, PATH_CATEGORY, NO_EVENT,
                           piece.annotations))
    tracks.register(PATH_TRACK, PATH_TRACK_NAME, GROUP_ANALYSIS)
    lay_out_track(PATH_TRACK, slices, tracks, operations, new_tracks)
    return len(slices), ident
