"""The cross-rank critical path of each profiled step: the chain of work that determined when the step ended.

Times are on the common clock (arrivals.py, clock_align.py). Per step, over the collective instances of that
step found on at least two ranks:
  - the path ends at the latest end, over ranks, of the step (its host range, or its last collective when
    that ends later: the GPU finishing after the host moved on); that rank is where the walk starts;
  - walking backwards on rank r from time t: its latest collective c of the step ending by t; the time from
    c's end to t is SEGMENT_WORK (r's work after c, compute and host time not told apart);
  - at c the walk jumps to q, the participant that arrived last (everyone else waited for it: their wait is
    not on the path, q's work is): SEGMENT_TRANSFER is c from q's arrival to its end (data movement once
    all had arrived); before it, q's gap from its previous collective's end (or its step's start, whichever is
    later) to its arrival splits into SEGMENT_COMPUTE (q's computation in it, collectives.py
    compute_before_us) and SEGMENT_IDLE (the rest: host gap, launch delay, input wait);
  - the walk continues on q from that earlier time, and ends at the step's start on the rank it is on
    (no collective of the step left: SEGMENT_WORK back to the step's start, e.g. the GPU still finishing
    the previous step's collective).
Segments tile the path: their durations sum to its length; share = duration / length. The path lies inside the
step's span across ranks (span_us: the earliest rank's step start to the latest end, common clock), which is
what its length is compared with: a rank's own step is shorter when the ranks start apart. The late rank's compute
before each collective it holds up is on the path; a rank that is never last is never on it (except the tail).
The merged Perfetto trace draws the path (merge/critical_path_overlays.py); this is the data.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from fleetscope.analysis.cross_rank.arrivals import ArrivalMatrix
from fleetscope.analysis.per_rank.rank import RankResult
from fleetscope.traces.validate import finite

SEGMENT_COMPUTE = "compute"
SEGMENT_IDLE = "host gap"
SEGMENT_TRANSFER = "data movement"
SEGMENT_WORK = "work"
SEGMENT_KINDS_TEXT = (f"{SEGMENT_COMPUTE}: the last-arriving rank's computation before the collective; "
                      f"{SEGMENT_IDLE}: the rest of its time before arriving (launch gaps, syncs, input wait); "
                      f"{SEGMENT_TRANSFER}: the collective once all had arrived; {SEGMENT_WORK}: a rank's time "
                      "after a collective until the next point on the path (computation and host time not told "
                      "apart)")
"""What each segment kind means, as the terminal, the HTML report and README.md say it."""
END_TOLERANCE_US = 1.0
"""A collective ending this little after the walk's time still counts as ending by it (rounding)."""
STEPS_KEPT = 64


@dataclass(frozen=True, kw_only=True)
class PathSegment:
    kind: str
    """SEGMENT_COMPUTE | SEGMENT_IDLE | SEGMENT_TRANSFER | SEGMENT_WORK (module docstring)."""
    rank: int
    collective: str
    """The instance it leads to or belongs to ("name #ordinal"); "" for the step's tail without one."""
    start_us: float
    """Start of the interval it lies in, after the path's start (compute and host gap share one interval)."""
    duration_us: float
    share: float
    """duration_us / the path's length."""


@dataclass(frozen=True, kw_only=True)
class StepPath:
    step: int
    length_us: float
    """From the path's start (a step start) to the step's end."""
    span_us: float = 0.0
    """The step across ranks: the earliest rank's step start to the latest end (common clock); length_us <= it."""
    start_ns: int = 0
    """The path's start as epoch nanoseconds on the common clock (each rank's time less its clock offset):
    the clock of the merged trace, so segment starts there are start_ns + start_us * 1000."""
    segments: list[PathSegment] = field(default_factory=list)
    """In time order."""


@dataclass(frozen=True, kw_only=True)
class PathShare:
    """Time on the paths of all steps, by rank and segment kind."""

    rank: int
    kind: str
    duration_us: float
    share: float
    """Of the summed path lengths."""


@dataclass(frozen=True, kw_only=True)
class CriticalPaths:
    steps: list[StepPath] = field(default_factory=list)
    """Up to STEPS_KEPT steps."""
    by_rank: list[PathShare] = field(default_factory=list)
    """Largest first."""


def critical_paths(results: list[RankResult], matrix: ArrivalMatrix | None,
                   offsets_us: dict[int, float]) -> CriticalPaths:
    """The paths of a window's steps; `matrix` already shifted by `offsets_us` (clock_align.py)."""
    if matrix is None:
        return CriticalPaths()
    shared = matrix.columns(matrix.present.sum(axis=0) >= 2)
    by_rank = {r.rank: r for r in results}
    step_numbers = sorted({key[0] for key in shared.keys if key[0] >= 0})[:STEPS_KEPT]
    paths = [p for p in (_step_path(step, shared, by_rank, offsets_us) for step in step_numbers) if p is not None]
    return CriticalPaths(steps=paths, by_rank=_by_rank(paths))


def _step_windows(step: int, m: ArrivalMatrix, by_rank: dict[int, RankResult],
                  offsets_us: dict[int, float]) -> dict[int, tuple[float, float]]:
    windows = {}
    for rank in m.ranks:
        result = by_rank.get(rank)
        timing = next((s for s in result.steps if s.step == step), None) if result else None
        if timing is not None:
            windows[rank] = (m.to_common_us(result, timing.start_us, offsets_us),
                             m.to_common_us(result, timing.end_us, offsets_us))
    return windows


def _step_path(step: int, m: ArrivalMatrix, by_rank: dict[int, RankResult],
               offsets_us: dict[int, float]) -> StepPath | None:
    columns = np.flatnonzero(np.asarray([key[0] == step for key in m.keys]))
    windows = _step_windows(step, m, by_rank, offsets_us)
    if not columns.size or not windows:
        return None
    ends = {rank: max(end, float(np.nanmax(m.end_us[m.ranks.index(rank), columns])))
            for rank, (_, end) in windows.items()}
    rank = max(ends, key=lambda r: (ends[r], -r))
    t, path_end = ends[rank], ends[rank]
    segments: list[tuple[str, int, str, float, float]] = []      # kind, rank, collective, start, duration
    remaining = set(columns.tolist())
    while True:
        row = m.ranks.index(rank)
        start_of_step = windows.get(rank, (t, t))[0]
        candidates = [c for c in remaining if m.present[row, c] and m.end_us[row, c] <= t + END_TOLERANCE_US]
        if not candidates:
            segments.append((SEGMENT_WORK, rank, "", min(start_of_step, t), max(t - start_of_step, 0.0)))
            t = min(start_of_step, t)
            break
        c = max(candidates, key=lambda col: m.end_us[row, col])
        remaining.discard(c)
        label = f"{m.keys[c][1]} #{m.keys[c][2]}"
        end = min(float(m.end_us[row, c]), t)
        segments.append((SEGMENT_WORK, rank, label, end, t - end))
        q_row = int(np.nanargmax(m.start_us[:, c]))
        arrival = min(float(m.start_us[q_row, c]), end)
        segments.append((SEGMENT_TRANSFER, m.ranks[q_row], label, arrival, end - arrival))
        rank = m.ranks[q_row]
        begin = max(_known_or_never(m.previous_end_us, q_row, c), windows.get(rank, (arrival, arrival))[0])
        begin = min(begin, arrival)
        before = m.compute_before_us if m.compute_before_us is not None else m.interval_compute_us
        compute = min(float(np.nan_to_num(before[q_row, c])), arrival - begin)
        segments.append((SEGMENT_IDLE, rank, label, begin, arrival - begin - compute))
        segments.append((SEGMENT_COMPUTE, rank, label, begin, compute))
        t = begin
        if begin <= windows.get(rank, (begin, begin))[0]:
            break
    span = path_end - min(start for start, _ in windows.values())
    return _assemble(step, segments, t, path_end, m.base_time_ns, span)


def _known_or_never(values: np.ndarray | None, row: int, column: int) -> float:
    """The value at (row, column); -inf (before anything) where there is none or it is not finite."""
    value = finite(values[row, column]) if values is not None else None
    return -np.inf if value is None else value


def _assemble(step: int, raw: list[tuple[str, int, str, float, float]], path_start: float,
              path_end: float, base_time_ns: int, span_us: float) -> StepPath:
    length = path_end - path_start
    kept = [s for s in reversed(raw) if s[4] > 0]
    segments = [PathSegment(kind=kind, rank=rank, collective=label, start_us=start - path_start,
                            duration_us=duration, share=duration / length if length > 0 else 0.0)
                for kind, rank, label, start, duration in kept]
    return StepPath(step=step, length_us=length, segments=segments, span_us=span_us,
                    start_ns=base_time_ns + round(path_start * 1000))


def _by_rank(paths: list[StepPath]) -> list[PathShare]:
    total = sum(p.length_us for p in paths)
    durations: dict[tuple[int, str], float] = {}
    for path in paths:
        for segment in path.segments:
            key = (segment.rank, segment.kind)
            durations[key] = durations.get(key, 0.0) + segment.duration_us
    shares = [PathShare(rank=rank, kind=kind, duration_us=d, share=d / total if total > 0 else 0.0)
              for (rank, kind), d in durations.items()]
    return sorted(shares, key=lambda s: (-s.duration_us, s.rank, s.kind))
